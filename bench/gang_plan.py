"""Time to plan and ungate one 64-member gang on the openb cluster (1,213 GPU nodes).

For each case, 64 gated members are created in a fake API server running on its own
thread (its work is not timed with ours); the gang controller's ledger holds the openb
nodes (optionally with background load); then one controller round is timed: plan all
64 members (`gpuplace.placement.gangs.plan`), reserve them, write each plan (64 PATCHes), narrow
each member's node affinity (64 PATCHes), remove each gate (64 PATCHes). The planner
alone is timed too (median of several runs on the same ledger; it changes nothing).

    .venv/bin/python -m bench.gang_plan [--nodes CSV] [--repeat 3] [--members 64]

Prints one JSON object. Without the openb node list it prints {"skipped": "..."}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import connecting, keys, kube, pods
from gpuplace.cluster.gang_marks import gated, plan_mark
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers.api import KubePods, PodApi
from gpuplace.controllers.controller import Parts
from gpuplace.controllers.store import gang_members
from gpuplace.dev.localapi import ThreadedServer, objects, serve_in_thread
from gpuplace.extender import workloads
from gpuplace.gangs.controller import GangController, GangSettings
from gpuplace.placement import gangs, policies, trace
from gpuplace.placement.inventory import Node
from gpuplace.placement.ledger import Grant, Ledger
from gpuplace.placement.requests import WHOLE, GpuRequest

DEFAULT_NODES = Path("/work/shared/data/openb/openb_node_list_gpu_node.csv")

CASES: dict[str, dict[str, Any]] = {
    "64x1gpu-idle": {"count": 1, "percent": None, "load": 0.0},
    "64x8gpu-idle": {"count": 8, "percent": None, "load": 0.0},
    "64x50pct-idle": {"count": None, "percent": 50, "load": 0.0},
    "64x1gpu-loaded70": {"count": 1, "percent": None, "load": 0.7},
    "64x2gpu-loaded50": {"count": 2, "percent": None, "load": 0.5},
}


def preload(ledger: Ledger, load: float, rng: random.Random) -> int:
    """Take about `load` of every node's GPUs with background pods (whole or half)."""
    taken = 0
    for state in list(ledger.states()):
        for gpu in state.node.gpus:
            if rng.random() >= load:
                continue
            milli = WHOLE if rng.random() < 0.6 else WHOLE // 2
            ledger.reserve(Grant(f"bg-{taken}", state.node.name, (gpu.index,), milli, 0))
            taken += 1
    return taken


def member_pods(namespace: str, size: int, case: dict[str, Any]) -> list[dict[str, Any]]:
    pods = []
    for i in range(size):
        pod = objects.pod(
            f"worker-{i:03d}",
            namespace,
            percent=case["percent"],
            count=case["count"],
            annotations={keys.GANG_NAME: "train", keys.GANG_SIZE: str(size)},
            labels={keys.GANG_LABEL: "train"},
            gates=[keys.GANG_GATE],
        )
        pods.append(pod)
    return pods


def create_all(server: ThreadedServer, bodies: list[dict[str, Any]]) -> None:
    for body in bodies:
        server.api.create(body)


def request_of(case: dict[str, Any]) -> GpuRequest:
    count = case["count"] or 1
    milli = WHOLE if case["percent"] is None else case["percent"] * 10
    return GpuRequest(milli=milli, count=count, cpu_milli=1000, host_memory_mib=1024)


async def run_case(
    server: ThreadedServer,
    nodes: list[Node],
    name: str,
    case: dict[str, Any],
    *,
    size: int,
    repeat: int,
) -> dict[str, Any]:
    api = kube.Kube(connecting.client_for(server.configuration()), timeout=60.0)
    policy = policies.make("default", workload=workloads.FALLBACK)
    rounds: list[float] = []
    plans: list[float] = []
    spanned = 0
    patches = 0
    try:
        for attempt in range(repeat):
            namespace = f"bench-{attempt}-{name}"
            bodies = member_pods(namespace, size, case)
            server.call(partial(create_all, server, bodies))
            sync = LedgerSync()
            for node in nodes:
                sync.ledger.put_node(node)
            reader = pods.Reader()
            listed = server.call(partial(server.api.objects, "pods", namespace))
            sync.replace_pods([reader.record(body) for body in listed])
            preload(sync.ledger, case["load"], random.Random(attempt))
            sync.ready.set()
            store = gang_members(sync)
            members = [gangs.Member(pod.uid, request_of(case)) for pod in store.pods.values()]
            for _ in range(5):
                started = time.perf_counter()
                found = gangs.plan(sync.ledger, policy, members)
                plans.append(time.perf_counter() - started)
            if not isinstance(found, gangs.Plan):
                return {"case": name, "fits": False, "reason": found.reason}
            spanned = len(found.nodes)
            parts: Parts[PodApi] = Parts(KubePods(api), sync, lambda: policy)
            controller = GangController(
                parts, store, registry=CollectorRegistry(), settings=GangSettings(concurrency=16)
            )
            before = len(server.api.calls)
            started = time.perf_counter()
            await controller.step()
            rounds.append(time.perf_counter() - started)
            patches = len(server.api.calls) - before
            after = server.call(partial(server.api.objects, "pods", namespace))
            ungated = sum(1 for body in after if not gated(body) and plan_mark(body) is not None)
            if ungated != size:
                return {"case": name, "error": f"only {ungated} of {size} members ungated"}
    finally:
        await api.close()
    return {
        "case": name,
        "members": size,
        "request": {"gpus": case["count"] or 1, "percent": case["percent"] or 100},
        "background_load": case["load"],
        "nodes_spanned": spanned,
        "plan_ms_p50": round(statistics.median(plans) * 1000, 2),
        "plan_ms_max": round(max(plans) * 1000, 2),
        "plan_and_ungate_ms_p50": round(statistics.median(rounds) * 1000, 1),
        "plan_and_ungate_ms_max": round(max(rounds) * 1000, 1),
        "api_calls_per_gang": patches,
        "repeats": repeat,
    }


async def main_async(nodes: list[Node], size: int, repeat: int) -> list[dict[str, Any]]:
    results = []
    with serve_in_thread() as server:
        for name, case in CASES.items():
            results.append(await run_case(server, nodes, name, case, size=size, repeat=repeat))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=Path, default=DEFAULT_NODES)
    parser.add_argument("--members", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if not args.nodes.exists():
        print(json.dumps({"skipped": f"openb node list not found at {args.nodes}"}))
        return 0
    nodes = trace.parse_nodes(str(args.nodes), args.nodes.read_text().splitlines())
    results = asyncio.run(main_async(nodes, args.members, args.repeat))
    print(
        json.dumps(
            {
                "benchmark": "gang_plan",
                "cluster": {"file": str(args.nodes), "nodes": len(nodes)},
                "python": sys.version.split()[0],
                "results": results,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
