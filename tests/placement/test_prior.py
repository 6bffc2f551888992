"""The typical workload's prior (whole GPUs always count; a request's own shape counts)
and what it is for: identical shares pack on a fresh or quiet cluster (issue 18)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpuplace.placement import choosing, policies
from gpuplace.placement.fragmentation import (
    OWN_SHAPE_BELOW,
    PRIOR,
    WHOLE_TYPE,
    Prior,
    TaskType,
    Workload,
)
from gpuplace.placement.ledger import Ledger

from .clusters import ledger, node, share, whole

HALF = TaskType(1000, 500, 1, frozenset())
QUARTER = TaskType(1000, 250, 1, frozenset())


def popularity(workload: Workload) -> dict[TaskType, float]:
    return {task: round(p, 9) for task, p in workload.types}


def test_the_floor_gives_whole_gpus_their_least_share() -> None:
    floor = Prior(floor=0.25, pods=0)
    halves = Workload.from_requests([share(500)] * 3, prior=floor)
    assert popularity(halves) == {HALF: 0.75, WHOLE_TYPE: 0.25}
    assert halves.observed == ((HALF, 1.0),)
    assert halves.pods == 3
    # whole GPUs already weighing more than the floor: nothing added
    mixed = Workload.from_requests([share(500), whole(1)], prior=floor)
    assert mixed.types == mixed.observed
    # nothing observed: whole GPUs alone
    assert popularity(Workload.from_requests([], prior=PRIOR)) == {WHOLE_TYPE: 1.0}
    # no prior: FGD's own workload, unchanged
    assert popularity(Workload.from_requests([share(500)])) == {HALF: 1.0}


@pytest.mark.parametrize(("seen", "least"), [(1, 8 / 9), (8, 0.5), (24, 0.25), (1000, 0.25)])
def test_few_pods_seen_weigh_less_than_the_prior(seen: int, least: float) -> None:
    assert PRIOR.least(seen) == pytest.approx(least)
    halves = Workload.from_requests([share(500)] * seen, prior=PRIOR)
    assert popularity(halves) == pytest.approx({HALF: 1 - least, WHOLE_TYPE: least})


def test_observing_counts_the_request_as_one_more_pod() -> None:
    floor = Prior(floor=0.25, pods=0)
    halves = Workload.from_requests([share(500)] * 3, prior=floor)
    seen = halves.observing(QUARTER)
    assert seen.pods == 4
    assert popularity(seen) == {HALF: 0.5625, QUARTER: 0.1875, WHOLE_TYPE: 0.25}
    assert halves.observing(HALF) is halves  # a shape it counts already
    cpu_only = TaskType(1000, 0, 0, frozenset())
    assert halves.observing(cpu_only) is halves
    given_mix = Workload([(HALF, 1.0)])
    assert given_mix.observing(QUARTER) is given_mix  # not built from pods
    many = Workload.from_requests([share(500)] * OWN_SHAPE_BELOW, prior=floor)
    assert many.observing(QUARTER) is many  # one more pod would weigh under 1%


def test_default_scores_each_shape_against_the_workload_it_sees() -> None:
    base = Workload.from_requests([share(500)] * 30, prior=PRIOR)
    policy = policies.DefaultPolicy(base)
    assert policy.seen_by(share(500)) is base
    quarter = policy.seen_by(share(250))
    assert popularity(quarter) == popularity(base.observing(QUARTER))
    assert policy.seen_by(share(250, memory=512)) is quarter  # same task type, kept


def _pack(book: Ledger, workload: Workload, milli: int, count: int) -> list[tuple[str, int]]:
    """Place `count` shares of `milli` one at a time as the extender does (the best
    score of `evaluate`, the policy's line included): their (node, GPU)s."""
    chooser = choosing.Chooser(book, policies.make("default", workload=workload))
    request = share(milli)
    placed: list[tuple[str, int]] = []
    for index in range(count):
        evaluation = chooser.evaluate(request)
        if not evaluation.choices:
            break
        best = max(evaluation.choices.values(), key=lambda choice: choice.score)
        assert book.reserve(choosing.grant_for(f"p{index}", best, request))
        placed.append((best.node, best.gpus[0]))
    return placed


def test_sixteen_quarter_shares_fill_four_gpus_when_the_workload_is_one_half_share() -> None:
    """The issue's case in the engine: the typical workload is the first pod's (50%)."""
    book = ledger(*(node(f"a100-{i}", 8) for i in range(3)))
    workload = Workload.from_requests([share(500)], prior=PRIOR)
    assert len(set(_pack(book, workload, 250, 16))) == 4
    without_prior = Workload.from_requests([share(500)])
    spread = ledger(*(node(f"a100-{i}", 8) for i in range(3)))
    assert len(set(_pack(spread, without_prior, 250, 16))) == 8  # what the issue saw


@settings(max_examples=300, deadline=None)
@example(milli=50, first=[710], count=6, nodes=1, gpus=2, refresh=False)
# found by hypothesis with 4 pseudo-pods: whole GPUs weighed 4/10 against five 81% pods
# and the 5% shares' own shape, so packing a fourth share onto GPU 0 (leaving 80%, no
# longer room for an 81% pod) scored worse than opening GPU 1
@example(milli=50, first=[810] * 5, count=4, nodes=1, gpus=2, refresh=False)
@example(milli=50, first=[810] * 6, count=4, nodes=1, gpus=2, refresh=True)
@given(
    milli=st.integers(5, 60).map(lambda x: x * 10),
    first=st.lists(st.integers(1, 100).map(lambda x: x * 10), max_size=6),
    count=st.integers(1, 20),
    nodes=st.integers(1, 3),
    gpus=st.sampled_from([1, 2, 4, 8]),
    refresh=st.booleans(),
)
def test_identical_shares_never_open_a_gpu_while_a_used_one_fits_them(
    milli: int, first: list[int], count: int, *, nodes: int, gpus: int, refresh: bool
) -> None:
    """On a quiet cluster (empty nodes alike; the typical workload the shapes of the
    first few GPU pods, which finished, or nothing yet; with `refresh` rebuilt from
    every pod so far before each arrival), each share goes to a GPU already in use
    whenever one has room for it."""
    book = ledger(*(node(f"n{i}", gpus) for i in range(nodes)))
    history = [share(milli) for milli in first]
    chooser_workload = Workload.from_requests(history, prior=PRIOR)
    chooser = choosing.Chooser(book, policies.make("default", workload=chooser_workload))
    request = share(milli)
    for index in range(count):
        if refresh:
            workload = Workload.from_requests(history, prior=PRIOR)
            chooser = choosing.Chooser(book, policies.make("default", workload=workload))
        evaluation = chooser.evaluate(request)
        if not evaluation.choices:
            break
        best = max(evaluation.choices.values(), key=lambda choice: choice.score)
        state = book.state(best.node)
        assert state is not None
        roomy_used = [
            (s.node.name, gpu)
            for s in book.states()
            for gpu, left in enumerate(s.free_milli)
            if milli <= left < 1000
        ]
        if roomy_used:
            assert state.free_milli[best.gpus[0]] < 1000, (best, roomy_used)
        assert book.reserve(choosing.grant_for(f"p{index}", best, request))
        history.append(request)


@pytest.mark.parametrize("milli", [100, 250, 300, 500])
def test_whole_gpus_stay_whole_with_the_prior(milli: int) -> None:
    """After shares, a whole-GPU request still finds a free GPU on each 8-GPU node that
    took shares (the shares packed instead of spreading)."""
    book = ledger(node("a", 8))
    workload = Workload.from_requests([share(milli)], prior=PRIOR)
    placed = _pack(book, workload, milli, 8)
    used = {gpu for _, gpu in placed}
    assert len(used) == -(-8 // (1000 // milli))
