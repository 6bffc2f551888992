"""A gang member as the gang controller keeps it, and the plan mark written on it.

`Reader.record(pod)` is the transform of the gang-pod informer (pods labelled
`gpuplace.io/gang`): the few fields gang decisions need, read once per event —
gang name, size and timeout (`gpuplace.cluster.annotations`), priority, creation time, our
scheduling gate, the GPU request, the node constraints (`gang_affinity.NodeFilter`),
the plan mark and the `gpuplace.io/GangReady` condition.

The plan mark is the value of the `gpuplace.io/gang-plan` annotation, compact JSON:
`{"id": "3f9c0a1b2c4d", "members": 4, "node": "gpu-a100-7"}` — the plan it belongs
to, how many members that plan placed, and this member's node. The member's GPUs are
in the assignment annotations (`gpuplace.cluster.assignments`), written in the same PATCH, so
the ledger rebuilt after a restart holds them exactly as planned.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpuplace.cluster import annotations as grammar
from gpuplace.cluster import assignments, keys, pods, taints
from gpuplace.extender.gang_affinity import NodeFilter
from gpuplace.placement.requests import GpuRequest
from gpuplace.placement.taints import Toleration

GangKey = tuple[str, str]
"""(namespace, gang name)."""


@dataclass(frozen=True, slots=True)
class PlanMark:
    """What the `gang-plan` annotation says: plan id, members in the plan, this node."""

    id: str
    members: int
    node: str

    def encode(self) -> str:
        return json.dumps(
            {"id": self.id, "members": self.members, "node": self.node}, separators=(",", ":")
        )

    @classmethod
    def decode(cls, raw: object) -> PlanMark | None:
        """The mark, or None when absent or unreadable (an unreadable mark is no plan)."""
        if not isinstance(raw, str) or not raw:
            return None
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        plan_id, members, node = value.get("id"), value.get("members"), value.get("node")
        if not isinstance(plan_id, str) or not plan_id or not isinstance(node, str) or not node:
            return None
        if not isinstance(members, int) or isinstance(members, bool) or members < 1:
            return None
        return cls(plan_id, members, node)


@dataclass(frozen=True, slots=True)
class GangPod:
    uid: str
    namespace: str
    name: str
    resource_version: str
    gang: str
    """Gang name ("" when the pod's gang annotations cannot be read)."""
    size: int
    timeout: float
    """`gang-timeout` in seconds."""
    priority: int
    created: float
    """metadata.creationTimestamp, POSIX seconds (0 when absent)."""
    gated: bool
    """Our gate `gpuplace.io/gang` is in spec.schedulingGates."""
    node_name: str
    phase: str
    deleting: bool
    request: GpuRequest | None
    plan: PlanMark | None
    assigned: bool
    """Carries assignment annotations."""
    filter: NodeFilter
    condition: tuple[str, str] | None
    """(status, reason) of the GangReady condition, if any."""
    problem: str = ""
    preemption_policy: str = ""
    """spec.preemptionPolicy ("Never": this member's gang never preempts)."""
    tolerations: tuple[Toleration, ...] = ()
    """spec.tolerations: the planner keeps it off nodes whose taints or cordon it does
    not tolerate, as kube-scheduler would."""

    @property
    def key(self) -> GangKey:
        return (self.namespace, self.gang)

    @property
    def terminal(self) -> bool:
        return self.phase in pods.TERMINAL_PHASES

    @property
    def live(self) -> bool:
        """Neither finished nor being deleted: it counts towards its gang."""
        return not self.terminal and not self.deleting

    def order(self) -> tuple[float, str]:
        """Oldest first, then by name: who is in the gang when more than N exist."""
        return (self.created, self.name)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def gates(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    raw = (pod.get("spec") or {}).get("schedulingGates") or []
    return [gate for gate in raw if isinstance(gate, dict)]


def gated(pod: Mapping[str, Any]) -> bool:
    """True while our gate is on the pod."""
    return any(gate.get("name") == keys.GANG_GATE for gate in gates(pod))


def plan_mark(pod: Mapping[str, Any]) -> PlanMark | None:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return PlanMark.decode(annotations.get(keys.GANG_PLAN))


def _timestamp(raw: object) -> float:
    if not isinstance(raw, str) or not raw:
        return 0.0
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def condition(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pod's GangReady condition, if any."""
    for item in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(item, dict) and item.get("type") == keys.GANG_CONDITION:
            return item
    return None


class Reader:
    """`record` with the request memo of `gpuplace.cluster.pods.Reader`."""

    def __init__(self) -> None:
        self._requests = pods.Reader()

    def record(self, pod: Mapping[str, Any]) -> GangPod:
        """The informer's transform: a pod dict → GangPod. O(annotations + containers)."""
        metadata = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        status = pod.get("status") or {}
        annotations = metadata.get("annotations") or {}
        labels = metadata.get("labels") or {}
        problem = ""
        gang = ""
        size = 0
        timeout = grammar.DEFAULT_GANG_TIMEOUT_SECONDS
        request: GpuRequest | None = None
        try:
            parsed = grammar.parse(annotations)
            if parsed is not None and parsed.gang is not None:
                gang, size = parsed.gang.name, parsed.gang.size
                timeout = parsed.gang.timeout_seconds
            request = self._requests.request(pod)
        except grammar.AnnotationError as error:
            problem = str(error)
        if not gang and not problem:
            problem = f"labelled {keys.GANG_LABEL}={labels.get(keys.GANG_LABEL, '')} but "
            problem += f"has no {keys.GANG_NAME} annotation"
        found = condition(pod)
        priority = spec.get("priority")
        return GangPod(
            uid=str(metadata.get("uid") or ""),
            namespace=str(metadata.get("namespace") or ""),
            name=str(metadata.get("name") or ""),
            resource_version=str(metadata.get("resourceVersion") or ""),
            gang=gang,
            size=size,
            timeout=timeout,
            priority=priority if isinstance(priority, int) else 0,
            created=_timestamp(metadata.get("creationTimestamp")),
            gated=gated(pod),
            node_name=str(spec.get("nodeName") or ""),
            phase=str(status.get("phase") or ""),
            deleting=bool(metadata.get("deletionTimestamp")),
            request=request,
            plan=plan_mark(pod),
            assigned=assignments.assigned(pod),
            filter=NodeFilter.of(pod),
            condition=(str(found.get("status")), str(found.get("reason") or ""))
            if found is not None
            else None,
            problem=problem,
            preemption_policy=str(spec.get("preemptionPolicy") or ""),
            tolerations=taints.of_pod(pod),
        )
