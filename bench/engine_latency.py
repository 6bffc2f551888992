"""Decision latency of the placement engine, and the wall time of a full replay.

Prints JSON: for the openb cluster (1,213 nodes, 6,212 GPUs; read from
../shared/data/openb when present, else a synthetic cluster of the same shape)
and a synthetic 10,000-node × 8-GPU cluster, the p50/p99 time of one `choose`
while the cluster fills from empty to 90% of its GPUs with pods drawn from the
openb default mix (or a bundled mix); and the wall time of one full default
replay of openb_pod_list_default.csv (seed 42).

    .venv/bin/python bench/engine_latency.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuplace.placement import choosing, fragmentation, policies, trace  # noqa: E402
from gpuplace.placement.inventory import Gpu, Inventory, Node  # noqa: E402
from gpuplace.placement.ledger import Ledger  # noqa: E402
from gpuplace.replay import simulation  # noqa: E402

OPENB = REPO.parent / "shared" / "data" / "openb"


def openb_nodes() -> tuple[list[Node], str]:
    path = OPENB / "openb_node_list_gpu_node.csv"
    if path.exists():
        return simulation.read_nodes(path), str(path.name)
    shapes = [
        ("G2", 8, 96_000, 393_216, 549),
        ("T4", 2, 104_000, 524_288, 387),
        ("P100", 2, 16_000, 122_880, 107),
        ("V100M16", 4, 32_000, 131_072, 170),
    ]
    nodes: list[Node] = []
    for model, gpus, cpu, memory, count in shapes:
        for _ in range(count):
            name = f"synthetic-{len(nodes):05d}"
            nodes.append(Node(name, cpu, memory, tuple(Gpu(i, model, 0) for i in range(gpus))))
    return nodes, "synthetic openb-shaped"


def pods_mix() -> list[trace.TracePod]:
    path = OPENB / "openb_pod_list_default.csv"
    if path.exists():
        return simulation.read_pods(path)
    return simulation.read_pods(REPO / "gpuplace" / "data" / "pods.csv")


def big_cluster(count: int) -> list[Node]:
    models = ("A100", "H100", "L40S", "A10")
    return [
        Node(
            f"node-{i:05d}",
            128_000,
            1_048_576,
            tuple(Gpu(g, models[i % len(models)], 81_920, nvlink=g // 4) for g in range(8)),
            max_pods=250,
        )
        for i in range(count)
    ]


def latency(
    nodes: list[Node], mix: list[trace.TracePod], fill: float, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    workload = fragmentation.Workload.from_requests(pod.request() for pod in mix)
    book = Ledger(Inventory(nodes))
    rank = simulation.node_rank([node.name for node in nodes], seed)
    chooser = choosing.Chooser(book, policies.make("default", workload=workload, rank=rank))
    capacity = sum(len(node.gpus) for node in nodes) * 1000
    timings: list[float] = []
    allocated = 0
    n = 0
    while allocated < fill * capacity and n < 200_000:
        pod = mix[rng.randrange(len(mix))]
        request = pod.request()
        start = time.perf_counter()
        choice = chooser.choose(request, rng)
        timings.append(time.perf_counter() - start)
        if choice is not None:
            book.reserve(choosing.grant_for(f"p{n}", choice, request))
            allocated += request.total_milli
        n += 1
    timings.sort()
    return {
        "nodes": len(nodes),
        "gpus": sum(len(node.gpus) for node in nodes),
        "decisions": len(timings),
        "p50_ms": round(statistics.median(timings) * 1000, 3),
        "p99_ms": round(timings[int(0.99 * (len(timings) - 1))] * 1000, 3),
        "max_ms": round(timings[-1] * 1000, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller fills, no full replay")
    args = parser.parse_args()
    mix = pods_mix()
    nodes, source = openb_nodes()
    fill = 0.3 if args.quick else 0.9
    out: dict[str, object] = {"openb": {"source": source, **latency(nodes, mix, fill, 42)}}
    out["synthetic_10000x8"] = latency(big_cluster(10_000), mix, 0.1 if args.quick else 0.5, 42)
    if not args.quick and (OPENB / "openb_pod_list_default.csv").exists():
        figures, _ = simulation.run(
            nodes,
            mix,
            pods_name="openb_pod_list_default.csv",
            policy_name="default",
            seed=42,
            extender=False,
        )
        out["full_replay_default"] = {
            "wall_seconds": figures.wall_seconds,
            "arrivals": figures.arrivals,
            "decision_p50_ms": figures.decision_p50_ms,
            "decision_p99_ms": figures.decision_p99_ms,
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
