"""A managed pod as the sidecar keeps it: the one reading of a pod in a process.

`Reader.record(pod_dict)` is the transform of the process's one informer of managed pods
(`gpuplace.cluster.mirroring`): when the event arrives it reads the GPU request
(`grammar.request_for`), the gang annotations (name, size, timeout, an elastic gang's
`gang-min`: from the same parse, memoised across pods that share them) and the grant
(`assignments.grant_of`), and, for the pods the gang, queue and plan controllers keep
(those labelled `gpuplace.io/gang` or `gpuplace.io/queue`, or behind the planner's gate
`gpuplace.io/place`), what they decide with: the gates (the planner's release also keeps
the pod's raw `spec.affinity`, which it narrows without a read),
the plan mark (`gpuplace.cluster.gang_marks`), the node constraints
(`gpuplace.cluster.node_affinity`), the tolerations, the GangReady condition, the
preemption policy. So the ledger sync, the extender's verbs and the controllers read
one immutable `PodRecord` per pod version and never parse a pod again (the controllers'
indexes, `gpuplace.controllers.store`, hold these very records), and the informer's
cache holds ~1 KB per pod instead of the whole object. A pod whose annotations cannot
be read is still recorded (with `problem` saying why), never dropped: its name must
stay resolvable for bind and `gpuplace explain`.

Must never do I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpuplace.cluster import assignments, dra_claims, grammar, keys, taints
from gpuplace.cluster.gang_marks import PlanMark, gated, plan_mark
from gpuplace.cluster.gang_marks import gates as gates_of
from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.placement.gangs import Domain, GangKey
from gpuplace.placement.inventory import Inventory
from gpuplace.placement.ledger import Grant
from gpuplace.placement.requests import GpuRequest
from gpuplace.placement.taints import Toleration

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
_REQUEST_MEMO_LIMIT = 1 << 16
_SYSTEM = frozenset(keys.SYSTEM_ANNOTATIONS)
"""Known system annotations: they never change what a pod asks for."""


NO_CONSTRAINTS = NodeAffinity((), None)
"""The node constraints of a pod that has none (and of pods no controller keeps)."""


@dataclass(frozen=True, slots=True)
class Read:
    """What a pod's own annotations and containers say, shared by the pods that say the
    same (`Reader`'s memo): its GPU request (None: it asks for none) and its gang's
    annotations ("" and 0 without a gang)."""

    request: GpuRequest | None
    gang: str = ""
    """`gang-name`."""
    size: int = 0
    """`gang-size`."""
    timeout: float = grammar.DEFAULT_GANG_TIMEOUT_SECONDS
    """`gang-timeout`, seconds."""
    minimum: int = 0
    """`gang-min` of an elastic gang (`grammar.Gang.elastic_minimum`; 0: every member)."""
    restart: bool = False
    """`gang-on-failure` (or its default) is `restart`: a member's failure ends the run of
    all (`grammar.Gang.failure_policy`)."""
    domain: str = ""
    """`gang-domain`: the node label whose values the gang keeps to ("": any nodes)."""
    domain_required: bool = True
    """`gang-domain-policy` is `required` (else `preferred`)."""


@dataclass(frozen=True, slots=True)
class Controlled:
    """What the gang, queue and plan controllers decide with, read for the pods they keep
    (those labelled `gpuplace.io/gang` or `gpuplace.io/queue`, those behind the gate
    `gpuplace.io/place`, and those on the DRA path, whose GPUs the claim controller plans);
    every other pod shares `UNCONTROLLED` (one slot of its record,
    not a dozen)."""

    queue: str = ""
    """The queue label: the GpuQueue the webhook queued it in ("" for none)."""
    gang_name: str = ""
    """`gang-name` ("" without a gang, or when its annotations cannot be read)."""
    gang_size: int = 0
    """`gang-size` (0 without a gang)."""
    gang_timeout: float = grammar.DEFAULT_GANG_TIMEOUT_SECONDS
    """`gang-timeout`, seconds."""
    gang_gated: bool = False
    """Our gang gate `gpuplace.io/gang` is in spec.schedulingGates."""
    queue_gated: bool = False
    """The queue's gate is still on it (its queue has not admitted it yet)."""
    place_gated: bool = False
    """The planner's gate `gpuplace.io/place` is still on it (`gpuplace.planning`)."""
    gates: tuple[str, ...] = ()
    """The names of all its scheduling gates, ours and others', in order."""
    spec_affinity: Any = dataclasses.field(default=None, compare=False, hash=False)
    """spec.affinity as the API has it, for a pod behind the planner's gate only (its
    release narrows it without reading the pod again); None otherwise."""
    plan: PlanMark | None = None
    """The gang plan it carries (`gpuplace.io/gang-plan`), if readable."""
    assigned: bool = False
    """Carries assignment annotations (readable or not)."""
    affinity: NodeAffinity = NO_CONSTRAINTS
    """Where its spec lets it go (nodeSelector, required node affinity)."""
    tolerations: tuple[Toleration, ...] = ()
    """spec.tolerations: a plan keeps it off nodes whose taints or cordon it does not
    tolerate, as kube-scheduler would."""
    preemption_policy: str = ""
    """spec.preemptionPolicy ("Never": a gang with this member never preempts)."""
    gang_ready: tuple[str, str] | None = None
    """(status, reason) of its `gpuplace.io/GangReady` condition, if any."""
    restart: bool = False
    """Its gang restarts as a whole when a member fails (`Read.restart`)."""
    domain: str = ""
    """`gang-domain` ("" for none)."""
    domain_required: bool = True
    """`gang-domain-policy` is `required`."""
    failure: str = ""
    """Why it has failed, in words for Events ("" while it has not: `failure_of`)."""
    disrupted: bool = False
    """It carries the condition `DisruptionTarget=True` (evicted, preempted or deleted by
    a controller)."""
    ending: bool = False
    """It ends by itself (`ending`): every container has terminated and none is restarted
    (`restartPolicy: Never`), so the kubelet makes it Failed or Succeeded, once it has
    stopped the pod (seen on v1.36: the exit shows first, the phase later)."""


UNCONTROLLED = Controlled()


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
    """spec.schedulingGates is not empty (anyone's gates: `gang_gated`, `queue_gated` are
    ours)."""
    request: GpuRequest | None
    """What the pod asks for; None when it asks for no GPU or its annotations are bad."""
    grant: Grant | None
    """What its assignment annotations say it holds (None: nothing, or unreadable)."""
    assigned_at: float | None
    """POSIX time of the assignment annotation."""
    problem: str = ""
    """Why `request` or `grant` could not be read ("" when fine)."""
    gang: str = ""
    """The gang label ("" for none): victim selection groups by it, and the gang
    controller keeps the pods that carry it."""
    priority: int = 0
    """spec.priority (what its PriorityClass resolved to at creation; 0 without), as an
    int32 (`priority_of`: the one reading, for the extender and both controllers)."""
    nominated: str = ""
    """status.nominatedNodeName: the node kube-scheduler preempted for it, or the node
    gpuplace's planner handed it (`gpuplace.planning`) ("" for none)."""
    unschedulable: bool = False
    """kube-scheduler's last try found no node: condition PodScheduled False, reason
    Unschedulable (it tries again when the cluster changes)."""
    minimum: int = 0
    """`gang-min` of an elastic gang (`Gang.elastic_minimum`: 0 unless 0 < gang-min <
    gang-size, so `elastic` needs no second test; 0: every member is needed)."""
    created: float = 0.0
    """metadata.creationTimestamp, POSIX seconds (0 when absent)."""
    controlled: Controlled = UNCONTROLLED
    """What the gang, queue and plan controllers decide with (`UNCONTROLLED`, shared, for
    the pods none keeps)."""
    claim: str = ""
    """The ResourceClaim gpuplace's entry of `spec.resourceClaims` names: the pod is on the
    DRA path (`gpuplace.cluster.dra_claims`); "" for a pod on the device-plugin path."""
    claim_gated: bool = False
    """The DRA gate (`keys.DRA_GATE`) is still on it: its claim may not exist yet."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def gang_key(self) -> GangKey:
        """The gang it belongs to, as the gang controller keys it: (namespace, gang-name)."""
        return (self.namespace, self.controlled.gang_name)

    @property
    def workload(self) -> str:
        """The queue workload it belongs to: `namespace/name`, or `gang namespace/name`."""
        if self.controlled.gang_name:
            return f"gang {self.namespace}/{self.controlled.gang_name}"
        return f"{self.namespace}/{self.name}"

    @property
    def elastic(self) -> bool:
        return 0 < self.minimum < self.controlled.gang_size

    @property
    def live(self) -> bool:
        """Neither finished nor being deleted: it counts towards its gang or workload."""
        return not self.terminal and not self.deleting

    def order(self) -> tuple[float, str]:
        """Oldest first, then by name: who is in a gang when more than its size exist."""
        return (self.created, self.name)

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
        self._requests: dict[object, tuple[Read, grammar.AnnotationError | None]] = {}

    def request(self, pod: Mapping[str, Any]) -> GpuRequest | None:
        """`gpuplace.cluster.grammar.request_for(pod)`, memoised. Raises `AnnotationError`, also
        for a pod whose shape is not a pod's (annotations not strings, containers not a
        list of objects...)."""
        read, error = self.read(pod)
        if error is not None:
            raise error
        return read.request

    def read(self, pod: Mapping[str, Any]) -> tuple[Read, grammar.AnnotationError | None]:
        """What `pod`'s annotations and containers say, from one parse, memoised, and why
        its request cannot be read (None: it can). A gang whose annotations parse keeps
        its gang even when the request cannot be read (its controller says why)."""
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
            return self._requests[memo_key]
        found = _read(pod)
        if memo_key is not None:
            if len(self._requests) >= _REQUEST_MEMO_LIMIT:
                self._requests.clear()
            self._requests[memo_key] = found
        return found

    def record(self, pod: Mapping[str, Any]) -> PodRecord:
        """The informer's transform: a pod dict → PodRecord. O(annotations + containers)."""
        metadata = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        status = pod.get("status") or {}
        read, error = self.read(pod)
        request = read.request
        problem = "" if error is None else str(error)
        try:
            grant = assignments.grant_of(pod, request)
        except assignments.AssignmentError as refused:
            grant, problem = None, str(refused)
        node_name = str(spec.get("nodeName") or "")
        if grant is not None and node_name and node_name != grant.node:
            problem = f"bound to {node_name} but its GPUs were assigned on {grant.node}"
            grant = None
        labels = metadata.get("labels") or {}
        gang = str(labels.get(keys.GANG_LABEL) or "")
        queue = str(labels.get(keys.QUEUE_LABEL) or "")
        controlled = UNCONTROLLED
        place_gated = bool(spec.get("schedulingGates")) and gated(pod, keys.PLACE_GATE)
        claim = dra_claims.named(pod)
        # a controller keeps it (the claim controller plans a DRA pod): read what it decides with
        if gang or queue or place_gated or claim:
            controlled = Controlled(
                queue=queue,
                gang_name=read.gang,
                gang_size=read.size,
                gang_timeout=read.timeout,
                gang_gated=gated(pod, keys.GANG_GATE),
                queue_gated=gated(pod, keys.QUEUE_GATE),
                place_gated=place_gated,
                gates=tuple(str(g.get("name") or "") for g in gates_of(pod)),
                spec_affinity=spec.get("affinity") if place_gated else None,
                plan=plan_mark(pod),
                assigned=assignments.assigned(pod),
                affinity=NodeAffinity.of(pod),
                tolerations=taints.of_pod(pod),
                preemption_policy=str(spec.get("preemptionPolicy") or ""),
                gang_ready=gang_ready(status.get("conditions")),
                restart=read.restart,
                domain=read.domain,
                domain_required=read.domain_required,
                failure=failure_of(status, deleting=bool(metadata.get("deletionTimestamp")))
                if read.gang
                else "",
                disrupted=disruption(status.get("conditions")) is not None,
                ending=ending(spec, status),
            )
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
            assigned_at=assignments.assigned_at(pod),
            problem=problem,
            gang=gang,
            priority=priority_of(spec.get("priority")),
            nominated=str(status.get("nominatedNodeName") or ""),
            unschedulable=no_node_fits(status.get("conditions")),
            minimum=read.minimum,
            created=timestamp(metadata.get("creationTimestamp")),
            controlled=controlled,
            claim=claim,
            claim_gated=gated(pod, keys.DRA_GATE),
        )


