"""A managed pod as the sidecar keeps it: the few fields decisions need, read once.

`record(pod_dict)` is the pod informer's transform: it reads the GPU request
(`grammar.request_for`), an elastic gang's `gang-min` (from the same parse) and the grant
(`assignments.grant_of`) when the event arrives, so the ledger sync and the extender
never parse a pod twice and the informer's cache holds ~1 KB per pod instead of the
whole object. A pod whose annotations cannot be read is still recorded (with `problem`
saying why), never dropped: its name must stay resolvable for bind and `gpuplace explain`.

Must never do I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpuplace.cluster import assignments, grammar, keys
from gpuplace.placement.ledger import Grant
from gpuplace.placement.requests import GpuRequest

Read = tuple[GpuRequest | None, int]
"""A pod's GPU request (None: it asks for none) and its elastic gang's `gang-min` (0: none)."""
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
_REQUEST_MEMO_LIMIT = 1 << 16
_SYSTEM = frozenset(keys.SYSTEM_ANNOTATIONS)
"""Known system annotations: they never change what a pod asks for."""


@dataclass(frozen=True, slots=True)
class PodRecord:
    uid: str
    namespace: str
    name: str
    resource_version: str
    node_name: str
    """spec.nodeName: "" until bound."""
    phase: str
    deleting: bool
    """metadata.deletionTimestamp is set (containers may still run)."""
    gated: bool
    """spec.schedulingGates is not empty."""
    request: GpuRequest | None
    """What the pod asks for; None when it asks for no GPU or its annotations are bad."""
    grant: Grant | None
    """What its assignment annotations say it holds (None: nothing, or unreadable)."""
    assigned_at: float | None
    """POSIX time of the assignment annotation."""
    problem: str = ""
    """Why `request` or `grant` could not be read ("" when fine)."""
    gang: str = ""
    """The gang label ("" for none)."""
    priority: int = 0
    """spec.priority (what its PriorityClass resolved to at creation; 0 without)."""
    nominated: str = ""
    """status.nominatedNodeName: the node kube-scheduler preempted for it ("" for none)."""
    unschedulable: bool = False
    """kube-scheduler's last try found no node: condition PodScheduled False, reason
    Unschedulable (it tries again when the cluster changes)."""
    minimum: int = 0
    """`gang-min` of an elastic gang (`Gang.elastic_minimum`; 0: every member is needed)."""
    created: float = 0.0
    """metadata.creationTimestamp, POSIX seconds (0 when absent)."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def terminal(self) -> bool:
        """Succeeded or Failed: its containers have stopped and its GPUs are free."""
        return self.phase in TERMINAL_PHASES

    @property
    def bound(self) -> bool:
        return bool(self.node_name)

    @property
    def started(self) -> tuple[float, str]:
        """When it started, as the queue controller orders a gang's members (its
        `assigned-at`, else its creation), then its name: an elastic gang gives back the
        most recently started first (`gpuplace.placement.elastic.extras`)."""
        return (self.assigned_at or self.created, self.name)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class Reader:
    """`record` with a memo of requests by the inputs `request_for` reads.

    Pods of one Job or Deployment share annotations and container resources; the memo
    turns 100,000 annotation parses into a few hundred. Bounded; O(annotations).
    """

    def __init__(self) -> None:
        self._requests: dict[object, Read | grammar.AnnotationError] = {}

    def request(self, pod: Mapping[str, Any]) -> GpuRequest | None:
        """`gpuplace.cluster.grammar.request_for(pod)`, memoised. Raises `AnnotationError`, also
        for a pod whose shape is not a pod's (annotations not strings, containers not a
        list of objects...)."""
        return self.read(pod)[0]

    def read(self, pod: Mapping[str, Any]) -> Read:
        """`request(pod)` and its elastic gang's `gang-min` (0: not elastic), from one
        parse, memoised. Raises as `request`."""
        metadata = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        try:
            ours = metadata.get("annotations") or {}
            memo_key: object = (
                tuple(
                    sorted(
                        (k, v)
                        for k, v in ours.items()
                        if k.startswith(keys.PREFIX) and k not in _SYSTEM
                    )
                ),
                # repr, not sorted JSON: the API server writes maps sorted (Go), and a
                # different order would only cost a memo miss, never a wrong answer
                repr(
                    [
                        (c.get("resources"), c.get("restartPolicy"), c.get("name"))
                        for field in ("containers", "initContainers")
                        for c in spec.get(field) or ()
                    ]
                ),
                repr(spec.get("overhead")),
            )
            hash(memo_key)
        except (TypeError, AttributeError, ValueError):
            memo_key = None
        if memo_key is not None and memo_key in self._requests:
            found = self._requests[memo_key]
            if isinstance(found, grammar.AnnotationError):
                raise found
            return found
        _check_shape(pod)
        read: Read | grammar.AnnotationError
        try:
            spec = grammar.parse(metadata.get("annotations") or {})
            request = grammar.request_of(pod, spec)
            read = (request, spec.gang.elastic_minimum if spec and spec.gang else 0)
        except grammar.AnnotationError as error:
            read = error
        except (TypeError, ValueError, AttributeError) as error:
            read = grammar.AnnotationError.one("spec", f"the pod cannot be read: {error}")
        if memo_key is not None:
            if len(self._requests) >= _REQUEST_MEMO_LIMIT:
                self._requests.clear()
            self._requests[memo_key] = read
        if isinstance(read, grammar.AnnotationError):
            raise read
        return read

    def record(self, pod: Mapping[str, Any]) -> PodRecord:
        """The informer's transform: a pod dict → PodRecord. O(annotations + containers)."""
        metadata = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        status = pod.get("status") or {}
        problem = ""
        try:
            request, minimum = self.read(pod)
        except grammar.AnnotationError as error:
            request, minimum, problem = None, 0, str(error)
        try:
            grant = assignments.grant_of(pod, request)
        except assignments.AssignmentError as error:
            grant, problem = None, str(error)
        node_name = str(spec.get("nodeName") or "")
        if grant is not None and node_name and node_name != grant.node:
            problem = f"bound to {node_name} but its GPUs were assigned on {grant.node}"
            grant = None
        labels = metadata.get("labels") or {}
        return PodRecord(
            uid=str(metadata.get("uid") or ""),
            namespace=str(metadata.get("namespace") or ""),
            name=str(metadata.get("name") or ""),
            resource_version=str(metadata.get("resourceVersion") or ""),
            node_name=node_name,
            phase=str(status.get("phase") or ""),
            deleting=bool(metadata.get("deletionTimestamp")),
            gated=bool(spec.get("schedulingGates")),
            request=request,
            grant=grant,
            assigned_at=assignments.assigned_at(pod) if grant is not None else None,
            problem=problem,
            gang=str(labels.get(keys.GANG_LABEL) or ""),
            priority=priority_of(spec.get("priority")),
            nominated=str(status.get("nominatedNodeName") or ""),
            unschedulable=no_node_fits(status.get("conditions")),
            minimum=minimum,
            created=timestamp(metadata.get("creationTimestamp")),
        )


