"""PodDisruptionBudgets, read the way the Eviction API applies them, for a pre-check.

A gang preempts all or nothing (docs/gangs.md), but each eviction is checked by the API
server alone, against the budget as it is then. So before evicting anything the gang
controller asks `refused(budgets, victims)`: which victims the API server would refuse
if all of them were evicted now, counting every victim of the same budget together.
The rules are kube-apiserver's (pkg/registry/core/pod/storage/eviction.go):

- a pod that is Pending, Succeeded, Failed or already being deleted is evicted without
  looking at budgets;
- a budget matches a pod of its namespace whose labels its `spec.selector` selects
  (`LabelSelectorAsSelector`): an absent selector or a malformed one matches nothing, a
  present but empty one (`selector: {}`) matches every pod of the namespace (policy/v1);
- a pod matched by more than one budget cannot be evicted (the API answers 500);
- a budget whose `status.observedGeneration` is behind its `metadata.generation` refuses
  (429: "still being processed"); one whose `status.disruptedPods` holds more than
  `MAX_DISRUPTED_PODS` entries (evictions the disruption controller has not confirmed
  yet) refuses (403; each eviction adds one entry); one with
  `status.disruptionsAllowed` of k allows k evictions, so victims beyond the first k of
  a budget are refused.

Conservative where the API server is lenient (an unready pod it may evict without
decrementing counts here as one disruption): the pre-check may spare a pod the API
would have allowed, never the reverse. Pure: no I/O; O(budgets × victims × labels).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Labels = Mapping[str, str]
Matcher = Callable[[Labels], bool]

IGNORED_PHASES = frozenset({"Pending", "Succeeded", "Failed"})
MAX_DISRUPTED_PODS = 2000
"""kube-apiserver's `MaxDisruptedPodSize`: a budget whose `status.disruptedPods` holds
more entries refuses every eviction (403)."""


@dataclass(frozen=True, slots=True)
class Budget:
    namespace: str
    name: str
    matches: Matcher | None
    """None: the selector selects nothing."""
    allowed: int
    """status.disruptionsAllowed."""
    observed: bool
    """status.observedGeneration has caught up with metadata.generation."""
    disrupted: int = 0
    """Entries in status.disruptedPods."""


@dataclass(frozen=True, slots=True)
class Victim:
    uid: str
    namespace: str
    name: str
    labels: Labels
    phase: str
    deleting: bool


def _requirement(expression: Mapping[str, Any]) -> Matcher | None:
    key = expression.get("key")
    operator = expression.get("operator")
    values = frozenset(str(v) for v in expression.get("values") or ())
    if not isinstance(key, str) or not key:
        return None
    if operator == "In" and values:
        return lambda labels: labels.get(key) in values
    if operator == "NotIn" and values:
        return lambda labels: labels.get(key) not in values
    if operator == "Exists" and not values:
        return lambda labels: key in labels
    if operator == "DoesNotExist" and not values:
        return lambda labels: key not in labels
    return None


def selector(raw: object) -> Matcher | None:
    """A metav1.LabelSelector as a predicate, as `LabelSelectorAsSelector` reads it: None
    (selects nothing) when it is absent or malformed; a present but empty one selects
    everything."""
    if not isinstance(raw, Mapping):
        return None
    wanted = raw.get("matchLabels") or {}
    expressions = raw.get("matchExpressions") or []
    if not isinstance(wanted, Mapping) or not isinstance(expressions, list):
        return None
    pairs = {str(key): str(value) for key, value in wanted.items()}
    tests: list[Matcher] = [lambda labels: all(labels.get(k) == v for k, v in pairs.items())]
    for expression in expressions:
        test = _requirement(expression) if isinstance(expression, Mapping) else None
        if test is None:
            return None
        tests.append(test)
    return lambda labels: all(test(labels) for test in tests)


def budget(pdb: Mapping[str, Any]) -> Budget:
    """One policy/v1 PodDisruptionBudget as the API server sent it."""
    metadata = pdb.get("metadata") or {}
    status = pdb.get("status") or {}
    allowed = status.get("disruptionsAllowed")
    generation = metadata.get("generation")
    observed = status.get("observedGeneration")
    disrupted = status.get("disruptedPods")
    return Budget(
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        matches=selector((pdb.get("spec") or {}).get("selector")),
        allowed=allowed if isinstance(allowed, int) else 0,
        observed=not isinstance(generation, int)
        or (isinstance(observed, int) and observed >= generation),
        disrupted=len(disrupted) if isinstance(disrupted, Mapping) else 0,
    )


def refused(budgets: Sequence[Budget], victims: Sequence[Victim]) -> dict[str, str]:
    """Victim UID → why the API server would refuse its eviction, were all `victims`
    evicted now in this order (see the module docstring). Victims not named may go."""
    why: dict[str, str] = {}
    used: dict[tuple[str, str], int] = {}
    for victim in victims:
        if victim.deleting or victim.phase in IGNORED_PHASES:
            continue
        mine = [
            b
            for b in budgets
            if b.namespace == victim.namespace
            and b.matches is not None
            and b.matches(victim.labels)
        ]
        if len(mine) > 1:
            names = ", ".join(sorted(b.name for b in mine))
            why[victim.uid] = f"it is covered by more than one PodDisruptionBudget ({names})"
            continue
        if not mine:
            continue
        (found,) = mine
        key = (found.namespace, found.name)
        if not found.observed:
            why[victim.uid] = f"PodDisruptionBudget {found.name} is still being processed"
            continue
        if found.disrupted + used.get(key, 0) > MAX_DISRUPTED_PODS:
            why[victim.uid] = (
                f"PodDisruptionBudget {found.name} has too many evictions not confirmed by "
                "the disruption controller"
            )
            continue
        if used.get(key, 0) >= found.allowed:
            why[victim.uid] = (
                f"PodDisruptionBudget {found.name} allows {max(found.allowed, 0)} disruption(s) now"
            )
            continue
        used[key] = used.get(key, 0) + 1
    return why
