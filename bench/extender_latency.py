"""Latency of the extender verbs as kube-scheduler sees them with the shipped profile:
filter, bind.

For two clusters, the openb one (1,213 nodes; ../shared/data/openb when present, else a
synthetic cluster of the same shape) and a synthetic 10,000-node × 8-GPU one:

1. a fake kube-apiserver (gpuplace.dev.localapi) is filled with the nodes and with bound pods
   holding `--prefill` of the GPUs (placed at random, so the cluster is fragmented),
   and served from a forked process (no shared GIL or event loop);
2. the sidecar (informers, ledger, extender app) starts against it and syncs, and
   scores ahead its most common request shapes and those the pending pods wait for
   (`gpuplace.extender.warming`; `--warm-shapes`, 0 = off; `--warm-pending-shapes`); the time
   that takes is reported, and the stream starts after it. Every pending pod exists
   before the stream starts (a backlog), so with `--warm-pending-shapes` above the
   number of rare shapes no filter meets a shape not scored ahead; run with
   `--warm-pending-shapes 0` to see what a shape's first filter costs;
3. `--pods` pending GPU pods drawn from the openb default mix (or the bundled mix) go
   through the verbs one after another over HTTP on 127.0.0.1, from a process of its
   own standing in for kube-scheduler (`--client`: by default a Go program,
   bench/kube_scheduler_client, that encodes, sends and reads as kube-scheduler's
   HTTP extender does with encoding/json and net/http, when `go` is on PATH; else
   Python's aiohttp in a spawned process), as kube-scheduler sends them: filter with
   every node's name (`percentageOfNodesToScore: 100`, no node affinity narrowing: the
   worst case), then bind with the node filter passed (the policy's best; one of a tie
   at random: the profile names no prioritize). bind's write (the Binding) goes to the
   fake API server over HTTP.

Prints one JSON document: p50/p99/max per verb, client-side (the HTTP round trip) and
server-side (as the sidecar times its answers: reading and deciding, not writing them),
and the share of binds that succeeded; filter's server-side figures also split by
whether the pod's request shape was scored ahead as a common one, as one pods wait
for, or not at all.

    .venv/bin/python -m bench.extender_latency [--quick] [--repeat 8] [--client go|python]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import gc
import json
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry

from bench import engine_latency
from gpuplace.cluster import assignments, connecting, kube
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.placement import choosing, trace
from gpuplace.placement.inventory import Inventory, Node
from gpuplace.placement.ledger import Grant, GrantState, Ledger
from gpuplace.replay import simulation
from gpuplace.wiring.settings import SidecarSettings
from gpuplace.wiring.sidecar import Sidecar

REPO = Path(__file__).resolve().parents[1]
OPENB = REPO.parent / "shared" / "data" / "openb"
GPU_MEMORY = {"T4": 15360, "P100": 16384, "V100M16": 16384, "V100M32": 32768, "A10": 24576}
AT = datetime(2026, 11, 21, tzinfo=UTC)


class _Recorded:
    """A duration histogram's child that also keeps each observation in `kept`."""

    def __init__(self, child: Any, kept: list[float]) -> None:
        self.child, self.kept = child, kept

    def observe(self, amount: float) -> None:
        self.kept.append(amount)
        self.child.observe(amount)


def pods_mix() -> tuple[list[trace.TracePod], str]:
    path = OPENB / "openb_pod_list_default.csv"
    if path.exists():
        pods = simulation.read_pods(path)
        name = path.name
    else:
        pods = simulation.read_pods(REPO / "gpuplace" / "data" / "pods.csv")
        name = "gpuplace/data/pods.csv"
    return [pod for pod in pods if pod.num_gpu > 0], name


def node_body(node: Node) -> dict[str, Any]:
    model = node.model
    memory = node.gpus[0].memory_mib or GPU_MEMORY.get(model, 32768) if node.gpus else 0
    nvlink = [gpu.nvlink for gpu in node.gpus] if any(g.nvlink >= 0 for g in node.gpus) else None
    return objects.node(
        node.name,
        gpus=len(node.gpus),
        model=model,
        gpu_memory_mib=memory,
        cpu=f"{node.cpu_milli}m",
        memory=f"{node.memory_mib}Mi",
        pods=str(node.max_pods),
        nvlink=nvlink,
    )


