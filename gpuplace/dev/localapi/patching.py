"""The three PATCH content types kube-apiserver accepts for built-in kinds.

- `application/merge-patch+json`: RFC 7386 (a null deletes a key, maps merge, lists
  are replaced).
- `application/strategic-merge-patch+json`: treated as a merge patch. Real strategic
  merge differs for lists with patch-merge keys (containers, conditions...) and for
  `$patch` directives; the fake refuses `$`-directives rather than mis-applying them.
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


def apply(content_type: str, target: dict[str, Any], patch: Any) -> dict[str, Any]:
    """`target` patched; raises `PatchError` when the patch does not apply."""
    kind = content_type.split(";", maxsplit=1)[0].strip().lower()
    if kind in (MERGE, STRATEGIC):
        if not isinstance(patch, dict):
            raise PatchError("a merge patch must be a JSON object")
        if kind == STRATEGIC and _has_directive(patch):
            raise PatchError("$-directives of strategic merge patch are not supported by the fake")
        result = merge(target, patch)
        assert isinstance(result, dict)
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