def _read(pod: Mapping[str, Any]) -> tuple[Read, grammar.AnnotationError | None]:
    """`Reader.read` without the memo."""
    read = Read(None)
    try:
        _check_shape(pod)
        spec = grammar.parse((pod.get("metadata") or {}).get("annotations") or {})
        gang = spec.gang if spec is not None else None
        if gang is not None:
            read = Read(
                None,
                gang.name,
                gang.size,
                gang.timeout_seconds,
                gang.elastic_minimum,
                restart=gang.failure_policy is grammar.OnFailure.RESTART,
                domain=gang.domain or "",
                domain_required=gang.domain_policy is grammar.DomainPolicy.REQUIRED,
            )
        request = grammar.request_of(pod, spec)
    except grammar.AnnotationError as error:
        return read, error
    except (TypeError, ValueError, AttributeError) as error:
        return read, grammar.AnnotationError.one("spec", f"the pod cannot be read: {error}")
    return dataclasses.replace(read, request=request), None


def gang_ready(conditions: object) -> tuple[str, str] | None:
    """(status, reason) of the pod's `gpuplace.io/GangReady` condition among
    status.conditions, if any. O(conditions)."""
    if not isinstance(conditions, list):
        return None
    for item in conditions:
        if isinstance(item, Mapping) and item.get("type") == keys.GANG_CONDITION:
            return (str(item.get("status")), str(item.get("reason") or ""))
    return None


