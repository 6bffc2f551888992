"""Time one round of queue admission (`gpuplace.placement.queueing.admitting.admit`), as the queue
controller will run it: a scratch copy of the ledger, then every waiting workload tried.

The cluster: NODES nodes of 8 whole GPUs; 8 queues in one cohort, each with an eighth of
the GPUs as nominal quota; about 90% of the GPUs held by running pods (whole GPUs and 50%
shares) spread over the queues, some borrowing; WAITING pods (whole GPUs, shares, and 4-GPU
gangs of 2) waiting across the queues. Each case is timed REPEAT times (median, max), with
full reasons (what a controller reports) and without (what the replay uses).

    .venv/bin/python -m bench.queue_round [--repeat 5]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from typing import Any

from gpuplace.placement import policies
from gpuplace.placement.gangs import Member
from gpuplace.placement.inventory import Gpu, Inventory, Node
from gpuplace.placement.ledger import Grant, GrantState, Ledger
from gpuplace.placement.queueing import admitting
from gpuplace.placement.queueing.quotas import ANY_MODEL, GPUS, QueueSpec, Quota
from gpuplace.placement.requests import WHOLE, GpuRequest

QUEUES = 8
CASES = ((100, 200), (1000, 500), (1000, 2000))
"""(nodes, waiting pods)."""


def cluster(nodes: int) -> Ledger:
    return Ledger(
        Inventory(
            Node(f"n{i}", 128_000, 1_048_576, tuple(Gpu(g, "A100", 81_920) for g in range(8)))
            for i in range(nodes)
        )
    )


def load(ledger: Ledger, rng: random.Random) -> list[admitting.Running]:
    """About 90% of the GPUs held, each pod in a random queue (uneven: some borrow)."""
    running = []
    weights = [2, 2, 1, 1, 1, 1, 0.5, 0.5]
    for state in list(ledger.states()):
        for gpu in state.node.gpus:
            if rng.random() > 0.9:
                continue
            halves = 2 if rng.random() < 0.3 else 1
            for half in range(halves):
                uid = f"{state.node.name}-{gpu.index}-{half}"
                milli = WHOLE if halves == 1 else 500
                grant = Grant(uid, state.node.name, (gpu.index,), milli, 0, 1000, 1024)
                ledger.reserve(replace(grant, state=GrantState.CONFIRMED))
                queue = rng.choices(range(QUEUES), weights)[0]
                running.append(admitting.Running(uid, f"q{queue}", (uid,), 0, rng.random()))
    return running


def waiting(count: int, rng: random.Random) -> list[admitting.Workload]:
    shapes = [
        GpuRequest(milli=WHOLE, count=1, cpu_milli=4000, host_memory_mib=16_384),
        GpuRequest(milli=500, count=1, cpu_milli=2000, host_memory_mib=8_192),
        GpuRequest(milli=250, memory_mib=10_240, count=1, cpu_milli=1000, host_memory_mib=4_096),
        GpuRequest(milli=WHOLE, count=4, cpu_milli=16_000, host_memory_mib=65_536),
    ]
    found = []
    for i in range(count):
        shape = rng.randrange(len(shapes) + 1)
        queue = f"q{rng.randrange(QUEUES)}"
        if shape == len(shapes):  # a gang of two 4-GPU members
            members = tuple(Member(f"w{i}-{m}", shapes[3]) for m in range(2))
        else:
            members = (Member(f"w{i}", shapes[shape]),)
        found.append(admitting.Workload(f"w{i}", queue, members, rng.randrange(3), float(i)))
    return found


def case(nodes: int, count: int, repeat: int, explain: bool) -> dict[str, Any]:
    rng = random.Random(nodes * 7 + count)
    ledger = cluster(nodes)
    running = load(ledger, rng)
    pods = waiting(count, rng)
    nominal = nodes * 8 * WHOLE // QUEUES
    queues = [
        QueueSpec(f"q{i}", {(GPUS, ANY_MODEL): Quota(nominal)}, cohort="all") for i in range(QUEUES)
    ]
    policy = policies.BestFitPolicy(None)
    times = []
    decided = None
    for _ in range(repeat):
        start = time.perf_counter()
        placer = admitting.Placer.scratch(ledger, policy)
        placer.explain = explain
        decided = admitting.admit(placer, queues, running, pods, now=1e6)
        times.append(time.perf_counter() - start)
    assert decided is not None
    return {
        "nodes": nodes,
        "gpus": nodes * 8,
        "running": len(running),
        "waiting": count,
        "reasons": explain,
        "admitted": len(decided.admissions),
        "reclaims": len(decided.reclaims),
        "round_ms_p50": round(statistics.median(times) * 1000, 1),
        "round_ms_max": round(max(times) * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = [
        case(nodes, count, args.repeat, explain)
        for nodes, count in CASES
        for explain in (True, False)
    ]
    print(json.dumps({"cases": rows}, indent=2))


if __name__ == "__main__":
    main()
