"""The GpuQueues and the namespaces' labels as the sidecar keeps them: which queue a GPU pod
uses, and whether it may.

Two informers feed one `QueueDirectory`: GpuQueues (`gpuqueues.gpuplace.io`, cluster-scoped,
read into the engine's `QueueSpec` by `gpuplace.cluster.gpuqueues`) and namespaces (their
labels: `gpuplace.io/queue` names a namespace's default queue, and a queue's
`namespaceSelector` matches them). The admission webhook, in the same process, asks
`resolve` about every GPU pod it admits (a pod naming a queue that does not exist, or one
its namespace may not use, is refused there); the queue controller reads the queues'
specs and the status they show.

`resolve(namespace, asked)` is docs/queues.md's rule: the pod's `gpuplace.io/queue`
annotation (`asked`), else its namespace's label, else no queue. A namespace the informer
has not seen yet is matched by the one label the API server puts on every namespace
(`kubernetes.io/metadata.name`).

Handlers run synchronously in the event loop and never do I/O; `resolve` is
O(selector terms), `specs` O(queues).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gpuplace.cluster import gpuqueues, grammar, keys, kube, watching
from gpuplace.placement.queueing import quotas

NAME_LABEL = "kubernetes.io/metadata.name"
"""The label kube-apiserver sets on every namespace to its name."""
API_VERSION = "gpuplace.io/v1alpha1"
KIND = "GpuQueue"
SHOWN_QUEUES = 8
"""Queue names a refusal lists at most."""


@dataclass(frozen=True, slots=True)
class QueueRecord:
    """One GpuQueue: its engine spec (None when it cannot be used, `problem` says why),
    who may use it, and the status it shows now."""

    name: str
    uid: str
    generation: int
    spec: quotas.QueueSpec | None
    selector: gpuqueues.LabelSelector | None
    """Its `namespaceSelector`; None: no namespace may use it."""
    problem: str = ""
    status: Mapping[str, Any] = field(default_factory=dict)
    """Its `status` as last read (the controller writes only what differs)."""


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    name: str
    uid: str
    labels: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Resolution:
    """Which queue a pod uses: `queue` ("" for none), named by `source` (`annotation` or
    `namespace`), or `refusal`: why it may not."""

    queue: str = ""
    source: str = ""
    refusal: str = ""
    forbidden: bool = False
    """The refusal is the queue's choice (its namespaceSelector leaves the namespace out),
    not a queue that is missing or broken."""


def queue_record(raw: Mapping[str, Any]) -> QueueRecord:
    """The GpuQueue informer's transform; never raises for an object with a name."""
    metadata = raw.get("metadata") or {}
    name = str(metadata.get("name") or "")
    generation = metadata.get("generation")
    status = raw.get("status")
    base = QueueRecord(
        name=name,
        uid=str(metadata.get("uid") or ""),
        generation=generation if isinstance(generation, int) else 0,
        spec=None,
        selector=None,
        status=dict(status) if isinstance(status, Mapping) else {},
    )
    try:
        # the informer lists gpuqueues: an item without apiVersion and kind (a list of a
        # built-in kind leaves them out; some servers do so for custom resources too) is
        # one all the same
        queue = gpuqueues.read({"apiVersion": API_VERSION, "kind": KIND, **raw})
        spec = gpuqueues.to_spec(queue)
    except gpuqueues.QueueError as error:
        return replace(base, problem=str(error))
    return replace(base, spec=spec, selector=queue.spec.namespace_selector)


def namespace_record(raw: Mapping[str, Any]) -> NamespaceRecord:
    """The namespace informer's transform."""
    metadata = raw.get("metadata") or {}
    labels = metadata.get("labels") or {}
    return NamespaceRecord(
        name=str(metadata.get("name") or ""),
        uid=str(metadata.get("uid") or ""),
        labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {},
    )


def describe(selector: gpuqueues.LabelSelector) -> str:
    """A namespaceSelector as a person reads it: `team=a, tier In (x, y)`; `{}` for all."""
    parts = [f"{key}={value}" for key, value in sorted(selector.match_labels.items())]
    for requirement in selector.match_expressions:
        values = f" ({', '.join(requirement.values)})" if requirement.values else ""
        parts.append(f"{requirement.key} {requirement.operator}{values}")
    return ", ".join(parts) or "{} (every namespace)"


