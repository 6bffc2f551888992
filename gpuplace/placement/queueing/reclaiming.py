"""Which borrowed workloads to preempt so that a queue gets back the quota it lent.

A queue whose waiting workload fits inside its own nominal quota, but finds its cohort's
lending pool used up or no GPU free for it, may preempt workloads of the *borrowing*
queues of its cohort (queues using more than their nominal), as its reclaim policy
allows: any, or only those of lower priority than the waiting workload. With fair sharing
it may also do so beyond its nominal, from queues that would still borrow at least the
share it reaches, or with `LessThanInitialShare` from queues that borrowed more than that
share before (`gpuplace.placement.queueing.admitting` decides which candidate is allowed).

`victims(candidates, admits, allowed, could)` picks them:

1. candidates in order: an elastic gang's extra members first (each alone: the gang runs
   on without them), then whole workloads (a gang is one candidate, all its members);
   each group lowest priority first, then the most recently admitted first (admission
   times are exact: `assigned-at` is stamped to the microsecond, strictly increasing,
   `gpuplace.cluster.assignments.Stamps`), then by key;
2. greedy: take, in that order, every candidate that is allowed once those taken before
   it are gone (`allowed`: its queue still borrows, and a policy lets it go);
3. shortest: the shortest start of that list after which the waiting workload would be
   admitted (`admits`: quota and a real place in the ledger, the same test as admission),
   found by bisection: more victims never make room smaller, so `admits` only turns from
   false to true along the list;
4. minimal: drop every taken candidate the workload can do without, the most important
   first, so each victim left is needed: without any one of them `admits` is false;
5. fewest: a set of two or more victims gives way to one allowed candidate that alone
   would admit the workload and is no worse a victim on any count the order weighs
   (`dominates`): it stops no whole workload where the set stops none (extras go before
   any whole workload: their gangs run on), frees no more GPU (`Candidate.milli`),
   throws away no more GPU time (`Candidate.gpu_time`: GPUs x seconds since it
   started) and is of no higher priority than the set's highest. Among such, the least
   disruptive (`disruption`: fewest whole workloads stopped, then fewest extras given
   back, then the lowest priority, then the least GPU time, then the order of step 1).
   So never k victims where one alone frees as much, loses as little and outranks none
   of them: issue 41's two 50% shares of a GPU, where the whole-GPU pod admitted with
   them frees the same (whole-second admission times tied them, and ties go by name).
   One that would free more, lose more or outrank them is not taken instead: measured
   on the openb replay (docs/performance.md), taking the one victim whenever it alone
   admits the workload and frees no more GPU (an 8-GPU job that had run for days
   instead of eight 1-GPU pods just started) threw away 10% more work with the default
   queues and, with `LessThanInitialShare` on every queue, set queues preempting each
   other's 8-GPU jobs back and forth (18,838 preemptions instead of 2,947; 26,606 when
   it could also free more GPU). All within a bound on the work:
   candidates are tried least disruptive first, so the first admitted is the answer;
   the caller's `could` (cheap: quota arithmetic and the candidate's own nodes,
   `gpuplace.placement.queueing.admitting`) skips, without an admission test, those that cannot
   admit the workload; and at most `ALONE_TESTS` reach a test (each is a plan: about
   20 ms for a gang at 1,000 nodes), so where that many could and do not, step 4's set
   stands. Candidates of step 4's set are not tried alone (none admits alone: each is
   needed beside the others).

Nothing is evicted (None) when even every candidate would not make room.

Complexity: O(C log C) to order C candidates and C calls of `allowed` (cheap: quota
arithmetic), then O(log C + V) calls of `admits` for V victims before step 4 (each a quota
check and a plan: `gpuplace.placement.queueing.admitting`; a quota check alone where
quota refuses), and O(V) at most in step 4 (`needed`); step 5 only when step 4 left two
victims or more: O(C * V) to compare each candidate with the set (`dominates`), O(C log C)
to sort those that pass by `disruption`, up to C more calls of `allowed` and of `could`,
and at most `ALONE_TESTS` more of `admits` (the measured cost, docs/performance.md: about
0.1 s a reclaim of two victims or more at 1,000 nodes, mostly `could`).

Pure: no I/O, no clock; ties go to the workload key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    """What one preemption would take away: a whole workload, or one extra member of an
    elastic gang (`shrink`)."""

    key: str
    """The running workload's key."""
    queue: str
    uids: tuple[str, ...]
    priority: int
    admitted: float
    """When it was admitted (an elastic member: when it started), on the caller's clock."""
    shrink: bool = False
    gpu_time: float = 0.0
    """GPU-seconds its pods have run (GPUs held x seconds since each started), what
    preempting it throws away: the caller's figure, compared between candidates only."""
    milli: int = 0
    """Milli-GPU its pods hold (1000: one whole GPU), what preempting it frees."""

    def __post_init__(self) -> None:
        if not self.uids:
            raise ValueError(f"candidate {self.key} names no pod")


