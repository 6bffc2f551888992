"""Capacity holds for queues: which starving workload gets nodes kept for it.

A workload of several GPUs (a multi-GPU pod, or a gang) needs them free at once, and a
stream of small pods takes every GPU that frees first: it can wait forever behind them
although its queue is the one furthest below its fair share, and preemption finds no
node it could empty (the small pods of queues that may not be preempted sit on every
one). So, after each round, `starving(round, workloads, now=..., after=..., past=...)`
names at most one waiting workload to hold capacity for:

- it waits for room (`Why.PLACE`), for its cohort's quota (`Why.COHORT`) or for
  workloads it preempts (`Why.RECLAIMING`), and was created at least `after` seconds
  ago (`Workload.created`);
- it asks for more than one GPU in all (one GPU frees often enough);
- it is the first such workload of its queue (the queue's own order);
- its queue's fair share (`quotas.Accounts.fair_share`: its share now, plus its past
  share while it borrows) is below that of another queue of its cohort: holding
  capacity for a queue already ahead of every other would only cost allocation;
- among those, the lowest fair share, then the oldest, then by key;
- when none is, the workload held for so far (`current`) keeps its hold while it still
  waits for room: a hold that came and went with every small move of the shares would
  start another node draining each time.

The caller holds the nodes `gangs.fence` gives for it (`gpuplace.placement.fences`: no
new pod there but its members; the queue controller's admissions and the extender's
filter both honour it), so they drain towards it while the reclaims of the rounds
(`admitting`) preempt what they may there. One hold at a time, as for starving gangs.

Pure: no I/O, no clock. O(waiting + queues).
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuplace.placement import quotas
from gpuplace.placement.admitting import Round, Why, Workload

WAITING_FOR_ROOM = frozenset({Why.PLACE, Why.COHORT, Why.RECLAIMING})


def fair_shares(round: Round, past: Mapping[str, float]) -> dict[str, float]:
    """Each queue's fair share after the round: its share plus its past share while it
    borrows, else 0 (`quotas.Accounts.fair_share`). O(queues)."""
    return {
        status.name: quotas.with_past(status.share, past.get(status.name, 0.0))
        for status in round.queues
    }


def starving(
    round: Round,
    workloads: Mapping[str, Workload],
    *,
    now: float,
    after: float,
    past: Mapping[str, float] | None = None,
    current: str = "",
) -> Workload | None:
    """The workload to hold capacity for, or None (module docstring). `current`: the
    key of the workload held for now ("" for none)."""
    fair = fair_shares(round, past or {})
    cohort = {status.name: status.cohort for status in round.queues}
    firsts: dict[str, tuple[int, Workload]] = {}
    for waiting in round.waiting:
        workload = workloads.get(waiting.key)
        if (
            workload is None
            or waiting.why not in WAITING_FOR_ROOM
            or not cohort.get(waiting.queue)
            or now - workload.created < after
            or sum(member.request.count for member in workload.members) <= 1
        ):
            continue
        first = firsts.get(waiting.queue)
        if first is None or waiting.position < first[0]:
            firsts[waiting.queue] = (waiting.position, workload)
    best: tuple[float, float, str] | None = None
    chosen = None
    for queue, (_, workload) in firsts.items():
        mine = fair.get(queue, 0.0)
        others = [
            fair[name]
            for name, theirs in cohort.items()
            if theirs == cohort[queue] and name != queue
        ]
        if not others or mine >= max(others):
            continue
        key = (mine, workload.created, workload.key)
        if best is None or key < best:
            best, chosen = key, workload
    if chosen is None and current:
        for waiting in round.waiting:
            if waiting.key == current and waiting.why in WAITING_FOR_ROOM:
                return workloads.get(current)
    return chosen
