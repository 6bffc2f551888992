"""`Chooser.evaluate` is incremental (per scoring shape, from the ledger's change log,
with a sorted index for host memory, filled ahead by `prepare`); whatever happened
before, its answer equals scoring every named node afresh."""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.placement import choosing, fit, policies
from gpuplace.placement.fragmentation import Workload
from gpuplace.placement.ledger import Conflict, Ledger
from gpuplace.placement.requests import GpuRequest

from .clusters import ledger, node

NAMES = ("a", "b", "c", "d", "gone")


def cluster() -> Ledger:
    return ledger(
        node("a", 4, memory=16_384, cpu=8000, ram=16_384),
        node("b", 2, memory=16_384, cpu=4000, ram=4096),
        node("c", 1, cpu=16_000, ram=8192),
        node("d", 2, model="T4", memory=16_384, cpu=8000, ram=2048),
    )


def afresh(
    book: Ledger, request: GpuRequest, policy: choosing.Policy, names: list[str]
) -> choosing.Evaluation:
    expected = choosing.Evaluation()
    for name in names:
        state = book.state(name)
        if state is None:
            expected.misfits[name] = choosing.UNKNOWN
            continue
        found = choosing.best_on(state, request, policy)
        if isinstance(found, fit.Misfit):
            expected.misfits[name] = found
            continue
        place = policy.place(name)
        if place is not None:
            found = choosing.Choice(found.node, found.gpus, found.score - choosing.TIE * place)
        expected.choices[name] = found
    return expected


shares = st.builds(
    GpuRequest,
    milli=st.sampled_from([100, 250, 500, 810, 1000]),
    memory_mib=st.sampled_from([0, 4096]),
    count=st.just(1),
    models=st.sampled_from([frozenset(), frozenset({"T4"}), frozenset({"A100"})]),
    cpu_milli=st.sampled_from([0, 1000, 3000]),
    host_memory_mib=st.sampled_from([0, 1024, 3000, 6000]),
)
pairs = st.builds(
    GpuRequest,
    milli=st.just(1000),
    count=st.just(2),
    cpu_milli=st.sampled_from([0, 3000]),
    host_memory_mib=st.sampled_from([0, 3000]),
)
requests = st.one_of(shares, pairs)
steps = st.lists(
    st.tuples(
        st.sampled_from(["grant", "release", "evaluate", "prepare"]),
        requests,
        st.lists(st.sampled_from(NAMES), unique=True, min_size=1),
        st.integers(0, 12),
    ),
    max_size=40,
)


def _change(
    book: Ledger,
    chooser: choosing.Chooser,
    rng: random.Random,
    op: tuple[str, GpuRequest, list[str], int],
) -> bool:
    """Apply a grant, release or prepare step; False for any other kind."""
    kind, request, names, uid = op
    if kind == "grant":
        choice = chooser.choose(request, rng)
        if choice is not None:
            with contextlib.suppress(Conflict):
                book.reserve(choosing.grant_for(f"p{uid}", choice, request))
    elif kind == "release":
        book.release(f"p{uid}")
    elif kind == "prepare":
        chooser.prepare(request, names)
    else:
        return False
    return True


@settings(max_examples=120, deadline=None)
@given(steps, st.sampled_from(["default", "fgd", "best-fit", "first-fit"]))
def test_incremental_evaluation_equals_scoring_afresh(
    ops: list[tuple[str, GpuRequest, list[str], int]], policy_name: str
) -> None:
    book = cluster()
    workload = Workload.from_requests([op[1] for op in ops] or [GpuRequest()])
    policy = policies.make(policy_name, workload=workload)
    chooser = choosing.Chooser(book, policy)
    rng = random.Random(0)
    shared: list[tuple[int, list[str], choosing.Evaluation, choosing.Evaluation]] = []
    for kind, request, names, uid in ops:
        if not _change(book, chooser, rng, (kind, request, names, uid)):
            got = chooser.evaluate(request, names)
            want = afresh(book, request, policy, names)
            assert got.choices == want.choices
            assert got.misfits == want.misfits
            view = chooser.evaluate(request, names, shared=True)
            shared.append((book.generation, names, view, want))
            _check_top(view)
        for generation, named, view, want in shared:
            if generation == book.generation:  # a shared result holds while nothing changed
                assert {n: view.choices[n] for n in named if n in view.choices} == want.choices
                assert {n: view.misfits[n] for n in named if n in view.misfits} == want.misfits
        everyone = list(book.inventory.names())
        assert chooser.missing(request) == sorted(chooser.unseen(request, everyone))
    last = GpuRequest(250, count=1, host_memory_mib=3000)
    everything = chooser.evaluate(last)
    assert everything.choices == afresh(book, last, policy, ["a", "b", "c", "d"]).choices


