"""A gang that keeps to one topology domain (`gpuplace.io/gang-domain`): the planner
plans one domain at a time and never splits a required one; a preferred one spans as
few as hold it; shortfalls name each domain tried (docs/gangs.md, "One rack or block")."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.placement import gangs, policies
from gpuplace.placement.choosing import Policy
from gpuplace.placement.ledger import Grant, Ledger

from .clusters import ledger, node, whole
from .test_gangs import state_of

RACK = "example.com/rack"


def in_rack(*spec: tuple[str, int, str | None]) -> Ledger:
    return ledger(
        *(
            node(name, gpus, labels={RACK: rack} if rack is not None else None)
            for name, gpus, rack in spec
        )
    )


def gang(n: int, *, required: bool = True, value: str = "", count: int = 1) -> list[gangs.Member]:
    domain = gangs.Domain(RACK, required, value)
    return [gangs.Member(f"m{i}", whole(count), domain=domain) for i in range(n)]


def best_fit() -> Policy:
    return policies.make("best-fit")


def racks(book: Ledger, result: gangs.Plan) -> set[str]:
    return {book.inventory[choice.node].labels[RACK] for choice in result.choices.values()}


def test_without_a_domain_the_gang_spans_racks_with_one_it_keeps_to_one() -> None:
    """Rack a has one 3-GPU node; rack b two 2-GPU nodes. Fewest nodes puts three members
    on a1 and one in rack b; asked to keep to one rack, all four go to rack b and a1's
    three free GPUs are left alone."""
    book = in_rack(("a1", 3, "a"), ("b1", 2, "b"), ("b2", 2, "b"))
    free = gangs.plan(book, best_fit(), [gangs.Member(f"m{i}", whole(1)) for i in range(4)])
    assert isinstance(free, gangs.Plan) and racks(book, free) == {"a", "b"}
    before = state_of(book)
    kept = gangs.plan(book, best_fit(), gang(4))
    assert isinstance(kept, gangs.Plan), kept
    assert racks(book, kept) == {"b"} and kept.per_node() == {"b1": 2, "b2": 2}
    assert state_of(book) == before


def test_of_the_domains_that_hold_it_the_plan_on_fewest_nodes_then_the_tightest_wins() -> None:
    book = in_rack(("a1", 2, "a"), ("a2", 2, "a"), ("b1", 4, "b"), ("c1", 8, "c"), ("d1", 4, "d"))
    chosen = gangs.plan(book, best_fit(), gang(4))
    assert isinstance(chosen, gangs.Plan)
    # b and d hold it on one node with no room left; c would too but is roomier
    assert racks(book, chosen) == {"b"}


def test_a_required_domain_that_none_holds_waits_and_names_every_domain_tried() -> None:
    book = in_rack(("a1", 3, "a"), ("b1", 2, "b"), ("b2", 2, "b"), ("x", 8, None))
    book.reserve(Grant("busy", "b1", (0,), 1000, 0))
    short = gangs.plan(book, best_fit(), gang(4))
    assert isinstance(short, gangs.Shortfall)
    assert short.ever  # rack b holds four once its busy GPU frees
    assert [(t.value, t.placed, t.nodes) for t in short.domains] == [("a", 3, 1), ("b", 3, 2)]
    assert short.reason.startswith(
        f"no one {RACK} (gang-domain, required) holds all 4 gang members now (2 domains tried)"
    )
    assert "a: 3 of 4 fit now (1 node, never all even idle); b: 3 of 4 fit now (2 nodes)" in (
        short.reason
    )
    # the unlabelled 8-GPU node is never used for a required domain
    assert short.placed == 3


def test_a_gang_too_big_for_every_domain_can_never_fit() -> None:
    book = in_rack(("a1", 2, "a"), ("b1", 2, "b"))
    short = gangs.plan(book, best_fit(), gang(3))
    assert isinstance(short, gangs.Shortfall) and not short.ever
    assert short.reason.startswith(f"the gang can never fit in one {RACK}")


def test_no_node_with_the_label_is_a_shortfall_that_never_fits() -> None:
    book = in_rack(("x", 8, None))
    short = gangs.plan(book, best_fit(), gang(2))
    assert isinstance(short, gangs.Shortfall) and not short.ever
    assert f"no node carries the label {RACK}" in short.reason


def test_a_preferred_domain_spans_as_few_as_hold_the_gang() -> None:
    book = in_rack(("a1", 3, "a"), ("b1", 2, "b"), ("c1", 1, "c"), ("x", 8, None))
    one = gangs.plan(book, best_fit(), gang(3, required=False))
    assert isinstance(one, gangs.Plan) and racks(book, one) == {"a"}
    two = gangs.plan(book, best_fit(), gang(5, required=False))
    assert isinstance(two, gangs.Plan) and racks(book, two) == {"a", "b"}
    anywhere = gangs.plan(book, best_fit(), gang(10, required=False))
    assert isinstance(anywhere, gangs.Plan)  # every rack is too small: unlabelled nodes too
    assert "x" in anywhere.nodes


def test_a_running_gang_grows_only_in_its_own_domain() -> None:
    book = in_rack(("a1", 1, "a"), ("b1", 4, "b"))
    pinned = gangs.plan(book, best_fit(), gang(1, value="a"))
    assert isinstance(pinned, gangs.Plan) and racks(book, pinned) == {"a"}
    short = gangs.plan(book, best_fit(), gang(2, value="a"))
    assert isinstance(short, gangs.Shortfall)
    assert f"{RACK}=a, where the gang runs" in short.reason
    # preferred: its own domain first, elsewhere when it is full
    moved = gangs.plan(book, best_fit(), gang(2, value="a", required=False))
    assert isinstance(moved, gangs.Plan)


def test_the_fence_of_a_gang_keeping_to_a_domain_lies_in_one_domain() -> None:
    book = in_rack(("a1", 4, "a"), ("b1", 2, "b"), ("b2", 2, "b"))
    for name in ("a1", "b1", "b2"):
        book.reserve(Grant(f"busy-{name}", name, (0,), 1000, 0))
    held = gangs.fence(book, gang(4))
    assert held and len({book.inventory[n].labels[RACK] for n in held}) == 1
    assert gangs.fence(book, gang(5)) == ()


# --- property ---------------------------------------------------------------------------


@st.composite
def clusters(draw: st.DrawFn) -> tuple[Ledger, list[gangs.Member]]:
    count = draw(st.integers(1, 8))
    spec = [
        (f"n{i}", draw(st.integers(1, 4)), draw(st.sampled_from(["a", "b", "c", None])))
        for i in range(count)
    ]
    book = in_rack(*spec)
    for name, gpus, _ in spec:
        for index in range(gpus):
            if draw(st.booleans()):
                book.reserve(Grant(f"busy-{name}-{index}", name, (index,), 1000, 0))
    size = draw(st.integers(1, 8))
    gpus = draw(st.integers(1, 2))
    return book, gang(size, count=gpus)


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_members_never_span_two_domains_under_a_requirement(
    found: tuple[Ledger, list[gangs.Member]],
) -> None:
    """Point 4: a plan under a required domain has every member on nodes of one value of
    its label; and it fails only when no single domain, planned alone, would hold it."""
    book, members = found
    before = state_of(book)
    result = gangs.plan(book, best_fit(), members)
    assert state_of(book) == before
    alone = [
        value
        for value, nodes in gangs.domains(book, RACK).items()
        if isinstance(
            gangs.plan(
                book,
                best_fit(),
                [dataclasses.replace(m, domain=None, nodes=nodes) for m in members],
            ),
            gangs.Plan,
        )
    ]
    if isinstance(result, gangs.Plan):
        assert len(result.choices) == len(members)
        assert len(racks(book, result)) == 1
        assert racks(book, result) <= set(alone)
    else:
        assert alone == [], (alone, result.reason)
        assert len(result.domains) == len(gangs.domains(book, RACK))
