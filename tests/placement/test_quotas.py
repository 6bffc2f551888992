"""Quota accounting in GPU units: what a grant counts, the nominal, borrowing and lending
rules of a cohort, the weighted share; and, as properties, that admitting only what
`Accounts.check` allows never takes a queue past its limits nor a cohort past its pool."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuplace.placement.inventory import Gpu, Inventory
from gpuplace.placement.ledger import Grant
from gpuplace.placement.queueing import quotas
from gpuplace.placement.queueing.quotas import (
    ANY_MODEL,
    GPU_COMPUTE,
    GPU_MEMORY,
    GPUS,
    Accounts,
    Quota,
)

from .clusters import node, share, whole

ANY = (GPUS, ANY_MODEL)


def queue(
    name: str,
    nominal: int,
    *,
    cohort: str = "c",
    borrowing: int | None = None,
    lending: int | None = None,
    weight: float = 1.0,
) -> quotas.QueueSpec:
    return quotas.QueueSpec(
        name, {ANY: Quota(nominal, borrowing, lending)}, cohort=cohort, weight=weight
    )


# --- what a grant counts ---------------------------------------------------------------


def test_a_whole_gpu_counts_one_gpu_its_compute_and_all_its_memory() -> None:
    gpu = Gpu(0, "A100", 81_920)
    assert quotas.held(gpu, 1000, 0) == (1000, 1000, 81_920)


def test_a_share_counts_the_larger_of_its_compute_and_memory_fractions() -> None:
    gpu = Gpu(0, "A100", 81_920)
    assert quotas.held(gpu, 500, 10_240) == (500, 500, 10_240)
    assert quotas.held(gpu, 100, 40_960) == (500, 100, 40_960)


def test_a_memory_only_share_counts_its_memory_against_gpus_and_no_compute() -> None:
    gpu = Gpu(0, "A100", 81_920)
    assert quotas.held(gpu, 0, 20_480) == (250, 0, 20_480)


def test_usage_sums_per_model_and_skips_gpus_that_are_gone() -> None:
    inventory = Inventory(
        [node("a", 2, model="A100", memory=40_960), node("h", 1, model="H100", memory=81_920)]
    )
    grants = [
        Grant("p1", "a", (0, 1), 1000, 0),
        Grant("p2", "h", (0,), 250, 8_192),
        Grant("p3", "gone", (0,), 1000, 0),
        Grant("p4", "h", (3,), 1000, 0),
    ]
    assert quotas.usage(grants, Inventory(inventory)) == {
        "A100": (2000, 2000, 81_920),
        "H100": (250, 250, 8_192),
    }


def test_estimate_is_an_upper_bound_on_the_largest_gpu_of_the_model() -> None:
    assert quotas.estimate([whole(2), share(300, 4_096)], "A100", 40_960) == (
        2300,
        2300,
        2 * 40_960 + 4_096,
    )


# --- the rules -------------------------------------------------------------------------


def test_without_a_cohort_a_queue_stops_at_its_nominal() -> None:
    accounts = Accounts([queue("a", 2000, cohort="")])
    assert accounts.check("a", {ANY: 2000}) is None
    accounts.charge("a", {ANY: 1500})
    verdict = accounts.check("a", {ANY: 1000})
    assert verdict is not None and verdict.refusal is quotas.Refusal.QUOTA
    assert "1.5 of 2 used, needs 1 more" in verdict.message


def test_limits_without_a_cohort_are_refused() -> None:
    with pytest.raises(ValueError, match="need a cohort"):
        queue("a", 1000, cohort="", borrowing=1000)


def test_a_queue_borrows_what_its_cohort_lends_up_to_its_borrowing_limit() -> None:
    accounts = Accounts([queue("a", 2000, borrowing=1000), queue("b", 4000)])
    assert accounts.check("a", {ANY: 3000}) is None
    verdict = accounts.check("a", {ANY: 3001})
    assert verdict is not None and verdict.refusal is quotas.Refusal.QUOTA
    assert "borrowing limit" in verdict.message
    accounts.charge("a", {ANY: 3000})
    assert accounts.borrowing("a") == {ANY: 1000}
    assert accounts.lent("b") == {ANY: 1000}
    assert accounts.share("a") == pytest.approx(1000 / 6000)


def test_the_cohort_runs_dry_when_its_lendable_quota_is_used() -> None:
    accounts = Accounts([queue("a", 2000), queue("b", 2000)])
    accounts.charge("a", {ANY: 3000})
    accounts.charge("b", {ANY: 1000})
    verdict = accounts.check("b", {ANY: 500})
    assert verdict is not None and verdict.refusal is quotas.Refusal.COHORT
    assert accounts.within_nominal("b", {ANY: 500})  # what reclaim may preempt for


def test_a_lending_limit_keeps_the_rest_of_the_nominal_for_the_queue() -> None:
    accounts = Accounts([queue("a", 4000, lending=1000), queue("b", 0)])
    # b may borrow only the 1 GPU a lends, however idle a is
    assert accounts.check("b", {ANY: 1000}) is None
    verdict = accounts.check("b", {ANY: 1001})
    assert verdict is not None and verdict.refusal is quotas.Refusal.COHORT
    accounts.charge("b", {ANY: 1000})
    # a still has its kept 3 GPUs, and the fourth only once b gives it back
    assert accounts.check("a", {ANY: 3000}) is None
    assert accounts.check("a", {ANY: 3001}) is not None


def test_a_queue_covers_only_the_models_it_names_and_leaves_unnamed_resources_open() -> None:
    h100 = quotas.QueueSpec("h", {(GPUS, "H100"): Quota(1000)})
    accounts = Accounts([h100])
    use = accounts.use_of("h", {"H100": (1000, 1000, 81_920)})
    assert use == {(GPUS, "H100"): 1000}  # memory and compute: not limited here
    refused = accounts.use_of("h", {"A100": (1000, 1000, 40_960)})
    assert isinstance(refused, quotas.Verdict) and "model A100" in refused.message
    assert accounts.use_of("h", {"A100": (1000, 1000, 40_960)}, strict=False) == {}


def test_a_model_line_takes_its_model_and_the_star_line_the_others() -> None:
    spec = quotas.QueueSpec(
        "q",
        {
            (GPUS, ANY_MODEL): Quota(4000),
            (GPUS, "H100"): Quota(1000),
            (GPU_MEMORY, ANY_MODEL): Quota(100_000),
        },
    )
    accounts = Accounts([spec])
    use = accounts.use_of("q", {"H100": (1000, 1000, 81_920), "A100": (2000, 2000, 81_920)})
    assert use == {
        (GPUS, "H100"): 1000,
        (GPUS, ANY_MODEL): 2000,
        (GPU_MEMORY, ANY_MODEL): 163_840,
    }
    assert not isinstance(use, quotas.Verdict)
    verdict = accounts.check("q", use)
    assert verdict is not None and "gpu-memory" in verdict.message
    assert GPU_COMPUTE not in {resource for resource, _ in use}


def test_the_queue_below_its_share_goes_first_weights_counted() -> None:
    accounts = Accounts([queue("a", 1000, weight=2), queue("b", 1000), queue("c", 2000)])
    accounts.charge("a", {ANY: 2000})  # borrows 1 of 4 lendable, weight 2: 0.125
    accounts.charge("b", {ANY: 1500})  # borrows 0.5 of 4, weight 1: 0.125
    accounts.charge("c", {ANY: 500})  # inside its nominal: 0
    assert accounts.share("a") == pytest.approx(0.125)
    assert accounts.share("b") == pytest.approx(0.125)
    order = sorted(["a", "b", "c"], key=accounts.order)
    assert order[0] == "c"
    # ties on share go to the queue that fills less of its nominal (a: 2x over 2 = 1.0,
    # b: 1.5)
    assert order == ["c", "a", "b"]


def test_the_past_share_counts_only_while_a_queue_borrows() -> None:
    past = {"a": 0.3, "b": 0.0, "c": 0.5}
    accounts = Accounts([queue("a", 1000), queue("b", 1000), queue("c", 2000)], past)
    accounts.charge("a", {ANY: 2000})  # borrows 1 of 4: 0.25, 0.55 with its past
    accounts.charge("b", {ANY: 2500})  # borrows 1.5 of 4: 0.375, no past
    accounts.charge("c", {ANY: 500})  # inside its nominal: its past does not weigh
    assert accounts.fair_share("a") == pytest.approx(0.55)
    assert accounts.fair_share("b") == pytest.approx(0.375)
    assert accounts.fair_share("c") == 0.0
    assert sorted(["a", "b", "c"], key=accounts.order) == ["c", "b", "a"]
    # what-ifs keep the rule: c past its nominal counts its past
    assert accounts.fair_share_with("c", {ANY: 2000}) == pytest.approx(0.125 + 0.5)
    assert accounts.fair_share("c") == 0.0


def test_a_queue_spec_refuses_a_weight_of_zero_and_a_lending_limit_above_nominal() -> None:
    with pytest.raises(ValueError, match="weight"):
        queue("a", 1000, weight=0)
    with pytest.raises(ValueError, match="lending limit"):
        Quota(1000, lending_limit=2000)
    with pytest.raises(ValueError, match="nominal"):
        Quota(-1)


# --- properties ------------------------------------------------------------------------


@st.composite
def cohorts(draw: st.DrawFn) -> list[quotas.QueueSpec]:
    count = draw(st.integers(1, 4))
    specs = []
    for i in range(count):
        nominal = draw(st.integers(0, 8)) * 500
        in_cohort = draw(st.booleans())
        borrowing = (
            draw(st.none() | st.integers(0, 8).map(lambda n: n * 500)) if in_cohort else None
        )
        lending = (
            draw(st.none() | st.integers(0, nominal // 500).map(lambda n: n * 500))
            if in_cohort
            else None
        )
        specs.append(
            queue(
                f"q{i}",
                nominal,
                cohort="c" if in_cohort else "",
                borrowing=borrowing,
                lending=lending,
            )
        )
    return specs


def check_limits(accounts: Accounts) -> None:
    """The quota invariants: no queue past its limits, no cohort past what it lends, and so
    no cohort past the sum of its nominals."""
    pooled: dict[str, int] = {}
    lendable: dict[str, int] = {}
    totals: dict[str, tuple[int, int]] = {}
    for name, spec in accounts.specs.items():
        used = accounts.used[name].get(ANY, 0)
        quota = spec.quotas[ANY]
        if not spec.cohort:
            assert used <= quota.nominal
            continue
        if quota.borrowing_limit is not None:
            assert used <= quota.nominal + quota.borrowing_limit
        pooled[spec.cohort] = pooled.get(spec.cohort, 0) + max(0, used - quota.kept)
        lendable[spec.cohort] = lendable.get(spec.cohort, 0) + quota.lendable
        use, nominal = totals.get(spec.cohort, (0, 0))
        totals[spec.cohort] = (use + used, nominal + quota.nominal)
    for cohort, amount in pooled.items():
        assert amount <= lendable[cohort]  # lending limits respected
        assert totals[cohort][0] <= totals[cohort][1]  # quota never exceeded


@given(
    cohorts(),
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6), st.booleans()), max_size=40),
)
def test_check_allows_exactly_what_keeps_every_queue_and_cohort_within_quota(
    specs: list[quotas.QueueSpec], steps: list[tuple[int, int, bool]]
) -> None:
    accounts = Accounts(specs)
    held: dict[str, list[int]] = {spec.name: [] for spec in specs}
    for index, size, release in steps:
        name = specs[index % len(specs)].name
        if release and held[name]:
            accounts.charge(name, {ANY: held[name].pop()}, -1)
        else:
            amount = size * 250
            if accounts.check(name, {ANY: amount}) is None:
                accounts.charge(name, {ANY: amount})
                held[name].append(amount)
            else:  # and only what would break a limit is refused
                accounts.charge(name, {ANY: amount})
                with pytest.raises(AssertionError):
                    check_limits(accounts)
                accounts.charge(name, {ANY: amount}, -1)
        check_limits(accounts)
        for spec in specs:
            assert accounts.used[spec.name].get(ANY, 0) == sum(held[spec.name])
