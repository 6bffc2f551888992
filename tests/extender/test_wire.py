"""The extender's JSON: Go field names in and out; the fast priorities encoder writes
exactly what the model would."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pydantic_core
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gpuplace.extender import wire
from gpuplace.extender.node_names import EveryNode
from gpuplace.placement import choosing
from gpuplace.placement.choosing import Choice
from tests import c_helpers_built


def _model(scores: list[tuple[str, int]]) -> wire.HostPriorityList:
    """The model of the answer: every host that scores above 0."""
    return wire.HostPriorityList([wire.HostPriority(host=h, score=s) for h, s in scores if s])


@given(st.lists(st.tuples(st.text(max_size=12), st.integers(0, 10)), max_size=20))
def test_priorities_json_equals_the_model_dump(scores: list[tuple[str, int]]) -> None:
    fast = wire.priorities_json([h for h, _ in scores], [s for _, s in scores])
    assert json.loads(fast) == json.loads(_model(scores).dump())
    assert json.loads(fast) == [{"Host": h, "Score": s} for h, s in scores if s]


PLAIN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-", min_size=1, max_size=20)


@given(st.lists(st.tuples(PLAIN, st.integers(0, 10)), max_size=20))
def test_priorities_json_for_dns_names_is_byte_for_byte_the_model_dump(
    scores: list[tuple[str, int]],
) -> None:
    assert wire.priorities_json([h for h, _ in scores], [s for _, s in scores]) == (
        _model(scores).dump()
    )


@given(st.lists(st.tuples(PLAIN, st.integers(0, 10)), unique_by=lambda e: e[0], max_size=30))
def test_priorities_json_gives_kube_scheduler_the_same_totals(
    scores: list[tuple[str, int]],
) -> None:
    """What kube-scheduler does with the answer (prioritizeNodes): each listed host's
    score is added to that node's total, a node not listed adds nothing. Leaving out
    the zeros changes no node's total."""
    totals = dict.fromkeys((h for h, _ in scores), 0)
    for entry in json.loads(wire.priorities_json([h for h, _ in scores], [s for _, s in scores])):
        assert entry["Score"] > 0
        totals[entry["Host"]] += entry["Score"]
    assert totals == dict(scores)


def test_priorities_json_outside_the_fast_path_and_misaligned() -> None:
    hosts = ["a", "b", "c"]
    for scores in ([0, 11, 3], [-1, 2, 3], [1, 2, 3]):
        assert json.loads(wire.priorities_json(hosts, scores)) == [
            {"Host": h, "Score": s} for h, s in zip(hosts, scores, strict=True) if s
        ]
    assert wire.priorities_json(hosts, [0, 0, 0]) == b"[]"
    with pytest.raises(ValueError, match="3 hosts but 2 scores"):
        wire.priorities_json(hosts, [1, 2])


def test_the_c_encoder_is_built() -> None:
    """Without a C compiler the package installs without it (prioritize's answers are
    then ranked and encoded in Python); where the build is required (CI, the image), its
    absence is a failure."""
    c_helpers_built.check_built("gpuplace.extender._priorities")


_SCORES = st.one_of(
    st.floats(-1e6, 1e6),
    st.floats(allow_nan=False, allow_infinity=False),  # spans beyond the floats too
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.0 + 2**-52, 5e-324]),  # ties, tiny spans
)
_CHOSEN = st.lists(st.tuples(PLAIN, st.none() | _SCORES), unique_by=lambda e: e[0], max_size=40)


def _choices(entries: list[tuple[str, float | None]]) -> tuple[list[str], list[Choice | None]]:
    hosts = [host for host, _ in entries]
    return hosts, [None if v is None else Choice(h, (0,), v) for h, v in entries]


