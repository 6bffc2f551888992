"""Synchronous work of one gang-preemption planning round, at 1,000 and 10,000 nodes.

Every node has 8 GPUs, each held by a 1-GPU pod of priority 0 (bound, running); a
priority-100 gang of 8 members × 8 whole GPUs must evict 64 of them. Timed, as
`gpuplace.controllers.victims.plan` (for `gpuplace.gangs.evicting.GangPreemptions`, and a
lone DRA pod's `gpuplace.claims.preempting`) runs them on the event loop the
extender's verbs share: `victim_units` (O(pods + grants), once per attempt) and one
`gpuplace.placement.victim_choice.for_gang` (one pass). One attempt makes at most `PASSES` passes
(each after a budget refused a unit) and yields to the loop between them, and one gang
plans per controller round: `longest_blocking_seconds` (victim_units + the first pass)
is the longest stretch without an await, `round_bound_seconds` (victim_units + passes ×
for_gang) bounds the round's planning.

    .venv/bin/python -m bench.gang_preempt_plan [--nodes 1000,10000] [--repeat 3]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from gpuplace.cluster.nodes import NodeRecord
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import victims as eviction_victims
from gpuplace.gangs import evicting
from gpuplace.placement import gangs, policies, victim_choice
from gpuplace.placement.ledger import Grant, GrantState
from gpuplace.placement.requests import WHOLE, GpuRequest
from tests.placement.clusters import node

GPUS = 8
MEMBERS = 8


def bound(sync: LedgerSync, uid: str, where: str, gpu: int, milli: int) -> None:
    """A running pod of priority 0 bound to `where`, holding `milli` of GPU `gpu`."""
    grant = Grant(uid, where, (gpu,), milli, 0, 100, 100, state=GrantState.CONFIRMED)
    sync.upsert_pod(
        PodRecord(
            uid=uid,
            namespace="batch",
            name=uid,
            resource_version="1",
            node_name=where,
            phase="Running",
            deleting=False,
            gated=False,
            request=None,
            grant=grant,
            assigned_at=None,
        )
    )


def cluster(count: int) -> LedgerSync:
    sync = LedgerSync()
    for n in range(count):
        name = f"gpu-{n:05d}"
        sync.put_node(NodeRecord(name, name, True, node(name, GPUS)))
        for g in range(GPUS):
            bound(sync, f"{name}-p{g}", name, g, WHOLE)
    return sync


def measure(count: int, repeat: int) -> dict[str, Any]:
    started = time.perf_counter()
    sync = cluster(count)
    built = time.perf_counter() - started
    request = GpuRequest(milli=WHOLE, count=GPUS, cpu_milli=100, host_memory_mib=100)
    members = [gangs.Member(f"m{i}", request) for i in range(MEMBERS)]
    policy = policies.make("best-fit")
    units_s: list[float] = []
    plan_s: list[float] = []
    victims = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        units = eviction_victims.victim_units(sync, 100)
        t1 = time.perf_counter()
        found = victim_choice.for_gang(sync.ledger, policy, members, units)
        t2 = time.perf_counter()
        units_s.append(t1 - t0)
        plan_s.append(t2 - t1)
        victims = len(found.uids) if found is not None else -1
    units_median, plan_median = statistics.median(units_s), statistics.median(plan_s)
    return {
        "nodes": count,
        "gpus": count * GPUS,
        "pods": len(sync.pods),
        "build_seconds": round(built, 3),
        "victim_units_seconds": round(units_median, 4),
        "for_gang_seconds": round(plan_median, 4),
        "longest_blocking_seconds": round(units_median + plan_median, 4),
        "passes_per_attempt": eviction_victims.PASSES,
        "plans_per_round": evicting.PLANS_PER_ROUND,
        "round_bound_seconds": round(units_median + plan_median * eviction_victims.PASSES, 3),
        "victims": victims,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1000,10000")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cases = [measure(int(n), args.repeat) for n in args.nodes.split(",")]
    print(json.dumps({"benchmark": "gang_preempt_plan", "cases": cases}, indent=2))


if __name__ == "__main__":
    main()
