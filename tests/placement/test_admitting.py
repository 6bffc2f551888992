"""A round of queue admission: quota AND a real place, a gang as one unit, fair-share order,
borrowing, reclaim (lowest priority and most recent first, whole gangs, never more than
needed), elastic gangs, StrictFIFO and max wait; and, as properties over random clusters,
queues and workloads, the invariants of issue 29: quota never exceeded, no admitted
workload without a place, a gang admitted whole or not at all, lending limits respected,
every victim of a reclaim needed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.placement import policies
from gpuplace.placement.gangs import Member
from gpuplace.placement.inventory import Inventory
from gpuplace.placement.ledger import Grant, GrantState, Ledger
from gpuplace.placement.queueing import admitting, quotas
from gpuplace.placement.queueing.admitting import Placer, Running, Why, Workload
from gpuplace.placement.queueing.quotas import ANY_MODEL, GPUS, Preemption, QueueSpec, Quota
from gpuplace.placement.requests import GpuRequest

from .clusters import ledger, node, share, whole
from .test_gangs import state_of

ANY = (GPUS, ANY_MODEL)
FINAL = quotas.FairStrategy.FINAL_SHARE
INITIAL = quotas.FairStrategy.INITIAL_SHARE
STRATEGY_LISTS = [(FINAL,), (FINAL, INITIAL), (INITIAL,)]


def gpus(n: float) -> int:
    return round(n * 1000)


def spec(
    name: str,
    nominal: float,
    *,
    cohort: str = "lab",
    borrowing: float | None = None,
    lending: float | None = None,
    weight: float = 1.0,
    reclaim: Preemption = Preemption.ANY,
    fair: Preemption = Preemption.NEVER,
    strategies: tuple[quotas.FairStrategy, ...] = (FINAL,),
    queueing: quotas.Queueing = quotas.Queueing.BEST_EFFORT_FIFO,
    max_wait: float | None = None,
) -> QueueSpec:
    quota = Quota(
        gpus(nominal),
        None if borrowing is None else gpus(borrowing),
        None if lending is None else gpus(lending),
    )
    return QueueSpec(
        name,
        {ANY: quota},
        cohort=cohort,
        weight=weight,
        reclaim=reclaim,
        fair_sharing=fair,
        fair_strategies=strategies,
        queueing=queueing,
        max_wait=max_wait,
    )


def pod(
    key: str, queue: str, request: GpuRequest, *, priority: int = 0, created: float = 0
) -> Workload:
    return Workload(key, queue, (Member(key, request),), priority, created)


def gang(
    key: str, queue: str, request: GpuRequest, size: int, *, minimum: int = 0, priority: int = 0
) -> Workload:
    members = tuple(Member(f"{key}-{i}", request) for i in range(size))
    return Workload(key, queue, members, priority, 0.0, minimum)


def policy() -> policies.BestFitPolicy:
    return policies.BestFitPolicy(None)


def run(
    book: Ledger,
    queues: Sequence[QueueSpec],
    running: Sequence[Running],
    waiting: Sequence[Workload],
    *,
    now: float = 100.0,
    reclaims: int = 1,
    past: dict[str, float] | None = None,
) -> admitting.Round:
    return admitting.admit(
        Placer(book, policy()), queues, running, waiting, now=now, reclaims=reclaims, past=past
    )


def hold(
    book: Ledger, key: str, queue: str, *grants: Grant, priority: int = 0, admitted: float = 0
) -> Running:
    for grant in grants:
        book.reserve(grant)
    return Running(key, queue, tuple(g.pod_uid for g in grants), priority, admitted)


def whole_on(uid: str, node_name: str, *indices: int) -> Grant:
    return Grant(uid, node_name, indices, 1000, 0, 1000, 1024, GrantState.CONFIRMED)


# --- admission -------------------------------------------------------------------------


def test_a_pod_within_quota_is_admitted_with_its_gpus_and_the_live_ledger_is_untouched() -> None:
    book = ledger(node("n1", 2))
    before = state_of(book)
    placer = Placer.scratch(book, policy())
    decided = admitting.admit(placer, [spec("a", 2)], [], [pod("p", "a", whole(1))], now=0)
    assert [a.key for a in decided.admissions] == ["p"]
    admission = decided.admissions[0]
    assert admission.choices["p"].node == "n1" and not admission.borrowing
    assert admission.use == {ANY: 1000}
    assert state_of(book) == before
    assert placer.ledger.get("p") is not None  # reserved in the round's copy


def test_quota_that_covers_a_request_fragmentation_withholds_does_not_admit_it() -> None:
    """Two GPUs half used: the quota covers a whole GPU, no GPU has one free."""
    book = ledger(node("n1", 1), node("n2", 1))
    running = [
        hold(book, "x", "a", Grant("x", "n1", (0,), 500, 0)),
        hold(book, "y", "a", Grant("y", "n2", (0,), 500, 0)),
    ]
    decided = run(book, [spec("a", 4, cohort="")], running, [pod("p", "a", whole(1))])
    assert decided.admissions == ()
    (waiting,) = decided.waiting
    assert waiting.why is Why.PLACE and waiting.position == 1


def test_admissions_of_one_round_never_count_a_gpu_twice() -> None:
    book = ledger(node("n1", 1))
    waiting = [pod("p", "a", whole(1), created=1), pod("q", "b", whole(1), created=2)]
    decided = run(book, [spec("a", 1, cohort=""), spec("b", 1, cohort="")], [], waiting)
    assert len(decided.admissions) == 1
    assert decided.waiting[0].why is Why.PLACE


def test_a_gang_is_admitted_whole_or_not_at_all() -> None:
    book = ledger(node("n1", 2), node("n2", 1))
    decided = run(book, [spec("a", 8, cohort="")], [], [gang("g", "a", whole(1), 4)])
    assert decided.admissions == ()
    assert decided.waiting[0].why is Why.NEVER  # 3 GPUs in all: never
    decided = run(book, [spec("a", 8, cohort="")], [], [gang("g", "a", whole(1), 3)])
    assert set(decided.admissions[0].choices) == {"g-0", "g-1", "g-2"}


def test_quota_refuses_a_gang_larger_than_what_is_left_and_says_so() -> None:
    book = ledger(node("n1", 8))
    decided = run(book, [spec("a", 2, cohort="")], [], [gang("g", "a", whole(1), 3)])
    (waiting,) = decided.waiting
    assert waiting.why is Why.QUOTA
    assert "queue a" in waiting.reason and "needs 3 more" in waiting.reason


def test_a_queue_borrows_idle_quota_of_its_cohort_and_is_reported_borrowing() -> None:
    book = ledger(node("n1", 4))
    queues = [spec("a", 1), spec("b", 3)]
    decided = run(book, queues, [], [gang("g", "a", whole(1), 3)])
    (admission,) = decided.admissions
    assert admission.borrowing
    status = {s.name: s for s in decided.queues}
    assert status["a"].borrowed == {ANY: 2000}
    assert status["b"].lent == {ANY: 2000}
    assert status["a"].share > 0 and status["b"].share == 0


def test_capacity_goes_first_to_the_queue_furthest_below_its_weighted_share() -> None:
    book = ledger(node("n1", 1))
    running = [hold(book, "r", "a", whole_on("r", "n9", 0))] if False else []
    queues = [spec("a", 1), spec("b", 1), spec("c", 2)]
    # c holds nothing, a already borrows: the one free GPU goes to b's pod although a's
    # is older and of higher priority
    book2 = ledger(node("n1", 3))
    running = [
        hold(book2, "r1", "a", whole_on("r1", "n1", 0)),
        hold(book2, "r2", "a", whole_on("r2", "n1", 1)),
    ]
    waiting = [
        pod("pa", "a", whole(1), priority=10, created=1),
        pod("pb", "b", whole(1), created=2),
    ]
    decided = run(book2, queues, running, waiting)
    assert [a.key for a in decided.admissions] == ["pb"]
    assert running and book is not None


def test_reclaim_preempts_the_lowest_priority_most_recent_borrowed_workload_only() -> None:
    book = ledger(node("n1", 4))
    queues = [spec("a", 2), spec("b", 2)]
    running = [
        hold(book, "b1", "b", whole_on("b1", "n1", 0), priority=5, admitted=1),
        hold(book, "b2", "b", whole_on("b2", "n1", 1), priority=1, admitted=2),
        hold(book, "b3", "b", whole_on("b3", "n1", 2), priority=1, admitted=3),
        hold(book, "b4", "b", whole_on("b4", "n1", 3), priority=1, admitted=4),
    ]
    decided = run(book, queues, running, [pod("p", "a", whole(1), priority=3)])
    assert decided.admissions == ()
    (reclaim,) = decided.reclaims
    assert [v.key for v in reclaim.victims] == ["b4"]
    (waiting,) = decided.waiting
    assert waiting.why is Why.RECLAIMING and "b4" in waiting.reason


def test_a_held_workload_looks_for_victims_on_its_held_nodes_first() -> None:
    # a borrows 8 of the 16 GPUs, its pods interleaved in time over both nodes: the 8 most
    # recent (all a may lose) free no whole node, so without the hold nothing is found
    book = ledger(node("n1", 8), node("n2", 8))
    queues = [spec("a", 8), spec("b", 8)]
    running = [
        hold(book, f"a{t}", "a", whole_on(f"a{t}", f"n{t % 2 + 1}", t // 2), admitted=t)
        for t in range(16)
    ]
    big = pod("big", "b", whole(8))
    assert run(book, queues, running, [big]).reclaims == ()
    held = Workload("big", "b", big.members, held=frozenset({"n2"}))
    (reclaim,) = run(book, queues, running, [held]).reclaims
    assert sorted(v.key for v in reclaim.victims) == sorted(f"a{t}" for t in range(1, 16, 2))
    # nodes held where no victims would do: it looks among all of them, as before
    elsewhere = Workload("big", "b", big.members, held=frozenset({"n3"}))
    assert run(book, queues, running, [elsewhere]).reclaims == ()


def test_reclaim_evicts_a_gang_whole_and_never_more_than_needed() -> None:
    book = ledger(node("n1", 4))
    queues = [spec("a", 3), spec("b", 1)]
    running = [
        hold(book, "b-gang", "b", whole_on("g0", "n1", 0), whole_on("g1", "n1", 1), admitted=1),
        hold(book, "b-pod", "b", whole_on("bp", "n1", 2), admitted=2),
        hold(book, "a-pod", "a", whole_on("ap", "n1", 3), admitted=3),
    ]
    # a needs 2 GPUs inside its nominal: b borrows 2 (the gang and its pod exceed b's 1)
    decided = run(book, queues, running, [gang("w", "a", whole(1), 2)])
    (reclaim,) = decided.reclaims
    # the most recent first: b-pod alone is not enough, b-gang alone is; b-pod is spared
    assert [(v.key, v.uids) for v in reclaim.victims] == [("b-gang", ("g0", "g1"))]


def half_on(uid: str, node_name: str, index: int) -> Grant:
    return Grant(uid, node_name, (index,), 500, 0, 1000, 1024, GrantState.CONFIRMED)


def issue_41(times: dict[str, float]) -> tuple[Ledger, list[QueueSpec], list[Running]]:
    """Issue 41's cluster: one 4-GPU node, queues a and b of 2 GPUs each in a cohort
    (a may borrow 2); a runs six 50% shares a-0..a-5, two per GPU on GPUs 0-2, and one
    whole GPU a-7 on GPU 3, admitted at `times`: a borrows 2."""
    book = ledger(node("n1", 4))
    queues = [spec("a", 2, borrowing=2), spec("b", 2)]
    running = [
        hold(book, f"a-{i}", "a", half_on(f"a-{i}", "n1", i // 2), admitted=times[f"a-{i}"])
        for i in range(6)
    ]
    running.append(hold(book, "a-7", "a", whole_on("a-7", "n1", 3), admitted=times["a-7"]))
    return book, queues, running


def test_one_victim_where_one_alone_frees_what_two_do() -> None:
    """Issue 41: b asks one whole GPU inside its nominal. a-7 alone, or a-4 and a-5 (both
    on GPU 2), give back one GPU of quota and one free GPU: a-7 alone is evicted where it
    was admitted with them or after them."""
    # as whole-second `assigned-at` read them: a-4, a-5 and a-7 in one second tie, and
    # the tie went by name (a-4, a-5 first)
    tied = {f"a-{i}": 40.0 + (i >= 4) for i in range(6)} | {"a-7": 41.0}
    # exact times, a-7 last (as the issue's log had it)
    exact = {f"a-{i}": 40.0 + i / 10 for i in range(6)} | {"a-7": 41.955}
    for times in (tied, exact):
        book, queues, running = issue_41(times)
        decided = run(book, queues, running, [pod("b-1", "b", whole(1))])
        (reclaim,) = decided.reclaims
        assert [(v.key, v.uids) for v in reclaim.victims] == [("a-7", ("a-7",))], times


def test_one_victim_that_would_lose_more_or_outranks_the_two_is_not_taken() -> None:
    """The same cluster, but a-7 admitted long before the shares (its loss would throw
    away 90 GPU-seconds, the two newest shares' 45.5), or of higher priority than them:
    the two newest shares go, as the order says."""
    first = {f"a-{i}": 50.0 + i for i in range(6)} | {"a-7": 10.0}
    book, queues, running = issue_41(first)
    (reclaim,) = run(book, queues, running, [pod("b-1", "b", whole(1))]).reclaims
    assert sorted(v.key for v in reclaim.victims) == ["a-4", "a-5"]
    tied = {f"a-{i}": 40.0 + (i >= 4) for i in range(6)} | {"a-7": 41.0}
    book, queues, running = issue_41(tied)
    running[-1] = replace(running[-1], priority=1)
    (reclaim,) = run(book, queues, running, [pod("b-1", "b", whole(1))]).reclaims
    assert sorted(v.key for v in reclaim.victims) == ["a-4", "a-5"]


def test_a_larger_workload_is_not_stopped_instead_of_two_that_free_enough() -> None:
    """b asks 2 GPUs: a's two newest 1-GPU pods (on n2) make the room, and so would its
    8-GPU job alone (on n1). The two go: one victim instead holds more GPU than they do
    (it would free 6 GPUs nobody asked for)."""
    book = ledger(node("n1", 8), node("n2", 2))
    queues = [spec("a", 2), spec("b", 8)]
    running = [
        hold(book, "big", "a", whole_on("big", "n1", *range(8)), admitted=1),
        hold(book, "p1", "a", whole_on("p1", "n2", 0), admitted=50),
        hold(book, "p2", "a", whole_on("p2", "n2", 1), admitted=51),
    ]
    (reclaim,) = run(book, queues, running, [pod("w", "b", whole(2))]).reclaims
    assert sorted(v.key for v in reclaim.victims) == ["p1", "p2"]


def test_reclaim_lower_priority_spares_workloads_of_equal_or_higher_priority() -> None:
    book = ledger(node("n1", 2))
    queues = [spec("a", 1, reclaim=Preemption.LOWER_PRIORITY), spec("b", 1)]
    running = [
        hold(book, "b1", "b", whole_on("b1", "n1", 0), priority=5),
        hold(book, "b2", "b", whole_on("b2", "n1", 1), priority=5),
    ]
    decided = run(book, queues, running, [pod("p", "a", whole(1), priority=5)])
    assert decided.reclaims == ()
    assert decided.waiting[0].why is Why.COHORT  # b borrowed what a lends
    assert "0 gpus left to lend" in decided.waiting[0].reason
    decided = run(book, queues, running, [pod("p", "a", whole(1), priority=6)])
    assert len(decided.reclaims) == 1


def test_a_queue_beyond_its_nominal_reclaims_nothing_without_fair_sharing() -> None:
    book = ledger(node("n1", 4))
    queues = [spec("a", 1), spec("b", 1), spec("c", 2)]
    running = [hold(book, f"b{i}", "b", whole_on(f"b{i}", "n1", i), admitted=i) for i in range(3)]
    running.append(hold(book, "a0", "a", whole_on("a0", "n1", 3)))
    waiting = [pod("p", "a", whole(1))]
    assert run(book, queues, running, waiting).reclaims == ()
    fair = [spec("a", 1, fair=Preemption.ANY), spec("b", 1), spec("c", 2)]
    decided = run(book, fair, running, waiting)
    # b borrows 2, a would borrow 1 after: b keeps at least a's share once b2 goes
    (reclaim,) = decided.reclaims
    assert [v.key for v in reclaim.victims] == ["b2"]


def test_fair_sharing_never_preempts_a_queue_that_would_end_below_the_preemptor() -> None:
    book = ledger(node("n1", 3))
    fair = [spec("a", 1, fair=Preemption.ANY), spec("b", 1), spec("c", 1)]
    running = [
        hold(book, "a0", "a", whole_on("a0", "n1", 0)),
        hold(book, "b0", "b", whole_on("b0", "n1", 1)),
        hold(book, "b1", "b", whole_on("b1", "n1", 2)),
    ]
    # a at 1 (its nominal) would borrow 1; b borrows 1 and would borrow 0 after: no
    assert run(book, fair, running, [pod("p", "a", whole(1))]).reclaims == ()


def five_gpus() -> tuple[Ledger, list[Running], list[Workload]]:
    """One node of 5: b holds four (b0 oldest), a one; a waits for 2 more."""
    book = ledger(node("n1", 5))
    running = [hold(book, f"b{i}", "b", whole_on(f"b{i}", "n1", i), admitted=i) for i in range(4)]
    running.append(hold(book, "a0", "a", whole_on("a0", "n1", 4)))
    return book, running, [pod("p", "a", whole(2))]


def test_less_than_initial_share_preempts_where_the_final_share_rule_does_not() -> None:
    book, running, waiting = five_gpus()
    # pool 5: b borrows 3 (3/5), a would borrow 2 (2/5); two of b's go, b ends at 1/5
    only_final = [spec("a", 1, fair=Preemption.ANY), spec("b", 1), spec("c", 3)]
    assert run(book, only_final, running, waiting).reclaims == ()
    both = [spec("a", 1, fair=Preemption.ANY, strategies=(FINAL, INITIAL)), *only_final[1:]]
    (reclaim,) = run(book, both, running, waiting).reclaims
    assert sorted(v.key for v in reclaim.victims) == ["b2", "b3"]  # the newest, no more
    # never when the victim's queue had no more than the preemptor reaches
    level = [spec("a", 1, fair=Preemption.ANY, strategies=(INITIAL,)), spec("b", 2), spec("c", 2)]
    assert run(book, level, running, waiting).reclaims == ()


def test_a_queue_held_below_the_others_in_the_past_may_preempt_past_their_share() -> None:
    book, running, waiting = five_gpus()
    queues = [spec("a", 1, fair=Preemption.ANY), spec("b", 1), spec("c", 3)]
    # now: a would borrow 2/5, b keep 1/5 — refused on shares alone (the test above)
    assert run(book, queues, running, waiting).reclaims == ()
    # b borrowed 0.3 on average before: 0.2 + 0.3 >= 0.4, two of b's newest go
    (reclaim,) = run(book, queues, running, waiting, past={"b": 0.3}).reclaims
    assert sorted(v.key for v in reclaim.victims) == ["b2", "b3"]
    # and a queue that borrowed much before does not, even by its initial share
    greedy = [spec("a", 1, fair=Preemption.ANY, strategies=(INITIAL,)), *queues[1:]]
    assert run(book, greedy, running, waiting).reclaims != ()
    assert run(book, greedy, running, waiting, past={"a": 0.5}).reclaims == ()


def test_the_past_share_never_takes_a_victim_into_its_nominal() -> None:
    """b borrows 1 GPU with a large past share: by its initial share (past counted) a
    could take b's 4-GPU pod, which would leave b inside its nominal: never."""
    book = ledger(node("n1", 10))
    running = [
        hold(book, "a0", "a", whole_on("a0", "n1", 0, 1)),
        hold(book, "b1", "b", whole_on("b1", "n1", 2), admitted=1),
        hold(book, "b0", "b", whole_on("b0", "n1", 3, 4, 5, 6), admitted=2),
        hold(book, "c0", "c", whole_on("c0", "n1", 7, 8, 9)),
    ]
    queues = [spec("a", 2, fair=Preemption.ANY, strategies=(INITIAL,)), spec("b", 4), spec("c", 4)]
    waiting = [pod("p", "a", whole(2))]
    assert run(book, queues, running, waiting).reclaims == ()
    assert run(book, queues, running, waiting, past={"b": 0.5}).reclaims == ()


def test_capacity_goes_first_to_the_queue_that_borrowed_less_in_the_past() -> None:
    def first(past: dict[str, float] | None) -> list[str]:
        book = ledger(node("n1", 6))
        running = [
            hold(book, "a0", "a", whole_on("a0", "n1", 0, 1)),
            hold(book, "b0", "b", whole_on("b0", "n1", 2, 3)),
        ]
        waiting = [pod("pa", "a", whole(2)), pod("pb", "b", whole(2))]
        queues = [spec("a", 1), spec("b", 1), spec("c", 4)]
        return [x.key for x in run(book, queues, running, waiting, past=past).admissions]

    # both borrow 1/6 now and room is left for one: a wins the tie by name
    assert first(None) == ["pa"]
    assert first({"a": 0.2, "b": 0.1}) == ["pb"]


@st.composite
def fair_scenarios(draw: st.DrawFn) -> tuple[int, list[float], list[int], int, int]:
    """One node of `size` whole GPUs; queues a, b, c (nominals); a holds exactly its
    nominal, b and c what was drawn (b mostly borrowing); a waits for `asked` more, so
    only fair sharing (never reclaim) may preempt for it; priorities drawn."""
    size = draw(st.integers(3, 8))
    nominals = [draw(st.integers(1, 3)), draw(st.integers(0, 2)), draw(st.integers(0, 3))]
    held_a = min(nominals[0], size - 1)
    held_b = draw(st.integers(0, size - held_a))
    held_c = draw(st.integers(0, size - held_a - held_b))
    return (
        size,
        [float(n) for n in nominals],
        [held_a, held_b, held_c],
        draw(st.integers(1, 3)),
        draw(st.integers(0, 2)),
    )


@settings(max_examples=300, deadline=None)
@given(
    fair_scenarios(),
    st.sampled_from(STRATEGY_LISTS),
)
def test_fair_sharing_victims_follow_the_queues_strategies(
    scenario: tuple[int, list[float], list[int], int, int],
    strategies: tuple[quotas.FairStrategy, ...],
) -> None:
    """Checked with `quotas.Accounts` alone: each victim's queue keeps at least the
    share the waiting workload's queue reaches (LessThanOrEqualToFinalShare), or had more
    before (LessThanInitialShare, where listed); none goes below its nominal; and a second
    strategy changes nothing where the first found victims."""
    size, nominals, held, asked, priority = scenario

    def queues(chosen: tuple[quotas.FairStrategy, ...]) -> list[QueueSpec]:
        first = spec("a", nominals[0], fair=Preemption.ANY, strategies=chosen)
        return [first, spec("b", nominals[1]), spec("c", nominals[2])]

    def scene() -> tuple[Ledger, list[Running]]:
        book = ledger(node("n1", size))
        running, index = [], 0
        for name, count in zip("abc", held, strict=True):
            for i in range(count):
                grant = whole_on(f"{name}{i}", "n1", index)
                running.append(hold(book, f"{name}{i}", name, grant, admitted=float(i)))
                index += 1
        return book, running

    waiting = [pod("p", "a", whole(asked), priority=priority)]
    book, running = scene()
    decided = run(book, queues(strategies), running, waiting)
    accounts = quotas.Accounts(queues(strategies))
    for workload in running:
        accounts.charge(workload.queue, {ANY: 1000 * len(workload.uids)})
    reaches = accounts.share_with("a", {ANY: 1000 * asked})
    for reclaim in decided.reclaims:
        gone: dict[str, int] = {}
        for victim in reclaim.victims:
            assert victim.queue in ("b", "c")
            gone[victim.queue] = gone.get(victim.queue, 0) + 1000 * len(victim.uids)
        for name, amount in gone.items():
            before = accounts.share(name)
            after = accounts.share_with(name, {ANY: amount}, -1)
            used = accounts.used[name].get(ANY, 0) - amount
            assert used >= accounts.specs[name].quotas[ANY].nominal  # never below nominal
            final = after >= reaches
            initial = INITIAL in strategies and before > reaches
            assert final or initial, (name, before, after, reaches)
    if strategies == (FINAL, INITIAL):
        book, running = scene()
        alone = run(book, queues(strategies[:1]), running, waiting)
        if alone.reclaims:
            assert alone.reclaims == decided.reclaims


def test_the_second_strategy_is_tried_only_when_the_first_finds_no_victims() -> None:
    """Pool 10 (nominals 1, 1, 1, 7): b borrows 3 (share 0.3), c borrows 4 (0.4), a would
    borrow 2 (0.2). The final-share rule lets one of b's go and two of c's; the
    initial-share rule any of both, the newest first (b's)."""

    def victims(strategies: tuple[quotas.FairStrategy, ...]) -> set[str]:
        book = ledger(node("n1", 10))
        running = [hold(book, "a0", "a", whole_on("a0", "n1", 0))]
        running += [
            hold(book, f"b{i}", "b", whole_on(f"b{i}", "n1", 1 + i), admitted=10 + i)
            for i in range(4)
        ]
        running += [
            hold(book, f"c{i}", "c", whole_on(f"c{i}", "n1", 5 + i), admitted=i) for i in range(5)
        ]
        queues = [
            spec("a", 1, fair=Preemption.ANY, strategies=strategies),
            spec("b", 1),
            spec("c", 1),
            spec("d", 7),
        ]
        (reclaim,) = run(book, queues, running, [pod("p", "a", whole(2))]).reclaims
        return {victim.key for victim in reclaim.victims}

    assert victims((FINAL,)) == {"b3", "c4"}
    assert victims((INITIAL,)) == {"b3", "b2"}
    assert victims((FINAL, INITIAL)) == {"b3", "c4"}  # the first found some
    assert victims((INITIAL, FINAL)) == {"b3", "b2"}


def test_a_queue_names_each_fair_sharing_strategy_once() -> None:
    with pytest.raises(ValueError, match="distinct"):
        spec("a", 1, strategies=(FINAL, FINAL))
    with pytest.raises(ValueError, match="distinct"):
        spec("a", 1, strategies=())


def test_two_reclaims_of_one_round_never_count_on_the_same_freed_gpu() -> None:
    book = ledger(node("n1", 4))
    queues = [spec("a", 2), spec("b", 2)]
    running = [hold(book, f"b{i}", "b", whole_on(f"b{i}", "n1", i), admitted=i) for i in range(4)]
    waiting = [pod("p1", "a", whole(1), created=1), pod("p2", "a", whole(1), created=2)]
    decided = run(book, queues, running, waiting, reclaims=2)
    assert [(r.key, [v.key for v in r.victims]) for r in decided.reclaims] == [
        ("p1", ["b3"]),
        ("p2", ["b2"]),
    ]
    before = book.snapshot()
    assert run(book, queues, running, waiting, reclaims=2).reclaims == decided.reclaims
    assert book.snapshot() == before  # applied while looking, undone after


def test_victims_already_leaving_are_not_evicted_again() -> None:
    book = ledger(node("n1", 2))
    queues = [spec("a", 1), spec("b", 1)]
    running = [
        hold(book, "b1", "b", whole_on("b1", "n1", 0), admitted=1),
        Running("b2", "b", ("b2",), 0, 2, leaving_for="p"),
    ]
    book.reserve(whole_on("b2", "n1", 1))
    decided = run(book, queues, running, [pod("p", "a", whole(1))])
    assert decided.reclaims == ()
    assert decided.waiting[0].why is Why.RECLAIMING


def test_an_elastic_gang_starts_with_what_fits_and_grows_later() -> None:
    book = ledger(node("n1", 3))
    queues = [spec("a", 8, cohort="")]
    elastic = gang("e", "a", whole(1), 5, minimum=2)
    decided = run(book, queues, [], [elastic])
    (admission,) = decided.admissions
    assert set(admission.choices) == {"e-0", "e-1", "e-2"}
    # later: 2 more GPUs appear; the running gang grows by what fits
    book2 = ledger(node("n1", 3), node("n2", 1))
    for uid, index in (("e-0", 0), ("e-1", 1), ("e-2", 2)):
        book2.reserve(whole_on(uid, "n1", index))
    running = [
        Running("e", "a", ("e-0", "e-1", "e-2"), 0, 0.0, minimum=2, missing=elastic.members[3:])
    ]
    decided = run(book2, queues, running, [])
    (growth,) = decided.admissions
    assert growth.growth and set(growth.choices) == {"e-3"}


def test_an_elastic_gang_below_its_minimum_waits_whole() -> None:
    book = ledger(node("n1", 1))
    decided = run(book, [spec("a", 8, cohort="")], [], [gang("e", "a", whole(1), 4, minimum=2)])
    assert decided.admissions == ()


def test_elastic_extras_are_given_back_before_any_whole_workload() -> None:
    book = ledger(node("n1", 4))
    queues = [spec("a", 2), spec("b", 2)]
    for uid, index in (("e-0", 0), ("e-1", 1), ("e-2", 2)):
        book.reserve(whole_on(uid, "n1", index))
    running = [
        Running("e", "b", ("e-0", "e-1", "e-2"), 0, 1.0, minimum=1, started=(1.0, 1.0, 5.0)),
        hold(book, "b-late", "b", whole_on("bl", "n1", 3), admitted=9),
    ]
    decided = run(book, queues, running, [gang("w", "a", whole(1), 2)])
    (reclaim,) = decided.reclaims
    assert all(v.shrink and v.key == "e" for v in reclaim.victims)
    assert sorted(uid for v in reclaim.victims for uid in v.uids) == ["e-1", "e-2"]


def test_growth_waits_while_a_workload_lacks_a_place() -> None:
    book = ledger(node("n1", 2))
    queues = [spec("a", 8, cohort="")]
    elastic = gang("e", "a", whole(1), 3, minimum=1)
    book.reserve(whole_on("e-0", "n1", 0))
    running = [Running("e", "a", ("e-0",), 0, 0.0, minimum=1, missing=elastic.members[1:])]
    decided = run(book, queues, running, [gang("big", "a", whole(1), 2)])
    assert decided.admissions == ()


def test_strict_fifo_holds_back_what_is_behind_its_first_refusal() -> None:
    book = ledger(node("n1", 1))
    strict = [spec("a", 8, cohort="", queueing=quotas.Queueing.STRICT_FIFO)]
    waiting = [pod("big", "a", whole(2), created=1), pod("small", "a", whole(1), created=2)]
    decided = run(book, strict, [], waiting)
    assert decided.admissions == ()
    assert [(w.key, w.why) for w in decided.waiting] == [("big", Why.NEVER), ("small", Why.BEHIND)]
    loose = [spec("a", 8, cohort="")]
    assert [a.key for a in run(book, loose, [], waiting).admissions] == ["small"]


def test_a_workload_past_max_wait_goes_first_in_its_queue() -> None:
    book = ledger(node("n1", 1))
    queues = [spec("a", 8, cohort="", max_wait=60)]
    waiting = [
        pod("urgent", "a", whole(1), priority=10, created=90),
        pod("starving", "a", whole(1), priority=0, created=10),
    ]
    decided = run(book, queues, [], waiting, now=100)
    assert [a.key for a in decided.admissions] == ["starving"]
    assert not decided.waiting[0].overdue


def test_a_workload_naming_an_unknown_queue_is_told_so() -> None:
    decided = run(ledger(node("n1", 1)), [], [], [pod("p", "nope", whole(1))])
    assert decided.waiting[0].why is Why.NO_QUEUE
    assert "queue nope does not exist" in decided.waiting[0].reason


def test_per_model_quota_steers_a_pod_to_the_model_its_queue_covers() -> None:
    book = ledger(node("a", 1, model="A100"), node("h", 1, model="H100"))
    queues = [QueueSpec("q", {(GPUS, "H100"): Quota(1000)})]
    decided = run(book, queues, [], [pod("p", "q", whole(1))])
    assert decided.admissions[0].choices["p"].node == "h"
    only_a100 = [QueueSpec("q", {(GPUS, "A100"): Quota(0)})]
    decided = run(book, only_a100, [], [pod("p", "q", whole(1))])
    assert decided.waiting[0].why is Why.QUOTA


def test_the_worked_example_of_docs_queues_md() -> None:
    book = ledger(node("dgx", 8))
    queues = [spec("team-a", 4, cohort="research"), spec("team-b", 4, cohort="research")]
    running: list[Running] = []

    def step(waiting: list[Workload], now: float) -> admitting.Round:
        decided = run(book, queues, running, waiting, now=now)
        for order, admission in enumerate(decided.admissions):
            for grant in admission.grants:
                book.reserve(grant)
            # admitted one after another, in the round's order
            running.append(
                Running(admission.key, admission.queue, admission.uids, 0, now + order / 100)
            )
        return decided

    # 1. six 1-GPU pods of team A: four on its nominal, two borrowed from B
    decided = step([pod(f"a{i}", "team-a", whole(1), created=i) for i in range(6)], 1)
    assert len(decided.admissions) == 6
    status = {q.name: q for q in decided.queues}
    assert status["team-a"].borrowed == {ANY: 2000} and status["team-b"].lent == {ANY: 2000}
    # 2. a 2-GPU pod of team B: two GPUs are free
    assert [a.key for a in step([pod("b1", "team-b", whole(2))], 2).admissions] == ["b1"]
    # 3. another: inside B's nominal, nothing free, A borrows 2: A's two latest pods go
    decided = step([pod("b2", "team-b", whole(2))], 3)
    (reclaim,) = decided.reclaims
    assert sorted(v.key for v in reclaim.victims) == ["a4", "a5"]
    assert decided.waiting[0].why is Why.RECLAIMING
    for victim in reclaim.victims:
        book.release(victim.key)
        running[:] = [r for r in running if r.key != victim.key]
    # ... once they are gone, b2 is admitted on their GPUs
    assert [a.key for a in step([pod("b2", "team-b", whole(2))], 4).admissions] == ["b2"]


# --- properties ------------------------------------------------------------------------


REQUESTS = st.sampled_from([whole(1), whole(2), share(500), share(250, 8_192)])


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[Ledger, list[QueueSpec], list[Workload], list[Workload]]:
    """A cluster, queues, what arrives first (mostly into one queue, which then borrows)
    and what arrives next (anywhere): the second round is where reclaims happen."""
    nodes = [
        node(f"n{i}", draw(st.integers(1, 4)), model=draw(st.sampled_from(["A100", "H100"])))
        for i in range(draw(st.integers(1, 3)))
    ]
    count = draw(st.integers(2, 3))
    queues = []
    for i in range(count):
        cohort = draw(st.sampled_from(["", "lab", "lab", "lab"]))
        nominal = draw(st.integers(1, 6)) / 2
        queues.append(
            spec(
                f"q{i}",
                nominal,
                cohort=cohort,
                borrowing=draw(st.none() | st.integers(0, 4)) if cohort else None,
                lending=draw(st.none() | st.integers(0, int(nominal))) if cohort else None,
                weight=draw(st.sampled_from([0.5, 1.0, 2.0])),
                reclaim=draw(st.sampled_from(list(Preemption))),
                fair=draw(st.sampled_from(list(Preemption))) if cohort else Preemption.NEVER,
                strategies=draw(st.sampled_from(STRATEGY_LISTS)),
                queueing=draw(
                    st.sampled_from(
                        [quotas.Queueing.BEST_EFFORT_FIFO] * 3 + [quotas.Queueing.STRICT_FIFO]
                    )
                ),
            )
        )
    borrower = draw(st.integers(0, count - 1))

    def workloads(prefix: str, most: int, into: int | None) -> list[Workload]:
        found = []
        for i in range(draw(st.integers(0, most))):
            index = into if into is not None else draw(st.integers(0, count - 1))
            request = draw(REQUESTS)
            size = draw(st.integers(1, 3)) if into is not None else draw(st.sampled_from([1, 1, 2]))
            minimum = draw(st.integers(0, size))
            members = tuple(Member(f"{prefix}{i}-{m}", request) for m in range(size))
            found.append(
                Workload(
                    f"{prefix}{i}",
                    queues[index].name,
                    members,
                    draw(st.integers(0, 2)),
                    float(i),
                    minimum,
                )
            )
        return found

    first = workloads("first", 10, borrower)
    return ledger(*nodes), queues, first, workloads("then", 4, None)


def admitted_as_running(
    decided: admitting.Round, workloads: Sequence[Workload], at: float
) -> list[Running]:
    by_key = {w.key: w for w in workloads}
    found = []
    for admission in decided.admissions:
        workload = by_key[admission.key]
        started = admission.uids
        missing = tuple(m for m in workload.members if m.uid not in started)
        found.append(
            Running(
                workload.key,
                workload.queue,
                started,
                workload.priority,
                at,
                workload.minimum,
                missing,
            )
        )
    return found


def check_round(
    book: Ledger,
    queues: Sequence[QueueSpec],
    running: Sequence[Running],
    waiting: Sequence[Workload],
    decided: admitting.Round,
) -> None:
    # no admitted workload without a place: every grant fits the ledger as it was, with
    # the others of the round, without overcommitting anything
    fresh = Ledger(Inventory(list(book.inventory)))
    for grant in book:
        fresh.reserve(grant, overcommit=True)
    for admission in decided.admissions:
        for grant in admission.grants:
            fresh.reserve(grant)  # raises when oversubscribed
    # a gang admitted whole or not at all (an elastic one with at least its minimum)
    by_key = {w.key: w for w in waiting}
    for admission in decided.admissions:
        if admission.growth:
            continue
        workload = by_key[admission.key]
        need = workload.minimum if workload.elastic else len(workload.members)
        assert len(admission.uids) >= need
        assert set(admission.uids) <= {m.uid for m in workload.members}
    # quota never exceeded, lending limits respected (running use counted as it is)
    accounts = quotas.Accounts(queues)
    inventory = book.inventory
    for held in running:
        grants = [g for uid in held.uids if (g := book.get(uid)) is not None]
        use = accounts.use_of(held.queue, quotas.usage(grants, inventory), strict=False)
        assert not isinstance(use, quotas.Verdict)
        accounts.charge(held.queue, use)
    before = {name: dict(used) for name, used in accounts.used.items()}
    for admission in decided.admissions:
        accounts.charge(admission.queue, admission.use)
    for queue in queues:
        quota = queue.quotas[ANY]
        used = accounts.used[queue.name].get(ANY, 0)
        if used == before[queue.name].get(ANY, 0):
            continue  # nothing admitted here: what ran already is not this round's doing
        limit = quota.nominal
        if queue.cohort:
            limit += quota.borrowing_limit if quota.borrowing_limit is not None else 10**9
        assert used <= limit, queue.name
    pooled = sum(
        max(0, accounts.used[q.name].get(ANY, 0) - q.quotas[ANY].kept) for q in queues if q.cohort
    )
    lendable = sum(q.quotas[ANY].lendable for q in queues if q.cohort)
    pooled_before = sum(
        max(0, before[q.name].get(ANY, 0) - q.quotas[ANY].kept) for q in queues if q.cohort
    )
    assert pooled <= max(lendable, pooled_before)


@st.composite
def reclaim_scenarios(
    draw: st.DrawFn,
) -> tuple[Ledger, list[QueueSpec], list[Workload], list[Workload]]:
    """Queue b fills the cluster borrowing a's idle quota; then a's small workloads come."""
    nodes = [node(f"n{i}", draw(st.integers(1, 4))) for i in range(draw(st.integers(1, 3)))]
    queues = [
        spec("a", draw(st.integers(1, 4)), reclaim=draw(st.sampled_from(list(Preemption)))),
        spec("b", draw(st.integers(0, 1)), lending=0),
    ]
    first = [
        Workload(
            f"b{i}",
            "b",
            tuple(Member(f"b{i}-{m}", whole(1)) for m in range(draw(st.integers(1, 2)))),
            draw(st.integers(0, 2)),
            float(i),
            draw(st.sampled_from([0, 1])),
        )
        for i in range(draw(st.integers(3, 10)))
    ]
    then = [
        pod(f"a{i}", "a", draw(REQUESTS), priority=draw(st.integers(0, 3)), created=float(i))
        for i in range(draw(st.integers(1, 3)))
    ]
    return ledger(*nodes), queues, first, then


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_rounds_keep_every_invariant(
    scenario: tuple[Ledger, list[QueueSpec], list[Workload], list[Workload]],
) -> None:
    two_rounds(scenario, reclaims=1)


PASTS = st.dictionaries(st.sampled_from("abc"), st.floats(0, 2), max_size=3)
"""Past shares (fair sharing over time): they move the order and the fair-sharing
verdicts, never the invariants."""


@settings(max_examples=100, deadline=None)
@given(reclaim_scenarios(), st.integers(1, 3), PASTS)
def test_reclaims_keep_every_invariant_and_evict_only_what_is_needed(
    scenario: tuple[Ledger, list[QueueSpec], list[Workload], list[Workload]],
    reclaims: int,
    past: dict[str, float],
) -> None:
    two_rounds(scenario, reclaims=reclaims, past=past)


@settings(max_examples=150, deadline=None)
@given(st.one_of(reclaim_scenarios(), scenarios()))
def test_the_cheap_test_of_a_candidate_alone_never_rules_out_one_that_admits(
    scenario: tuple[Ledger, list[QueueSpec], list[Workload], list[Workload]],
) -> None:
    """Issue 41's step 5 skips, without a plan, the candidates `_Preempting.could`
    rules out: each of those, alone, would not admit the workload; and the test changes
    neither the ledger nor the accounts."""
    book, queues, first, then = scenario
    decided = admitting.admit(Placer(book, policy()), queues, [], first, now=1.0)
    running = admitted_as_running(decided, first, 1.0)
    waiting = [w for w in first if w.key not in {a.key for a in decided.admissions}] + then
    state = admitting._Round(Placer.scratch(book, policy()), queues, running, 2.0)
    state.failures = None
    for workload in waiting:
        if workload.queue not in state.accounts.specs:
            continue
        members = workload.members[: workload.minimum] if workload.elastic else workload.members
        preempting = admitting._Preempting(state, workload, members, ())
        before = held(state)
        for candidate in admitting._candidates(state, workload.queue):
            if preempting.admits([candidate]):
                assert preempting.could(candidate), candidate
        assert held(state) == before


def held(state: admitting._Round) -> tuple[object, ...]:
    """The grants, the nodes' states and the accounts' use (not the ledger's generation,
    which every what-if moves)."""
    grants, _, nodes = state_of(state.placer.ledger)
    return grants, nodes, repr(state.accounts.used)


def two_rounds(
    scenario: tuple[Ledger, list[QueueSpec], list[Workload], list[Workload]],
    *,
    reclaims: int,
    past: dict[str, float] | None = None,
) -> None:
    """Round one admits `first` from nothing; round two, on a scratch copy, the rest and
    `then`: both keep the invariants, and each reclaim of round two (the first when
    several: the others are chosen with it applied) evicts only victims it needs."""
    book, queues, first, then = scenario
    placer = Placer(book, policy())
    decided = admitting.admit(placer, queues, [], first, now=1.0)
    empty = Ledger(Inventory(list(book.inventory)))
    check_round(empty, queues, [], first, decided)
    running = admitted_as_running(decided, first, 1.0)
    waiting = [w for w in first if w.key not in {a.key for a in decided.admissions}] + then
    before = state_of(book)
    second = Placer.scratch(book, policy())
    decided = admitting.admit(
        second, queues, running, waiting, now=2.0, reclaims=reclaims, past=past
    )
    assert state_of(book) == before  # a scratch round leaves the live ledger alone
    check_round(book, queues, running, waiting, decided)
    # every victim of the reclaim is needed: once the round's admissions are in, without
    # any one of its victims the workload would still not be admitted
    by_key = {w.key: w for w in waiting}
    after = [*running, *admitted_as_running(decided, waiting, 2.0)]
    for reclaim in decided.reclaims[:1]:
        workload = by_key[reclaim.key]
        members = workload.members[: workload.minimum] if workload.elastic else workload.members
        placer = Placer.scratch(book, policy())
        for admission in decided.admissions:
            for grant in admission.grants:
                placer.ledger.reserve(grant)
        state = admitting._Round(placer, queues, after, 2.0)
        state.failures = None
        every = {uid for v in reclaim.victims for uid in v.uids}
        assert admitting._admits_without(state, every, workload.queue, members)
        for spared in reclaim.victims:
            rest = {uid for v in reclaim.victims if v is not spared for uid in v.uids}
            if set(spared.uids) <= rest:
                continue
            assert not admitting._admits_without(state, rest, workload.queue, members)