def pod_body(name: str, pod: trace.TracePod) -> dict[str, Any]:
    whole = pod.num_gpu > 1 or pod.gpu_milli >= 1000
    models = ",".join(m for m in pod.gpu_spec.split("|") if m) or None
    return objects.pod(
        name,
        f"team-{hash(name) % 20}",
        percent=None if whole else max(1, -(-pod.gpu_milli // 10)),
        count=pod.num_gpu if whole else None,
        model=models,
        cpu=f"{max(pod.cpu_milli, 1)}m",
        host_memory=f"{max(pod.memory_mib, 1)}Mi",
    )


def prefill(
    api: localapi.FakeApi,
    nodes: list[Node],
    mix: list[trace.TracePod],
    share: float,
    rng: random.Random,
) -> int:
    """Bound pods holding about `share` of the GPUs, placed at random where they fit."""
    ledger = Ledger(Inventory(nodes))
    names = [node.name for node in nodes]
    target = share * sum(len(node.gpus) for node in nodes) * 1000
    held = 0
    bodies: list[dict[str, Any]] = []
    misses = 0
    while held < target and misses < 2000:
        pod = rng.choice(mix)
        request = pod.request()
        state = ledger.state(rng.choice(names))
        assert state is not None
        choice = choosing.best_on(state, request, _FirstGpu())
        if not isinstance(choice, choosing.Choice):
            misses += 1
            continue
        misses = 0
        name = f"filled-{len(bodies):06d}"
        grant = choosing.grant_for(f"uid-{name}", choice, request)
        ledger.reserve(grant)
        body = pod_body(name, pod)
        body["metadata"]["uid"] = grant.pod_uid
        confirmed = Grant(
            grant.pod_uid,
            grant.node,
            grant.gpus,
            grant.milli,
            grant.memory_mib,
            grant.cpu_milli,
            grant.host_memory_mib,
            GrantState.CONFIRMED,
        )
        body["metadata"]["annotations"].update(assignments.annotations_for(confirmed, None, AT))
        body["spec"]["nodeName"] = grant.node
        body["status"] = {"phase": "Running"}
        bodies.append(body)
        held += grant.milli * len(grant.gpus)
    api.load("pods", bodies)
    return len(bodies)


class _FirstGpu:
    name = "first"

    def score(self, state: Any, request: Any, gpus: tuple[int, ...]) -> float:
        return 0.0

    def prefer(self, state: Any, request: Any, gpus: tuple[int, ...]) -> float:
        return 0.0

    def place(self, name: str) -> float | None:
        return None


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

    return {
        "p50_ms": at(0.5),
        "p99_ms": at(0.99),
        "max_ms": round(ordered[-1] * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
        "n": len(ordered),
    }


def resident_mib() -> float:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


async def schedule(
    base: str, names: list[str], pending: list[dict[str, Any]], seed: int
) -> dict[str, Any]:
    """kube-scheduler's side with the shipped profile: each pending pod through filter
    and bind over HTTP, one after another. Returns the round-trip times per verb and the
    outcomes."""
    rng = random.Random(seed)
    client_side: dict[str, list[float]] = {"filter": [], "bind": [], "total": []}
    outcomes = {"bound": 0, "unschedulable": 0, "refused": 0}
    async with aiohttp.ClientSession() as session:

        async def post(verb: str, body: Any) -> Any:
            # As Go's encoding/json writes kube-scheduler's ExtenderArgs: fields in
            # declaration order (Pod, Nodes, NodeNames), no spaces.
            data = json.dumps(body, separators=(",", ":")).encode()
            began = time.perf_counter()
            async with session.post(
                f"{base}/{verb}", data=data, headers={"Content-Type": "application/json"}
            ) as reply:
                answer = await reply.read()
            client_side[verb].append(time.perf_counter() - began)
            return json.loads(answer)

        for pod in pending:
            began = time.perf_counter()
            verdict = await post("filter", {"Pod": pod, "Nodes": None, "NodeNames": names})
            passed = verdict["NodeNames"]
            if not passed:
                outcomes["unschedulable"] += 1
                continue
            # One node: bound without scoring. Several (a policy's tie): the profile has no
            # prioritizeVerb, so kube-scheduler's own plugins pick; here at random.
            node = passed[0] if len(passed) == 1 else rng.choice(passed)
            metadata = pod["metadata"]
            result = await post(
                "bind",
                {
                    "PodName": metadata["name"],
                    "PodNamespace": metadata["namespace"],
                    "PodUID": metadata["uid"],
                    "Node": node,
                },
            )
            outcomes["bound" if not result["Error"] else "refused"] += 1
            client_side["total"].append(time.perf_counter() - began)
    return {"client_side": client_side, "outcomes": outcomes}


GO_CLIENT = REPO / "bench" / "kube_scheduler_client" / "main.go"


def build_go_client(directory: Path) -> Path | None:
    """kube-scheduler's side in Go (bench/kube_scheduler_client), built into `directory`;
    None when no Go toolchain is on PATH."""
    go = shutil.which("go")
    if go is None:
        return None
    binary = directory / "kube-scheduler-client"
    subprocess.run([go, "build", "-o", str(binary), str(GO_CLIENT)], check=True, cwd=directory)
    return binary


def _go_schedule(
    binary: Path, base: str, names: list[str], pending: list[dict[str, Any]], seed: int
) -> dict[str, Any]:
    """`schedule`, by the Go stand-in: the work on its stdin, the figures on its stdout."""
    work = json.dumps({"base": base, "names": names, "pods": pending, "seed": seed}).encode()
    done = subprocess.run([str(binary)], input=work, capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the Go client failed: {done.stderr.decode(errors='replace')}")
    figures: dict[str, Any] = json.loads(done.stdout)
    return figures


def _scheduler_process(connection: Connection) -> None:
    """The child process standing in for kube-scheduler: receives the work, sends the
    figures back."""
    base, names, pending, seed = connection.recv()
    connection.send(asyncio.run(schedule(base, names, pending, seed)))
    connection.close()


StandIn = Callable[[str, list[str], list[dict[str, Any]], int], dict[str, Any]]
"""Runs kube-scheduler's side (base URL, node names, pending pods, seed) to the end and
returns its figures, as `schedule` does."""


def _python_stand_in() -> tuple[StandIn, BaseProcess]:
    """`schedule` in a process spawned now (before the sidecar's heap grows: its JSON
    work then shares neither this event loop nor the GIL), and the process."""
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=_scheduler_process, args=(theirs,), daemon=True
    )
    process.start()
    theirs.close()  # the child's end: a child that dies makes `recv` fail, not hang

    def run(base: str, names: list[str], pending: list[dict[str, Any]], seed: int) -> Any:
        ours.send((base, names, pending, seed))
        return ours.recv()

    return run, process


async def drive(
    url: str,
    nodes: list[Node],
    pending: list[dict[str, Any]],
    seed: int,
    *,
    warm_shapes: int = 64,
    warm_pending_shapes: int = 16,
    go_client: Path | None = None,
) -> dict[str, Any]:
    configuration = client.Configuration(host=url)
    api = kube.Kube(connecting.client_for(configuration), timeout=30)
    settings = SidecarSettings(
        pod_events=False,
        advertise_resources=False,
        workload_refresh_seconds=3600,
        sync_wait_seconds=60,
        warm_shapes=warm_shapes,
        warm_pending_shapes=warm_pending_shapes,
    )
    registry = CollectorRegistry()
    sidecar = Sidecar(settings, registry, api, rng=random.Random(1))
    server_side: dict[str, list[float]] = {"filter": [], "bind": []}

    # Server side, as the sidecar's duration histogram times each call: reading the
    # request and answering it, not writing the answer (the socket's pace, which the
    # round trip shows) nor the work done after it.
    duration = sidecar.service.metrics.duration
    children = duration.labels

    def recorded(verb: str, result: str) -> _Recorded:
        return _Recorded(children(verb, result), server_side[verb])

    duration.labels = recorded  # type: ignore[method-assign,assignment]
    pauses: list[tuple[int, float]] = []
    began_gc = [0.0]

    def collector(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began_gc[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began_gc[0]))

    # kube-scheduler in a process of its own: its work neither shares this event loop
    # nor adds to the sidecar's figures (the Go program is started when the stream does).
    stand_in: StandIn
    scheduler: BaseProcess | None = None
    if go_client is None:
        stand_in, scheduler = _python_stand_in()
    else:
        stand_in = functools.partial(_go_schedule, go_client)
    names = [node.name for node in nodes]
    gc.collect()
    before = resident_mib()
    async with sidecar.running():
        started = time.perf_counter()
        await sidecar.sync.ready.wait()
        sync_seconds = time.perf_counter() - started
        if warm_shapes:
            await sidecar.warmer.warm.wait()
        warm_seconds = time.perf_counter() - started - sync_seconds
        gc.collect()
        sidecar_mib = resident_mib() - before
        common = set(sidecar.warmer.counted) if warm_shapes else set()
        waiting = set(sidecar.warmer.ahead) - common if warm_shapes else set()
        kinds = []
        for pod in pending:
            shape = sidecar.decider.request(pod)
            scoring = choosing.scoring_shape(shape) if shape is not None else None
            kinds.append(
                "common" if scoring in common else "waiting" if scoring in waiting else "neither"
            )
        runner = web.AppRunner(sidecar.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        gc.callbacks.append(collector)
        figures = await asyncio.to_thread(stand_in, base, names, pending, seed)
        gc.callbacks.remove(collector)
        gc.collect()
        scheduled_mib = resident_mib() - before
        await runner.cleanup()
    if scheduler is not None:
        scheduler.join(10)
    filters = list(zip(server_side["filter"], kinds, strict=False))
    by_kind = {
        kind: quantiles([seconds for seconds, k in filters if k == kind])
        for kind in ("common", "waiting", "neither")
    }
    return {
        "sidecar_sync_seconds": round(sync_seconds, 2),
        "scoring_ahead_seconds": round(warm_seconds, 2),
        "request_shapes_scored_ahead": {"common": len(common), "waiting": len(waiting)},
        "sidecar_memory_mib_after_scoring_ahead": round(sidecar_mib),
        "sidecar_memory_mib_after_scheduling": round(scheduled_mib),
        "filter_server_side_by_shape": {
            "scored_ahead_as_common": by_kind["common"],
            "scored_ahead_as_waiting": by_kind["waiting"],
            "not_scored_ahead": by_kind["neither"],
        },
        "client_side": {verb: quantiles(values) for verb, values in figures["client_side"].items()},
        "server_side": {verb: quantiles(values) for verb, values in server_side.items()},
        "outcomes": figures["outcomes"],
        "gc_pauses_while_scheduling": {
            f"gen{generation}": quantiles([d for g, d in pauses if g == generation])
            for generation in (0, 1, 2)
        },
    }


def scenario(
    label: str,
    *,
    nodes: list[Node],
    source: str,
    mix: list[trace.TracePod],
    mix_name: str,
    count: int,
    fill: float,
    seed: int,
    repeat: int,
    warm_shapes: int,
    warm_pending_shapes: int,
    client: str = "python",
) -> dict[str, Any]:
    rng = random.Random(seed)
    api = localapi.FakeApi(record_calls=100)
    api.load("nodes", (node_body(node) for node in nodes))
    filled = prefill(api, nodes, mix, fill, rng)
    pending = []
    drawn = rng.choice(mix)
    for index in range(count):
        if index % repeat == 0:
            drawn = rng.choice(mix)
        body = pod_body(f"pending-{index:05d}", drawn)
        body["metadata"]["uid"] = f"uid-pending-{index:05d}"
        pending.append(body)
    api.load("pods", pending)
    api.warm()
    with (
        tempfile.TemporaryDirectory(prefix="gpuplace-bench-") as temporary,
        localapi.serve_in_subprocess(api) as server,
    ):
        go_client = build_go_client(Path(temporary)) if client == "go" else None
        if client == "go" and go_client is None:
            raise SystemExit("--client go: no Go toolchain (`go`) on PATH")
        figures = asyncio.run(
            drive(
                server.url,
                nodes,
                pending,
                seed,
                warm_shapes=warm_shapes,
                warm_pending_shapes=warm_pending_shapes,
                go_client=go_client,
            )
        )
    return {
        "cluster": label,
        "nodes": len(nodes),
        "gpus": sum(len(node.gpus) for node in nodes),
        "node_source": source,
        "pod_mix": mix_name,
        "prefilled_pods": filled,
        "prefilled_gpu_share": fill,
        "pods_scheduled": count,
        "pods_per_request_shape": repeat,
        "warm_shapes_setting": warm_shapes,
        "warm_pending_shapes_setting": warm_pending_shapes,
        "kube_scheduler_stand_in": client,
        **figures,
    }


def _scenario(run: dict[str, Any]) -> dict[str, Any]:
    label = run.pop("label")
    return scenario(label, **run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer pods")
    parser.add_argument("--prefill", type=float, default=0.5, help="share of GPUs held")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--cluster", choices=("both", "openb", "10k"), default="both")
    parser.add_argument(
        "--warm-shapes",
        type=int,
        default=64,
        help="the sidecar's --warm-shapes (request shapes scored ahead; 0 = off)",
    )
    parser.add_argument(
        "--warm-pending-shapes",
        type=int,
        default=16,
        help="the sidecar's --warm-pending-shapes (other shapes pending pods wait for)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="consecutive pods with the same request (a Job's replicas); 1 = every pod drawn",
    )
    parser.add_argument(
        "--client",
        choices=("auto", "go", "python"),
        default="auto",
        help="kube-scheduler's stand-in: Go's encoding/json and net/http as kube-scheduler "
        "uses them (bench/kube_scheduler_client; needs `go`), or Python's aiohttp; "
        "auto = go when `go` is on PATH",
    )
    args = parser.parse_args()
    if args.client == "auto":
        args.client = "go" if shutil.which("go") else "python"
    mix, mix_name = pods_mix()
    openb, source = engine_latency.openb_nodes()
    runs: list[dict[str, Any]] = []
    common = {
        "mix": mix,
        "mix_name": mix_name,
        "fill": args.prefill,
        "seed": args.seed,
        "repeat": args.repeat,
        "warm_shapes": args.warm_shapes,
        "warm_pending_shapes": args.warm_pending_shapes,
        "client": args.client,
    }
    if args.cluster in ("both", "openb"):
        runs.append(
            {"label": "openb", "nodes": openb, "source": source, **common}
            | {"count": 200 if args.quick else 1000}
        )
    if args.cluster in ("both", "10k"):
        runs.append(
            {
                "label": "10k x 8 GPUs",
                "nodes": engine_latency.big_cluster(10_000),
                "source": "synthetic",
            }
            | common
            | {"count": 50 if args.quick else 1000}
        )
    results = []
    for run in runs:
        # Each cluster in a fresh process: the second would otherwise inherit the first
        # sidecar's heap (and its frozen objects) and measure that too.
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            results.append(pool.submit(_scenario, run).result())
    print(
        json.dumps(
            {
                "benchmark": "extender verbs over HTTP on 127.0.0.1 (filter, bind)",
                "kube_writes": "bind's PATCH and Binding go to the fake kube-apiserver "
                "(gpuplace.dev.localapi) in a forked process over HTTP on 127.0.0.1; "
                "Events disabled",
                "target": "p99 <= 10 ms per verb at 10,000 nodes",
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
