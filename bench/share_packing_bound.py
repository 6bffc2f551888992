"""An upper bound on GPU allocation at 100% arrived, for the openb replay.

For each seed, take the pods that arrive before the arrived GPU request passes 100% of
the cluster's capacity (the paper's procedure, `gpuplace.placement.replay.arrival_order`) and
pack only their *shares* (single-GPU pods asking for less than a whole GPU) into
1000-milli GPUs offline, largest first, each into the fullest GPU it fits
(best-fit decreasing — near-optimal for bin packing). Every milli-GPU left over in
those GPUs can only be used by another share, so no placement can allocate more than
`arrived − leftover`. The bound ignores CPU, memory, GPU models, multi-GPU pods and
the order of arrival, all of which only lower what is reachable.

    .venv/bin/python bench/share_packing_bound.py [--pods FILE] [--seeds 42-51]

Prints JSON: per seed the arrived request, the GPUs the shares need and the bound.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuplace.placement import replay  # noqa: E402
from gpuplace.replay import simulation  # noqa: E402

OPENB = REPO.parent / "shared" / "data" / "openb"


def bound(pods_file: Path, nodes_file: Path, seed: int) -> dict[str, float | int]:
    nodes = simulation.read_nodes(nodes_file)
    pods = simulation.read_pods(pods_file)
    capacity = sum(len(node.gpus) for node in nodes) * 1000
    arrived = 0
    shares: list[int] = []
    for pod in replay.arrival_order(pods, capacity, seed):
        if arrived + pod.total_milli > capacity:
            break
        arrived += pod.total_milli
        if pod.num_gpu == 1 and pod.gpu_milli < 1000:
            shares.append(pod.gpu_milli)
    shares.sort(reverse=True)
    free: list[int] = []  # free milli of each opened GPU, kept sorted
    for share in shares:
        position = bisect.bisect_left(free, share)
        if position == len(free):
            bisect.insort(free, 1000 - share)
        else:
            left = free.pop(position) - share
            bisect.insort(free, left)
    leftover = sum(free)
    return {
        "seed": seed,
        "arrived_percent": round(100 * arrived / capacity, 2),
        "share_gpus": len(free),
        "share_leftover_milli": leftover,
        "allocation_bound_percent": round(100 * (arrived - leftover) / capacity, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="upper bound on allocation at 100% arrived")
    parser.add_argument("--pods", type=Path, default=OPENB / "openb_pod_list_default.csv")
    parser.add_argument("--nodes", type=Path, default=OPENB / "openb_node_list_gpu_node.csv")
    parser.add_argument("--seeds", default="42-51", help="a range A-B or a comma list")
    args = parser.parse_args()
    if not args.pods.exists() or not args.nodes.exists():
        print(f"skipped: openb trace not found ({args.pods})", file=sys.stderr)
        return 0
    if "-" in args.seeds:
        low, high = (int(part) for part in args.seeds.split("-"))
        seeds = list(range(low, high + 1))
    else:
        seeds = [int(part) for part in args.seeds.split(",")]
    rows = [bound(args.pods, args.nodes, seed) for seed in seeds]
    mean = sum(float(row["allocation_bound_percent"]) for row in rows) / len(rows)
    print(
        json.dumps(
            {"pods": args.pods.name, "runs": rows, "mean_bound_percent": round(mean, 2)}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
