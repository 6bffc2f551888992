"""What a container gets from the device plugin: pure decisions, no I/O, no clock.

The plugin serves one extended resource, `gpuplace.io/gpu` (`keys.RESOURCE_GPU`): the GPU
container of a gpuplace pod requests its GPU count of it. Each device the plugin lists is
a *slot* on one GPU, `<GPU UUID>::<n>` (`slots_per_gpu` per GPU), so the kubelet's own
record (its checkpoint, the pod-resources API) names the GPUs a container holds, and a GPU
that turns unhealthy takes exactly its slots out of the node's allocatable. The slots carry
no share: percent and memory are the sidecar's (`gpuplace.io/gpu-percent`,
`gpuplace.io/gpu-memory` on node status); a slot only says "this container goes through
the agent".

`Allocate` names no pod. This module finds it among the pods bound to this node whose
assignment annotations (written by the sidecar before the Binding) grant GPUs here, and
whose GPU container asks for as many slots as the kubelet is allocating (`choose`):

1. an *exact* candidate: not yet answered, not yet started, granted exactly the GPUs of
   the slots the kubelet picked (GetPreferredAllocation steers it there, `prefer`);
2. else, only when the caller allows it (after waiting for its pod view to catch up), a
   *mismatch*: a fresh candidate with the same count whose grant names other GPUs. The
   grant wins: the container gets its granted GPUs, whatever slots the kubelet recorded;
3. else nothing: the kubelet is refused, and the container starts with no GPU at all.

A container is answered once. The kubelet allocates only for a container whose devices
its checkpoint does not hold, so a call that names the GPUs of a pod already answered or
started is another container's (docs/node-agent.md, "Why no answer is given twice").

Nothing is chosen while a *stranger* could be the container the kubelet is allocating
for: a pod bound here, not finished, whose container that has not started asks for as
many slots, but that holds no usable grant here (`read`). Allocate cannot tell it from a
granted pod, and whatever it answered would be that pod's to use.

Within a tier the oldest pod wins (creationTimestamp, then namespace/name): the kubelet
admits the pods it receives together in that order. Two candidates whose answers would be
equal (the same GPUs, percent and memory) are interchangeable; when they differ the
choice is `ambiguous` and the plugin counts it (docs/node-agent.md says when this can
happen and what it costs).

`answer` builds the ContainerAllocateResponse from the grant alone: its GPUs by UUID
(CDI device names, or the NVIDIA runtime's volume-mount/env list, plus device nodes when
their minor numbers are known), and for a share (milli < 1000, memory-only included) the
MPS pipe directory mount, `CUDA_MPS_PIPE_DIRECTORY` and its limits. It never names a GPU
that is not in the chosen pod's grant, nor one this node does not have. Every function
here is O(pods on the node × GPUs per pod) or better.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from gpuplace.agent import handover
from gpuplace.agent.deviceplugin import api_pb2
from gpuplace.agent.handover import NodeGpu, Options
from gpuplace.cluster import assignments, keys, mps_limits

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
SLOT_SEPARATOR = "::"
MAX_DEVICE_ID = 63
"""The kubelet's limit on a device ID's length."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A pod bound to this node that holds a grant here, as Allocate needs it."""

    uid: str
    namespace: str
    name: str
    created: str
    """metadata.creationTimestamp (RFC 3339 sorts as text)."""
    container: str
    """The container that requests `gpuplace.io/gpu`."""
    count: int
    """How many slots it requests: its granted GPU count."""
    uuids: tuple[str, ...]
    """The granted GPUs, by UUID, in grant order."""
    milli: int
    memory_mib: int
    started: bool
    """The kubelet already created that container (its status has a containerID)."""

    @property
    def share(self) -> bool:
        return mps_limits.is_share(self.milli)

    @property
    def terms(self) -> tuple[tuple[str, ...], int, int]:
        """What the answer depends on: equal terms, equal answers."""
        return (self.uuids, self.milli, self.memory_mib)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Stranger:
    """A pod bound to this node, not finished, with a container that has not started and
    asks for slots, but without a usable grant here: the kubelet may be allocating for it,
    and it must get nothing."""

    namespace: str
    name: str
    counts: frozenset[int]
    """The slot counts its containers that have not started ask for."""

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