@settings(max_examples=500)
@given(_CHOSEN)
def test_ranked_answer_in_c_is_byte_for_byte_pythons(
    entries: list[tuple[str, float | None]],
) -> None:
    """The C encoder writes exactly what ranking in Python and encoding does: the same
    0-10 per node (10 for the best, the rest spread over 0-9), zeros left out."""
    ranked_json = c_helpers_built.built().ranked_json
    hosts, chosen = _choices(entries)
    python = wire.priorities_json(hosts, choosing.ranked_found(chosen))
    assert ranked_json(hosts, chosen, choosing.MAX_EXTENDER_SCORE) == python
    with c_helpers_built.in_use(None, ranked_json):
        assert wire.ranked_priorities_json(hosts, chosen) == python
    with c_helpers_built.in_use(None, None):
        assert wire.ranked_priorities_json(hosts, chosen) == python


@given(_CHOSEN, st.sampled_from(['nod"e', "nöde", "a b", "x\\y", "\u2028"]), st.data())
def test_ranked_answer_hands_what_c_does_not_write_to_python(
    entries: list[tuple[str, float | None]], odd: str, data: st.DataObject
) -> None:
    """A host JSON must escape, or a score that is not a finite float: C declines (None)
    and the answer is Python's, the same as ever."""
    ranked_json = c_helpers_built.built().ranked_json
    hosts, chosen = _choices(entries)
    at = data.draw(st.integers(0, len(hosts)))
    kind = data.draw(st.sampled_from(["host", "nan", "inf", "int"]))
    if kind == "host":
        hosts.insert(at, odd)
        chosen.insert(at, Choice(odd, (0,), 1.0))
    else:
        value: Any = {"nan": math.nan, "inf": math.inf, "int": 3}[kind]
        hosts.insert(at, "odd")
        chosen.insert(at, Choice("odd", (0,), value))
    assert ranked_json(hosts, chosen, choosing.MAX_EXTENDER_SCORE) is None
    if kind in ("host", "int"):
        python = wire.priorities_json(hosts, choosing.ranked_found(chosen))
        with c_helpers_built.in_use(None, ranked_json):
            assert wire.ranked_priorities_json(hosts, chosen) == python
        assert json.loads(python)  # the odd host's score, at least, is in it


def test_ranked_answer_edges() -> None:
    one = [Choice("a", (0,), 0.25)]
    both = c_helpers_built.BUILT
    for ranked in (None, *([] if both is None else [both.ranked_json])):
        with c_helpers_built.in_use(None, ranked):
            assert wire.ranked_priorities_json(["a"], one) == b'[{"Host":"a","Score":10}]'
            assert wire.ranked_priorities_json(["a", "b"], [None, None]) == b"[]"
            assert wire.ranked_priorities_json([], []) == b"[]"


def test_the_c_encoder_refuses_what_it_cannot_rank() -> None:
    one = [Choice("a", (0,), 0.25)]
    ranked_json = c_helpers_built.built().ranked_json
    with pytest.raises(ValueError, match="2 hosts but 1 choices"):
        ranked_json(["a", "b"], one, 10)
    with pytest.raises(ValueError, match="1-99"):
        ranked_json(["a"], one, 100)
    with pytest.raises(AttributeError):
        ranked_json(["a"], [object()], 10)


def test_go_and_lower_camel_keys_are_accepted() -> None:
    go = wire.ExtenderArgs.model_validate_json(
        b'{"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["a"], "Nodes": null}'
    )
    camel = wire.ExtenderArgs.model_validate_json(
        b'{"pod": {"metadata": {"name": "p"}}, "nodeNames": ["a"]}'
    )
    assert go.names() == camel.names() == ["a"]
    full = wire.ExtenderArgs.model_validate_json(
        b'{"Pod": {"metadata": {"name": "p"}}, "Nodes": {"items": [{"metadata": {"name": "n"}}]}}'
    )
    assert full.names() == ["n"]
    assert full.node_objects() == {"n": {"metadata": {"name": "n"}}}
    bind = wire.BindingArgs.model_validate_json(
        b'{"PodName": "p", "PodNamespace": "d", "PodUID": "u", "Node": "n"}'
    )
    assert (bind.pod_name, bind.pod_namespace, bind.pod_uid, bind.node) == ("p", "d", "u", "n")
    with pytest.raises(ValidationError):
        wire.BindingArgs.model_validate_json(b'{"PodName": "p"}')


