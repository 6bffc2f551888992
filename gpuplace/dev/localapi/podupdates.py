"""Which changes of a pod's spec an update may make: kube-apiserver's `ValidatePodUpdate`
(pkg/apis/core/validation) for what gpuplace and its tests do to pods, refereed against
the real server by `tests/dev/test_gated.py`.

- `spec.nodeName` only through `pods/binding`;
- scheduling gates may only be removed (`validateOnlyDeletedSchedulingGates`);
- while the pod is gated (KEP-3838): `spec.nodeSelector` may gain keys, never change or
  lose one (`validateNodeSelectorMutation`); the node affinity's required terms may only
  narrow: none yet, anything may be set; else the same number of terms, each keeping its
  requirements in order and appending only (an empty term stays empty)
  (`validateNodeAffinityMutation`, `validateNodeSelectorTermHasOnlyAdditions`); its
  preferred terms change freely;
- otherwise only containers' images, `activeDeadlineSeconds` and tolerations change;
  anything else is the Forbidden "pod updates may not change fields other than ...".

Refusals are 422 Invalid with kube-apiserver's causes (field, reason, message); the value
a cause quotes is JSON here where Go prints its own syntax. Absent and empty lists and
maps compare equal, as `apiequality.Semantic` does. Pure functions; O(size of the spec).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gpuplace.dev.localapi.statuses import ApiStatusError

Obj = dict[str, Any]

TERMS = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
TERMS += ".nodeSelectorTerms"
UPDATABLE = (
    "`spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,"
    "`spec.tolerations` (only additions to existing tolerations),"
    "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously "
    "negative)"
)
_MUTABLE = ("schedulingGates", "activeDeadlineSeconds", "tolerations")


Cause = dict[str, str]


def _cause(kind: str, path: str, why: str, value: Any = None) -> Cause:
    if kind == "FieldValueInvalid":
        message = f"Invalid value: {json.dumps(value, separators=(',', ':'))}: {why}"
    else:
        message = f"Forbidden: {why}"
    return {"reason": kind, "message": message, "field": path}


def _pruned(value: Any) -> Any:
    """`value` with empty lists, maps and None dropped (Semantic equality)."""
    if isinstance(value, Mapping):
        kept = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, [], {})}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    return bool(_pruned(a) == _pruned(b))


def _terms(node_affinity: Mapping[str, Any] | None) -> list[Obj] | None:
    """The required terms; None where there is no required part at all."""
    required = (node_affinity or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return None
    return list(required.get("nodeSelectorTerms") or [])


def _only_additions(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    before_e, after_e = old.get("matchExpressions") or [], new.get("matchExpressions") or []
    before_f, after_f = old.get("matchFields") or [], new.get("matchFields") or []
    if not before_e and not before_f:
        return not after_e and not after_f
    if len(before_e) > len(after_e) or len(before_f) > len(after_f):
        return False
    return all(_same(a, b) for a, b in zip(before_e, after_e, strict=False)) and all(
        _same(a, b) for a, b in zip(before_f, after_f, strict=False)
    )


def _node_affinity_causes(
    new: Mapping[str, Any] | None, old: Mapping[str, Any] | None
) -> list[Cause]:
    before = _terms(old)
    if not before:
        return []  # no required terms yet: anything may be set
    after = _terms(new) or []
    if len(before) != len(after):
        why = "no additions/deletions to non-empty NodeSelectorTerms list are allowed"
        return [_cause("FieldValueInvalid", TERMS, why, after)]
    why = "only additions are allowed (no mutations or deletions)"
    return [
        _cause("FieldValueInvalid", f"{TERMS}[{index}]", why, now)
        for index, (was, now) in enumerate(zip(before, after, strict=True))
        if not _only_additions(now, was)
    ]


def causes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Cause]:
    """Why kube-apiserver refuses the update of pod `old` to `new` (empty: allowed)."""
    before, after = dict(old.get("spec") or {}), dict(new.get("spec") or {})
    found: list[Cause] = []
    if before.get("nodeName") != after.get("nodeName"):
        why = "may only be set through pods/binding"
        return [_cause("FieldValueForbidden", "spec.nodeName", why)]
    old_gates = {gate.get("name") for gate in before.get("schedulingGates") or []}
    for index, gate in enumerate(after.get("schedulingGates") or []):
        if gate.get("name") not in old_gates:
            why = f"only deletion is allowed, but found new scheduling gate '{gate.get('name')}'"
            found.append(_cause("FieldValueForbidden", f"spec.schedulingGates[{index}].name", why))
    munged = dict(after)
    if old_gates:
        old_selector = before.get("nodeSelector") or {}
        new_selector = after.get("nodeSelector") or {}
        if any(new_selector.get(key) != value for key, value in old_selector.items()):
            why = "only additions to spec.nodeSelector are allowed (no mutations or deletions)"
            found.append(_cause("FieldValueInvalid", "spec.nodeSelector", why, new_selector))
        munged["nodeSelector"] = before.get("nodeSelector")
        old_node = (before.get("affinity") or {}).get("nodeAffinity")
        new_affinity = after.get("affinity")
        if not _same(old_node, (new_affinity or {}).get("nodeAffinity")):
            found += _node_affinity_causes((new_affinity or {}).get("nodeAffinity"), old_node)
            munged["affinity"] = {**(new_affinity or {}), "nodeAffinity": old_node}
    if not _same(_fixed(before), _fixed(munged)):
        why = f"pod updates may not change fields other than {UPDATABLE}"
        found.append(_cause("FieldValueForbidden", "spec", why))
    return found


def _fixed(spec: Mapping[str, Any]) -> Obj:
    kept = {k: v for k, v in spec.items() if k not in _MUTABLE}
    kept["containers"] = [
        {k: v for k, v in c.items() if k != "image"} for c in spec.get("containers") or []
    ]
    return kept


def check(old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """Raise kube-apiserver's 422 when the update of `old` to `new` is refused."""
    found = causes(old, new)
    if not found:
        return
    name = str(old["metadata"]["name"])
    shown = [f"{cause['field']}: {cause['message']}" for cause in found]
    why = shown[0] if len(shown) == 1 else "[" + ", ".join(shown) + "]"
    raise ApiStatusError(
        422, f'Pod "{name}" is invalid: {why}', kind="Pod", name=name, causes=found
    )
