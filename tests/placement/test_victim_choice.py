"""Preemption victims per GPU: the preemptor fits on one GPU set afterwards, every victim
is needed, and the cheapest selection wins (gpuplace.placement.victim_choice)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.placement import choosing, fit, gangs, policies, victim_choice
from gpuplace.placement.ledger import Grant, Ledger, LedgerError
from gpuplace.placement.requests import GpuRequest, Topology
from gpuplace.placement.victim_choice import Unit
from tests.placement.clusters import ledger, node, share, whole


def put(book: Ledger, uid: str, gpus: tuple[int, ...], milli: int, memory: int = 0) -> Grant:
    grant = Grant(uid, "n", gpus, milli, memory, cpu_milli=1000, host_memory_mib=1024)
    book.reserve(grant)
    return grant


def unit(grant: Grant, priority: int = 0, *, offered: bool = True) -> Unit:
    return Unit((grant.pod_uid,), (grant,), (priority,), 0 if offered else 1)


def two_gpus() -> tuple[Ledger, dict[str, Grant]]:
    """GPU 0 holds 50% + 40%, GPU 1 holds 60% + 30%."""
    book = ledger(node("n", 2))
    grants = {
        "a50": put(book, "a50", (0,), 500),
        "a40": put(book, "a40", (0,), 400),
        "b60": put(book, "b60", (1,), 600),
        "b30": put(book, "b30", (1,), 300),
    }
    return book, grants


def answer(book: Ledger, request: GpuRequest, units: list[Unit], pdb: int = 0) -> set[str] | None:
    state = book.state("n")
    assert state is not None
    found = victim_choice.evict(state, request, units, pdb_violations=pdb)
    if found is None:
        return None
    assert victim_choice.takes(victim_choice.after(state, found.units), request, found.gpus)
    return set(found.uids)


def test_seventy_percent_on_two_busy_gpus_evicts_on_one_gpu_only() -> None:
    """All four offered: the 60% pod alone leaves GPU 1 with 70% free; one pod is fewer
    than either GPU's two (50+40 would need both, 60+30 need not)."""
    book, grants = two_gpus()
    units = [unit(g) for g in grants.values()]
    assert answer(book, share(700), units) == {"b60"}


def test_seventy_one_percent_needs_a_whole_gpus_pods_and_the_lower_priorities_go() -> None:
    """71%: either GPU must be emptied (2 pods, 90% each); the lower highest priority wins,
    and at equal priorities everything ties but the GPU index: GPU 0's pods."""
    book, grants = two_gpus()
    assert answer(book, share(710), [unit(g) for g in grants.values()]) == {"a50", "a40"}
    priorities = {"a50": 10, "a40": 10, "b60": 20, "b30": 0}
    units = [unit(g, priorities[uid]) for uid, g in grants.items()]
    assert answer(book, share(710), units) == {"a50", "a40"}
    priorities = {"a50": 10, "a40": 30, "b60": 20, "b30": 0}
    units = [unit(g, priorities[uid]) for uid, g in grants.items()]
    assert answer(book, share(710), units) == {"b60", "b30"}


def test_scheduler_pick_on_totals_is_narrowed_or_dropped() -> None:
    """kube-scheduler on totals offers 40% + 30% (70% free on the node, on no GPU): no
    subset of them makes room; only pods it did not offer could."""
    book, grants = two_gpus()
    offered = [unit(grants["a40"]), unit(grants["b30"])]
    assert answer(book, share(700), offered) is None
    others = [unit(grants["a50"], offered=False), unit(grants["b60"], offered=False)]
    assert answer(book, share(700), offered + others) == {"b60"}


def test_pods_offered_win_over_pods_not_offered() -> None:
    book, grants = two_gpus()
    units = [
        unit(grants["a50"]),
        unit(grants["a40"]),
        unit(grants["b60"], offered=False),
        unit(grants["b30"]),
    ]
    assert answer(book, share(700), units) == {"a50", "a40"}


def test_fewest_pdb_violations_first() -> None:
    """Two of four offered violate a PDB: a selection of one pod may violate at most one,
    one of two at most two; one victim bounds lower."""
    book, grants = two_gpus()
    units = [unit(g) for g in grants.values()]
    assert answer(book, share(700), units, pdb=2) == {"b60"}


def test_memory_on_the_gpu_counts() -> None:
    book = ledger(node("n", 1, memory=40_960))
    small = put(book, "small", (0,), 100, 30_000)
    big = put(book, "big", (0,), 600, 5_000)
    assert answer(book, share(300, 20_000), [unit(small), unit(big)]) == {"small"}


