"""A queued pod as the queue controller keeps it, and the store its informer fills.

`Reader.record(pod)` is the transform of the queued-pod informer (pods labelled
`gpuplace.io/managed=true` and `gpuplace.io/queue`: the webhook puts both on every pod it
queues): the few fields admission needs, read once per event — its queue (the label),
whether the queue gate and the gang gate are on it, its gang (name, size, `gang-min`),
priority, creation time, when it was admitted (its `assigned-at`), the GPU request, the
node constraints, the plan mark. Which pods are admitted is read from the pods
themselves (the queue gate is gone), so a restart rebuilds the same admissions.

`QueueStore` keeps them by UID and calls its listeners on every change (the controller's
wake-up). Pure apart from the informer: no I/O in the handlers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import assignments, grammar, keys, kube, pods, taints, watching
from gpuplace.cluster.gang_marks import PlanMark, gated, plan_mark
from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.placement.requests import GpuRequest
from gpuplace.placement.taints import Toleration

SELECTOR = f"{keys.MANAGED}=true,{keys.QUEUE_LABEL}"


@dataclass(frozen=True, slots=True)
class QueuedPod:
    uid: str
    namespace: str
    name: str
    resource_version: str
    queue: str
    gated: bool
    """The queue gate is on it: it waits for its queue."""
    gang_gated: bool
    gang: str
    """Its gang's name ("" for a pod alone)."""
    size: int
    minimum: int
    """`gang-min` of an elastic gang (0: not elastic)."""
    priority: int
    created: float
    """metadata.creationTimestamp, POSIX seconds (0 when absent)."""
    admitted: float
    """When its queue admitted it (`assigned-at`, POSIX seconds; 0: not known)."""
    node_name: str
    phase: str
    deleting: bool
    request: GpuRequest | None
    plan: PlanMark | None
    assigned: bool
    affinity: NodeAffinity
    tolerations: tuple[Toleration, ...] = ()
    problem: str = ""

    @property
    def key(self) -> str:
        """The workload it belongs to: `namespace/name`, or `gang namespace/name`."""
        if self.gang:
            return f"gang {self.namespace}/{self.gang}"
        return f"{self.namespace}/{self.name}"

    @property
    def terminal(self) -> bool:
        return self.phase in pods.TERMINAL_PHASES

    @property
    def live(self) -> bool:
        return not self.terminal and not self.deleting

    @property
    def elastic(self) -> bool:
        return 0 < self.minimum < self.size

    def order(self) -> tuple[float, str]:
        """Oldest first, then by name (who is in a gang when more than its size exist)."""
        return (self.created, self.name)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class Reader:
    """`record` with the request memo of `gpuplace.cluster.pods.Reader`."""

    def __init__(self) -> None:
        self._requests = pods.Reader()

    def record(self, pod: Mapping[str, Any]) -> QueuedPod:
        """The informer's transform: a pod dict -> QueuedPod. O(annotations + containers)."""
        metadata = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        annotations = metadata.get("annotations") or {}
        labels = metadata.get("labels") or {}
        problem = ""
        gang = ""
        size = minimum = 0
        request: GpuRequest | None = None
        try:
            parsed = grammar.parse(annotations)
            if parsed is not None and parsed.gang is not None:
                gang, size = parsed.gang.name, parsed.gang.size
                minimum = parsed.gang.elastic_minimum
            request = self._requests.request(pod)
        except grammar.AnnotationError as error:
            problem = str(error)
        priority = spec.get("priority")
        return QueuedPod(
            uid=str(metadata.get("uid") or ""),
            namespace=str(metadata.get("namespace") or ""),
            name=str(metadata.get("name") or ""),
            resource_version=str(metadata.get("resourceVersion") or ""),
            queue=str(labels.get(keys.QUEUE_LABEL) or ""),
            gated=gated(pod, keys.QUEUE_GATE),
            gang_gated=gated(pod, keys.GANG_GATE),
            gang=gang,
            size=size,
            minimum=minimum,
            priority=pods.priority_of(priority),
            created=pods.timestamp(metadata.get("creationTimestamp")),
            admitted=assignments.assigned_at(pod) or 0.0,
            node_name=str(spec.get("nodeName") or ""),
            phase=str((pod.get("status") or {}).get("phase") or ""),
            deleting=bool(metadata.get("deletionTimestamp")),
            request=request,
            plan=plan_mark(pod),
            assigned=assignments.assigned(pod),
            affinity=NodeAffinity.of(pod),
            tolerations=taints.of_pod(pod),
            problem=problem,
        )


class QueueStore:
    """Queued pods by UID; see the module docstring."""

    def __init__(self) -> None:
        self.pods: dict[str, QueuedPod] = {}
        self.synced = asyncio.Event()
        self.version = 0
        """Grows with every change."""
        self.listeners: list[Callable[[], None]] = []

    def _tell(self) -> None:
        self.version += 1
        for listener in self.listeners:
            listener()

    def replace(self, objects: list[QueuedPod]) -> None:
        self.pods = {pod.uid: pod for pod in objects}
        self.synced.set()
        self._tell()

    def upsert(self, obj: QueuedPod) -> None:
        self.pods[obj.uid] = obj
        self._tell()

    def delete(self, obj: QueuedPod) -> None:
        self.pods.pop(obj.uid, None)
        self._tell()


def informer(
    api: kube.Kube,
    store: QueueStore,
    *,
    page_size: int = 500,
    watch_seconds: int = 300,
    metrics: watching.InformerMetrics | None = None,
) -> watching.Informer[QueuedPod]:
    """The queued-pod informer feeding `store` (run it with `.run()`)."""
    return watching.Informer(
        api,
        "pods",
        store,
        Reader().record,
        label_selector=SELECTOR,
        page_size=page_size,
        watch_seconds=watch_seconds,
        metrics=metrics,
    )
