"""Which nodes a pod's spec allows, as kube-scheduler's NodeAffinity plugin reads it.

`NodeAffinity.of(pod)` compiles a pod's `nodeSelector` (every label equal) and
`affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution` (terms ORed,
requirements in a term ANDed; operators In, NotIn, Exists, DoesNotExist, Gt, Lt;
`matchFields` on `metadata.name`; an empty term matches no node); `matches(name,
labels)` answers for one node, `allowed(nodes)` for many. Used wherever gpuplace must
know where a pod may go before kube-scheduler says so: the gang planner offers each
member only the nodes its own constraints allow, the demo plays kube-scheduler's
filter with it. Preferred terms, pod (anti-)affinity and taints are not read.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

NAME_FIELD = "metadata.name"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


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


def terms(affinity: Any) -> list[Any]:
    """The raw `nodeSelectorTerms` of `spec.affinity` (empty when it has none)."""
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
class NodeAffinity:
    """A pod's hard node constraints: its `nodeSelector` and required node affinity
    (hashable: pods with equal ones share work)."""

    selector: tuple[tuple[str, str], ...]
    terms: tuple[Term, ...] | None
    """None: no required node affinity (every node passes it)."""

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> NodeAffinity:
        spec = pod.get("spec") or {}
        raw_selector = spec.get("nodeSelector") or {}
        selector = tuple(
            sorted((str(k), str(v)) for k, v in raw_selector.items())
            if isinstance(raw_selector, Mapping)
            else ()
        )
        raw_terms = terms(spec.get("affinity"))
        compiled: tuple[Term, ...] | None = None
        if raw_terms:
            compiled = tuple(
                Term(
                    _requirements(term.get("matchExpressions")),
                    _requirements(term.get("matchFields")),
                )
                if isinstance(term, Mapping)
                else Term((), ())
                for term in raw_terms
            )
        return cls(selector, compiled)

    @property
    def trivial(self) -> bool:
        return not self.selector and self.terms is None

    def matches(self, name: str, labels: Mapping[str, str]) -> bool:
        if any(labels.get(key) != value for key, value in self.selector):
            return False
        return self.terms is None or any(term.matches(name, labels) for term in self.terms)

    def allowed(self, nodes: Iterable[tuple[str, Mapping[str, str]]]) -> frozenset[str] | None:
        """Names of `nodes` (name, labels) these constraints pass; None when they pass all."""
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