def test_gang_unit_goes_whole_or_not_at_all() -> None:
    book = ledger(node("n", 2))
    g1 = put(book, "g1", (0,), 500)
    g2 = put(book, "g2", (1,), 500)
    solo = put(book, "solo", (0,), 400)
    gang = Unit(("g1", "g2"), (g1, g2), (0, 0))
    assert answer(book, share(600), [gang, unit(solo)]) == {"g1"} | {"g2"}
    assert answer(book, share(600), [unit(solo)]) is None


def test_whole_gpus_need_every_pod_on_them_and_nvlink_when_required() -> None:
    book = ledger(node("n", 4, nvlink=(0, 0, 1, 1)))
    grants = [put(book, f"p{i}", (i,), 500) for i in range(4)]
    units = [unit(g, priority=i) for i, g in enumerate(grants)]
    assert answer(book, whole(2), units) == {"p0", "p1"}
    assert answer(book, whole(2, topology=Topology.REQUIRED), units[1:]) == {"p2", "p3"}
    assert answer(book, whole(2, topology=Topology.REQUIRED), [units[0], units[2]]) is None


def test_nothing_offered_on_the_right_gpu_drops_the_node() -> None:
    book, grants = two_gpus()
    assert answer(book, share(700), [unit(grants["a40"])]) is None
    assert answer(book, GpuRequest(), [unit(grants["a40"])]) is None


# --- property ---------------------------------------------------------------------------

PODS = st.lists(
    st.tuples(
        st.integers(0, 3),  # GPU
        st.integers(1, 10).map(lambda tenths: tenths * 100),  # share
        st.integers(0, 4).map(lambda gib: gib * 4096),  # memory
        st.integers(-5, 5),  # priority
        st.booleans(),  # offered
    ),
    max_size=14,
)


@settings(max_examples=300, deadline=None)
@given(
    pods=PODS,
    milli=st.integers(1, 10).map(lambda tenths: tenths * 100),
    memory=st.integers(0, 5).map(lambda gib: gib * 4096),
    count=st.sampled_from([1, 1, 2, 3]),
)
def test_after_any_answer_the_preemptor_fits_and_no_victim_is_beyond_need(
    pods: list[tuple[int, int, int, int, bool]], milli: int, memory: int, count: int
) -> None:
    book = ledger(node("n", 4, memory=24_576, nvlink=(0, 0, 1, 1)))
    units = []
    for i, (gpu, share_milli, share_memory, priority, offered) in enumerate(pods):
        grant = Grant(f"p{i:02}", "n", (gpu,), share_milli, share_memory, 100, 100)
        book.reserve(grant, overcommit=True)
        units.append(Unit((grant.pod_uid,), (grant,), (priority,), 0 if offered else 1))
    request = (
        GpuRequest(milli=milli, memory_mib=memory, count=1, cpu_milli=100, host_memory_mib=100)
        if count == 1
        else GpuRequest(milli=1000, count=count, cpu_milli=100, host_memory_mib=100)
    )
    state = book.state("n")
    assert state is not None
    found = victim_choice.evict(state, request, units)
    everything = victim_choice.after(state, units)
    if found is None:
        # only when even evicting every unit would not make room
        assert fit.misfit(everything, request) is not None or fit.misfit(state, request) is None
        return
    assert found.units, "an answer always names a victim"
    assert victim_choice.takes(victim_choice.after(state, found.units), request, found.gpus)
    for victim in found.units:
        rest = [other for other in found.units if other is not victim]
        assert not victim_choice.fits_after(state, request, rest), victim.uids
    # only the GPUs it takes hold victims (host resources are plentiful here)
    assert all(victim.gpus() <= set(found.gpus) for victim in found.units)


@pytest.mark.parametrize(("pods", "needed"), [(13, 7), (20, 14)])
def test_search_is_bounded_on_crowded_gpus(pods: int, needed: int) -> None:
    """Pods of 5% each: 70% needs as many as free that much, the lowest priorities."""
    book = ledger(node("n", 1, cpu=640_000, ram=1 << 22))
    units = [unit(put(book, f"p{i:02}", (0,), 50), priority=i % 3) for i in range(pods)]
    found = answer(book, share(700), units)
    assert found is not None and len(found) == needed
    kept = {u.uids[0] for u in units} - found
    chosen_top = max(i % 3 for i in range(pods) if f"p{i:02}" in found)
    assert all(int(uid[1:]) % 3 >= chosen_top for uid in kept)


