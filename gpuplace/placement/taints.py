"""Node taints, pod tolerations and cordons, as kube-scheduler judges them.

The gang planner places members itself, before kube-scheduler sees them, so it must never
plan onto a node kube-scheduler would refuse them: `admits(node, tolerations)` is
kube-scheduler's two filters of the kind, with their exact semantics
(k8s.io/component-helpers `Toleration.ToleratesTaint`, the scheduler plugins
TaintToleration and NodeUnschedulable):

- every taint of effect `NoSchedule` or `NoExecute` must be tolerated (`PreferNoSchedule`
  only scores, it never filters);
- a toleration tolerates a taint when its effect is empty or equal, its key is empty
  (operator `Exists`: every key) or equal, and its operator is `Exists` (any value) or
  `Equal`/empty (equal values); any other operator tolerates nothing (the numeric `Lt`/`Gt`
  of the alpha gate TaintTolerationComparisonOperators, off by default: a node kube-scheduler
  might take is left out, never the other way round);
- a cordoned node (`spec.unschedulable`) admits only pods that tolerate the taint
  `node.kubernetes.io/unschedulable:NoSchedule`.

Pure values and functions; `admits` is O(taints × tolerations).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"
FILTERING = frozenset({NO_SCHEDULE, NO_EXECUTE})
"""Effects that keep a pod off a node (kube-scheduler's DoNotScheduleTaintsFilterFunc)."""
EXISTS = "Exists"
EQUAL = "Equal"


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str = ""
    effect: str = NO_SCHEDULE

    def __str__(self) -> str:
        value = f"={self.value}" if self.value else ""
        return f"{self.key}{value}:{self.effect}"


UNSCHEDULABLE = Taint("node.kubernetes.io/unschedulable", "", NO_SCHEDULE)
"""What a cordoned node asks a pod to tolerate (NodeUnschedulable plugin)."""


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str = ""
    operator: str = EQUAL
    value: str = ""
    effect: str = ""
    """Empty: every effect."""

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        if self.operator == EXISTS:
            return True
        if self.operator in ("", EQUAL):
            return self.value == taint.value
        return False


def tolerated(taint: Taint, tolerations: Iterable[Toleration]) -> bool:
    return any(toleration.tolerates(taint) for toleration in tolerations)


def untolerated(
    taints: Iterable[Taint], tolerations: Iterable[Toleration], *, unschedulable: bool = False
) -> Taint | None:
    """The first taint that keeps a pod with `tolerations` off the node (the cordon's
    `UNSCHEDULABLE` first), or None when kube-scheduler would let it on."""
    held = tuple(tolerations)
    if unschedulable and not tolerated(UNSCHEDULABLE, held):
        return UNSCHEDULABLE
    for taint in taints:
        if taint.effect in FILTERING and not tolerated(taint, held):
            return taint
    return None
