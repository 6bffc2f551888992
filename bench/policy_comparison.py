"""Policy figures on the openb pod lists: the table behind the README's claims.

Runs `gpuplace simulate`'s replay (gpuplace.replay.simulation.run) for each pod list × policy
× seed and prints JSON lines, then a summary: per list and policy the mean GPU
allocation at 100% arrived. `--via-extender` applies to the policies marked with `@x`
(e.g. `default@x,fgd`): those go through the sidecar's own filter/prioritize.

    .venv/bin/python bench/policy_comparison.py --lists default --policies fgd,best-fit,random
    .venv/bin/python bench/policy_comparison.py --lists all --policies default@x,fgd --seeds 42-44
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuplace.replay import simulation  # noqa: E402

OPENB = REPO.parent / "shared" / "data" / "openb"


def one(job: tuple[str, str, bool, int]) -> dict[str, object]:
    pods_name, policy, extender, seed = job
    nodes = simulation.read_nodes(OPENB / "openb_node_list_gpu_node.csv")
    pods = simulation.read_pods(OPENB / pods_name)
    figures, _ = simulation.run(
        nodes, pods, pods_name=pods_name, policy_name=policy, seed=seed, extender=extender
    )
    return asdict(figures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lists", default="default", help="'all' or comma list (default, cpu050, ...)"
    )
    parser.add_argument("--policies", default="default@x,fgd")
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    if not OPENB.is_dir():
        print(f"skipped: openb trace not found at {OPENB}", file=sys.stderr)
        return 0
    if args.lists == "all":
        lists = sorted(path.name for path in OPENB.glob("openb_pod_list_*.csv"))
    else:
        lists = [f"openb_pod_list_{name}.csv" for name in args.lists.split(",")]
    low, _, high = args.seeds.partition("-")
    seeds = list(range(int(low), int(high or low) + 1))
    policies = [(name.removesuffix("@x"), name.endswith("@x")) for name in args.policies.split(",")]
    jobs = [
        (pods, policy, ext, seed) for pods in lists for policy, ext in policies for seed in seeds
    ]
    with multiprocessing.Pool(args.jobs) as pool:
        rows = []
        for row in pool.imap(one, jobs):
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary: dict[str, dict[str, float]] = {}
    for row in rows:
        label = f"{row['policy']}{' via extender' if row['via_extender'] else ''}"
        summary.setdefault(str(row["pods"]), {}).setdefault(label, [])  # type: ignore[arg-type]
        summary[str(row["pods"])][label].append(row["allocation_at_100"])  # type: ignore[attr-defined]
    table = {
        pods: {label: round(statistics.fmean(values), 3) for label, values in by.items()}  # type: ignore[arg-type]
        for pods, by in summary.items()
    }
    print(json.dumps({"mean_allocation_at_100": table, "seeds": seeds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
