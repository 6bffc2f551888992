"""`gpuplace.extender.node_names`: a JSON array of node names compared as bytes with every
node's name (the C helper `gpuplace.extender._node_names`, compared here with what a JSON
parser reads), and the set of every node kept per Chooser."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.extender import node_names
from gpuplace.extender.node_names import EveryNode, EveryNodeSets
from gpuplace.placement import choosing, policies
from gpuplace.placement.inventory import Inventory
from gpuplace.placement.ledger import Ledger
from tests import c_helpers_built
from tests.placement.clusters import node

# DNS-like names, and some that JSON writes without escapes but that are not ASCII.
_NAME = st.text(alphabet=st.sampled_from("abz019.-:_éλ中😀 /"), min_size=1, max_size=70)
_SPACE = st.sampled_from(["", " ", "\n", "\t\r "])


def _every(listed: list[str]) -> EveryNode:
    """The set of `listed` in C, whether or not `GPUPLACE_NO_EXTENSIONS` is set."""
    with c_helpers_built.in_use(c_helpers_built.built().name_set, None):
        every = EveryNode.of(listed)
    assert every is not None
    return every


def _reference(every: EveryNode, text: bytes) -> bool:
    """What `listed_by` means, read with a JSON parser: each name once, nothing else."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, list)
        and all(isinstance(item, str) for item in value)
        and len(value) == len(set(value))
        and set(value) == set(every.names)
    )


def test_the_c_helper_is_built() -> None:
    """Without a C compiler the package installs without it (and filter parses every
    name); where the build is required (CI, the image), its absence is a failure, not a
    quiet slowdown."""
    c_helpers_built.check_built("gpuplace.extender._node_names")


@settings(max_examples=300)
@given(st.lists(_NAME, unique=True, max_size=30), st.randoms(use_true_random=False), _SPACE)
def test_any_order_and_spacing_of_every_name_matches(
    listed: list[str], rng: random.Random, space: str
) -> None:
    every = _every(listed)
    shuffled = listed[:]
    rng.shuffle(shuffled)
    separator = space + "," + space
    text = "[" + space + separator.join(json.dumps(n, ensure_ascii=False) for n in shuffled)
    data = b"{x}" + (text + space + "]" + space).encode() + b"}"
    assert every.listed_by(data, 3, len(data) - 1)
    assert every.names is listed


@settings(max_examples=300)
@given(
    st.lists(_NAME, unique=True, max_size=12),
    st.lists(_NAME, max_size=14),
    st.booleans(),
)
def test_other_lists_do_not_match(listed: list[str], sent: list[str], ascii_only: bool) -> None:
    """A name missing, one too many, one twice, or written with escapes: no match,
    exactly when a JSON parser disagrees (or escapes were needed: declined)."""
    every = _every(listed)
    text = json.dumps(sent, ensure_ascii=ascii_only).encode()
    got = every.listed_by(text, 0, len(text))
    assert got == (_reference(every, text) and b"\\" not in text)


@settings(max_examples=500)
@given(st.lists(_NAME, unique=True, max_size=5), st.binary(max_size=60), st.data())
def test_bytes_of_any_kind_never_match_wrongly(
    listed: list[str], junk: bytes, data: st.DataObject
) -> None:
    """Truncated, spliced or random bytes, and any bounds: a match only where a JSON
    parser reads each name once; out-of-range bounds are no match, not a crash."""
    every = _every(listed)
    good = json.dumps(listed, ensure_ascii=False).encode()
    cut = data.draw(st.integers(0, len(good)))
    text = data.draw(st.sampled_from([junk, good[:cut], good[:cut] + junk, junk + good]))
    start = data.draw(st.integers(-3, len(text) + 3))
    end = data.draw(st.integers(-3, len(text) + 3))
    got = every.listed_by(text, start, end)
    if 0 <= start <= end <= len(text):
        assert got == (_reference(every, text[start:end]) and b"\\" not in text[start:end])
    else:
        assert got is False


def test_repeated_calls_start_afresh() -> None:
    """Names met by one call are not remembered by the next (each call checks "once")."""
    every = _every(["a", "b"])
    for _ in range(3):
        assert every.listed_by(b'["b","a"]', 0, 9)
        assert not every.listed_by(b'["a","a"]', 0, 9)
    assert _every([]).listed_by(b"[ ]", 0, 3)
    assert not _every([]).listed_by(b'[""]', 0, 4)


def test_repeated_names_count_once_in_the_set() -> None:
    every = _every(["a", "b", "a"])
    assert every.listed_by(b'["a","b"]', 0, 9)
    assert not every.listed_by(b'["a","b","a"]', 0, 13)


def test_names_must_be_str() -> None:
    with pytest.raises(TypeError):
        c_helpers_built.built().name_set(["a", b"b"], 0)  # type: ignore[list-item]


def test_a_name_without_utf8_matches_nothing() -> None:
    """A lone surrogate (which a JSON parser may hand over) cannot be written without
    an escape, so no array is taken for every node: filter parses it instead."""
    every = _every(["a", "b\ud800"])
    assert not every.listed_by(b'["a"]', 0, 5)
    assert not every.listed_by(b'["a","b"]', 0, 9)


def test_each_choosers_set_is_built_once_and_kept_while_its_nodes_stay() -> None:
    """The set holds the Chooser's own list (its identity says "every node"); it is
    built again only when a node is added or removed, and the deciding Chooser's and a
    rebuilt one's (the warmer fills it before it decides) are both kept."""
    book = Ledger(Inventory((node("n0", 1), node("n1", 2))))
    current = choosing.Chooser(book, policies.make("best-fit"))
    rebuilt = choosing.Chooser(book, policies.make("first-fit"))
    sets = EveryNodeSets()
    with c_helpers_built.in_use(c_helpers_built.built().name_set, None):
        every = sets.of(current)
        assert every is not None and every.names is current.every_name()
        assert sorted(every.names) == ["n0", "n1"]
        assert every.listed_by(b'["n1","n0"]', 0, 11)
        assert sets.of(current) is every
        staged = sets.of(rebuilt)
        assert staged is not None and staged is not every
        assert sets.of(current) is every and sets.of(rebuilt) is staged
        book.put_node(node("n2", 1))
        grown = sets.of(current)
        assert grown is not None and grown is not every
        assert not grown.listed_by(b'["n1","n0"]', 0, 11)
        assert grown.listed_by(b'["n1","n0","n2"]', 0, 16)
        assert len(sets._kept) == node_names.KEPT