def _check_top(view: choosing.Evaluation) -> None:
    """A shared evaluation's `top` (its heap, kept across grants and releases) names
    exactly its choices at the highest score, each once, or None past `TOP_TIES`."""
    if view.top is None:  # a fresh evaluation (some node short of host memory)
        return
    top = view.top()
    scores = [choice.score for choice in view.choices.values()]
    best = {name for name, choice in view.choices.items() if choice.score == max(scores)}
    if len(best) > choosing.TOP_TIES:
        assert top is None
    else:
        assert top is not None and len(top) == len(set(top)) and set(top) == best


def test_top_follows_the_kept_evaluation_and_gives_up_past_the_ties() -> None:
    book = cluster()
    chooser = choosing.Chooser(book, policies.make("best-fit"))
    request = GpuRequest(500, count=1)
    view = chooser.evaluate(request, ["a", "b", "c", "d"], shared=True)
    _check_top(view)
    for uid in range(6):  # each grant changes the best node's score: the heap follows
        choice = chooser.choose(request, random.Random(uid))
        if choice is None:
            break
        book.reserve(choosing.grant_for(f"p{uid}", choice, request))
        _check_top(chooser.evaluate(request, ["a", "b", "c", "d"], shared=True))
    for uid in range(6):  # releases lower the packed nodes' scores: stale entries on top
        book.release(f"p{uid}")
        _check_top(chooser.evaluate(request, ["a", "b", "c", "d"], shared=True))
    many = ledger(*(node(f"n{index}", 1) for index in range(choosing.TOP_TIES + 2)))
    alike = choosing.Chooser(many, policies.make("random", rng=random.Random(1)))
    top = alike.evaluate(request, shared=True).top
    assert top is not None and top() is None  # the caller scans


def test_prepare_does_the_work_once() -> None:
    book = cluster()
    chooser = choosing.Chooser(book, policies.make("best-fit"))
    request = GpuRequest(500, count=1, host_memory_mib=1024)
    assert chooser.prepare(request, ["a", "b"]) == 2
    assert chooser.prepare(GpuRequest(500, count=1, host_memory_mib=4000), ["a", "b", "c"]) == 1
    assert chooser.prepare(request, ["a", "b", "c"]) == 0
    book.reserve(choosing.grant_for("p", chooser.outcome("a", request), request))  # type: ignore[arg-type]
    assert chooser.missing(request) == ["a", "d"]  # "a" changed, "d" never scored
    assert chooser.prepare(request, ["a", "b", "c"]) == 1  # "a" changed: scored again
    assert chooser.missing(request) == ["d"]
    assert chooser.evaluate(GpuRequest(500, count=1, host_memory_mib=6000), ["b"]).misfits[
        "b"
    ].kind is (fit.MisfitKind.MEMORY)


def test_the_fragmentation_memo_stays_bounded_and_never_empties_at_once() -> None:
    from gpuplace.placement.fragmentation import Memo

    memo: Memo[int, int] = Memo(limit=100)
    for key in range(1000):
        memo.put(key, key * 2)
        assert len(memo) <= 200
        assert memo.get(key) == key * 2
        if key >= 100:
            assert len(memo) >= 50  # a retired table is emptied gradually, not at once
    assert memo.get(999) == 1998 and memo.get(0) is None


