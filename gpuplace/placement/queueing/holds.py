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
  start another node draining each time. (Keeping it also while another workload of
  its queue moved ahead, or another queue fell further below, was measured and not
  adopted: docs/performance.md, "Queues".)

The caller holds the nodes `nodes(ledger, workload, staying(...))` gives for it
(`gpuplace.placement.fences`: no new pod there but its members; the queue controller's
admissions and the extender's filter both honour it), so they drain towards it, while
the reclaims of the rounds (`admitting`) preempt what they may there: the held
workload's victims are looked for on its nodes first (`admitting.Workload.held`). The
nodes are those `gangs.fence` picks (closest to holding it) among the nodes where the
fewest GPUs are held by pods that will not leave for it: its own queue's (a node full
of its queue's last 8-GPU pod would keep the next one waiting for exactly that pod),
and those of queues it may not preempt. While the same workload is held, each round
`repick` moves the hold to other nodes when fewer such GPUs are held there than on its
own (measured on the openb replay: docs/performance.md, "Queues"). One hold at a time,
as for starving gangs.

Pure: no I/O, no clock. `starving`: O(waiting + queues); `staying`: O(pods + queues);
`nodes`: O(grants) plus `gangs.fence` per level of blocked GPUs tried; `repick`: O(grants)
plus `nodes`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from gpuplace.placement import gangs
from gpuplace.placement.ledger import Ledger
from gpuplace.placement.queueing import quotas
from gpuplace.placement.queueing.admitting import Round, Why, Workload

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


def staying(
    round: Round, workload: Workload, queue_of: Mapping[str, str], past: Mapping[str, float]
) -> set[str]:
    """The running pods (UID -> queue in `queue_of`) that will not leave for `workload`:
    its own queue's, and those of every queue that does not borrow or whose fair share is
    not above its queue's. An estimate made once per hold, not the round's rules: fair
    sharing takes only from queues ahead of the preemptor's, reclaim inside a nominal
    from any queue that borrows. O(pods + queues)."""
    fair = fair_shares(round, past)
    mine = fair.get(workload.queue, 0.0)
    ahead = {
        status.name
        for status in round.queues
        if status.name != workload.queue
        and any(status.borrowed.values())
        and fair.get(status.name, 0.0) > mine
    }
    return {uid for uid, queue in queue_of.items() if queue not in ahead}


def nodes(ledger: Ledger, workload: Workload, stay: Collection[str]) -> tuple[str, ...]:
    """The nodes to hold for `workload` (module docstring): `gangs.fence`'s among the
    nodes where the fewest GPUs are held by pods that will not leave for it (UIDs
    `stay`, from `staying`), widening to more such GPUs until the fence finds room; empty
    when even an idle cluster could not hold it. O(grants + levels x `gangs.fence`)."""
    return _nodes(ledger, workload, _blocked_per_node(ledger, stay))


def blocked(ledger: Ledger, names: Collection[str], stay: Collection[str]) -> int:
    """Milli-GPUs on nodes `names` held by pods that will not leave (UIDs `stay`).
    O(grants)."""
    per_node = _blocked_per_node(ledger, stay)
    return sum(per_node.get(name, 0) for name in names)


def repick(
    ledger: Ledger, workload: Workload, stay: Collection[str], held: Collection[str]
) -> tuple[str, ...] | None:
    """For the workload held for now, on nodes `held`: the nodes to hold instead, or None
    to keep them. It moves only to nodes where fewer GPUs are held by pods that will not
    leave for it than on its own now (pods come and go while a node drains: a long one
    that stays may land on no other node, or leave). O(grants) plus `nodes`."""
    per_node = _blocked_per_node(ledger, stay)
    found = _nodes(ledger, workload, per_node)
    if not found or set(found) == set(held):
        return None
    if sum(per_node[name] for name in found) >= sum(per_node.get(name, 0) for name in held):
        return None
    return found


def choose(
    ledger: Ledger,
    workload: Workload,
    stay: Collection[str],
    held: Collection[str] | None,
) -> tuple[str, ...] | None:
    """Where to hold for `workload`: `repick` when it is the workload held now (on nodes
    `held`; None: keep them), else `nodes` (empty: nowhere). O(grants) plus `nodes`."""
    if held is not None:
        return repick(ledger, workload, stay, held)
    return nodes(ledger, workload, stay)


def _blocked_per_node(ledger: Ledger, stay: Collection[str]) -> dict[str, int]:
    """Per node, the milli-GPUs held by pods that will not leave (0 for none). O(grants)."""
    per_node = {state.node.name: 0 for state in ledger.states()}
    for grant in ledger:
        if grant.pod_uid in stay:
            per_node[grant.node] = per_node.get(grant.node, 0) + grant.milli * len(grant.gpus)
    return per_node


def _nodes(ledger: Ledger, workload: Workload, per_node: Mapping[str, int]) -> tuple[str, ...]:
    for level in sorted(set(per_node.values())):
        found = gangs.fence(
            ledger,
            workload.members,
            exclude={name for name, milli in per_node.items() if milli > level},
        )
        if found:
            return found
    return ()
