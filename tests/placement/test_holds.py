"""Which starving workload gets capacity held (`holds.starving`): several GPUs, waiting
for room long enough, first of its queue, of a queue below another of its cohort (past
shares counted); the one held keeps its hold while it still waits; which nodes are held
(`holds.nodes`: the fewest GPUs of pods that will not leave for it, `holds.staying`) and
when the hold moves (`holds.repick`); and the fence a queue holds says whom it holds
for."""

from __future__ import annotations

from gpuplace.placement.choosing import Choice, grant_for
from gpuplace.placement.fences import QUEUED, Fence, Fences
from gpuplace.placement.gangs import Member
from gpuplace.placement.queueing import holds
from gpuplace.placement.queueing.admitting import QueueStatus, Round, Waiting, Why, Workload
from gpuplace.placement.queueing.quotas import ANY_MODEL, GPUS

from .clusters import ledger, node, whole


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
BUCKET = (GPUS, ANY_MODEL)


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


def test_held_nodes_are_those_with_the_fewest_gpus_of_pods_that_stay() -> None:
    book = ledger(node("n1", 8), node("n2", 8), node("n3", 8))
    # n1: b's last 8-GPU pod (it will not leave for b's next); n2: half of it c's, a
    # queue within its nominal; n3: pods of a, which borrows and is ahead of b
    book.reserve(grant_for("b-running", Choice("n1", tuple(range(8)), 0.0), whole(8)))
    book.reserve(grant_for("c-half", Choice("n2", (0, 1, 2, 3), 0.0), whole(4)))
    book.reserve(grant_for("a-one", Choice("n3", (0,), 0.0), whole(1)))
    book.reserve(grant_for("a-two", Choice("n3", (1, 2), 0.0), whole(2)))
    queue_of = {"b-running": "b", "c-half": "c", "a-one": "a", "a-two": "a"}
    decided = Round(
        (),
        (),
        (),
        (
            QueueStatus("a", "lab", {}, {BUCKET: 3000}, {}, 2, 0, 0, 0.5),
            QueueStatus("b", "lab", {}, {}, {}, 1, 1, 1, 0.0),
            QueueStatus("c", "lab", {}, {}, {}, 1, 0, 0, 0.0),
        ),
    )
    nxt = workload("b/next", "b", 8)
    stay = holds.staying(decided, nxt, queue_of, {})
    assert stay == {"b-running", "c-half"}
    # the fence alone takes the first node in inventory order that could hold it: n1,
    # where it would wait for exactly the pod of its own queue
    assert holds.nodes(book, nxt, ()) == ("n1",)
    assert holds.nodes(book, nxt, stay) == ("n3",)
    # b borrowing too, with a past share that puts it above a: a's pods stay too; n3
    # (3 GPUs that stay) before n2 (4)
    b = QueueStatus("b", "lab", {}, {BUCKET: 8000}, {}, 1, 1, 1, 0.25)
    decided = Round((), (), (), (decided.queues[0], b, decided.queues[2]))
    stay = holds.staying(decided, nxt, queue_of, {"b": 0.75})
    assert stay == set(queue_of)
    assert holds.nodes(book, nxt, stay) == ("n3",)
    book.reserve(grant_for("c-more", Choice("n3", (3, 4), 0.0), whole(2)))
    assert holds.nodes(book, nxt, {*stay, "c-more"}) == ("n2",)
    # nothing could ever hold it: no nodes
    assert holds.nodes(book, workload("b/huge", "b", 9), stay) == ()


def test_a_hold_moves_only_to_nodes_with_fewer_gpus_that_stay() -> None:
    book = ledger(node("n1", 8), node("n2", 8))
    nxt = workload("b/next", "b", 8)
    book.reserve(grant_for("c-long", Choice("n1", (0,), 0.0), whole(1)))
    book.reserve(grant_for("c-other", Choice("n2", (0, 1), 0.0), whole(2)))
    stay = {"c-long", "c-other"}
    assert holds.blocked(book, {"n1"}, stay) == 1000
    assert holds.blocked(book, {"n1", "n2"}, stay) == 3000
    assert holds.nodes(book, nxt, stay) == ("n1",)
    assert holds.repick(book, nxt, stay, {"n1"}) is None  # already the best
    # n2's pods that stay leave: n2 has none now, n1 still one
    book.release("c-other")
    assert holds.repick(book, nxt, stay, {"n1"}) == ("n2",)
    # as many on both: the hold stays where it drains already
    book.reserve(grant_for("c-again", Choice("n2", (0,), 0.0), whole(1)))
    assert holds.repick(book, nxt, {*stay, "c-again"}, {"n1"}) is None


def test_a_queue_fence_names_the_queued_workload_and_is_no_gang_fence() -> None:
    fences = Fences()
    fences.hold(Fence(("team-b", "big"), frozenset({"n1"}), frozenset({"uid-1"}), 0.0, QUEUED))
    assert fences.owner is None  # the gang controller's own fence only
    assert fences.blocks("uid-1", "n1") is None
    why = fences.blocks("other", "n1")
    assert why is not None and "queued workload team-b/big" in why
    assert fences.blocks("other", "n2") is None
