"""Elastic gangs' counts, the generic victim choice (`reclaiming.victims`: order, minimal),
entitlements by water-filling and Jain's index."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuplace.placement import elastic
from gpuplace.placement.queueing import fairness, reclaiming

# --- elastic ---------------------------------------------------------------------------


@given(st.integers(0, 40), st.integers(0, 40), st.integers(0, 40))
def test_largest_finds_the_largest_count_that_fits(limit: int, low: int, span: int) -> None:
    high = low + span
    calls: list[int] = []

    def fits(k: int) -> bool:
        calls.append(k)
        return k <= limit

    found = elastic.largest(fits, low, high)
    assert found == (min(limit, high) if low <= limit else None)
    assert len(calls) <= 2 + math.ceil(math.log2(span + 1))


def test_a_gang_starts_whole_else_with_the_most_that_fit_from_its_minimum() -> None:
    assert elastic.start(lambda k: k <= 8, 2, 8) == 8
    assert elastic.start(lambda k: k <= 5, 2, 8) == 5
    assert elastic.start(lambda k: k <= 1, 2, 8) is None
    assert elastic.start(lambda k: k <= 5, 0, 8) is None  # not elastic: whole or nothing
    with pytest.raises(ValueError):
        elastic.start(lambda k: True, 0, 0)


def test_a_running_gang_grows_by_what_fits_and_gives_back_its_latest_extras_first() -> None:
    assert elastic.grow(lambda k: k <= 2, 5) == 2
    assert elastic.grow(lambda k: False, 5) == 0
    assert elastic.extras(["m0", "m1", "m2", "m3"], 2) == ["m3", "m2"]
    assert elastic.extras(["m0", "m1"], 2) == []
    assert elastic.extras(["m0", "m1"], 0) == []


# --- the victim choice -----------------------------------------------------------------


def candidate(
    key: str, priority: int, admitted: float, *, shrink: bool = False
) -> reclaiming.Candidate:
    return reclaiming.Candidate(key, "b", (key,), priority, admitted, shrink)


def test_candidates_go_extras_first_then_lowest_priority_then_most_recent() -> None:
    found = reclaiming.ordered(
        [
            candidate("old-low", 0, 1),
            candidate("new-low", 0, 5),
            candidate("high", 9, 9),
            candidate("extra", 9, 0, shrink=True),
        ]
    )
    assert [c.key for c in found] == ["extra", "new-low", "old-low", "high"]


@given(
    st.lists(st.tuples(st.integers(1, 5), st.integers(0, 3), st.booleans()), max_size=8),
    st.integers(0, 20),
)
def test_victims_admit_the_workload_and_each_one_is_needed(
    sizes: list[tuple[int, int, bool]], need: int
) -> None:
    candidates = [
        reclaiming.Candidate(f"w{i}", "b", (f"w{i}",), priority, float(i), allowed)
        for i, (_, priority, allowed) in enumerate(sizes)
    ]
    size = {f"w{i}": s for i, (s, _, _) in enumerate(sizes)}
    allowed = {f"w{i}" for i, (_, _, ok) in enumerate(sizes) if ok}

    def admits(chosen: Sequence[reclaiming.Candidate]) -> bool:
        return sum(size[c.key] for c in chosen) >= need

    found = reclaiming.victims(candidates, admits, lambda c, chosen: c.key in allowed)
    if found is None:
        assert sum(size[key] for key in allowed) < need
        return
    assert admits(found) and {c.key for c in found} <= allowed
    for spared in found:
        assert not admits([c for c in found if c is not spared])


@given(
    st.lists(
        st.tuples(st.integers(1, 5), st.integers(0, 3), st.booleans(), st.booleans()),
        max_size=8,
    ),
    st.integers(0, 20),
)
def test_never_several_victims_where_one_alone_would_do(
    sizes: list[tuple[int, int, bool, bool]], need: int
) -> None:
    """Issue 41: whatever the order's own pick, a set of two victims or more never stands
    where one allowed candidate alone admits the workload and is no worse a victim on
    any count (`reclaiming.dominates`: stops no workload where the set stops none, frees
    no more GPU, loses no more GPU time, outranks none of them); and it disrupts no more
    than any such one."""
    candidates = [
        reclaiming.Candidate(
            f"w{i}",
            "b",
            (f"w{i}",),
            priority,
            float(i),
            shrink,
            gpu_time=float(size * i),
            milli=1000 * size,
        )
        for i, (size, priority, shrink, _) in enumerate(sizes)
    ]
    size = {f"w{i}": s for i, (s, _, _, _) in enumerate(sizes)}
    allowed = {f"w{i}" for i, (_, _, _, ok) in enumerate(sizes) if ok}

    def admits(chosen: Sequence[reclaiming.Candidate]) -> bool:
        return sum(size[c.key] for c in chosen) >= need

    found = reclaiming.victims(candidates, admits, lambda c, chosen: c.key in allowed)
    if found is None or len(found) < 2:
        return
    for alone in candidates:
        if alone.key in allowed and reclaiming.dominates(alone, found) and admits([alone]):
            assert alone in found or reclaiming.disruption(found) <= reclaiming.disruption([alone])


def test_among_single_victims_the_lower_priority_then_the_least_gpu_time_goes() -> None:
    """Two shares are the order's pick; three whole workloads each alone would admit the
    workload and are no worse victims than the two: of them the lower priority goes,
    then, at equal priority, the one whose loss throws away less GPU time."""
    shares = [
        reclaiming.Candidate(f"s{i}", "b", (f"s{i}",), 0, 90.0, gpu_time=50.0, milli=500)
        for i in range(2)
    ]

    def whole(key: str, priority: int, gpu_time: float) -> reclaiming.Candidate:
        return reclaiming.Candidate(key, "b", (key,), priority, 90.0, gpu_time=gpu_time, milli=1000)

    def admits(chosen: Sequence[reclaiming.Candidate]) -> bool:
        keys = {c.key for c in chosen}
        return {"s0", "s1"} <= keys or any(key.startswith("w") for key in keys)

    def everyone(c: reclaiming.Candidate, chosen: Sequence[reclaiming.Candidate]) -> bool:
        return True

    wholes = [whole("w-lost-less", 0, 60.0), whole("w-lost-more", 0, 90.0)]
    found = reclaiming.victims([*shares, *wholes], admits, everyone)
    assert [c.key for c in found or []] == ["w-lost-less"]
    wholes.append(whole("w-low", -1, 95.0))  # ordered before the shares: it goes alone
    found = reclaiming.victims([*shares, *wholes], admits, everyone)
    assert [c.key for c in found or []] == ["w-low"]
    outlasting = [whole("w-lost-most", 0, 101.0)]  # would lose more than the two: no
    found = reclaiming.victims([*shares, *outlasting], admits, everyone)
    assert sorted(c.key for c in found or []) == ["s0", "s1"]


def test_step_five_skips_what_could_not_and_tests_a_bounded_number_alone() -> None:
    """Two shares, the most recently admitted, are the order's pick; of 100 older whole
    workloads only w-99 alone admits the workload. It is tried first (the most recent of
    them) when `could` lets it; when `could` rules it out it reaches no admission test,
    and of the others, which do not admit, at most `ALONE_TESTS` are tested."""
    shares = [candidate(f"s{i}", 0, float(200 + i)) for i in range(2)]
    wholes = [candidate(f"w-{i:02d}", 0, float(i)) for i in range(100)]
    tested: list[str] = []

    def admits(chosen: Sequence[reclaiming.Candidate]) -> bool:
        keys = {c.key for c in chosen}
        if len(chosen) == 1 and chosen[0].key.startswith("w"):
            tested.append(chosen[0].key)
        return {"s0", "s1"} <= keys or "w-99" in keys

    def everyone(c: reclaiming.Candidate, chosen: Sequence[reclaiming.Candidate]) -> bool:
        return True

    found = reclaiming.victims([*shares, *wholes], admits, everyone, lambda c: c.key >= "w-90")
    assert [c.key for c in found or []] == ["w-99"]
    assert tested == ["w-99"]  # the most recently admitted first, and it admits
    tested.clear()
    found = reclaiming.victims([*shares, *wholes], admits, everyone, lambda c: c.key < "w-99")
    assert sorted(c.key for c in found or []) == ["s0", "s1"]  # w-99 could not: never tried
    assert len(tested) == reclaiming.ALONE_TESTS


# --- fairness --------------------------------------------------------------------------


def test_entitlements_give_nominals_first_then_share_the_rest_by_weight() -> None:
    got = fairness.entitlements(
        100, {"a": 100, "b": 100, "c": 5}, {"a": 20, "b": 20, "c": 20}, {"a": 3, "b": 1, "c": 1}
    )
    # c wants 5 (below its nominal); a and b get 20 each, then 55 more shared 3:1
    assert got == pytest.approx({"a": 20 + 41.25, "b": 20 + 13.75, "c": 5})


def test_entitlements_scale_overcommitted_nominals_and_never_exceed_demand() -> None:
    got = fairness.entitlements(10, {"a": 30, "b": 30}, {"a": 10, "b": 10}, {})
    assert got == pytest.approx({"a": 5, "b": 5})
    assert fairness.entitlements(10, {"a": 1}, {"a": 0}, {}) == pytest.approx({"a": 1})


@given(
    st.floats(1, 1000),
    st.dictionaries(
        st.sampled_from("abcd"),
        st.tuples(st.floats(0, 500), st.floats(0, 300), st.floats(0.1, 5)),
        min_size=1,
    ),
)
def test_entitlements_share_out_the_capacity_within_demand(
    capacity: float, teams: dict[str, tuple[float, float, float]]
) -> None:
    demand = {t: d for t, (d, _, _) in teams.items()}
    got = fairness.entitlements(
        capacity,
        demand,
        {t: n for t, (_, n, _) in teams.items()},
        {t: w for t, (_, _, w) in teams.items()},
    )
    assert sum(got.values()) <= capacity * (1 + 1e-9) + 1e-6
    for team, amount in got.items():
        assert -1e-9 <= amount <= demand[team] + 1e-6
    if sum(demand.values()) >= capacity:
        assert sum(got.values()) == pytest.approx(capacity, rel=1e-6)


def test_jain_is_one_for_equal_shares_and_one_over_n_for_one_holder() -> None:
    assert fairness.jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert fairness.jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert fairness.jain([]) == 1.0