Reading = Candidate | Stranger | None
"""How Allocate sees one pod (`read`)."""


class Tier(enum.StrEnum):
    EXACT = "exact"
    MISMATCH = "mismatch"


@dataclass(frozen=True, slots=True)
class Match:
    candidate: Candidate
    tier: Tier
    ambiguous: bool
    """Another candidate of the same tier would have got a different answer."""


# --- devices ------------------------------------------------------------------------


def device_id(uuid: str, slot: int) -> str:
    return f"{uuid}{SLOT_SEPARATOR}{slot}"


def gpu_of(device: str) -> str:
    """The GPU UUID of a slot ID ("" when the ID is not one of ours)."""
    uuid, separator, slot = device.rpartition(SLOT_SEPARATOR)
    return uuid if separator and _number(slot) else ""


def _number(text: str) -> bool:
    """ASCII digits only: `str.isdigit` also takes "²" and other digits `int` refuses."""
    return text.isascii() and text.isdigit()


def devices(gpus: Iterable[NodeGpu], slots_per_gpu: int) -> list[api_pb2.Device]:
    """The ListAndWatch device list: `slots_per_gpu` slots per GPU, with its health and
    NUMA node (when known). O(GPUs × slots)."""
    listed: list[api_pb2.Device] = []
    for gpu in gpus:
        topology = (
            api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=gpu.numa)])
            if gpu.numa is not None
            else None
        )
        health = HEALTHY if gpu.healthy else UNHEALTHY
        for slot in range(slots_per_gpu):
            identifier = device_id(gpu.uuid, slot)
            if len(identifier) > MAX_DEVICE_ID:
                raise ValueError(f"device ID {identifier!r} is over {MAX_DEVICE_ID} characters")
            listed.append(api_pb2.Device(ID=identifier, health=health, topology=topology))
    return listed


# --- pods -----------------------------------------------------------------------------


def _requested(container: Mapping[str, Any]) -> int:
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping):
        return 0
    for part in ("limits", "requests"):
        values = resources.get(part) or {}
        raw = values.get(keys.RESOURCE_GPU) if isinstance(values, Mapping) else None
        if raw is not None and _number(str(raw)) and len(str(raw)) <= 9:
            return int(str(raw))
    return 0


