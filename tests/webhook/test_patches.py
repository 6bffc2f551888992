"""The JSON Patch builder agrees with `jsonpatch` and never touches the original."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplace.webhook import patches


def test_pointer_escapes_rfc6901() -> None:
    assert patches.pointer(("metadata", "labels", "gpuplace.io/managed")) == (
        "/metadata/labels/gpuplace.io~1managed"
    )
    assert patches.pointer(("a~b", 3, "-")) == "/a~0b/3/-"


def test_put_creates_missing_parents_in_one_add() -> None:
    doc: dict[str, Any] = {"spec": {}}
    patch = patches.Patch(doc)
    assert patch.put(("spec", "affinity", "nodeAffinity", "x"), [1])
    assert patch.ops == [
        {"op": "add", "path": "/spec/affinity", "value": {"nodeAffinity": {"x": [1]}}}
    ]
    assert patch.put(("spec", "affinity", "nodeAffinity", "y"), 2)
    assert patch.ops[-1] == {"op": "add", "path": "/spec/affinity/nodeAffinity/y", "value": 2}
    assert doc == {"spec": {}}
    assert jsonpatch.apply_patch(doc, patch.ops) == patch.doc
    # the first op's value was not changed by the second write
    assert patch.ops[0]["value"] == {"nodeAffinity": {"x": [1]}}


def test_put_same_value_is_no_op_and_different_is_replace() -> None:
    patch = patches.Patch({"spec": {"schedulerName": "default-scheduler"}})
    assert not patch.put(("spec", "schedulerName"), "default-scheduler")
    assert not patch
    assert patch.put(("spec", "schedulerName"), "gpuplace")
    assert patch.ops == [{"op": "replace", "path": "/spec/schedulerName", "value": "gpuplace"}]


def test_null_parent_is_replaced_by_add() -> None:
    original: dict[str, Any] = {"metadata": {"labels": None}}
    patch = patches.Patch(original)
    patch.put(("metadata", "labels", "a"), "b")
    assert jsonpatch.apply_patch(original, patch.ops) == {"metadata": {"labels": {"a": "b"}}}


def test_append_creates_list_then_uses_dash() -> None:
    original: dict[str, Any] = {"c": {}}
    patch = patches.Patch(original)
    patch.append(("c", "env"), {"name": "A"})
    patch.append(("c", "env"), {"name": "B"})
    assert [op["path"] for op in patch.ops] == ["/c/env", "/c/env/-"]
    assert jsonpatch.apply_patch(original, patch.ops) == patch.doc
    assert patch.doc == {"c": {"env": [{"name": "A"}, {"name": "B"}]}}
    assert original == {"c": {}}


def test_remove() -> None:
    original = {"r": {"a": "1", "b": "2"}}
    patch = patches.Patch(original)
    assert patch.remove(("r", "a"))
    assert not patch.remove(("r", "zzz"))
    assert patch.ops == [{"op": "remove", "path": "/r/a"}]
    assert original == {"r": {"a": "1", "b": "2"}}


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        ({"spec": "text"}, ("spec", "x")),
        ({"spec": {"containers": []}}, ("spec", "containers", 0, "env")),
        ({"spec": {}}, ("spec", "containers", 0)),
    ],
)
def test_impossible_shapes_raise_patch_error(doc: dict[str, Any], path: patches.Path) -> None:
    with pytest.raises(patches.PatchError):
        patches.Patch(doc).put(path, 1)


# --- property: any sequence of writes gives a patch jsonpatch agrees with ---------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(["", "a", "x/y"])
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["a", "b", "c/d", "~e"]), inner, max_size=3),
    ),
    max_leaves=12,
)
_tokens = st.sampled_from(["a", "b", "c/d", "~e"])
_writes = st.lists(
    st.tuples(
        st.sampled_from(["put", "append", "remove"]),
        st.lists(st.one_of(_tokens, st.integers(0, 2)), min_size=1, max_size=4),
        _json,
    ),
    max_size=8,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.dictionaries(_tokens, _json, max_size=4), _writes)
def test_patch_applies_to_the_original_and_yields_doc(
    original: dict[str, Any], writes: list[tuple[str, list[Any], Any]]
) -> None:
    before = copy.deepcopy(original)
    patch = patches.Patch(original)
    for kind, path, value in writes:
        try:
            if kind == "put":
                patch.put(tuple(path), value)
            elif kind == "append":
                patch.append(tuple(path), value)
            else:
                patch.remove(tuple(path))
        except patches.PatchError:
            continue
    assert original == before, "the original must never be modified"
    assert jsonpatch.apply_patch(original, patch.ops) == patch.doc
    # writing the final values again changes nothing
    again = patches.Patch(patch.doc)
    for kind, path, _ in writes:
        value = patch.get(tuple(path))
        if kind == "put" and value is not patches.MISSING:
            assert not again.put(tuple(path), value)
