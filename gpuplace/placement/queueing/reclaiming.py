"""Which borrowed workloads to preempt so that a queue gets back the quota it lent.

A queue whose waiting workload fits inside its own nominal quota, but finds its cohort's
lending pool used up or no GPU free for it, may preempt workloads of the *borrowing*
queues of its cohort (queues using more than their nominal), as its reclaim policy
allows: any, or only those of lower priority than the waiting workload. With fair sharing
it may also do so beyond its nominal, from queues that would still borrow at least the
share it reaches, or with `LessThanInitialShare` from queues that borrowed more than that
share before (`gpuplace.placement.queueing.admitting` decides which candidate is allowed).

`victims(candidates, admits, allowed)` picks them:

1. candidates in order: an elastic gang's extra members first (each alone: the gang runs
   on without them), then whole workloads (a gang is one candidate, all its members);
   each group lowest priority first, then the most recently admitted first;
2. greedy: take, in that order, every candidate that is allowed once those taken before
   it are gone (`allowed`: its queue still borrows, and a policy lets it go);
3. shortest: the shortest start of that list after which the waiting workload would be
   admitted (`admits`: quota and a real place in the ledger, the same test as admission),
   found by bisection: more victims never make room smaller, so `admits` only turns from
   false to true along the list;
4. minimal: drop every taken candidate the workload can do without, the most important
   first, so each victim left is needed: without any one of them `admits` is false.

Nothing is evicted (None) when even every candidate would not make room.

Complexity: O(C log C) to order C candidates and C calls of `allowed` (cheap: quota
arithmetic), then O(log C + V) calls of `admits` for V victims before step 4 (each a quota
check and a plan: `gpuplace.placement.queueing.admitting`).

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

    def __post_init__(self) -> None:
        if not self.uids:
            raise ValueError(f"candidate {self.key} names no pod")


def ordered(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Extra elastic members first, then lowest priority, then most recently admitted.
    O(C log C)."""
    return sorted(candidates, key=lambda c: (not c.shrink, c.priority, -c.admitted, c.key, c.uids))


def victims(
    candidates: Sequence[Candidate],
    admits: Callable[[Sequence[Candidate]], bool],
    allowed: Callable[[Candidate, Sequence[Candidate]], bool],
) -> list[Candidate] | None:
    """The candidates to preempt, each one needed, or None when no choice of them lets
    the workload in. `admits(chosen)`: would it be admitted once `chosen` are gone;
    `allowed(candidate, chosen)`: may the candidate go once `chosen` are gone. An empty
    list: it is admitted without preempting anyone. See the module docstring for the
    order and the complexity."""
    if admits([]):
        return []
    chosen: list[Candidate] = []
    for candidate in ordered(candidates):
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
    return needed(chosen[:high], admits)


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
