"""Which starving workload gets capacity held (`holds.starving`): several GPUs, waiting
for room long enough, first of its queue, of a queue below another of its cohort (past
shares counted); the one held keeps its hold while it still waits; and the fence a
queue holds says whom it holds for."""

from __future__ import annotations

from gpuplace.placement import holds
from gpuplace.placement.admitting import QueueStatus, Round, Waiting, Why, Workload
from gpuplace.placement.fences import QUEUED, Fence, Fences
from gpuplace.placement.gangs import Member

from .clusters import whole


def status(name: str, share: float, cohort: str = "lab") -> QueueStatus:
    return QueueStatus(name, cohort, {}, {}, {}, 0, 1, 1, share)


def workload(key: str, queue: str, gpus: int, created: float = 0.0) -> Workload:
    return Workload(key, queue, (Member(key, whole(gpus)),), 0, created)


def round_of(waiting: list[tuple[Workload, Why, int]], shares: dict[str, float]) -> Round:
    return Round(
        (),
        tuple(Waiting(w.key, w.queue, position, why, "") for w, why, position in waiting),
        (),
        tuple(status(name, share) for name, share in shares.items()),
    )


SHARES = {"a": 0.5, "b": 0.0}


def pick(
    waiting: list[tuple[Workload, Why, int]],
    shares: dict[str, float] = SHARES,
    *,
    now: float = 100.0,
    past: dict[str, float] | None = None,
    current: str = "",
) -> str | None:
    found = holds.starving(
        round_of(waiting, shares),
        {w.key: w for w, _, _ in waiting},
        now=now,
        after=60.0,
        past=past,
        current=current,
    )
    return None if found is None else found.key


def test_a_multi_gpu_workload_of_the_queue_below_the_others_is_held_for() -> None:
    big = workload("b/big", "b", 2)
    assert pick([(big, Why.PLACE, 1)]) == "b/big"
    assert pick([(big, Why.COHORT, 1)]) == "b/big"
    assert pick([(big, Why.RECLAIMING, 1)]) == "b/big"


def test_no_hold_for_one_gpu_a_fresh_wait_a_quota_refusal_or_a_queue_ahead() -> None:
    assert pick([(workload("b/one", "b", 1), Why.PLACE, 1)]) is None
    assert pick([(workload("b/big", "b", 2), Why.PLACE, 1)], now=30.0) is None
    assert pick([(workload("b/big", "b", 2), Why.QUOTA, 1)]) is None
    # team a borrows most: holding for it would only cost allocation
    assert pick([(workload("a/big", "a", 2), Why.PLACE, 1)]) is None
    # alone in its cohort (or in none): no one to be below
    lone = {"b": 0.0, "a": 0.5}
    rounded = round_of([(workload("b/big", "b", 2), Why.PLACE, 1)], lone)
    alone = Round((), rounded.waiting, (), (status("b", 0.0, ""), status("a", 0.5, "")))
    assert holds.starving(alone, {"b/big": workload("b/big", "b", 2)}, now=100, after=60) is None


def test_the_first_of_its_queue_and_the_lowest_fair_share_past_counted() -> None:
    first, second = workload("b/first", "b", 2, 10), workload("b/second", "b", 4, 0)
    assert pick([(second, Why.PLACE, 2), (first, Why.PLACE, 1)]) == "b/first"
    shares = {"a": 0.3, "b": 0.2, "c": 0.0}
    b, c = workload("b/big", "b", 2), workload("c/big", "c", 2)
    assert pick([(b, Why.PLACE, 1), (c, Why.PLACE, 1)], shares) == "c/big"
    # c within its nominal: its past does not weigh; b borrows and its past does
    assert pick([(b, Why.PLACE, 1)], shares, past={"b": 0.5}) is None
    assert pick([(b, Why.PLACE, 1)], shares, past={"a": 0.5}) == "b/big"


def test_the_workload_held_for_keeps_its_hold_while_it_waits_for_room() -> None:
    big = workload("b/big", "b", 2)
    level = {"a": 0.25, "b": 0.25}  # b no longer below a: no new hold
    assert pick([(big, Why.PLACE, 1)], level) is None
    assert pick([(big, Why.PLACE, 1)], level, current="b/big") == "b/big"
    assert pick([(big, Why.QUOTA, 1)], level, current="b/big") is None
    assert pick([], level, current="b/big") is None


def test_a_queue_fence_names_the_queued_workload_and_is_no_gang_fence() -> None:
    fences = Fences()
    fences.hold(Fence(("team-b", "big"), frozenset({"n1"}), frozenset({"uid-1"}), 0.0, QUEUED))
    assert fences.owner is None  # the gang controller's own fence only
    assert fences.blocks("uid-1", "n1") is None
    why = fences.blocks("other", "n1")
    assert why is not None and "queued workload team-b/big" in why
    assert fences.blocks("other", "n2") is None
