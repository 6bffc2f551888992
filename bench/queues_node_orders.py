"""How much the queue replay's figures depend on the order the nodes are listed in.

`gpuplace simulate --queues` replays the openb trace on 30 GPUs (three 8-GPU nodes and
three small ones). Ties between equal nodes go to the first listed, so the order decides
which node the first pods land on, and with capacity holds which node is drained; the
same trace on the same nodes listed in another order is a fair second sample of a
replay that has no seed. This runs `gpuplace.replay.in_time.replay` (both runs: without
and with queues) for the nodes as listed, reversed, and rotated by two, and prints one
JSON line per order, then a summary line with each figure's mean, min and max.

    .venv/bin/python bench/queues_node_orders.py --queues bench/queues-openb-over-time.yaml \\
        --fair-sharing-half-life 21600 --hold-after 120 --jobs 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuplace.placement import trace  # noqa: E402
from gpuplace.placement.inventory import Node  # noqa: E402
from gpuplace.replay import in_time, simulation  # noqa: E402

OPENB = REPO.parent / "shared" / "data" / "openb"
ORDERS = ("listed", "reversed", "rotated-2")


def ordered(nodes: list[Node], order: str) -> list[Node]:
    if order == "reversed":
        return nodes[::-1]
    if order == "rotated-2":
        return nodes[2:] + nodes[:2]
    return nodes


def one(job: tuple[str, str, float | None, float | None, int]) -> dict[str, Any]:
    order, queues_file, half_life, hold_after, gpus = job
    nodes = trace.scaled(simulation.read_nodes(OPENB / "openb_node_list_gpu_node.csv"), gpus)
    pods = in_time.read_jobs(OPENB / "openb_pod_list_default.csv")
    queues = in_time.read_queues(Path(queues_file))
    document = in_time.replay(
        ordered(list(nodes), order),
        pods,
        queues,
        policy_name="default",
        half_life=half_life,
        hold_after=hold_after,
    )
    queued = document["queues"]
    return {
        "order": order,
        "nodes": [node.name for node in ordered(list(nodes), order)],
        "allocation_no_queues": document["no_queues"]["allocation"],
        "allocation": queued["allocation"],
        "allocation_cost_points": document["allocation_cost_points"],
        "jain": queued["jain"],
        "share_vs_entitlement": {t["team"]: t["share_vs_entitlement"] for t in queued["teams"]},
        "holds": queued["holds"],
        "lost_gpu_hours": queued["lost_gpu_hours"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queues", default=str(REPO / "bench" / "queues-openb-over-time.yaml"))
    parser.add_argument("--fair-sharing-half-life", type=float, default=None)
    parser.add_argument("--hold-after", type=float, default=None)
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    if not OPENB.is_dir():
        print(f"skipped: openb trace not found at {OPENB}", file=sys.stderr)
        return 0
    jobs = [
        (order, args.queues, args.fair_sharing_half_life, args.hold_after, args.gpus)
        for order in ORDERS
    ]
    if args.jobs > 1:
        with multiprocessing.Pool(args.jobs) as pool:
            rows = pool.map(one, jobs)
    else:
        rows = [one(job) for job in jobs]
    for row in rows:
        print(json.dumps(row), flush=True)
    summary: dict[str, Any] = {}
    for key in ("allocation_no_queues", "allocation", "allocation_cost_points", "jain"):
        summary[key] = _spread([row[key] for row in rows])
    for team in rows[0]["share_vs_entitlement"]:
        summary[team] = _spread([row["share_vs_entitlement"][team] for row in rows])
    print(json.dumps({"summary": summary, "orders": len(rows)}))
    return 0


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


if __name__ == "__main__":
    raise SystemExit(main())