def ordered(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Extra elastic members first, then lowest priority, then most recently admitted.
    O(C log C)."""
    return sorted(candidates, key=lambda c: (not c.shrink, c.priority, -c.admitted, c.key, c.uids))


def disruption(chosen: Sequence[Candidate]) -> tuple[int, int, int, float]:
    """How much preempting `chosen` disrupts, smaller is better (module docstring, step
    5): whole workloads stopped, extra members given back, the highest priority among
    them, their GPU time. O(len(chosen))."""
    stopped = sum(1 for c in chosen if not c.shrink)
    return (
        stopped,
        len(chosen) - stopped,
        max((c.priority for c in chosen), default=0),
        sum(c.gpu_time for c in chosen),
    )


def victims(
    candidates: Sequence[Candidate],
    admits: Callable[[Sequence[Candidate]], bool],
    allowed: Callable[[Candidate, Sequence[Candidate]], bool],
    could: Callable[[Candidate], bool] | None = None,
) -> list[Candidate] | None:
    """The candidates to preempt, each one needed, or None when no choice of them lets
    the workload in. `admits(chosen)`: would it be admitted once `chosen` are gone;
    `allowed(candidate, chosen)`: may the candidate go once `chosen` are gone;
    `could(candidate)`: a cheap test that `admits([candidate])` may be true (False only
    where it is not; default: always may). An empty list: it is admitted without
    preempting anyone. See the module docstring for the order and the complexity."""
    if admits([]):
        return []
    order = ordered(candidates)
    chosen: list[Candidate] = []
    for candidate in order:
        if allowed(candidate, chosen):
            chosen.append(candidate)
    if not chosen or not admits(chosen):
        return None
    low, high = 0, len(chosen)
    """`admits(chosen[:low])` is false, `admits(chosen[:high])` true."""
    while high - low > 1:
        middle = (low + high) // 2
        if admits(chosen[:middle]):
            high = middle
        else:
            low = middle
    found = needed(chosen[:high], admits)
    if len(found) < 2:
        return found
    return fewest(found, order, admits, allowed, could or (lambda _: True))


ALONE_TESTS = 32
"""Candidates `fewest` tests alone with `admits` at most (those that pass `could`, the
least disruptive first)."""


def fewest(
    found: list[Candidate],
    order: Sequence[Candidate],
    admits: Callable[[Sequence[Candidate]], bool],
    allowed: Callable[[Candidate, Sequence[Candidate]], bool],
    could: Callable[[Candidate], bool],
) -> list[Candidate]:
    """Step 5 of the module docstring: `found` (two or more victims, each needed), or the
    least disruptive candidate of `order` that is no worse a victim than `found` on any
    count (`dominates`) and alone would admit the workload. Candidates are tried least
    disruptive first (ties in `order`), so the first one that is allowed alone, passes
    `could` and is admitted is the answer; at most `ALONE_TESTS` of them reach `admits`.
    O(C * V) for `dominates` (V: len(found)), O(C log C) to sort, at most C calls of
    `allowed` and of `could`, at most `ALONE_TESTS` of `admits`."""
    cost = disruption(found)
    taken = {id(c) for c in found}
    alone = [
        (each, c)
        for c in order
        if id(c) not in taken and dominates(c, found) and (each := disruption([c])) < cost
    ]
    alone.sort(key=lambda item: item[0])  # stable: ties keep the order of step 1
    tests = 0
    for _, candidate in alone:
        if tests >= ALONE_TESTS:
            break
        if not allowed(candidate, []) or not could(candidate):
            continue
        tests += 1
        if admits([candidate]):
            return [candidate]
    return found


def dominates(candidate: Candidate, found: Sequence[Candidate]) -> bool:
    """Whether preempting `candidate` alone is no worse than preempting all of `found`
    on any count the order weighs (step 5): it stops no workload where `found` stops
    none, frees no more GPU, throws away no more GPU time, and is of no higher priority
    than the highest of them. O(len(found))."""
    return (
        (candidate.shrink or any(not c.shrink for c in found))
        and candidate.milli <= sum(c.milli for c in found)
        and candidate.gpu_time <= sum(c.gpu_time for c in found)
        and candidate.priority <= max(c.priority for c in found)
    )


def needed(
    chosen: Sequence[Candidate], admits: Callable[[Sequence[Candidate]], bool]
) -> list[Candidate]:
    """`chosen` (which `admits`) without every candidate it can do without, the most
    important first (they are spared first). Spares runs of candidates at once, halving
    the run each pass down to one at a time (the last pass makes each one left needed:
    sparing more never helps, since fewer victims never make more room): O(m log V)
    calls of `admits` when m of V are needed, O(V) at worst."""
    kept = list(chosen)
    size = max(1, len(kept) // 2)
    while True:
        end = len(kept)
        while end > 0:
            start = max(0, end - size)
            rest = kept[:start] + kept[end:]
            if rest and admits(rest):
                kept = rest
            end = start
        if size == 1:
            return kept
        size = max(1, size // 2)
