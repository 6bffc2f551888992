"""Ledger invariants (DESIGN.md): no GPU over its share or memory, a whole GPU is
exclusive, granting twice never counts twice, release restores, snapshot → restore
reproduces the same ledger."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.placement import choosing, policies
from gpuplace.placement.fragmentation import Workload
from gpuplace.placement.ledger import (
    Conflict,
    Grant,
    GrantState,
    Ledger,
    LedgerError,
    NodeState,
    Oversubscribed,
)
from gpuplace.placement.requests import GpuRequest

from .clusters import ledger, node, share


def fresh() -> Ledger:
    return ledger(node("a", 4, memory=16_384), node("b", 2, memory=16_384), node("c", 1))


def free_state(state: NodeState) -> tuple[object, ...]:
    return (
        state.node.name,
        list(state.free_milli),
        list(state.free_memory),
        list(state.memory_only),
        state.cpu,
    )


def check_invariants(book: Ledger) -> None:
    for state in book.states():
        held_milli = [0] * len(state.node.gpus)
        held_memory = [0] * len(state.node.gpus)
        whole_holders: dict[int, list[str]] = {}
        memory_only: dict[int, set[str]] = {}
        sharers: dict[int, set[str]] = {}
        for grant in book.grants_on(state.node.name):
            for index in grant.gpus:
                held_milli[index] += grant.milli
                held_memory[index] += grant.memory_mib
                sharers.setdefault(index, set()).add(grant.pod_uid)
                if grant.milli == 1000:
                    whole_holders.setdefault(index, []).append(grant.pod_uid)
                if grant.memory_only:
                    assert len(grant.gpus) == 1 and grant.memory_mib > 0
                    memory_only.setdefault(index, set()).add(grant.pod_uid)
        for gpu in state.node.gpus:
            pooled = memory_only.get(gpu.index, set())
            assert held_milli[gpu.index] <= 1000
            assert held_memory[gpu.index] <= gpu.memory_mib
            # Memory-only shares take the compute nobody else may then take.
            assert state.free_milli[gpu.index] == 1000 - held_milli[gpu.index] - (
                1000 if pooled else 0
            )
            assert state.memory_only[gpu.index] == len(pooled)
            assert state.free_memory[gpu.index] == gpu.memory_mib - held_memory[gpu.index]
            if gpu.index in whole_holders:
                assert sharers[gpu.index] == set(whole_holders[gpu.index])
                assert len(whole_holders[gpu.index]) == 1
            if pooled:
                # A memory-only share shares its GPU with memory-only shares alone.
                assert sharers[gpu.index] == pooled


requests = st.one_of(
    st.builds(
        GpuRequest,
        milli=st.integers(1, 1000),
        memory_mib=st.sampled_from([0, 1024, 8192, 16_384]),
        count=st.just(1),
        cpu_milli=st.integers(0, 4000),
        host_memory_mib=st.integers(0, 8192),
    ),
    st.builds(
        GpuRequest,
        milli=st.just(1000),
        count=st.integers(2, 4),
        cpu_milli=st.integers(0, 4000),
        host_memory_mib=st.integers(0, 8192),
    ),
    st.builds(GpuRequest, cpu_milli=st.integers(0, 8000), host_memory_mib=st.integers(0, 8192)),
    st.builds(
        GpuRequest,
        milli=st.just(0),
        memory_mib=st.sampled_from([1024, 4096, 8192, 16_384]),
        count=st.just(1),
        cpu_milli=st.integers(0, 4000),
        host_memory_mib=st.integers(0, 8192),
    ),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("grant"), requests, st.integers(0, 30)),
        st.tuples(st.just("release"), st.just(GpuRequest()), st.integers(0, 30)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(operations, st.sampled_from(policies.NAMES))
def test_random_grants_and_releases_keep_every_invariant(
    ops: list[tuple[str, GpuRequest, int]], policy_name: str
) -> None:
    book = fresh()
    workload = Workload.from_requests([op[1] for op in ops if op[0] == "grant"])
    policy = policies.make(policy_name, workload=workload)
    chooser = choosing.Chooser(book, policy)
    rng = random.Random(1)
    for kind, request, uid in ops:
        if kind == "grant":
            choice = chooser.choose(request, rng)
            if choice is not None:
                grant = choosing.grant_for(f"pod-{uid}", choice, request)
                try:
                    book.reserve(grant)
                except Conflict:
                    assert f"pod-{uid}" in book
        else:
            book.release(f"pod-{uid}")
        check_invariants(book)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(requests, st.integers(0, 20)), max_size=40))
def test_release_restores_and_snapshot_restore_is_identical(
    items: list[tuple[GpuRequest, int]],
) -> None:
    book = fresh()
    chooser = choosing.Chooser(book, policies.make("best-fit", workload=Workload(())))
    rng = random.Random(0)
    empty = [
        (s.node.name, list(s.free_milli), list(s.free_memory), list(s.memory_only), s.cpu)
        for s in book.states()
    ]
    for request, uid in items:
        choice = chooser.choose(request, rng)
        if choice is not None and f"p{uid}" not in book:
            book.reserve(choosing.grant_for(f"p{uid}", choice, request))
    copy = Ledger(book.inventory)
    copy.restore(book.snapshot())
    assert copy.snapshot() == book.snapshot()
    assert [
        (s.node.name, s.free_milli, s.free_memory, s.memory_only, s.cpu) for s in copy.states()
    ] == [(s.node.name, s.free_milli, s.free_memory, s.memory_only, s.cpu) for s in book.states()]
    for grant in book.snapshot():
        book.release(grant.pod_uid)
    after = [
        (s.node.name, list(s.free_milli), list(s.free_memory), list(s.memory_only), s.cpu)
        for s in book.states()
    ]
    assert after == empty
    assert len(book) == 0


def test_granting_the_same_uid_twice_never_counts_twice() -> None:
    book = fresh()
    grant = Grant("u1", "a", (0,), 500, 1024)
    assert book.reserve(grant) is True
    assert book.reserve(grant) is False
    assert book.state("a").free_milli[0] == 500  # type: ignore[union-attr]
    confirmed = Grant("u1", "a", (0,), 500, 1024, state=GrantState.CONFIRMED)
    assert book.reserve(confirmed) is False
    assert book.get("u1").state is GrantState.CONFIRMED  # type: ignore[union-attr]
    with pytest.raises(Conflict, match="already holds GPUs"):
        book.reserve(Grant("u1", "a", (1,), 500, 1024))


def test_oversubscription_is_refused_with_a_readable_reason() -> None:
    book = fresh()
    book.reserve(Grant("u1", "a", (0,), 600, 0))
    with pytest.raises(Oversubscribed, match=r"gpu 0 of a: 40% free, needs 50%"):
        book.reserve(Grant("u2", "a", (0,), 500, 0))
    with pytest.raises(Oversubscribed, match="MiB free"):
        book.reserve(Grant("u3", "a", (1,), 100, 20_000))
    with pytest.raises(LedgerError, match="no GPU 9"):
        book.reserve(Grant("u4", "a", (9,), 100, 0))
    with pytest.raises(LedgerError, match="unknown node"):
        book.reserve(Grant("u5", "zz", (0,), 100, 0))


def test_whole_gpu_grant_excludes_any_share() -> None:
    book = fresh()
    book.reserve(Grant("whole", "c", (0,), 1000, 0))
    with pytest.raises(Oversubscribed):
        book.reserve(Grant("tiny", "c", (0,), 1, 0))
    first_fit = policies.make("first-fit")
    assert choosing.choose(book, share(1), first_fit, random.Random(0), ["c"]) is None


def test_restore_records_reality_even_when_it_overcommits() -> None:
    book = fresh()
    grants = [Grant("x", "c", (0,), 700, 0), Grant("y", "c", (0,), 700, 0)]
    book.restore(grants)
    assert len(book) == 2
    assert book.state("c").free_milli[0] == -400  # type: ignore[union-attr]
    first_fit = policies.make("first-fit")
    assert choosing.choose(book, share(1), first_fit, random.Random(0), ["c"]) is None


def test_a_grant_on_gpus_a_node_lost_is_released_without_touching_the_others() -> None:
    """A node republished with fewer GPUs keeps the grants on the lost ones recorded
    (not taken from its state); releasing one then gives nothing back that was not taken
    (it raised IndexError, or left more free than the GPU has)."""
    book = fresh()
    assert book.reserve(Grant("x", "b", (1,), 300, 0))
    assert book.reserve(Grant("y", "b", (0,), 200, 0))
    assert book.reserve(Grant("z", "b", (0, 1), 100, 0))
    two = book.inventory.get("b")
    assert two is not None
    book.put_node(node("b", 1, memory=16_384))
    assert book.state("b").free_milli == [800]  # type: ignore[union-attr]
    assert book.release("x") is not None
    assert book.release("z") is not None
    assert book.state("b").free_milli == [800]  # type: ignore[union-attr]
    book.put_node(two)  # the GPU is back, and of the grants only y is still there
    assert book.state("b").free_milli == [800, 1000]  # type: ignore[union-attr]
    check_invariants(book)


def test_a_relist_records_a_grant_on_a_gpu_the_node_no_longer_has() -> None:
    """A relist (`restore`, as `LedgerSync.replace_pods` runs it) after a node was
    republished with fewer GPUs: a running pod's grant on a lost GPU is recorded, taken
    from no state, and counts again when the GPU returns, as `put_node` keeps such grants.
    It raised LedgerError ("node b has no GPU 1"), failing the whole relist (found by
    test_fragmentation_totals' property: reserve, drop the node, add it smaller, relist)."""
    book = fresh()
    two = book.inventory.get("b")
    assert two is not None
    book.put_node(node("b", 1, memory=16_384))
    book.restore([Grant("x", "b", (1,), 300, 0), Grant("y", "b", (0,), 200, 0)])
    assert {grant.pod_uid for grant in book} == {"x", "y"}
    assert book.state("b").free_milli == [800]  # type: ignore[union-attr]
    with pytest.raises(LedgerError, match="no GPU 1"):  # a new decision still may not
        book.reserve(Grant("w", "b", (1,), 100, 0))
    book.put_node(two)
    assert book.state("b").free_milli == [800, 700]  # type: ignore[union-attr]
    check_invariants(book)


def test_node_versions_never_repeat_after_remove_and_add() -> None:
    book = fresh()
    before = book.state("b").version  # type: ignore[union-attr]
    removed = book.inventory.get("b")
    assert removed is not None
    book.remove_node("b")
    book.put_node(removed)
    assert book.state("b").version > before  # type: ignore[union-attr]


def test_change_log_keeps_readers_that_keep_up_and_restarts_those_that_lag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full change log drops its older half only: a reader that looks every few
    changes never has to rescan every node; one further behind than half the log does."""
    monkeypatch.setattr(Ledger, "CHANGE_LOG_LIMIT", 8)
    book = fresh()
    keeping_up = book.changes(-1, 0)[:2]
    lagging = keeping_up
    seen: list[str] = []
    expected: list[str] = []
    for round_ in range(20):
        uid = f"p{round_}"
        book.reserve(Grant(uid, "a", (round_ % 4,), 100, 0))
        book.release(uid)
        expected += ["a", "a"]
        epoch, cursor, changed = book.changes(*keeping_up)
        assert changed is not None, f"a reader two changes behind restarted at round {round_}"
        seen += changed
        keeping_up = (epoch, cursor)
    assert seen == expected
    assert book.changes(*lagging)[2] is None  # 40 changes behind an 8-entry log
    before_restore = keeping_up
    book.restore([])
    assert book.changes(*before_restore)[2] is None