def started(members: Iterable[PodRecord]) -> list[PodRecord]:
    """A gang's started live members (bound, neither finished nor being deleted), oldest
    started first (`PodRecord.started`): the order `gpuplace.placement.elastic.extras`
    reads. O(m log m)."""
    return sorted(
        (m for m in members if m.bound and not m.terminal and not m.deleting),
        key=lambda m: m.started,
    )


def timestamp(raw: object) -> float:
    """An RFC 3339 time (creationTimestamp) as POSIX seconds; 0 when absent or unreadable."""
    if not isinstance(raw, str) or not raw:
        return 0.0
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


UNSCHEDULABLE = "Unschedulable"
"""The reason kube-scheduler gives its PodScheduled=False condition when no node fits."""


def no_node_fits(conditions: object) -> bool:
    """Whether status.conditions hold PodScheduled False with reason Unschedulable.
    O(conditions); anything not a list of objects reads as no."""
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(condition, Mapping)
        and condition.get("type") == "PodScheduled"
        and condition.get("status") == "False"
        and condition.get("reason") == UNSCHEDULABLE
        for condition in conditions
    )


def priority_of(value: object) -> int:
    """spec.priority as an int32 (0 when absent or not a number)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(-(1 << 31), min(value, (1 << 31) - 1))


def _check_shape(pod: Mapping[str, Any]) -> None:
    """Raise AnnotationError unless the parts `request_for` reads have a pod's shape."""

    def bad(where: str, what: str) -> grammar.AnnotationError:
        return grammar.AnnotationError.one(where, f"{where} must be {what}")

    metadata = pod.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise bad("metadata", "an object")
    notes = (metadata or {}).get("annotations")
    if notes is not None and (
        not isinstance(notes, Mapping)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in notes.items())
    ):
        raise bad("metadata.annotations", "an object of strings")
    spec = pod.get("spec")
    if spec is not None and not isinstance(spec, Mapping):
        raise bad("spec", "an object")
    for field in ("containers", "initContainers"):
        containers = (spec or {}).get(field)
        if containers is None:
            continue
        if not isinstance(containers, list) or not all(
            isinstance(c, Mapping)
            and isinstance(c.get("resources") or {}, Mapping)
            and all(isinstance(v or {}, Mapping) for v in (c.get("resources") or {}).values())
            for c in containers
        ):
            raise bad(f"spec.{field}", "a list of containers")
    if not isinstance((spec or {}).get("overhead") or {}, Mapping):
        raise bad("spec.overhead", "an object")


def record(pod: Mapping[str, Any]) -> PodRecord:
    """`Reader().record(pod)` without a memo (one-off reads: explain, tests)."""
    return Reader().record(pod)