def test_totals_pick_is_kube_schedulers_and_frees_no_gpu() -> None:
    """Reprieve in the order 50, 60, 40, 30 (older first): the 40% and 30% pods go, 70%
    free on the node, on no GPU; our eviction frees GPU 1 instead."""
    book, grants = two_gpus()
    state = book.state("n")
    assert state is not None
    units = [unit(grants[uid]) for uid in ("a50", "b60", "a40", "b30")]
    picked = victim_choice.totals_pick(state, share(700), units)
    assert {u.uids[0] for u in picked} == {"a40", "b30"}
    assert not victim_choice.fits_after(state, share(700), picked)
    assert victim_choice.totals_pick(state, share(200), units) == []  # totals fit already


# --- a waiting gang ---------------------------------------------------------------------


def test_gang_evicts_only_what_its_members_need_or_nothing() -> None:
    """GPU 0: 60%; GPU 1: 30% + 30%. Two members of 70% each: the 60% pod and one 30%
    pod (the lower priority) go; the other 30% pod stays."""
    book = ledger(node("n", 2))
    p1 = put(book, "p1", (0,), 600)
    p2 = put(book, "p2", (1,), 300)
    p3 = put(book, "p3", (1,), 300)
    members = [gangs.Member(f"m{i}", share(700)) for i in range(2)]
    units = [unit(p1, 5), unit(p2, 5), unit(p3, 1)]
    found = victim_choice.for_gang(book, policies.make("best-fit"), members, units)
    assert found is not None
    assert set(found.uids) == {"p1", "p3"}
    assert sorted(choice.gpus for choice in found.choices.values()) == [(0,), (1,)]
    assert victim_choice.for_gang(book, policies.make("best-fit"), members, units[1:]) is None
    assert len(book) == 3  # the ledger is never changed


def test_gang_victim_spanning_nodes_goes_whole() -> None:
    book = ledger(node("a", 1), node("b", 1))
    left = Grant("g0", "a", (0,), 900, 0, cpu_milli=1000, host_memory_mib=1024)
    right = Grant("g1", "b", (0,), 900, 0, cpu_milli=1000, host_memory_mib=1024)
    book.reserve(left)
    book.reserve(right)
    gang = Unit(("g0", "g1"), (left, right), (0, 0))
    found = victim_choice.for_gang(
        book, policies.make("best-fit"), [gangs.Member("m", share(500))], [gang]
    )
    assert found is not None and set(found.uids) == {"g0", "g1"}


# --- memory-only shares -------------------------------------------------------------------


def memory_only(memory: int) -> GpuRequest:
    return GpuRequest(milli=0, memory_mib=memory, count=1, cpu_milli=1000, host_memory_mib=1024)


def test_a_memory_only_preemptor_empties_a_gpu_of_compute_shares() -> None:
    """Memory-only shares never join a GPU holding compute shares: a memory-only
    preemptor needs every compute share of one GPU gone (or room among memory-only ones)."""
    book, grants = two_gpus()
    units = [unit(g, priority=p) for g, p in zip(grants.values(), (0, 0, 1, 1), strict=True)]
    assert answer(book, memory_only(8192), units) == {"a50", "a40"}


def test_a_compute_preemptor_needs_every_memory_only_share_of_its_gpu_gone() -> None:
    """The last memory-only share to leave gives its GPU's compute back, and only then:
    evicting one of two frees nothing a compute share can use."""
    book = ledger(node("n", 2))
    mem = [put(book, f"m{i}", (0,), 0, 4096) for i in range(2)]
    busy = put(book, "busy", (1,), 900)
    units = [unit(mem[0]), unit(mem[1]), unit(busy, priority=5)]
    assert answer(book, share(500), units) == {"m0", "m1"}
    assert answer(book, share(500), units[:1]) is None  # one of the two does not do


def test_a_memory_only_preemptor_joins_memory_only_shares_when_memory_is_short() -> None:
    book = ledger(node("n", 1, memory=16_384))
    mem = [put(book, f"m{i}", (0,), 0, 6144) for i in range(2)]
    assert answer(book, memory_only(8192), [unit(mem[0]), unit(mem[1], priority=3)]) == {"m0"}


