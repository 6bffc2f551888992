"""The load-aware tie-break (`gpuplace.placement.load_ties`): measured load orders only what
the policy scores equal, between nodes and between GPU sets of a node; it never changes
which (node, GPU set) answers fit, and old loads change nothing."""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.placement import choosing, fit, load_ties, policies
from gpuplace.placement.fragmentation import Workload
from gpuplace.placement.ledger import Conflict, Ledger, LedgerError
from gpuplace.placement.requests import GpuRequest, Topology

from .clusters import ledger, node, share, whole


def _view(utilization: dict[str, dict[int, float]], at: float = 0.0) -> load_ties.Loads:
    return load_ties.Loads.measured(utilization, at)


def _first_in_line(policy: choosing.Policy, names: list[str]) -> str:
    return min(names, key=lambda name: policy.place(name) or 0.0)


def test_levels_are_whole_percent_and_unmeasured_gpus_count_at_the_mean() -> None:
    view = _view({"a": {0: 0.204, 1: 0.8, 2: float("nan")}, "b": {0: 1.7, 1: -0.2}})
    assert view.levels == {"a": {0: 20, 1: 80}, "b": {0: 100, 1: 0}}
    assert view.floors == {"a": 20, "b": 0}
    assert view.neutral == 50
    assert view.level("a", 2) == 50 and view.level("c", 0) == 50
    assert view.of("a", (0, 1)) == 100 and view.of("c", (0, 1, 2)) == 150


def test_loads_are_fresh_only_within_their_max_age() -> None:
    view = _view({"a": {0: 0.5}}, at=100.0)
    assert view.fresh(100.0, 30.0) and view.fresh(130.0, 30.0)
    assert not view.fresh(130.5, 30.0)
    assert not view.fresh(99.0, 30.0)  # from the future: a clock that went back


def test_of_two_equal_nodes_the_less_loaded_wins_against_the_line() -> None:
    book = ledger(node("n1", 2), node("n2", 2))
    policy = policies.make("best-fit")
    chooser = choosing.Chooser(book, policy, ties=True)
    request = share(500, 1024)
    first = _first_in_line(policy, ["n1", "n2"])
    other = "n2" if first == "n1" else "n1"
    rng = random.Random(0)
    assert chooser.choose(request, rng).node == first  # type: ignore[union-attr]

    busy = _view({first: {0: 0.9, 1: 0.9}, other: {0: 0.1, 1: 0.1}})
    assert load_ties.choose(chooser, request, rng, busy).node == other  # type: ignore[union-attr]
    found = [chooser.outcome(name, request) for name in ("n1", "n2")]
    chosen = [item if isinstance(item, choosing.Choice) else None for item in found]
    scores = dict(zip(("n1", "n2"), choosing.ranked_found(chosen), strict=True))
    assert scores[first] == 10 and scores[other] < 10
    broken = load_ties.tie_broken(chosen, busy, book.state, policy.place)
    scores = dict(zip(("n1", "n2"), choosing.ranked_found(broken), strict=True))
    assert scores == {other: 10, first: 0}

    # Equal loads: the line decides again, as without loads.
    even = _view({first: {0: 0.3}, other: {0: 0.3}})
    assert load_ties.choose(chooser, request, rng, even).node == first  # type: ignore[union-attr]


def test_within_a_node_the_least_loaded_interchangeable_gpu_is_taken() -> None:
    book = ledger(node("n", 4))
    policy = policies.make("default", workload=Workload.from_requests([share(500)]))
    chooser = choosing.Chooser(book, policy, ties=True)
    request = share(500, 1024)
    choice = chooser.outcome("n", request)
    assert isinstance(choice, choosing.Choice) and choice.gpus == (0,)
    state = book.state("n")
    assert state is not None
    view = _view({"n": {0: 0.8, 1: 0.5, 2: 0.2, 3: 0.9}})
    assert load_ties.pick(state, choice, view).gpus == (2,)
    assert load_ties.pick(state, choice, None) is choice
    assert load_ties.pick(state, choice, _view({"n": {0: 0.5, 1: 0.5}})).gpus == (0,)


