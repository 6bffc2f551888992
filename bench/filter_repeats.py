"""Cost of a repeated filter: the first one for a request shape, a repeat with nothing
changed (the kept answer, `gpuplace.extender.repeating`), the same repeat with no answer kept
(`--filter-answers-kept 0`: what every repeat cost before), and a repeat after a change
on one named node (the kept answer is stale: decided anew, incrementally).

kube-scheduler calls filter again for each pending pod on every pod event in the cluster
(issue 18 saw 182 calls within seconds for one pod); most of those events change no
node's GPUs. This measures, in the sidecar's own process, what one such call costs in
the extender's filter verb as the HTTP handler runs it: the arguments from the raw body
(every node's name, compared as bytes when it is every node, as kube-scheduler sends
them), the decision, and the answer encoded, but not the HTTP exchange itself (see
bench/extender_latency.py for the round trip). The machine's other load shows in p99
and max: compare p50 and mean.

The cluster: `--nodes` A100 nodes (8 GPUs each; 1,000 and 10,000 by default), every GPU
holding one 30% share and, at random, up to two more: a pod asking 80% of a GPU fits
nowhere (the pending pod that is filtered again and again). For comparison, one asking
10% fits everywhere: an answer some node passed is not kept (its pod goes on to
prioritize and bind), so its repeat costs what it did. Prints one JSON document:
p50/p99/max/mean in milliseconds per case, nodes and calls.

    .venv/bin/python -m bench.filter_repeats [--nodes 1000,10000] [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry

from bench.extender_latency import quantiles
from gpuplace.cluster import connecting, kube
from gpuplace.cluster import nodes as node_records
from gpuplace.dev.localapi import objects
from gpuplace.placement.ledger import Grant
from gpuplace.runtime import gc_tuning
from gpuplace.wiring.settings import SidecarSettings
from gpuplace.wiring.sidecar import Sidecar


def body(pod: dict[str, Any], names: list[str]) -> bytes:
    """filter's arguments as kube-scheduler encodes them: Go writes ExtenderArgs' fields in
    their declared order (Pod, Nodes, NodeNames), so `NodeNames` comes last, which is what
    lets filter compare every node's name as bytes (`ExtenderArgs.with_every_name`)."""
    return json.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}).encode()


async def measure(count: int, calls: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    api = kube.Kube(connecting.client_for(client.Configuration(host="http://127.0.0.1:9")))
    settings = SidecarSettings(
        pod_events=False, advertise_resources=False, workload_refresh_seconds=3600, warm_shapes=0
    )
    sidecar = Sidecar(settings, CollectorRegistry(), api, rng=random.Random(1))
    try:
        sync, service = sidecar.sync, sidecar.service
        names = [f"a100-{index:05d}" for index in range(count)]
        sync.replace_nodes(node_records.record(objects.node(name, gpus=8)) for name in names)
        uid = 0
        for name in names:
            for gpu in range(8):
                for _ in range(1 + rng.randrange(3)):
                    uid += 1
                    sync.ledger.reserve(Grant(f"held-{uid}", name, (gpu,), 300, 0))
        sync.ready.set()
        raws = {
            "fits-nowhere": body(objects.pod("pending", percent=80), names),
            "fits-everywhere": body(objects.pod("small", percent=10), names),
        }
        repeats = service.repeats
        figures: dict[str, Any] = {"nodes": count, "gpus": count * 8, "calls": calls}

        async def filter_once(raw: bytes) -> float:
            started = time.perf_counter()
            await service.filter(service.filter_args(raw))
            return time.perf_counter() - started

        for case, raw in raws.items():
            row: dict[str, Any] = {}
            service.repeats = repeats
            row["first"] = round(await filter_once(raw) * 1000, 3)
            # long-lived state out of the collector's sight, as the sidecar does every
            # --gc-freeze-seconds (without it a full pass lands in some filter)
            gc_tuning.freeze()
            if case == "fits-nowhere":
                row["repeat_kept"] = quantiles([await filter_once(raw) for _ in range(calls)])
            service.repeats = None
            row["repeat_not_kept"] = quantiles([await filter_once(raw) for _ in range(calls)])
            service.repeats = repeats
            if case != "fits-nowhere":
                figures[case] = row
                continue
            changed: list[float] = []
            for index in range(calls):
                grant = Grant(f"churn-{index}", rng.choice(names), (rng.randrange(8),), 1, 0)
                sync.ledger.reserve(grant, overcommit=True)
                changed.append(await filter_once(raw))
                sync.ledger.release(grant.pod_uid)
            row["repeat_after_a_named_node_changed"] = quantiles(changed)
            figures[case] = row
        return figures
    finally:
        await api.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1000,10000", help="cluster sizes, comma-separated")
    parser.add_argument("--calls", type=int, default=200, help="filters per case")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    results = [
        asyncio.run(measure(int(count), args.calls, args.seed)) for count in args.nodes.split(",")
    ]
    print(json.dumps({"filter_repeats": results}, indent=2))


if __name__ == "__main__":
    main()