class QueueDirectory:
    """GpuQueues by name and namespaces by name; see the module docstring."""

    def __init__(self) -> None:
        self.queues: dict[str, QueueRecord] = {}
        self.namespaces: dict[str, NamespaceRecord] = {}
        self.queues_synced = asyncio.Event()
        self.namespaces_synced = asyncio.Event()
        self.version = 0
        """Grows with every change of a queue or a namespace."""
        self.listeners: list[Callable[[], None]] = []
        """Called after every change (the queue controller's wake-up)."""
        self.queue_handler = _Handler(self, "queues")
        self.namespace_handler = _Handler(self, "namespaces")

    # --- reading ---------------------------------------------------------------------

    def synced(self) -> bool:
        return self.queues_synced.is_set() and self.namespaces_synced.is_set()

    def not_ready_reason(self) -> str | None:
        if not self.queues_synced.is_set():
            return (
                "GpuQueue informer has not listed yet (is the CRD gpuqueues.gpuplace.io "
                "installed? deploy/base/gpuqueue-crd.yaml)"
            )
        if not self.namespaces_synced.is_set():
            return "namespace informer has not listed yet"
        return None

    def specs(self) -> list[quotas.QueueSpec]:
        """The engine specs of every queue that can be used, by name."""
        return [record.spec for _, record in sorted(self.queues.items()) if record.spec is not None]

    def labels(self, namespace: str) -> Mapping[str, str]:
        found = self.namespaces.get(namespace)
        return found.labels if found is not None else {NAME_LABEL: namespace}

    def resolve(self, namespace: str, asked: str | None) -> Resolution:
        """The queue a GPU pod of `namespace` uses, given its `gpuplace.io/queue`
        annotation (`asked`, None when absent), or why it may not (module docstring)."""
        labels = self.labels(namespace)
        source = "annotation"
        name = asked
        if name is None:
            default = labels.get(keys.QUEUE_LABEL)
            if default is None:
                return Resolution()
            source = "namespace"
            name = grammar.queue_name(default)
            if name is None:
                return Resolution(
                    refusal=f"namespace {namespace} has the label {keys.QUEUE_LABEL}="
                    f"{default[:63]!r}, which is not a GpuQueue name; an admin must fix it"
                )
        named = (
            f"named by {keys.QUEUE}"
            if source == "annotation"
            else f"the default of namespace {namespace} (its label {keys.QUEUE_LABEL})"
        )
        record = self.queues.get(name)
        if record is None:
            known = sorted(self.queues)
            shown = ", ".join(known[:SHOWN_QUEUES]) + (" ..." if len(known) > SHOWN_QUEUES else "")
            return Resolution(
                name,
                source,
                f"GpuQueue {name} ({named}) does not exist; the queues are: "
                f"{shown or 'none'} (kubectl get gpuqueues)",
            )
        if record.spec is None:
            return Resolution(
                name, source, f"GpuQueue {name} ({named}) cannot be used: {record.problem}"
            )
        if record.selector is None:
            return Resolution(
                name,
                source,
                f"GpuQueue {name} ({named}) has no namespaceSelector, so no namespace may use "
                "it; an admin must add one",
            )
        if not record.selector.matches(labels):
            return Resolution(
                name,
                source,
                f"namespace {namespace} may not use GpuQueue {name} ({named}): its "
                f"namespaceSelector is {describe(record.selector)}",
                forbidden=True,
            )
        return Resolution(name, source)

    # --- the informers' handlers -----------------------------------------------------

    def _changed(self) -> None:
        self.version += 1
        for listener in self.listeners:
            listener()


class _Handler:
    """The handler of one informer (GpuQueues or namespaces), keyed by name."""

    def __init__(self, directory: QueueDirectory, kind: str) -> None:
        self.directory = directory
        self.kind = kind

    def _table(self) -> dict[str, Any]:
        if self.kind == "queues":
            return self.directory.queues
        return self.directory.namespaces

    def replace(self, objects: list[Any]) -> None:
        table = self._table()
        table.clear()
        table.update((obj.name, obj) for obj in objects if obj.name)
        synced = (
            self.directory.queues_synced
            if self.kind == "queues"
            else self.directory.namespaces_synced
        )
        synced.set()
        self.directory._changed()

    def upsert(self, obj: Any) -> None:
        if obj.name:
            self._table()[obj.name] = obj
            self.directory._changed()

    def delete(self, obj: Any) -> None:
        table = self._table()
        if table.get(obj.name) is not None and table[obj.name].uid in (obj.uid, ""):
            del table[obj.name]
        self.directory._changed()


def informers(
    api: kube.Kube,
    directory: QueueDirectory,
    *,
    page_size: int = 500,
    watch_seconds: int = 300,
    metrics: watching.InformerMetrics | None = None,
) -> tuple[watching.Informer[QueueRecord], watching.Informer[NamespaceRecord]]:
    """The GpuQueue and namespace informers feeding `directory` (run each with `.run()`)."""
    queues: watching.Informer[QueueRecord] = watching.Informer(
        api,
        "gpuqueues",
        directory.queue_handler,
        queue_record,
        page_size=page_size,
        watch_seconds=watch_seconds,
        metrics=metrics,
    )
    namespaces: watching.Informer[NamespaceRecord] = watching.Informer(
        api,
        "namespaces",
        directory.namespace_handler,
        namespace_record,
        page_size=page_size,
        watch_seconds=watch_seconds,
        metrics=metrics,
    )
    return queues, namespaces
