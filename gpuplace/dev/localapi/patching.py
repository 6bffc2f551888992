"""The three PATCH content types kube-apiserver accepts for built-in kinds.

- `application/merge-patch+json`: RFC 7386 (a null deletes a key, maps merge, lists
  are replaced).
- `application/strategic-merge-patch+json`: a merge patch, except the top-level lists
  the resource names with their patch-merge key (`Resource.merge_keys`: webhooks by
  name), which merge item by item as in the real server. Other keyed lists (containers,
  conditions...) are replaced, where the real server would merge them, and `$patch`
  directives are refused rather than mis-applied.
- `application/json-patch+json`: RFC 6902 through the `jsonpatch` package; a failed
  `test` or a missing path is an invalid request (422).
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
TYPES = (MERGE, STRATEGIC, JSON_PATCH)


class PatchError(ValueError):
    """A patch that cannot be applied; the message says why."""


class MergeKeyMissing(PatchError):
    """A strategic merge patch's list item without its patch-merge key: kube-apiserver
    answers a 500 (no reason) with the Go rendering of the item."""


def go_text(value: Any) -> str:
    """`value` as Go's fmt prints a decoded JSON value (`%v`): maps with sorted keys."""
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{go_text(value[k])}" for k in sorted(value)) + "]"
    if isinstance(value, list):
        return "[" + " ".join(go_text(item) for item in value) + "]"
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 merge patch: returns a new value, `target` is not changed."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: dict[str, Any] = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge(result.get(key), value)
    return result


def _has_directive(value: Any) -> bool:
    if isinstance(value, dict):
        return any(str(key).startswith("$") or _has_directive(v) for key, v in value.items())
    if isinstance(value, list):
        return any(_has_directive(item) for item in value)
    return False


def merge_by_key(items: Any, patch: list[Any], key: str) -> list[Any]:
    """A strategic merge of a list with a patch-merge key: an item of `patch` merges into
    the item of `items` with the same key, or is appended; the others stay. O(n × m)."""
    merged = [copy.deepcopy(item) for item in items] if isinstance(items, list) else []
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise MergeKeyMissing(
                f"map: {go_text(item)} does not contain declared merge key: {key}"
            )
        keys = [old.get(key) if isinstance(old, dict) else None for old in merged]
        if item[key] in keys:
            at = keys.index(item[key])
            merged[at] = merge(merged[at], item)
        else:
            merged.append(copy.deepcopy(item))
    return merged


def apply(
    content_type: str,
    target: dict[str, Any],
    patch: Any,
    merge_keys: tuple[tuple[str, str], ...] = (),
) -> dict[str, Any]:
    """`target` patched; raises `PatchError` when the patch does not apply. `merge_keys`:
    the top-level lists a strategic merge patch merges by key (`Resource.merge_keys`)."""
    kind = content_type.split(";", maxsplit=1)[0].strip().lower()
    if kind in (MERGE, STRATEGIC):
        if not isinstance(patch, dict):
            raise PatchError("a merge patch must be a JSON object")
        keyed = dict(merge_keys) if kind == STRATEGIC else {}
        if kind == STRATEGIC and _has_directive(patch):
            raise PatchError("$-directives of strategic merge patch are not supported by the fake")
        result = merge(target, {k: v for k, v in patch.items() if k not in keyed})
        assert isinstance(result, dict)
        for field, key in keyed.items():
            value = patch.get(field)
            if isinstance(value, list):
                result[field] = merge_by_key(result.get(field), value, key)
            elif value is not None:
                result[field] = merge(result.get(field), value)
            elif field in patch:
                result.pop(field, None)
        return result
    if kind == JSON_PATCH:
        if not isinstance(patch, list):
            raise PatchError("a JSON patch must be a JSON array of operations")
        try:
            patched = jsonpatch.JsonPatch(patch).apply(copy.deepcopy(target))
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
            raise PatchError(str(error)) from error
        except (TypeError, KeyError, ValueError) as error:
            raise PatchError(f"malformed JSON patch: {error}") from error
        if not isinstance(patched, dict):
            raise PatchError("the patched object is not a JSON object")
        return patched
    raise PatchError(f"unsupported patch content type {content_type!r}")
