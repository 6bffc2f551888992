"""The decayed past share of each queue (`share_history`): the exponential moving
average of a step function, checked against its closed form; splitting a step changes
nothing; a queue no longer borrowing decays toward 0."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuplace.placement.queueing.share_history import ShareHistory

HOUR = 3600.0


def test_a_share_held_for_one_half_life_counts_half() -> None:
    history = ShareHistory(HOUR)
    history.observe(0.0, {"a": 0.4, "b": 0.0})
    assert history.past(0.0) == {"a": 0.0}
    assert history.past(HOUR)["a"] == pytest.approx(0.2)
    assert history.past(2 * HOUR)["a"] == pytest.approx(0.3)
    assert "b" not in history.past(HOUR)  # never borrowed: nothing to remember


def test_a_queue_that_stops_borrowing_is_forgotten_by_halves() -> None:
    history = ShareHistory(HOUR)
    history.observe(0.0, {"a": 1.0})
    history.observe(10 * HOUR, {})
    assert history.past(10 * HOUR)["a"] == pytest.approx(1.0, abs=1e-3)
    assert history.past(11 * HOUR)["a"] == pytest.approx(0.5, abs=1e-3)
    assert history.past(12 * HOUR)["a"] == pytest.approx(0.25, abs=1e-3)


def test_nothing_is_remembered_before_the_first_observation() -> None:
    assert ShareHistory(HOUR).past(5.0) == {}


def test_an_observation_back_in_time_counts_as_the_same_moment() -> None:
    history = ShareHistory(HOUR)
    history.observe(HOUR, {"a": 1.0})
    history.observe(0.0, {"a": 0.0})  # a clock step back: no negative interval
    assert history.past(HOUR)["a"] == pytest.approx(0.0)


@pytest.mark.parametrize("half_life", [0.0, -1.0, float("nan")])
def test_the_half_life_must_be_positive(half_life: float) -> None:
    with pytest.raises(ValueError, match="half-life"):
        ShareHistory(half_life)


steps = st.lists(
    st.tuples(st.floats(0, 5 * HOUR), st.floats(0, 2)),
    min_size=1,
    max_size=12,
)


def closed_form(observed: list[tuple[float, float]], now: float, half_life: float) -> float:
    """∫ share(u) ln2/H 2^(-(now-u)/H) du for the step function `observed` (sorted
    (start, share) pairs, each held until the next start or `now`)."""
    total = 0.0
    for i, (start, share) in enumerate(observed):
        end = observed[i + 1][0] if i + 1 < len(observed) else now
        total += share * (0.5 ** ((now - end) / half_life) - 0.5 ** ((now - start) / half_life))
    return total


@given(steps, st.floats(0, 5 * HOUR))
def test_the_past_share_is_the_decayed_average_of_the_steps(
    drawn: list[tuple[float, float]], after: float
) -> None:
    observed = sorted(drawn)
    history = ShareHistory(HOUR)
    for start, share in observed:
        history.observe(start, {"a": share})
    now = observed[-1][0] + after
    expected = closed_form(observed, now, HOUR)
    assert history.past(now).get("a", 0.0) == pytest.approx(expected, abs=1e-9)
    # never beyond the largest share held: an average
    assert history.past(now).get("a", 0.0) <= max(s for _, s in observed) + 1e-12


@given(steps, st.floats(0, 1))
def test_observing_the_same_share_again_changes_nothing(
    drawn: list[tuple[float, float]], where: float
) -> None:
    observed = sorted(drawn)
    now = observed[-1][0] + HOUR
    once, twice = ShareHistory(HOUR), ShareHistory(HOUR)
    for i, (start, share) in enumerate(observed):
        once.observe(start, {"a": share})
        twice.observe(start, {"a": share})
        end = observed[i + 1][0] if i + 1 < len(observed) else now
        twice.observe(start + (end - start) * where, {"a": share})
    assert twice.past(now).get("a", 0.0) == pytest.approx(once.past(now).get("a", 0.0), abs=1e-9)