@settings(max_examples=200, deadline=None)
@given(
    kinds=st.lists(st.booleans(), min_size=4, max_size=4),  # per GPU: memory-only shares?
    pods=PODS,
    request_kind=st.sampled_from(["memory", "share", "whole"]),
    memory=st.integers(1, 5).map(lambda gib: gib * 4096),
)
def test_with_memory_only_shares_any_answer_fits_and_needs_every_victim(
    kinds: list[bool],
    pods: list[tuple[int, int, int, int, bool]],
    request_kind: str,
    memory: int,
) -> None:
    """The property above, with GPUs that hold memory-only shares (never mixed with
    compute shares, as the ledger keeps them) and memory-only preemptors."""
    book = ledger(node("n", 4, memory=24_576))
    units = []
    for i, (gpu, share_milli, share_memory, priority, offered) in enumerate(pods):
        milli = 0 if kinds[gpu] else share_milli
        grant = Grant(
            f"p{i:02}", "n", (gpu,), milli, max(share_memory, 1024 * kinds[gpu]), 100, 100
        )
        book.reserve(grant, overcommit=True)
        units.append(Unit((grant.pod_uid,), (grant,), (priority,), 0 if offered else 1))
    request = {
        "memory": GpuRequest(
            milli=0, memory_mib=memory, count=1, cpu_milli=100, host_memory_mib=100
        ),
        "share": GpuRequest(
            milli=500, memory_mib=memory, count=1, cpu_milli=100, host_memory_mib=100
        ),
        "whole": GpuRequest(milli=1000, count=1, cpu_milli=100, host_memory_mib=100),
    }[request_kind]
    state = book.state("n")
    assert state is not None
    found = victim_choice.evict(state, request, units)
    if found is None:
        everything = victim_choice.after(state, units)
        assert fit.misfit(everything, request) is not None or fit.misfit(state, request) is None
        return
    assert victim_choice.takes(victim_choice.after(state, found.units), request, found.gpus)
    assert fit.misfit(victim_choice.after(state, found.units), request) is None
    for victim in found.units:
        rest = [other for other in found.units if other is not victim]
        assert not victim_choice.fits_after(state, request, rest), victim.uids


# --- a waiting gang on random clusters ------------------------------------------------------

GANG_PODS = st.lists(
    st.tuples(
        st.integers(0, 2),  # node
        st.integers(0, 3),  # GPU (taken modulo the node's GPUs)
        st.sampled_from([1000, 1000, 600, 500, 300]),  # share (1000: a whole GPU)
        st.integers(0, 4),  # priority
        st.integers(0, 3),  # running gang (0: none)
    ),
    min_size=4,
    max_size=24,
)


@settings(max_examples=300, deadline=None)
@given(
    pods=GANG_PODS,
    sizes=st.lists(st.integers(2, 4), min_size=3, max_size=3),
    size=st.integers(2, 4),
    wants=st.sampled_from([(1000, 1), (1000, 2), (700, 1), (400, 1)]),
    priority=st.integers(1, 5),
)
def test_after_any_gang_eviction_all_members_fit_and_no_victim_is_beyond_need(
    pods: list[tuple[int, int, int, int, int]],
    sizes: list[int],
    size: int,
    wants: tuple[int, int],
    priority: int,
) -> None:
    """Random clusters of shares, whole GPUs and running gangs spanning nodes: a plan
    evicts only units below the gang's priority (what the caller offers), every member
    fits once they are gone (the ledger itself accepts the members' grants), and each
    victim unit is needed (without it some member has no room)."""
    book = ledger(*(node(f"n{i}", size) for i, size in enumerate(sizes)))
    by_gang: dict[int, list[tuple[Grant, int]]] = {}
    loose: list[Unit] = []
    for i, (at, gpu, milli, pod_priority, in_gang) in enumerate(pods):
        grant = Grant(f"p{i:02}", f"n{at}", (gpu % sizes[at],), milli, 0, 100, 100)
        try:
            book.reserve(grant)
        except LedgerError:
            continue  # the GPU is full: this pod was never placed
        if in_gang:
            by_gang.setdefault(in_gang, []).append((grant, pod_priority))
        else:
            loose.append(Unit((grant.pod_uid,), (grant,), (pod_priority,)))
    running = [
        Unit(
            tuple(g.pod_uid for g, _ in group),
            tuple(g for g, _ in group),
            tuple(p for _, p in group),
        )
        for group in by_gang.values()
    ]
    # the caller's choice: pods of lower priority only, a running gang whole or not at all
    units = [u for u in (*loose, *running) if max(u.priorities) < priority]
    milli, count = wants
    request = (
        share(milli, cpu=100, ram=100)
        if milli < 1000
        else GpuRequest(milli=1000, count=count, cpu_milli=100, host_memory_mib=100)
    )
    gang = [gangs.Member(f"m{i}", request) for i in range(size)]
    policy = policies.make("best-fit")
    found = victim_choice.for_gang(book, policy, gang, units)
    if found is None:
        return
    offered = {id(u) for u in units}
    assert all(id(victim) in offered for victim in found.units)
    assert all(max(victim.priorities) < priority for victim in found.units)
    # every member fits once the victims are gone: the ledger takes their grants
    gone = set(found.uids)
    scratch = Ledger(book.inventory)
    scratch.restore(grant for grant in book if grant.pod_uid not in gone)
    for member in gang:
        scratch.reserve(choosing.grant_for(member.uid, found.choices[member.uid], request))
    # no victim beyond need: without any one of them, some member has no room on the
    # plan's nodes, or the gang's own plan falls short
    where = {uid: choice.node for uid, choice in found.choices.items()}
    for victim in found.units:
        rest = [other for other in found.units if other is not victim]
        if victim_choice.place(book, gang, where, rest) is None:
            continue
        others = {uid for unit in rest for uid in unit.uids}
        without = Ledger(book.inventory)
        without.restore(grant for grant in book if grant.pod_uid not in others)
        assert isinstance(gangs.plan(without, policy, gang), gangs.Shortfall), victim.uids


