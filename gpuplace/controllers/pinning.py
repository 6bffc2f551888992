"""A gated gang member's required node affinity narrowed to its planned node (KEP-3838).

`narrowed(affinity, node)` is the member's `spec.affinity` pinned to its planned node,
following exactly the rules kube-apiserver (≥ 1.30, KEP-3838; `validateNodeAffinityMutation`
in `pkg/apis/core/validation`) applies to a gated pod's scheduling directives: they may
only be *tightened*.

- no required node affinity (or an empty term list): it may be set; we set one term
  `matchFields: [{key: metadata.name, operator: In, values: [node]}]`;
- otherwise the term list keeps its length and every existing term keeps its
  expressions and fields, unchanged and in order; the only change allowed is
  appending requirements to a non-empty term, so we append the `metadata.name In
  [node]` field requirement to each non-empty term (an empty term matches no node and
  may gain nothing: left alone);
- `preferredDuringScheduling…`, `podAffinity`, `podAntiAffinity` and `nodeSelector`
  are not touched.

`narrows(old, new)` is the same rule as a check, with kube-apiserver's own messages
(tests hold every patch the controller sends to it).

`nominating(node, ours)` is the other way a controller points kube-scheduler at its
planned node: the pods/status merge patch setting `status.nominatedNodeName` (the planner's
`--plan-pin nominate`, the claim controller's DRA pins), written only while the pod is
still the caller's to release.
Pure: no I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from gpuplace.cluster.node_affinity import NAME_FIELD, REQUIRED, terms


def pin(node: str) -> dict[str, Any]:
    """The field requirement that pins a pod to `node`."""
    return {"key": NAME_FIELD, "operator": "In", "values": [node]}


def nominating(
    node: str, ours: Callable[[dict[str, Any]], bool]
) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """The change (for `gpuplace.controllers.writing.Writer.write`, `status=True`) that
    nominates `node` while `ours(current)` holds (its gate still on it); None from it:
    nothing to do (not ours, or that node nominated already)."""

    def nominate(current: dict[str, Any]) -> dict[str, Any] | None:
        if not ours(current):
            return None
        if (current.get("status") or {}).get("nominatedNodeName") == node:
            return None
        return {"status": {"nominatedNodeName": node}}

    return nominate


def narrowed(affinity: Mapping[str, Any] | None, node: str) -> dict[str, Any] | None:
    """`spec.affinity` pinned to `node` under the gated-pod rules (module docstring), or
    None when every non-empty required term already carries the pin. O(terms)."""
    result: dict[str, Any] = copy.deepcopy(dict(affinity)) if affinity else {}
    node_affinity = result.get("nodeAffinity")
    if not isinstance(node_affinity, dict):
        node_affinity = result["nodeAffinity"] = {}
    existing = terms(result)
    requirement = pin(node)
    if not existing:
        node_affinity[REQUIRED] = {"nodeSelectorTerms": [{"matchFields": [requirement]}]}
        return result
    changed = False
    new_terms = []
    for term in existing:
        if not isinstance(term, dict) or (
            not term.get("matchExpressions") and not term.get("matchFields")
        ):
            new_terms.append(term)
            continue
        fields = list(term.get("matchFields") or [])
        if requirement in fields:
            new_terms.append(term)
            continue
        new_terms.append({**term, "matchFields": [*fields, requirement]})
        changed = True
    if not changed:
        return None
    node_affinity[REQUIRED] = {**node_affinity[REQUIRED], "nodeSelectorTerms": new_terms}
    return result


TERMS_PATH = f"spec.affinity.nodeAffinity.{REQUIRED}.nodeSelectorTerms"
"""Where kube-apiserver reports a refused change of the required terms."""
TERMS_CHANGED = "no additions/deletions to non-empty NodeSelectorTerms list are allowed"
TERM_CHANGED = "only additions are allowed (no mutations or deletions)"
POD_AFFINITY_CHANGED = (
    "spec: pod updates may not change fields other than those kube-apiserver lists (pod "
    "affinity and anti-affinity are not among them; a gated pod's node affinity may narrow)"
)
"""kube-apiserver's refusal of any other change of a pod's spec (Forbidden, in short)."""


def narrows(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> str | None:
    """None when kube-apiserver accepts `new` in place of `old` as a gated pod's
    `spec.affinity`, else its refusals as it words them (`FIELD: message`, joined by
    "; "): `validateNodeAffinityMutation` and `validateNodeSelectorTermHasOnlyAdditions`
    (an empty term may gain nothing; requirements compare as the API's semantic
    equality does, an absent `values` equal to an empty one). O(requirements)."""
    if _pod_affinity(old) != _pod_affinity(new):
        return POD_AFFINITY_CHANGED
    before, after = terms(old), terms(new)
    if not before:
        return None  # no required terms yet: anything may be set
    if len(before) != len(after):
        return f"{TERMS_PATH}: {TERMS_CHANGED}"
    refused = [
        f"{TERMS_PATH}[{index}]: {TERM_CHANGED}"
        for index, (was, now) in enumerate(zip(before, after, strict=True))
        if not _only_additions(was, now)
    ]
    return "; ".join(refused) or None


def _pod_affinity(affinity: Mapping[str, Any] | None) -> tuple[Any, Any]:
    if not isinstance(affinity, Mapping):
        return (None, None)
    return (affinity.get("podAffinity"), affinity.get("podAntiAffinity"))


def _requirements(term: Any, kind: str) -> list[Any]:
    """A term's `matchExpressions` or `matchFields`, each as (key, operator, values)."""
    raw = term.get(kind) if isinstance(term, Mapping) else None
    if not isinstance(raw, list):
        return []
    return [
        (item.get("key"), item.get("operator"), tuple(item.get("values") or ()))
        if isinstance(item, Mapping)
        else item
        for item in raw
    ]


def _only_additions(before: Any, after: Any) -> bool:
    old_expressions = _requirements(before, "matchExpressions")
    old_fields = _requirements(before, "matchFields")
    new_expressions = _requirements(after, "matchExpressions")
    new_fields = _requirements(after, "matchFields")
    if not old_expressions and not old_fields:
        return not new_expressions and not new_fields
    return (
        new_expressions[: len(old_expressions)] == old_expressions
        and new_fields[: len(old_fields)] == old_fields
    )