DISRUPTION_TARGET = "DisruptionTarget"
"""The pod condition kube-apiserver's Eviction API (and kube-scheduler's preemption, the
kubelet's evictions, the taint manager, pod GC) sets on a pod it disrupts; a Job's
`podFailurePolicy` matches it."""


def ending(spec: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Every container of the pod has terminated and `restartPolicy` is `Never`: the pod
    ends by itself (the kubelet sets its terminal phase once it has stopped it), so a
    gang restart lets it end rather than evict it (an eviction would mark it disrupted,
    and a Job's `podFailurePolicy` would then not count its failure). O(containers)."""
    if spec.get("restartPolicy") != "Never":
        return False
    statuses = status.get("containerStatuses")
    if not isinstance(statuses, list) or not statuses:
        return False
    return all(
        isinstance(item, Mapping)
        and isinstance((item.get("state") or {}).get("terminated"), Mapping)
        for item in statuses
    )


def disruption(conditions: object) -> str | None:
    """The reason of the pod's `DisruptionTarget=True` condition ("" when it has none), or
    None without one. O(conditions)."""
    if not isinstance(conditions, list):
        return None
    for item in conditions:
        if (
            isinstance(item, Mapping)
            and item.get("type") == DISRUPTION_TARGET
            and item.get("status") == "True"
        ):
            return str(item.get("reason") or "")
    return None


def _exited(statuses: object) -> str:
    """The first container that stopped with a non-zero exit code, in words ("" for none):
    now (`state`), or before the kubelet restarted it (`lastState`)."""
    if not isinstance(statuses, list):
        return ""
    for which in ("state", "lastState"):
        for item in statuses:
            if not isinstance(item, Mapping):
                continue
            terminated = (item.get(which) or {}).get("terminated")
            if not isinstance(terminated, Mapping):
                continue
            code = terminated.get("exitCode")
            if isinstance(code, int) and not isinstance(code, bool) and code != 0:
                why = terminated.get("reason")
                shown = f" ({why})" if isinstance(why, str) and why and why != "Error" else ""
                again = " and was restarted" if which == "lastState" else ""
                return f"its container {item.get('name')} exited with code {code}{shown}{again}"
    return ""


def failure_of(status: Mapping[str, Any], *, deleting: bool) -> str:
    """Why a gang member counts as failed, for Events ("" while it has not): one of its
    containers (not an init container: a sidecar's restart is no failure) that exited
    non-zero, phase Failed (an init container's failure included), a disruption
    (`DisruptionTarget`), a deletion before it completed. A pod that Succeeded never has
    failed. O(containers + conditions)."""
    phase = status.get("phase")
    if phase == "Succeeded":
        return ""
    exited = _exited(status.get("containerStatuses"))
    if exited:
        return exited
    disrupted = disruption(status.get("conditions"))
    if disrupted is not None:
        return f"it was disrupted ({disrupted or DISRUPTION_TARGET})"
    if phase == "Failed":
        reason, message = status.get("reason"), status.get("message")
        detail = ": ".join(str(part) for part in (reason, message) if part)
        return f"it failed ({detail})" if detail else "it failed"
    if deleting:
        return "it was deleted before it completed"
    return ""


def domain(pod: PodRecord, running: Iterable[PodRecord], inventory: Inventory) -> Domain | None:
    """The topology domain a gang member's plan keeps to (`gpuplace.io/gang-domain`), or
    None: pinned to the value of the gang's `running` members' nodes, so that a
    replacement or an elastic gang's growth joins the domain the gang runs in.
    O(running)."""
    key = pod.controlled.domain
    if not key:
        return None
    value = ""
    for member in running:
        node = inventory.get(member.node_name or (member.grant.node if member.grant else ""))
        if node is not None and key in node.labels:
            value = node.labels[key]
            break
    return Domain(key, pod.controlled.domain_required, value)


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
            and all(
                isinstance(v or {}, list if k == "claims" else Mapping)  # DRA: a list
                for k, v in (c.get("resources") or {}).items()
            )
            for c in containers
        ):
            raise bad(f"spec.{field}", "a list of containers")
    if not isinstance((spec or {}).get("overhead") or {}, Mapping):
        raise bad("spec.overhead", "an object")


def record(pod: Mapping[str, Any]) -> PodRecord:
    """`Reader().record(pod)` without a memo (one-off reads: explain, tests)."""
    return Reader().record(pod)