def test_a_gpu_that_differs_is_never_swapped_in() -> None:
    """GPU 1 holds a share already: not interchangeable with the empty ones, however idle."""
    book = ledger(node("n", 3))
    book.reserve(choosing.grant_for("p", choosing.Choice("n", (1,), 0.0), share(250)))
    policy = policies.make("best-fit")
    chooser = choosing.Chooser(book, policy, ties=True)
    request = whole(1)
    choice = chooser.outcome("n", request)
    assert isinstance(choice, choosing.Choice) and choice.gpus == (0,)
    state = book.state("n")
    assert state is not None
    view = _view({"n": {0: 0.9, 1: 0.0, 2: 0.4}})
    assert load_ties.pick(state, choice, view).gpus == (2,)


def test_a_better_score_is_never_given_up_for_a_lower_load() -> None:
    """best-fit scores the node with a half-used GPU higher: however busy it is, it wins."""
    book = ledger(node("used", 1), node("empty", 1))
    book.reserve(choosing.grant_for("p", choosing.Choice("used", (0,), 0.0), share(500)))
    policy = policies.make("best-fit")
    chooser = choosing.Chooser(book, policy, ties=True)
    request = share(500)
    view = _view({"used": {0: 1.0}, "empty": {0: 0.0}})
    assert load_ties.choose(chooser, request, random.Random(0), view).node == "used"  # type: ignore[union-attr]
    found = [chooser.outcome(name, request) for name in ("used", "empty")]
    chosen = [item if isinstance(item, choosing.Choice) else None for item in found]
    assert load_ties.tie_broken(chosen, view, book.state, policy.place) == chosen
    assert choosing.ranked_found(chosen)[0] == 10


def test_without_a_line_every_least_loaded_node_gets_ten() -> None:
    """random has no line: its exact ties are kube-scheduler's to draw, and stay so
    among the nodes of the lowest load."""
    book = ledger(node("a", 1), node("b", 1), node("c", 1))
    policy = policies.make("random", rng=random.Random(0))
    chooser = choosing.Chooser(book, policy, ties=True)
    request = share(500)
    chosen = [chooser.evaluate(request, ["a", "b", "c"]).choices.get(name) for name in "abc"]
    assert choosing.ranked_found(chosen) == [10, 10, 10]
    view = _view({"a": {0: 0.2}, "b": {0: 0.2}, "c": {0: 0.9}})
    broken = load_ties.tie_broken(chosen, view, book.state, policy.place)
    assert choosing.ranked_found(broken) == [10, 10, 0]
    drawn = {
        load_ties.choose(chooser, request, random.Random(seed), view).node  # type: ignore[union-attr]
        for seed in range(20)
    }
    assert drawn == {"a", "b"}


def test_many_alike_nodes_the_least_loaded_wins_wherever_it_stands() -> None:
    """The bound (set size × lightest GPU) orders the look; a node whose lightest GPU is
    idle but not interchangeable with the set still loses to a truly idle one."""
    names = [f"n{i:02d}" for i in range(30)]
    book = ledger(*(node(name, 2) for name in names))
    book.reserve(choosing.grant_for("p", choosing.Choice("n00", (1,), 0.0), share(500)))
    policy = policies.make("first-fit")
    chooser = choosing.Chooser(book, policy, ties=True)
    request = whole(1)
    utilization = {name: {0: 0.5, 1: 0.5} for name in names}
    utilization["n00"] = {0: 0.6, 1: 0.0}  # GPU 1 idle, but holds a share: not a candidate
    utilization["n17"] = {0: 0.1, 1: 0.3}
    view = _view(utilization)
    chosen: list[choosing.Choice | None] = [
        chooser.evaluate(request, names).choices.get(name) for name in names
    ]
    broken = load_ties.tie_broken(chosen, view, book.state, policy.place)
    scores = choosing.ranked_found(broken)
    assert [names[at] for at, score in enumerate(scores) if score == 10] == ["n17"]
    winner = broken[names.index("n17")]
    assert winner is not None and winner.gpus == (0,)
    picked = load_ties.choose(chooser, request, random.Random(0), view)
    assert picked is not None and (picked.node, picked.gpus) == ("n17", (0,))