def test_answers_use_go_field_names() -> None:
    result = wire.FilterResult(node_names=["a"], failed_nodes={"b": "why"})
    assert json.loads(result.dump()) == {
        "NodeNames": ["a"],
        "FailedNodes": {"b": "why"},
        "FailedAndUnresolvableNodes": {},
        "Error": "",
    }
    assert json.loads(wire.BindingResult(error="x").dump()) == {"Error": "x"}


@given(
    st.one_of(st.none(), st.lists(st.text(max_size=8), max_size=5)),
    st.one_of(st.none(), st.just({"items": [{"metadata": {"name": "n"}}]})),
    st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=5),
    st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=5),
    st.text(max_size=8),
)
def test_filter_answer_is_the_models_own_json(
    names: list[str] | None,
    nodes: dict[str, Any] | None,
    failed: dict[str, str],
    unresolvable: dict[str, str],
    error: str,
) -> None:
    """The hand-built answer is byte for byte what the model writes (any text: quotes,
    control characters, non-ASCII), with `Nodes` or `NodeNames` as kube-scheduler sent."""
    result = wire.FilterResult.model_construct(
        nodes=nodes,
        node_names=names,
        failed_nodes=failed,
        failed_and_unresolvable=unresolvable,
        error=error,
    )
    exclude = {"nodes"} if nodes is None else {"node_names"}
    assert result.dump() == result.model_dump_json(exclude=exclude).encode()


_TEXT = st.text(alphabet=st.sampled_from('ab"\\{}[],: \nNodeNames'), max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)


def _go(body: dict[str, Any]) -> bytes:
    """As Go's encoding/json writes it: no spaces."""
    return json.dumps(body, separators=(",", ":")).encode()


Parts = tuple[dict[str, Any], list[str], list[str] | None, list[str], Any]
_BODIES = st.tuples(
    st.dictionaries(_TEXT, _JSON, max_size=3),  # the pod
    st.lists(_TEXT, max_size=4),  # NodeNames sent
    st.one_of(st.none(), st.lists(_TEXT, max_size=4)),  # the names known, if not those
    st.permutations(["Pod", "Nodes", "NodeNames", "extra"]),  # the keys' order
    st.sampled_from([_go, lambda body: json.dumps(body).encode(), lambda b: _go(b) + b"\n"]),
)
"""ExtenderArgs bodies in parts: (pod, sent, other, order, encode)."""


def _body(
    pod: dict[str, Any], sent: list[str], known: list[str], order: list[str], encode: Any
) -> tuple[bytes, wire.ExtenderArgs]:
    """The body (the names `sent`, and `known` and the key's own name elsewhere in it, as
    decoys), and what parsing it whole gives."""
    pod = {**pod, "metadata": {"name": "p", "annotations": {'"NodeNames":': json.dumps(sent)}}}
    values = {"Pod": pod, "Nodes": None, "NodeNames": sent, "extra": {"NodeNames": known}}
    raw = encode({key: values[key] for key in order})
    return raw, wire.ExtenderArgs.model_validate_json(raw)


@given(_BODIES)
def test_with_names_is_the_full_parse_or_declines(parts: Parts) -> None:
    """For any body (any key order, spacing, and text full of quotes, brackets and the
    key's own name), `with_names` either declines or gives what parsing it whole does,
    with the known list itself when it gives one."""
    pod, sent, other, order, encode = parts
    known = list(sent) if other is None else other  # equal but not the same list, or another
    raw, full = _body(pod, sent, known, order, encode)
    fast = wire.ExtenderArgs.with_names(raw, known, pydantic_core.to_json(known))
    if fast is not None:
        assert fast.node_names is known
        assert fast.model_dump() == full.model_dump()
    if encode is _go and order[-1] == "NodeNames" and sent == known:
        assert fast is not None  # kube-scheduler's shape: always taken


