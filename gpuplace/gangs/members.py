"""A gang member as the gang controller keeps it.

`Reader.record(pod)` is the transform of the gang-pod informer (pods labelled
`gpuplace.io/gang`): the few fields gang decisions need, read once per event —
gang name, size and timeout (`gpuplace.cluster.grammar`), priority, creation time,
our scheduling gate and the plan mark (`gpuplace.cluster.gang_marks`), whether its queue
holds it (the queue label and gate), the GPU request,
the node constraints (`gpuplace.cluster.node_affinity.NodeAffinity`) and the
`gpuplace.io/GangReady` condition.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import assignments, grammar, keys, pods, taints
from gpuplace.cluster.gang_marks import PlanMark, gated, plan_mark, queued
from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.placement.gangs import GangKey
from gpuplace.placement.requests import GpuRequest
from gpuplace.placement.taints import Toleration


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
    affinity: NodeAffinity
    """Where its spec lets it go (nodeSelector, required node affinity)."""
    condition: tuple[str, str] | None
    """(status, reason) of the GangReady condition, if any."""
    problem: str = ""
    preemption_policy: str = ""
    """spec.preemptionPolicy ("Never": this member's gang never preempts)."""
    tolerations: tuple[Toleration, ...] = ()
    """spec.tolerations: the planner keeps it off nodes whose taints or cordon it does
    not tolerate, as kube-scheduler would."""
    minimum: int = 0
    """`gang-min`: an elastic gang may run with this many members (0: all of `size`)."""
    queued: bool = False
    """The webhook queued it (label `gpuplace.io/queue`): its GpuQueue admits the gang and
    writes its plan; the gang controller never plans it, it only settles that plan."""
    queue_gated: bool = False
    """The queue's gate is still on it (its queue has not admitted it yet)."""

    @property
    def elastic(self) -> bool:
        return 0 < self.minimum < self.size

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
        size = minimum = 0
        timeout = grammar.DEFAULT_GANG_TIMEOUT_SECONDS
        request: GpuRequest | None = None
        try:
            parsed = grammar.parse(annotations)
            if parsed is not None and parsed.gang is not None:
                gang, size = parsed.gang.name, parsed.gang.size
                timeout = parsed.gang.timeout_seconds
                minimum = parsed.gang.minimum
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
            created=pods.timestamp(metadata.get("creationTimestamp")),
            gated=gated(pod),
            node_name=str(spec.get("nodeName") or ""),
            phase=str(status.get("phase") or ""),
            deleting=bool(metadata.get("deletionTimestamp")),
            request=request,
            plan=plan_mark(pod),
            assigned=assignments.assigned(pod),
            affinity=NodeAffinity.of(pod),
            condition=(str(found.get("status")), str(found.get("reason") or ""))
            if found is not None
            else None,
            problem=problem,
            preemption_policy=str(spec.get("preemptionPolicy") or ""),
            tolerations=taints.of_pod(pod),
            minimum=minimum,
            queued=queued(pod),
            queue_gated=gated(pod, keys.QUEUE_GATE),
        )