def test_shapes_in_use_outlive_shapes_seen_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept evaluations go least recently used first: a stream of shapes seen once
    does not push out one that is used between them (the warmer's, worth a pass over
    every node each)."""
    monkeypatch.setattr(choosing, "EVALUATIONS_KEPT", 3)
    chooser = choosing.Chooser(cluster(), policies.make("best-fit"))
    names = ["a", "b", "c", "d"]
    kept = GpuRequest(500, count=1)
    assert chooser.prepare(kept, names) == 4
    for milli in (100, 200, 300, 400, 600, 700):
        chooser.evaluate(GpuRequest(milli, count=1), names)
        assert chooser.prepare(kept, names) == 0, f"pushed out after a {milli} shape"


def test_kept_evaluations_are_keyed_by_the_choosers_own_copies_of_node_names() -> None:
    """Kept evaluations (what filter's lookups read and its answer is written from) key
    each node by one copy of its name made by the chooser, shared by every shape: equal
    to the inventory's name, another object. A node added later gets its copy when
    first scored; a name no node has is not kept as one."""
    book = cluster()
    chooser = choosing.Chooser(book, policies.make("best-fit"))
    small, large = GpuRequest(250, count=1), GpuRequest(1000, count=2)
    given = {name: name for name in book.inventory.names()}

    def keys(request: GpuRequest, names: list[str]) -> dict[str, str]:
        view = chooser.evaluate(request, names, shared=True)
        return {key: key for key in (*view.choices, *view.misfits)}

    first = keys(small, ["a", "b", "c", "d", "gone"])
    second = keys(large, ["d", "c", "b", "a"])
    for name, inventory_name in given.items():
        assert first[name] == inventory_name and first[name] is not inventory_name
        assert second[name] is first[name]
    book.put_node(node("e", 2))
    later = keys(small, [*given, "e"])
    assert later["e"] == "e" and later["e"] is not book.state("e").node.name  # type: ignore[union-attr]
    assert all(later[name] is first[name] for name in given)
    assert "gone" not in chooser._names


every_steps = st.lists(
    st.tuples(
        st.sampled_from(["grant", "release", "evaluate", "prepare", "add", "remove", "stale"]),
        requests,
        st.lists(st.sampled_from(NAMES), unique=True, min_size=1),
        st.integers(0, 12),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(every_steps)
def test_every_nodes_own_list_evaluates_as_any_list_of_them(
    ops: list[tuple[str, GpuRequest, list[str], int]],
) -> None:
    """`evaluate(request, every_name())` (filter when kube-scheduler sent every
    node) skips the lookup per name; whatever happened before (nodes added, removed,
    granted, prepared, or a list of every node from before a change), it answers as
    for an equal list that is not that one, and as scoring those nodes afresh."""
    book = cluster()
    policy = policies.make("default", workload=Workload.from_requests([GpuRequest()]))
    chooser = choosing.Chooser(book, policy)
    rng = random.Random(0)
    stale: list[str] | None = None
    for kind, request, names, uid in ops:
        if _change(book, chooser, rng, (kind, request, names, uid)):
            pass
        elif kind == "add":
            book.put_node(node(f"new{uid}", 1 + uid % 3))
        elif kind == "remove" and len(book.inventory) > 1:
            book.remove_node(names[0])
        every = chooser.every_name()
        assert sorted(every) == sorted(book.inventory.names())
        listed = stale if kind == "stale" and stale is not None else every
        stale = every
        got = chooser.evaluate(request, listed, shared=True)
        want = afresh(book, request, policy, list(listed))
        assert {n: got.choices[n] for n in listed if n in got.choices} == want.choices
        assert {n: got.misfits[n] for n in listed if n in got.misfits} == want.misfits
        whole = len(listed) == len(got.choices) + len(got.misfits)
        assert whole == (set(got.choices) | set(got.misfits) == set(listed))