def test_with_names_declines_what_is_not_a_top_level_last_key() -> None:
    known = ["n0", "n1"]
    names = pydantic_core.to_json(known)
    pod = {"metadata": {"name": "p"}}
    nested = _go({"Pod": {**pod, "x": {"NodeNames": known}}, "NodeNames": ["other"]})
    assert wire.ExtenderArgs.with_names(nested, known, names) is None
    inside = _go({"Pod": pod, "NodeNames": ["other"], "s": 'a,"NodeNames":["n0","n1"]'})
    assert wire.ExtenderArgs.with_names(inside, known, names) is None
    for key in ("NodeNamez", 'x"NodeNames'):  # another key: one alike, one ending alike
        other = _go({"Pod": pod, "NodeNames": ["other"], key: known})
        assert wire.ExtenderArgs.model_validate_json(other).node_names == ["other"]
        assert wire.ExtenderArgs.with_names(other, known, names) is None
    broken = b'{"Pod":{"metadata":{"name":"p"}},"NodeNames":' + names + b"]}"
    assert wire.ExtenderArgs.with_names(broken, known, names) is None
    unnamed = b'{"Pod":{"metadata":{}},"NodeNames":' + names + b"}"
    assert wire.ExtenderArgs.with_names(unnamed, known, names) is None  # invalid: declined
    with pytest.raises(ValidationError):
        wire.ExtenderArgs.model_validate_json(unnamed)


def _every(names: list[str]) -> EveryNode:
    """Every node's set in C, whether or not `GPUPLACE_NO_EXTENSIONS` is set."""
    with c_helpers_built.in_use(c_helpers_built.built().name_set, None):
        every = EveryNode.of(names)
    assert every is not None
    return every


@given(_BODIES)
def test_with_every_name_is_the_full_parse_or_declines(parts: Parts) -> None:
    """For any body (any key order, spacing, and text full of quotes, brackets and the
    key's own name), `with_every_name` either declines or gives what parsing it whole
    does, with every node's list itself for `NodeNames` (the names sent, in any order)."""
    pod, sent, other, order, encode = parts
    known = list(dict.fromkeys(sent if other is None else other))
    random.Random(repr(sent)).shuffle(known)  # every node, in another order
    every = _every(known)
    raw, full = _body(pod, sent, known, order, encode)
    fast = wire.ExtenderArgs.with_every_name(raw, every)
    if fast is not None:
        assert fast.node_names is every.names
        assert full.node_names is not None
        assert sorted(full.node_names) == sorted(known)
        assert len(full.node_names) == len(known)
        assert fast.model_dump(exclude={"node_names"}) == full.model_dump(exclude={"node_names"})
    plain = all(name and '"' not in name and "\\" not in name and "\n" not in name for name in sent)
    once = len(set(sent)) == len(sent)
    if encode is _go and order[-1] == "NodeNames" and other is None and plain and once:
        assert fast is not None  # kube-scheduler's shape: always taken


def test_with_every_name_declines_what_is_not_every_node_once() -> None:
    every = _every(["n0", "n1"])
    pod = {"metadata": {"name": "p"}}
    taken = wire.ExtenderArgs.with_every_name(_go({"Pod": pod, "NodeNames": ["n1", "n0"]}), every)
    assert taken is not None and taken.node_names is every.names
    for sent in (["n0"], ["n0", "n1", "n2"], ["n0", "n1", "n1"], ["n0", "n\\u0031"], []):
        raw = _go({"Pod": pod, "NodeNames": sent}).replace(b"\\\\", b"\\")
        assert wire.ExtenderArgs.with_every_name(raw, every) is None
    nested = _go({"Pod": {**pod, "x": {"NodeNames": ["n0", "n1"]}}, "NodeNames": ["other"]})
    assert wire.ExtenderArgs.with_every_name(nested, every) is None
    inside = _go({"Pod": pod, "NodeNames": ["other"], "s": 'a,"NodeNames":["n0","n1"]'})
    assert wire.ExtenderArgs.with_every_name(inside, every) is None
    unnamed = b'{"Pod":{"metadata":{}},"NodeNames":["n0","n1"]}'
    assert wire.ExtenderArgs.with_every_name(unnamed, every) is None  # invalid: declined
    assert wire.ExtenderArgs.with_every_name(b'"NodeNames":["n0","n1"]}', every) is None