def _asking(pod: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """(status field, container name, slots) of each container, init containers included,
    that asks for slots."""
    spec = pod.get("spec") or {}
    found = []
    for field, status_field in (
        ("containers", "containerStatuses"),
        ("initContainers", "initContainerStatuses"),
    ):
        for container in spec.get(field) or []:
            if isinstance(container, Mapping) and (count := _requested(container)) > 0:
                found.append((status_field, str(container.get("name") or ""), count))
    return found


def _started(pod: Mapping[str, Any], status_field: str, container: str) -> bool:
    """The kubelet created that container (its status has a containerID)."""
    return any(
        isinstance(entry, Mapping)
        and entry.get("name") == container
        and bool(entry.get("containerID"))
        for entry in (pod.get("status") or {}).get(status_field) or []
    )


def _finished(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def read(pod: Mapping[str, Any], node: str, gpus: Sequence[NodeGpu]) -> Reading:
    """How Allocate sees one pod of the node: a `Candidate` (a usable grant here), a
    `Stranger` (no usable grant, but a container that has not started asks for slots), or
    None (not bound here, finished, or nothing left to allocate for). O(containers + GPUs)."""
    if (pod.get("spec") or {}).get("nodeName") != node or _finished(pod):
        return None
    found = candidate(pod, node, gpus)
    if found is not None:
        return found
    counts = frozenset(
        count for status_field, name, count in _asking(pod) if not _started(pod, status_field, name)
    )
    if not counts:
        return None
    metadata = pod.get("metadata") or {}
    return Stranger(
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        counts=counts,
    )


def candidate(pod: Mapping[str, Any], node: str, gpus: Sequence[NodeGpu]) -> Candidate | None:
    """The pod as an Allocate candidate, or None when it holds no usable grant on `node`
    (not bound here, finished, no or unreadable assignment, not exactly one container,
    init containers included, asking for slots, a slot count other than its granted GPU
    count, or granted GPUs this node does not have). O(containers + GPUs)."""
    spec = pod.get("spec") or {}
    metadata = pod.get("metadata") or {}
    if spec.get("nodeName") != node or _finished(pod):
        return None
    try:
        grant = assignments.grant_of(pod)
    except assignments.AssignmentError:
        return None
    if grant is None or grant.node != node:
        return None
    asking = _asking(pod)
    if len(asking) != 1 or asking[0][0] != "containerStatuses":
        return None  # an init container asking too: the webhook never makes such a pod
    _, container, count = asking[0]
    if count != len(grant.gpus):
        return None  # what the kubelet counts and what was granted disagree: refuse
    uuids = granted_uuids(pod, grant.gpus, gpus)
    if uuids is None:
        return None
    return Candidate(
        uid=str(metadata.get("uid") or ""),
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        created=str(metadata.get("creationTimestamp") or ""),
        container=container,
        count=count,
        uuids=uuids,
        milli=grant.milli,
        memory_mib=grant.memory_mib,
        started=_started(pod, "containerStatuses", container),
    )


def granted_uuids(
    pod: Mapping[str, Any], indices: Sequence[int], gpus: Sequence[NodeGpu]
) -> tuple[str, ...] | None:
    """The granted GPUs by UUID: the assignment's UUIDs when it has them (what the sidecar
    granted, whatever order NVML enumerates in today), else the node's UUIDs of the granted
    indices; None when any is not on this node."""
    on_node = {gpu.uuid for gpu in gpus}
    uuids = assignments.uuids_of(pod)
    if uuids:
        if len(uuids) != len(indices) or not set(uuids) <= on_node:
            return None
        return uuids
    by_index = {gpu.index: gpu.uuid for gpu in gpus}
    if not all(index in by_index for index in indices):
        return None
    return tuple(by_index[index] for index in indices)


def _age(candidate: Candidate) -> tuple[str, str, str]:
    return (candidate.created, candidate.namespace, candidate.name)


def _pick(tier: Tier, pool: list[Candidate]) -> Match | None:
    if not pool:
        return None
    chosen = min(pool, key=_age)
    return Match(chosen, tier, any(other.terms != chosen.terms for other in pool))


def suspects(size: int, strangers: Iterable[Stranger]) -> list[Stranger]:
    """The strangers the kubelet may be allocating `size` slots for. O(strangers)."""
    return [stranger for stranger in strangers if size in stranger.counts]


def choose(
    device_ids: Sequence[str],
    candidates: Iterable[Candidate],
    strangers: Iterable[Stranger],
    answered: Set[str],
    *,
    allow_mismatch: bool,
) -> Match | None:
    """The pod the kubelet is allocating `device_ids` for (see the module docstring), or
    None: no fresh candidate fits, or a stranger asks for as many slots (`suspects`).
    `answered`: UIDs of pods whose container this plugin already answered. O(candidates +
    strangers)."""
    size = len(device_ids)
    if suspects(size, strangers):
        return None
    asked = {gpu_of(device) for device in device_ids}
    fresh = [
        item
        for item in candidates
        if item.count == size and item.uid not in answered and not item.started
    ]
    exact = _pick(Tier.EXACT, [item for item in fresh if set(item.uuids) == asked])
    if exact is not None or not allow_mismatch:
        return exact
    return _pick(Tier.MISMATCH, fresh)


def prefer(
    request: api_pb2.ContainerPreferredAllocationRequest,
    candidates: Iterable[Candidate],
    answered: Set[str],
) -> list[str]:
    """GetPreferredAllocation for one container: a slot on each GPU of the oldest fresh
    candidate whose grant has a free slot on every granted GPU, so that the kubelet's record
    names the granted GPUs; else the must-include slots, then the lowest available ones.
    Advisory: Allocate decides from the grant either way. O(available + candidates)."""
    size = int(request.allocation_size)
    must = list(request.must_include_deviceIDs)
    free: dict[str, list[str]] = {}
    for device in sorted(request.available_deviceIDs, key=_slot_order):
        free.setdefault(gpu_of(device), []).append(device)
    fresh = sorted(
        (
            item
            for item in candidates
            if item.count == size and item.uid not in answered and not item.started
        ),
        key=_age,
    )
    for item in fresh:
        must_gpus = {gpu_of(device) for device in must}
        if not must_gpus <= set(item.uuids):
            continue
        chosen = list(must)
        for uuid in item.uuids:
            if uuid in must_gpus:
                continue
            if not free.get(uuid):
                break
            chosen.append(free[uuid][0])
        else:
            if len(chosen) == size:
                return chosen
    chosen = list(must)
    for device in sorted(request.available_deviceIDs, key=_slot_order):
        if len(chosen) >= size:
            break
        if device not in chosen:
            chosen.append(device)
    return chosen


def _slot_order(device: str) -> tuple[str, int, str]:
    """By GPU, then by slot number (compared as digits: no `int` of a caller's string)."""
    uuid, _, slot = device.rpartition(SLOT_SEPARATOR)
    digits = slot.lstrip("0") if _number(slot) else ""
    return (uuid, len(digits), digits)


# --- the answer --------------------------------------------------------------------


def answer(
    chosen: Candidate, gpus: Sequence[NodeGpu], options: Options
) -> api_pb2.ContainerAllocateResponse:
    """What the container of `chosen` gets (`gpuplace.agent.handover.edits`: exactly its
    granted GPUs and, for a share, MPS), as the device plugin's answer. Raises `Refusal`
    when a share cannot be capped (no MPS) or a granted GPU is missing or unhealthy.
    O(granted GPUs)."""
    given = handover.edits(
        str(chosen), chosen.uuids, chosen.milli, chosen.memory_mib, gpus=gpus, options=options
    )
    response = api_pb2.ContainerAllocateResponse()
    response.cdi_devices.extend(api_pb2.CDIDevice(name=name) for name in given.cdi_devices)
    response.envs.update(given.env)
    response.mounts.extend(
        api_pb2.Mount(
            container_path=mount.container_path,
            host_path=mount.host_path,
            read_only=mount.read_only,
        )
        for mount in given.mounts
    )
    response.devices.extend(
        api_pb2.DeviceSpec(container_path=path, host_path=path, permissions="rw")
        for path in given.device_nodes
    )
    return response


def granted_in(response: api_pb2.ContainerAllocateResponse, options: Options) -> set[str]:
    """The GPU UUIDs a response hands out, read back from it (for checks and tests)."""
    found: set[str] = set()
    prefix = f"{options.cdi_kind}="
    found.update(
        device.name[len(prefix) :]
        for device in response.cdi_devices
        if device.name.startswith(prefix)
    )
    root = handover.VOLUME_MOUNT_ROOT
    for mount in response.mounts:
        if mount.container_path.startswith(root + "/"):
            found.add(mount.container_path[len(root) + 1 :])
    visible = response.envs.get(handover.VISIBLE_DEVICES_ENV, "")
    if visible not in ("", "void", "none", handover.VOLUME_MOUNT_ROOT):
        found.update(visible.split(","))
    return found
