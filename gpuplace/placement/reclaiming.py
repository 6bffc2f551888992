"""Which borrowed workloads to preempt so that a queue gets back the quota it lent.

A queue whose waiting workload fits inside its own nominal quota, but finds its cohort's
lending pool used up or no GPU free for it, may preempt workloads of the *borrowing*
queues of its cohort (queues using more than their nominal), as its reclaim policy
allows: any, or only those of lower priority than the waiting workload. With fair sharing
it may also do so beyond its nominal, from queues that would still borrow at least the
share it reaches (`gpuplace.placement.admitting` decides which candidate is allowed).

`victims(candidates, admits, allowed)` picks them:

1. candidates in order: an elastic gang's extra members first (each alone: the gang runs
   on without them), then whole workloads (a gang is one candidate, all its members);
   each group lowest priority first, then the most recently admitted first;
2. greedy: take candidates in that order, skipping one that is not allowed once those
   taken are gone (`allowed`: its queue still borrows, and a policy lets it go), until the
   waiting workload would be admitted (`admits`: quota and a real place in the ledger, the
   same test as admission);
3. minimal: drop every taken candidate the workload can do without, the most important
   first, so each victim left is needed: without any one of them `admits` is false.

Nothing is evicted (None) when even every candidate would not make room.

Complexity: O(C log C) to order C candidates, then at most C + V calls of `admits` for
V victims (each a quota check and a plan: `gpuplace.placement.admitting`).

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
        if not allowed(candidate, chosen):
            continue
        chosen.append(candidate)
        if admits(chosen):
            return needed(chosen, admits)
    return None


def needed(
    chosen: Sequence[Candidate], admits: Callable[[Sequence[Candidate]], bool]
) -> list[Candidate]:
    """`chosen` (which `admits`) without every candidate it can do without, the most
    important first (they are spared first). O(V) calls of `admits`."""
    kept = list(chosen)
    for candidate in reversed(ordered(chosen)):
        rest = [other for other in kept if other is not candidate]
        if admits(rest):
            kept = rest
    return kept