def test_a_gang_evicts_only_for_a_plan_it_will_start_with() -> None:
    """n0 (8 GPUs) holds pods on GPUs 2, 3 and 7, n1 (4 GPUs) is idle; the gang wants
    4 × 2 whole GPUs and 1 × 3. Evicting the pods on GPUs 2 and 3 leaves exactly 11 free,
    and a first fit per node packs the gang, but the gang's own greedy plan (how the
    controller starts it) fits only 4 of 5: such victims would be evicted for nothing."""
    book = ledger(node("n0", 8), node("n1", 4))
    units = []
    for uid, gpu in (("p1", 3), ("p4", 7), ("p5", 2)):
        grant = Grant(uid, "n0", (gpu,), 1000, 0, 100, 100)
        book.reserve(grant)
        units.append(Unit((uid,), (grant,), (0,)))
    members = [gangs.Member(f"m{i}", whole(2)) for i in range(4)]
    members.append(gangs.Member("m4", whole(3)))
    policy = policies.make("best-fit")
    found = victim_choice.for_gang(book, policy, members, units)
    assert found is not None
    gone = set(found.uids)
    scratch = Ledger(book.inventory)
    scratch.restore(grant for grant in book if grant.pod_uid not in gone)
    started = gangs.plan(scratch, policy, members)
    assert not isinstance(started, gangs.Shortfall), (found.uids, started)
    assert dict(found.choices) == dict(started.choices)


@settings(max_examples=200, deadline=None)
@given(
    pods=st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, 7), st.sampled_from([1, 1, 2])),
        min_size=1,
        max_size=8,
    ),
    pairs=st.integers(2, 4),
    sizes=st.tuples(st.integers(4, 8), st.integers(2, 8)),
)
def test_after_any_mixed_gang_eviction_the_gangs_own_plan_succeeds(
    pods: list[tuple[int, int, int]], pairs: int, sizes: tuple[int, int]
) -> None:
    """Whole-GPU pods on two nodes and a gang of `pairs` × 2 GPUs + 1 × 3 GPUs: whenever
    `for_gang` answers, `gangs.plan` (what the controller starts the gang with) places
    every member on the ledger without the victims, as the answer's choices say."""
    book = ledger(*(node(f"n{i}", size) for i, size in enumerate(sizes)))
    units = []
    for i, (at, gpu, count) in enumerate(pods):
        first = gpu % max(sizes[at] - count + 1, 1)
        grant = Grant(
            f"p{i}", f"n{at}", tuple(range(first, first + count)), 1000 * count, 0, 100, 100
        )
        try:
            book.reserve(grant)
        except LedgerError:
            continue
        units.append(Unit((grant.pod_uid,), (grant,), (0,)))
    members = [gangs.Member(f"m{i}", whole(2)) for i in range(pairs)]
    members.append(gangs.Member("mx", whole(3)))
    policy = policies.make("best-fit")
    found = victim_choice.for_gang(book, policy, members, units)
    if found is None:
        return
    gone = set(found.uids)
    scratch = Ledger(book.inventory)
    scratch.restore(grant for grant in book if grant.pod_uid not in gone)
    started = gangs.plan(scratch, policy, members)
    assert not isinstance(started, gangs.Shortfall), (found.uids, started.reason)
    assert dict(found.choices) == dict(started.choices)