# --- properties -------------------------------------------------------------------------

NAMES = ("a", "b", "c", "d")
gpu_counts = st.one_of(
    st.integers(1, 4).map(lambda count: [count] * len(NAMES)),  # alike nodes: many ties
    st.lists(st.integers(1, 4), min_size=len(NAMES), max_size=len(NAMES)),
)
requests = st.one_of(
    st.builds(
        lambda milli, memory, cpu: GpuRequest(milli, memory, count=1, cpu_milli=cpu),
        st.sampled_from([250, 500, 1000]),
        st.sampled_from([0, 4096, 8192]),
        st.sampled_from([0, 1000]),
    ),
    st.builds(lambda memory: GpuRequest(0, memory, count=1), st.sampled_from([4096, 8192])),
    st.builds(
        GpuRequest,
        milli=st.just(1000),
        count=st.integers(2, 3),
        topology=st.sampled_from([Topology.ANY, Topology.PREFERRED, Topology.REQUIRED]),
    ),
)
utilizations = st.dictionaries(
    st.sampled_from(NAMES),
    st.dictionaries(
        st.integers(0, 3), st.floats(0.0, 1.0) | st.just(float("nan")), min_size=1, max_size=4
    ),
    min_size=1,
)


def _build(counts: list[int], linked: bool) -> Ledger:
    nodes = []
    for name, count in zip(NAMES, counts, strict=True):
        domains = tuple(i // 2 for i in range(count)) if linked else None
        nodes.append(node(name, count, memory=16_384, nvlink=domains))
    return ledger(*nodes)


def _fill(book: Ledger, grants: list[tuple[GpuRequest, int]]) -> None:
    chooser = choosing.Chooser(book, policies.make("first-fit"))
    rng = random.Random(1)
    for uid, (request, skip) in enumerate(grants):
        names = list(NAMES[skip % len(NAMES) :])
        choice = chooser.choose(request, rng, names)
        if choice is not None:
            with contextlib.suppress(Conflict):
                book.reserve(choosing.grant_for(f"g{uid}", choice, request))


def _fits(book: Ledger, choice: choosing.Choice, request: GpuRequest) -> bool:
    """Whether the ledger of grants takes `choice` for `request` (and gives it back)."""
    try:
        book.reserve(choosing.grant_for("probe", choice, request))
    except LedgerError:
        return False
    book.release("probe")
    return True


@settings(max_examples=150, deadline=None)
@given(
    st.tuples(gpu_counts, st.booleans()),
    st.lists(st.tuples(requests, st.integers(0, 3)), max_size=5),
    requests,
    utilizations,
    st.sampled_from(["default", "fgd", "best-fit", "first-fit"]),
)
def test_loads_only_reorder_equal_scores_and_never_change_what_fits(
    shape: tuple[list[int], bool],
    grants: list[tuple[GpuRequest, int]],
    request: GpuRequest,
    utilization: dict[str, dict[int, float]],
    policy_name: str,
) -> None:
    book = _build(*shape)
    _fill(book, grants)
    workload = Workload.from_requests([g[0] for g in grants] or [request])
    policy = policies.make(policy_name, workload=workload)
    plain = choosing.Chooser(book, policy)
    chooser = choosing.Chooser(book, policy, ties=True)
    view = _view(utilization)

    # Feasibility: the same nodes fit, for the same reasons, with the same choice.
    evaluation = chooser.evaluate(request, list(NAMES))
    without = plain.evaluate(request, list(NAMES))
    assert evaluation.choices == without.choices
    assert evaluation.misfits == without.misfits

    chosen: list[choosing.Choice | None] = [evaluation.choices.get(name) for name in NAMES]
    for choice in filter(None, chosen):
        state = book.state(choice.node)
        assert state is not None
        picked = load_ties.pick(state, choice, view)
        # Same node, same score; GPUs the policy scores and prefers exactly as its own,
        # which the ledger of grants takes (no over-commit) and which fit now offers.
        assert (picked.node, picked.score) == (choice.node, choice.score)
        assert len(set(picked.gpus)) == len(choice.gpus)
        assert choosing.scored(policy, state, request, picked.gpus) == choice.policy_score
        assert policy.prefer(state, request, picked.gpus) == policy.prefer(
            state, request, choice.gpus
        )
        assert _fits(book, picked, request)
        assert view.of(choice.node, picked.gpus) <= view.of(choice.node, choice.gpus)
        assert fit.misfit(state, request) is None

    # Between nodes: an unequal policy score keeps its order; the best stays the best.
    broken = load_ties.tie_broken(chosen, view, book.state, policy.place)
    assert [c is None for c in broken] == [c is None for c in chosen]
    pairs = [(a, b) for a in range(len(NAMES)) for b in range(len(NAMES))]
    for a, b in pairs:
        left, right = chosen[a], chosen[b]
        if left is None or right is None or left.policy_score <= right.policy_score:
            continue
        assert broken[a].score > broken[b].score  # type: ignore[union-attr]
    before = choosing.ranked_found(chosen)
    after = choosing.ranked_found(broken)
    for a, b in pairs:
        left, right = chosen[a], chosen[b]
        if left is not None and right is not None and left.policy_score > right.policy_score:
            assert after[a] >= after[b] and before[a] >= before[b]
    if any(chosen):
        top = max(c.policy_score for c in chosen if c is not None)
        winners = [at for at, score in enumerate(after) if score == choosing.MAX_EXTENDER_SCORE]
        tied = [at for at, c in enumerate(chosen) if c is not None and c.policy_score == top]
        assert winners and set(winners) <= set(tied)
        loads_of = {}
        for at in tied:
            state, candidate = book.state(NAMES[at]), chosen[at]
            assert state is not None and candidate is not None
            loads_of[at] = view.of(NAMES[at], load_ties.pick(state, candidate, view).gpus)
        assert all(loads_of[at] == min(loads_of.values()) for at in winners)

        picked_node = load_ties.choose(chooser, request, random.Random(0), view)
        assert picked_node is not None
        assert picked_node.policy_score == top
        assert view.of(picked_node.node, picked_node.gpus) == min(loads_of.values())
        assert _fits(book, picked_node, request)
    else:
        assert load_ties.choose(chooser, request, random.Random(0), view) is None

    # Without loads (or with old ones, which the caller then leaves out): today's answers.
    assert load_ties.tie_broken(chosen, None, book.state, policy.place) == chosen
    rng_a, rng_b = random.Random(3), random.Random(3)
    assert load_ties.choose(chooser, request, rng_a, None) == plain.choose(request, rng_b)


@pytest.mark.parametrize("policy_name", ["default", "fgd", "best-fit", "first-fit"])
def test_measuring_no_gpu_of_the_tied_nodes_leaves_the_policys_order(policy_name: str) -> None:
    """Loads that say nothing about the candidates (only another node measured) leave every
    node at the neutral level: the policy's own best still wins, with its own GPUs."""
    book = ledger(node("a", 4), node("b", 4), node("c", 2))
    workload = Workload.from_requests([share(500)])
    policy = policies.make(policy_name, workload=workload)
    chooser = choosing.Chooser(book, policy, ties=True)
    request = share(500, 1024)
    view = _view({"elsewhere": {0: 0.7}})
    rng = random.Random(5)
    plain = choosing.Chooser(book, policy).choose(request, random.Random(5))
    assert load_ties.choose(chooser, request, rng, view) == plain
