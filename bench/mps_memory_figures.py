"""What a share can use and what a GPU packs, on the H100 as the captures measured it
(issue 43): no GPU is needed and none is used.

Prints JSON:

- `measured_context_mib`: per thread percentage, the MiB a client's CUDA context took
  (every measurement in ../shared/fixtures/gpu and docs/node-agent.md's H100 run, read by
  `tests.agent.gpu_memory`), the H100 table's figure (`mps_limits.MODELS`) and its margin;
- `packable`: what the agent publishes from each capture (`gpuplace.agent.capacity`);
- `two_gib_share`: the env a `25 %, 2Gi` share gets and what it can allocate;
- `packed_gpu`: four 25 % shares whose asks with their contexts fill the packable memory,
  each allocating its whole ask at once; and the same under the rules before issue 43;
- `random_packings`: `--packings` seeded random mixes of shares, each packed by the
  engine until the GPU is full, then every client allocates its ask in pieces in a
  random order: how many allocations failed, under the new rules and the old.

    .venv/bin/python bench/mps_memory_figures.py [--packings 2000] [--seed 43]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuplace.agent import capacity, nvml  # noqa: E402
from gpuplace.cluster import mps_limits  # noqa: E402
from tests.agent import gpu_memory  # noqa: E402
from tests.agent import test_packed_gpu as packing  # noqa: E402
from tests.agent.kubelet import gpu_fixture  # noqa: E402

H100 = "NVIDIA-H100-80GB-HBM3"


def contexts(figures: gpu_memory.Figures) -> dict[str, Any]:
    table = mps_limits.MODELS[H100].context
    rows = {}
    for percent, mib in sorted(figures.contexts.items()):
        rows[f"{percent}%"] = {
            "measured": round(mib, 1),
            "table": table.mib(percent * 10),
            "margin": round(table.mib(percent * 10) - mib, 1),
        }
    rows["100% (plain, no MPS)"] = {
        "measured": figures.plain_context,
        "table": table.mib(0),
        "margin": table.mib(0) - figures.plain_context,
    }
    return {"table": f"{table.base_mib} + {table.per_percent_mib} x percent", "rows": rows}


def packable() -> dict[str, Any]:
    found = {}
    for name in ("idle", "plain-client", "mps-clients"):
        replay = nvml.Replay.load(gpu_fixture(f"nvml-{name}.json"))
        server = mps_limits.figures(replay.name(0)).server_mib
        memory = capacity.read(replay, 0, replay.memory_total(0), server, capacity.Readings())
        found[name] = {
            "total_mib": memory.total_mib,
            "reserved_mib": memory.reserved_mib,
            "server_mib": memory.server_mib,
            "packable_mib": memory.packable_mib,
        }
    return found


def outcome(placed: list[tuple[packing.Share, dict[str, str]]], order: list[int]) -> str:
    try:
        packing.play(placed, 1, order)
    except gpu_memory.OutOfMemory as failed:
        return f"failed: {failed}"
    return "every ask allocated"


def packed_gpu() -> dict[str, Any]:
    node = packing.published_node()
    context = node.gpus[0].context.mib(250)
    ask = (node.gpus[0].memory_mib - 4 * context) // 4
    _, placed = packing.pack([packing.Share(250, ask)] * 4)
    quarter = int(packing.FIGURES.total // 4)
    old = packing.old_rules([packing.Share(250, quarter)] * 4)
    return {
        "packable_mib": node.gpus[0].memory_mib,
        "shares": len(placed),
        "ask_mib": ask,
        "limit": placed[0][1][mps_limits.MEMORY_ENV],
        "result": outcome(placed, [0, 1, 2, 3]),
        "old_rules": {
            "ask_mib": quarter,
            "limit": old[0][1][mps_limits.MEMORY_ENV],
            "result": outcome(old, [0, 1, 2, 3]),
        },
    }


def random_packings(count: int, seed: int) -> dict[str, Any]:
    chance = random.Random(seed)
    results = {"new_rules_failed": 0, "old_rules_failed": 0, "shares_placed": 0}
    for _ in range(count):
        memory_only = chance.random() < 0.3
        shares = [
            packing.Share(
                0 if memory_only else chance.choice([10, 50, 100, 250, 333, 500, 750]),
                chance.randint(256, 40960),
            )
            for _ in range(chance.randint(1, 60))
        ]
        _, placed = packing.pack(shares)
        results["shares_placed"] += len(placed)
        order = list(range(len(placed)))
        chance.shuffle(order)
        if outcome(placed, order) != "every ask allocated":
            results["new_rules_failed"] += 1
        old = packing.old_rules(shares)
        old_order = list(range(len(old)))
        chance.shuffle(old_order)
        if outcome(old, old_order) != "every ask allocated":
            results["old_rules_failed"] += 1
    return {"packings": count, "seed": seed, **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packings", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=43)
    args = parser.parse_args()
    figures = gpu_memory.figures()
    _, two = packing.pack([packing.Share(250, 2048)])
    env = two[0][1]
    report = {
        "gpu": "NVIDIA H100 80GB HBM3, driver 580.159.04 (captured; no GPU used here)",
        "measured_context_mib": contexts(figures),
        "unattributed_under_load_mib_per_client": figures.unattributed_per_client,
        "packable": packable(),
        "two_gib_share": {"env": env, "result": outcome(two, [0])},
        "packed_gpu": packed_gpu(),
        "random_packings": random_packings(args.packings, args.seed),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
