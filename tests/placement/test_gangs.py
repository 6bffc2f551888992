"""The gang planner: all or nothing, never oversubscribed, the ledger untouched by planning,
fewest nodes for a homogeneous gang, NVLink domains kept whole, readable shortfalls."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.placement import gangs, policies
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fragmentation import Workload
from gpuplace.placement.ledger import Grant, Ledger, LedgerError
from gpuplace.placement.requests import GpuRequest, Topology

from .clusters import ledger, node, share, whole
from .test_ledger import check_invariants

DOMAINS_8 = (0, 0, 0, 0, 1, 1, 1, 1)


def members(request: GpuRequest, n: int, *, prefix: str = "m") -> list[gangs.Member]:
    return [gangs.Member(f"{prefix}{i}", request) for i in range(n)]


def best_fit() -> Policy:
    return policies.make("best-fit")


def state_of(book: Ledger) -> tuple[object, ...]:
    return (
        book.snapshot(),
        book.generation,
        tuple(
            (
                s.node.name,
                tuple(s.free_milli),
                tuple(s.free_memory),
                tuple(s.memory_only),
                s.cpu,
                s.memory,
                s.pods,
            )
            for s in book.states()
        ),
    )


# --- unit -------------------------------------------------------------------------------


def test_a_gang_that_fits_gets_every_member_and_the_ledger_is_untouched() -> None:
    book = ledger(node("a", 8, nvlink=DOMAINS_8), node("b", 4), node("c", 8, nvlink=DOMAINS_8))
    before = state_of(book)
    result = gangs.plan(book, best_fit(), members(whole(4), 4))
    assert isinstance(result, gangs.Plan)
    assert set(result.choices) == {"m0", "m1", "m2", "m3"}
    assert result.per_node() == {"a": 2, "c": 2}
    # each 4-GPU member takes exactly one NVLink domain
    for choice in result.choices.values():
        assert choice.gpus in ((0, 1, 2, 3), (4, 5, 6, 7))
    assert state_of(book) == before


def test_a_gang_that_does_not_fit_gets_nothing_and_says_why() -> None:
    book = ledger(node("a", 8), node("b", 4))
    before = state_of(book)
    result = gangs.plan(book, best_fit(), members(whole(4), 4))
    assert isinstance(result, gangs.Shortfall)
    assert result.placed == 3 and result.needed == 4
    assert not result.ever
    assert "never fit" in result.reason and "4 whole GPUs" in result.reason
    assert state_of(book) == before


def test_a_busy_cluster_is_a_shortfall_that_waiting_can_fix() -> None:
    book = ledger(node("a", 4), node("b", 4))
    book.reserve(Grant("other", "a", (0, 1), 1000, 0))
    result = gangs.plan(book, best_fit(), members(whole(2), 4))
    assert isinstance(result, gangs.Shortfall)
    assert result.ever and result.placed == 3
    assert "3 of 4 gang members fit now" in result.reason
    assert result.reasons == {"not enough whole GPUs free": 2}


def test_fewer_nodes_are_preferred_over_spreading() -> None:
    # eight 2-GPU nodes and one 8-GPU node: a gang of four 2-GPU members fits on the big one
    small = [node(f"s{i}", 2) for i in range(8)]
    book = ledger(*small, node("big", 8))
    result = gangs.plan(book, best_fit(), members(whole(2), 4))
    assert isinstance(result, gangs.Plan)
    assert result.nodes == ("big",)


def test_the_last_members_go_to_the_tightest_node_that_holds_them_all() -> None:
    book = ledger(node("a", 8), node("b", 2), node("c", 4))
    result = gangs.plan(book, best_fit(), members(whole(1), 10))
    assert isinstance(result, gangs.Plan)
    # 8 on a (largest), then the remaining 2 on b (smallest that holds both), not c
    assert result.per_node() == {"a": 8, "b": 2}


def test_multi_gpu_members_keep_nvlink_domains_whole() -> None:
    # node a: domains of 2 and 6 GPUs; b: no NVLink. Two 2-GPU members prefer a, and the
    # first takes the 2-domain so the 6-domain stays whole for the second (and others).
    book = ledger(node("a", 8, nvlink=(0, 0, 1, 1, 1, 1, 1, 1)), node("b", 8))
    result = gangs.plan(book, best_fit(), members(whole(2, topology=Topology.PREFERRED), 2))
    assert isinstance(result, gangs.Plan)
    assert result.nodes == ("a",)
    assert sorted(choice.gpus for choice in result.choices.values()) == [(0, 1), (2, 3)]


def test_required_nvlink_counts_only_whole_domains() -> None:
    book = ledger(node("a", 8, nvlink=(0, 0, 0, 1, 1, 1, 2, 2)))
    request = whole(3, topology=Topology.REQUIRED)
    state = book.state("a")
    assert state is not None
    assert gangs.capacity(state, request) == (2, 2)
    assert isinstance(gangs.plan(book, best_fit(), members(request, 2)), gangs.Plan)
    assert isinstance(gangs.plan(book, best_fit(), members(request, 3)), gangs.Shortfall)


def test_members_respect_their_eligible_nodes_and_exclusions() -> None:
    book = ledger(node("a", 8), node("b", 8), node("c", 8))
    group = [gangs.Member(f"m{i}", whole(2), frozenset({"b", "c"})) for i in range(4)]
    result = gangs.plan(book, best_fit(), group, exclude={"b"})
    assert isinstance(result, gangs.Plan)
    assert result.nodes == ("c",)
    nowhere = [gangs.Member("x", whole(1), frozenset())]
    missing = gangs.plan(book, best_fit(), nowhere)
    assert isinstance(missing, gangs.Shortfall)
    assert "node affinity" in missing.reason and not missing.ever


def test_heterogeneous_gang_places_heavy_members_first_on_few_nodes() -> None:
    book = ledger(node("a", 8), node("b", 8))
    group = [gangs.Member("driver", share(250)), *members(whole(4), 2)]
    result = gangs.plan(book, best_fit(), group)
    assert isinstance(result, gangs.Plan)
    # the two 4-GPU workers fill one node; the driver joins a used node only if it
    # fits: that node is full, so it opens the other
    workers = {result.choices["m0"].node, result.choices["m1"].node}
    assert len(workers) == 1
    assert result.choices["driver"].node not in workers


def test_duplicate_uids_are_refused() -> None:
    with pytest.raises(ValueError):
        gangs.plan(ledger(node("a", 2)), best_fit(), [gangs.Member("x", whole(1))] * 2)


def test_reserve_is_all_or_nothing() -> None:
    book = ledger(node("a", 4))
    group = members(whole(1), 4)
    result = gangs.plan(book, best_fit(), group)
    assert isinstance(result, gangs.Plan)
    book.reserve(Grant("intruder", "a", (3,), 1000, 0))
    snapshot = book.snapshot()
    with pytest.raises(LedgerError):
        gangs.reserve(book, result, group)
    assert book.snapshot() == snapshot


def test_fence_picks_nodes_closest_to_holding_the_gang() -> None:
    book = ledger(node("a", 8), node("b", 8), node("c", 8))
    book.reserve(Grant("x", "a", tuple(range(8)), 1000, 0))
    book.reserve(Grant("y", "b", (0,), 1000, 0))
    book.reserve(Grant("z", "c", (0, 1, 2, 3), 1000, 0))
    # 4 × 4 GPUs: needs two idle nodes; b (7 free) then c (4 free) are closest
    assert gangs.fence(book, members(whole(4), 4)) == ("b", "c")
    assert gangs.fence(book, members(whole(4), 7)) == ()


def test_default_policy_plans_too() -> None:
    workload = Workload.from_requests([whole(1), share(500)])
    book = ledger(node("a", 8), node("b", 8))
    result = gangs.plan(book, policies.make("default", workload=workload), members(share(500), 5))
    assert isinstance(result, gangs.Plan)
    assert len(result.nodes) == 1


# --- properties -------------------------------------------------------------------------

REQUESTS = st.one_of(
    st.builds(
        share,
        st.sampled_from([100, 250, 300, 500, 700, 1000]),
        st.sampled_from([0, 1024, 8192, 20_000]),
    ),
    st.builds(
        lambda count, topology: whole(count, topology=topology),
        st.integers(1, 4),
        st.sampled_from(list(Topology)),
    ),
    st.builds(  # memory-only shares
        lambda mib: GpuRequest(milli=0, memory_mib=mib, count=1, cpu_milli=1000),
        st.sampled_from([1024, 4096, 8192, 16_384]),
    ),
)


@st.composite
def clusters(draw: st.DrawFn) -> Ledger:
    count = draw(st.integers(1, 6))
    nodes = []
    for i in range(count):
        gpus = draw(st.sampled_from([1, 2, 4, 8]))
        nvlink = draw(
            st.sampled_from([None, tuple(index * 2 // gpus for index in range(gpus)), (0,) * gpus])
        )
        nodes.append(
            node(f"n{i}", gpus, memory=draw(st.sampled_from([16_384, 40_960])), nvlink=nvlink)
        )
    book = ledger(*nodes)
    # some load already on the cluster
    for j, request in enumerate(draw(st.lists(REQUESTS, max_size=8))):
        found = gangs.plan(book, best_fit(), [gangs.Member(f"bg{j}", request)])
        if isinstance(found, gangs.Plan):
            gangs.reserve(book, found, [gangs.Member(f"bg{j}", request)])
    return book


@st.composite
def gangs_of(draw: st.DrawFn) -> list[gangs.Member]:
    kinds = draw(st.lists(REQUESTS, min_size=1, max_size=3))
    sizes = draw(st.lists(st.integers(1, 6), min_size=len(kinds), max_size=len(kinds)))
    result = []
    for k, (request, size) in enumerate(zip(kinds, sizes, strict=True)):
        result.extend(members(request, size, prefix=f"g{k}-"))
    return result


@settings(max_examples=150, deadline=None)
@given(book=clusters(), group=gangs_of(), policy=st.sampled_from(["best-fit", "first-fit"]))
def test_plans_are_all_or_nothing_never_oversubscribe_and_leave_the_ledger(
    book: Ledger, group: list[gangs.Member], policy: str
) -> None:
    before = state_of(book)
    result = gangs.plan(book, policies.make(policy), group)
    assert state_of(book) == before
    if isinstance(result, gangs.Shortfall):
        assert result.placed < result.needed == len(group)
        assert result.reason
        return
    assert set(result.choices) == {member.uid for member in group}
    assert set(result.nodes) == {choice.node for choice in result.choices.values()}
    taken = gangs.reserve(book, result, group)  # raises Oversubscribed on any over-grant
    assert len(taken) == len(group)
    check_invariants(book)


@settings(max_examples=150, deadline=None)
@given(book=clusters(), request=REQUESTS, size=st.integers(1, 12))
def test_a_homogeneous_gang_fits_exactly_when_capacity_covers_it_on_fewest_nodes(
    book: Ledger, request: GpuRequest, size: int
) -> None:
    caps = sorted((gangs.capacity(state, request)[0] for state in book.states()), reverse=True)
    result = gangs.plan(book, best_fit(), members(request, size))
    fits = sum(caps) >= size
    assert isinstance(result, gangs.Plan) == fits
    if isinstance(result, gangs.Plan):
        covered, fewest = 0, 0
        for cap in caps:
            if covered >= size:
                break
            covered += cap
            fewest += 1
        assert len(result.nodes) == fewest


@settings(max_examples=100, deadline=None)
@given(book=clusters(), group=gangs_of(), data=st.data())
def test_plans_use_only_eligible_nodes(
    book: Ledger, group: list[gangs.Member], data: st.DataObject
) -> None:
    names = sorted(book.inventory.names())
    allowed = frozenset(data.draw(st.lists(st.sampled_from(names), unique=True)))
    excluded = frozenset(data.draw(st.lists(st.sampled_from(names), unique=True)))
    constrained = [gangs.Member(m.uid, m.request, allowed) for m in group]
    result = gangs.plan(book, best_fit(), constrained, exclude=excluded)
    if isinstance(result, gangs.Plan):
        for choice in result.choices.values():
            assert choice.node in allowed and choice.node not in excluded
