"""Node constraints of a gang member: which nodes its spec allows, and narrowing it to one.

`NodeFilter.of(pod)` compiles what kube-scheduler's NodeAffinity plugin reads from a
pod's spec, `nodeSelector` and `affinity.nodeAffinity.requiredDuringScheduling…`
(terms ORed, expressions in a term ANDed; operators In, NotIn, Exists, DoesNotExist,
Gt, Lt; `matchFields` on `metadata.name`), so the gang planner offers each member
only nodes its own constraints allow.

`narrowed(affinity, node)` is the member's `spec.affinity` pinned to its planned node,
following exactly the rules kube-apiserver (≥ 1.30, KEP-3838) applies to a gated pod's
scheduling directives: they may only be *tightened*.

- no required node affinity (or an empty term list): it may be set; we set one term
  `matchFields: [{key: metadata.name, operator: In, values: [node]}]`;
- otherwise the term list keeps its length and every existing term keeps its
  expressions and fields, unchanged and in order; the only change allowed is
  appending requirements to a term, so we append the `metadata.name In [node]` field
  requirement to each non-empty term (an empty term matches no node: left alone);
- `preferredDuringScheduling…`, `podAffinity`, `podAntiAffinity` and `nodeSelector`
  are not touched.

`narrows(old, new)` is the same rule as a check (tests hold every patch to it).
Pure: no I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NAME_FIELD = "metadata.name"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def pin(node: str) -> dict[str, Any]:
    """The field requirement that pins a pod to `node`."""
    return {"key": NAME_FIELD, "operator": "In", "values": [node]}


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str
    values: tuple[str, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key, "")
        op = self.operator
        if op == "In":
            return present and value in self.values
        if op == "NotIn":
            return not present or value not in self.values
        if op == "Exists":
            return present
        if op == "DoesNotExist":
            return not present
        if op in ("Gt", "Lt") and present and len(self.values) == 1:
            try:
                have, bound = int(value), int(self.values[0])
            except ValueError:
                return False
            return have > bound if op == "Gt" else have < bound
        return False


@dataclass(frozen=True, slots=True)
class Term:
    expressions: tuple[Requirement, ...]
    fields: tuple[Requirement, ...]

    def matches(self, name: str, labels: Mapping[str, str]) -> bool:
        if not self.expressions and not self.fields:
            return False  # an empty term matches no node
        fields = {NAME_FIELD: name}
        return all(r.matches(labels) for r in self.expressions) and all(
            r.matches(fields) for r in self.fields
        )


def _requirements(raw: Any) -> tuple[Requirement, ...]:
    if not isinstance(raw, list):
        return ()
    found = []
    for item in raw:
        if isinstance(item, Mapping):
            values = item.get("values") or []
            found.append(
                Requirement(
                    str(item.get("key") or ""),
                    str(item.get("operator") or ""),
                    tuple(str(v) for v in values) if isinstance(values, list) else (),
                )
            )
    return tuple(found)


def _terms(affinity: Any) -> list[Any]:
    if not isinstance(affinity, Mapping):
        return []
    node_affinity = affinity.get("nodeAffinity")
    if not isinstance(node_affinity, Mapping):
        return []
    required = node_affinity.get(REQUIRED)
    if not isinstance(required, Mapping):
        return []
    terms = required.get("nodeSelectorTerms")
    return list(terms) if isinstance(terms, list) else []


@dataclass(frozen=True, slots=True)
class NodeFilter:
    """A pod's hard node constraints (hashable: members with equal ones share work)."""

    selector: tuple[tuple[str, str], ...]
    terms: tuple[Term, ...] | None
    """None: no required node affinity (every node passes it)."""

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> NodeFilter:
        spec = pod.get("spec") or {}
        raw_selector = spec.get("nodeSelector") or {}
        selector = tuple(
            sorted((str(k), str(v)) for k, v in raw_selector.items())
            if isinstance(raw_selector, Mapping)
            else ()
        )
        raw_terms = _terms(spec.get("affinity"))
        terms: tuple[Term, ...] | None = None
        if raw_terms:
            terms = tuple(
                Term(
                    _requirements(term.get("matchExpressions")),
                    _requirements(term.get("matchFields")),
                )
                if isinstance(term, Mapping)
                else Term((), ())
                for term in raw_terms
            )
        return cls(selector, terms)

    @property
    def trivial(self) -> bool:
        return not self.selector and self.terms is None

    def matches(self, name: str, labels: Mapping[str, str]) -> bool:
        if any(labels.get(key) != value for key, value in self.selector):
            return False
        return self.terms is None or any(term.matches(name, labels) for term in self.terms)

    def allowed(self, nodes: Iterable[tuple[str, Mapping[str, str]]]) -> frozenset[str] | None:
        """Names of `nodes` (name, labels) this filter passes; None when it passes all."""
        if self.trivial:
            return None
        return frozenset(name for name, labels in nodes if self.matches(name, labels))

    def pinned_to(self) -> str | None:
        """The node every term pins the pod to with `metadata.name In [node]`, if any."""
        if not self.terms:
            return None
        pins = set()
        for term in self.terms:
            if not term.expressions and not term.fields:
                continue
            mine = [
                r.values[0]
                for r in term.fields
                if r.key == NAME_FIELD and r.operator == "In" and len(r.values) == 1
            ]
            if not mine:
                return None
            pins.update(mine)
        return pins.pop() if len(pins) == 1 else None


def narrowed(affinity: Mapping[str, Any] | None, node: str) -> dict[str, Any] | None:
    """`spec.affinity` pinned to `node` under the gated-pod rules (module docstring), or
    None when every non-empty required term already carries the pin."""
    result: dict[str, Any] = copy.deepcopy(dict(affinity)) if affinity else {}
    node_affinity = result.get("nodeAffinity")
    if not isinstance(node_affinity, dict):
        node_affinity = result["nodeAffinity"] = {}
    terms = _terms(result)
    requirement = pin(node)
    if not terms:
        node_affinity[REQUIRED] = {"nodeSelectorTerms": [{"matchFields": [requirement]}]}
        return result
    changed = False
    new_terms = []
    for term in terms:
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


def narrows(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> str | None:
    """None when `new` only tightens `old` as kube-apiserver allows for a gated pod, else
    what is wrong (the check of `validateNodeAffinityMutation`)."""
    old_terms = _terms(old)
    new_terms = _terms(new)
    old_rest = _without_required(old)
    new_rest = _without_required(new)
    if old_rest.get("podAffinity") != new_rest.get("podAffinity") or old_rest.get(
        "podAntiAffinity"
    ) != new_rest.get("podAntiAffinity"):
        return "pod affinity may not change"
    if not old_terms:
        return None
    if len(old_terms) != len(new_terms):
        return "no additions/deletions to non-empty NodeSelectorTerms list are allowed"
    for index, (before, after) in enumerate(zip(old_terms, new_terms, strict=True)):
        if not _only_additions(before, after):
            return f"nodeSelectorTerms[{index}]: only additions are allowed"
    return None


def _without_required(affinity: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(affinity) if isinstance(affinity, Mapping) else {}


def _prefix(before: Sequence[Any], after: Sequence[Any]) -> bool:
    return len(after) >= len(before) and list(after[: len(before)]) == list(before)


def _only_additions(before: Any, after: Any) -> bool:
    if not isinstance(before, Mapping) or not isinstance(after, Mapping):
        return bool(before == after)
    return _prefix(before.get("matchExpressions") or [], after.get("matchExpressions") or []) and (
        _prefix(before.get("matchFields") or [], after.get("matchFields") or [])
    )
