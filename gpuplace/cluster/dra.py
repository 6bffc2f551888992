"""gpuplace's device model on Dynamic Resource Allocation (`resource.k8s.io/v1`), spelled
once: what the node agent publishes in its node's ResourceSlice, what a ResourceClaim asks
of it, and how an allocation result reads back in the engine's units (docs/dra.md).

- Driver `gpu.gpuplace.io`; DeviceClass `gpu.gpuplace.io` (it selects the driver's
  devices, and `extendedResourceName: gpu.gpuplace.io/gpu` lets a pod ask whole GPUs as an
  extended resource, with no claim of its own).
- One ResourceSlice per node, named by `slice_name`, pool = the node's name, one device per
  GPU named `gpu-<index>`, `allowMultipleAllocations: true`.
- Attributes (their domain is the driver's: in CEL
  `device.attributes["gpu.gpuplace.io"].model`): `uuid` (string), `model` (the GPU
  Feature Discovery product string, `NVIDIA-H100-80GB-HBM3`), `index` (int, NVML's),
  `nvlinkDomain` (int: the lowest GPU index of its NVLink domain, -1 for none), `numaNode`
  (int), `migMode` (bool), `memory` (int, MiB, as GFD's `nvidia.com/gpu.memory`). What NVML
  could not say is left out, never guessed.
- Capacities: `compute` in milli-GPU (value 1000; Kubernetes writes it back as "1k") and
  `memory` in bytes (value `<MiB>Mi`, step 1Mi). Both have a request policy whose default
  is the whole value and whose range starts at 0: a claim that names nothing consumes a
  whole GPU, a memory-only share asks `compute: 0` and consumes no compute, a percent share
  without memory asks `memory: 0`.
- Health as device taints: `gpu.gpuplace.io/unhealthy` (NoSchedule) while NVML finds a GPU
  unfit, written by the agent; `gpu.gpuplace.io/agent-silent` (NoSchedule) on every device
  of a node whose agent stopped its heartbeat, written by the sidecar (the agent cannot
  write when it is silent) and dropped by the agent's next write of its slice.

`consumption` turns an allocation result's `consumedCapacity` into (milli, memory MiB), the
engine's grant units; `allocated` reads a claim's results of this driver. Pure: no I/O, no
clock (callers pass the time a taint is added). Every function is O(size of its input).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuplace.cluster import quantities
from gpuplace.cluster.nodes import product
from gpuplace.placement.requests import WHOLE

API_VERSION = "resource.k8s.io/v1"
DRIVER = "gpu.gpuplace.io"
DEVICE_CLASS = "gpu.gpuplace.io"
EXTENDED_RESOURCE = "gpu.gpuplace.io/gpu"
"""The DeviceClass's `extendedResourceName`: `resources.limits` of it asks that many whole
GPUs on a DRA node (kube-scheduler writes the claim; DRAExtendedResource, beta in 1.36).
Not `gpuplace.io/gpu`, the device plugin's slots: a pod the webhook gave slots (a share
among them) must never be served a whole device by DRA on another node."""

# --- attributes ----------------------------------------------------------------------
UUID = "uuid"
MODEL = "model"
INDEX = "index"
NVLINK_DOMAIN = "nvlinkDomain"
NUMA_NODE = "numaNode"
MIG_MODE = "migMode"
MEMORY_ATTRIBUTE = "memory"
"""An int attribute, MiB (GFD's unit); the capacity of the same name is a quantity."""
ATTRIBUTES = (UUID, MODEL, INDEX, NVLINK_DOMAIN, NUMA_NODE, MIG_MODE, MEMORY_ATTRIBUTE)
NVLINK_CONSTRAINT = f"{DRIVER}/{NVLINK_DOMAIN}"
"""The qualified attribute a claim's `matchAttribute` constraint names to keep its GPUs in
one NVLink domain."""

# --- capacities ----------------------------------------------------------------------
COMPUTE = "compute"
"""milli-GPU: 1000 is the whole GPU's compute."""
MEMORY = "memory"
"""bytes (a quantity, `20Gi`), step 1Mi."""
CAPACITIES = (COMPUTE, MEMORY)
MIB = quantities.MIB

# --- taints --------------------------------------------------------------------------
UNHEALTHY_TAINT = f"{DRIVER}/unhealthy"
SILENT_TAINT = f"{DRIVER}/agent-silent"
NO_SCHEDULE = "NoSchedule"

DEVICE_PREFIX = "gpu-"
MAX_NAME = 253
_DEVICE = re.compile(r"gpu-(0|[1-9][0-9]{0,3})")


class DraError(ValueError):
    """A claim or an allocation result that does not read as one of this driver's; the
    message says what is wrong (it reaches the kubelet's Event, or a log line)."""


# --- names ---------------------------------------------------------------------------


def device_name(index: int) -> str:
    """The device of the GPU with NVML index `index`: `gpu-<index>` (a DNS label)."""
    return f"{DEVICE_PREFIX}{index}"


def gpu_index(device: str) -> int | None:
    """The NVML index a device name stands for; None when it is not one of ours."""
    found = _DEVICE.fullmatch(device)
    return int(found.group(1)) if found else None


def pool_name(node: str) -> str:
    """A node's pool: its name (one slice, one pool per node)."""
    return node


def slice_name(node: str) -> str:
    """The name of `node`'s ResourceSlice: `<node>-gpu.gpuplace.io`, a DNS subdomain of at
    most 253 characters (a longer node name is cut and a hash of it kept)."""
    name = f"{node}-{DRIVER}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    keep = node[: MAX_NAME - len(DRIVER) - len(digest) - 2].rstrip(".-")
    return f"{keep}-{digest}-{DRIVER}"


# --- the slice -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One GPU as the slice publishes it (from NVML discovery); None = NVML could not say."""

    index: int
    uuid: str
    memory_mib: int
    model: str | None = None
    """NVML's name ("NVIDIA H100 80GB HBM3"); published as GFD's product string."""
    numa: int | None = None
    nvlink_domain: int | None = None
    """Lowest GPU index of its NVLink domain, -1 (`placement.inventory.NO_NVLINK`) when
    in none."""
    mig: bool | None = None
    healthy: bool = True
    packable_mib: int | None = None
    """What an MPS client can get of its memory with the control daemon running (NVML's
    total less the driver's reservation and the MPS server's memory, as the agent reads
    it); the slice's `memory` capacity, so that kube-scheduler packs no more than the GPU
    really has. None: NVML could not say, and the total is published instead."""

    @property
    def capacity_mib(self) -> int:
        """The `memory` capacity the slice publishes: the packable memory when known."""
        return self.packable_mib if self.packable_mib is not None else self.memory_mib


def _capacity(value: str, step: str) -> dict[str, Any]:
    return {
        "value": value,
        "requestPolicy": {
            "default": value,
            "validRange": {"min": "0", "max": value, "step": step},
        },
    }


def device(gpu: GpuDevice) -> dict[str, Any]:
    """The slice's device for `gpu` (see the module docstring). O(1)."""
    attributes: dict[str, dict[str, Any]] = {
        UUID: {"string": gpu.uuid},
        INDEX: {"int": gpu.index},
        MEMORY_ATTRIBUTE: {"int": gpu.memory_mib},
    }
    if gpu.model:
        attributes[MODEL] = {"string": product(gpu.model)}
    if gpu.nvlink_domain is not None:
        attributes[NVLINK_DOMAIN] = {"int": gpu.nvlink_domain}
    if gpu.numa is not None:
        attributes[NUMA_NODE] = {"int": gpu.numa}
    if gpu.mig is not None:
        attributes[MIG_MODE] = {"bool": gpu.mig}
    body: dict[str, Any] = {
        "name": device_name(gpu.index),
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            COMPUTE: _capacity(str(WHOLE), "1"),
            MEMORY: _capacity(f"{gpu.capacity_mib}Mi", "1Mi"),
        },
    }
    if not gpu.healthy:
        body["taints"] = [{"key": UNHEALTHY_TAINT, "effect": NO_SCHEDULE}]
    return body


def slice_spec(node: str, gpus: Iterable[GpuDevice], generation: int = 1) -> dict[str, Any]:
    """The spec of `node`'s ResourceSlice: its pool (one slice), its GPUs by index."""
    return {
        "driver": DRIVER,
        "nodeName": node,
        "pool": {"name": pool_name(node), "generation": generation, "resourceSliceCount": 1},
        "devices": [device(gpu) for gpu in sorted(gpus, key=lambda gpu: gpu.index)],
    }


def resource_slice(
    node: str, node_uid: str, gpus: Iterable[GpuDevice], generation: int = 1
) -> dict[str, Any]:
    """The whole ResourceSlice object, owned by its Node (it goes when the Node goes)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {
            "name": slice_name(node),
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}
            ],
        },
        "spec": slice_spec(node, gpus, generation),
    }


_QUANTITY_FIELDS = frozenset({"value", "default", "min", "max", "step"})


def _normal(value: Any, key: str = "") -> Any:
    """`value` with quantities parsed and a taint's `timeAdded` dropped: what the API
    server rewrites ("1000" → "1k", a taint's time set) compares equal to what was sent."""
    if isinstance(value, Mapping):
        return {
            name: _normal(item, name)
            for name, item in value.items()
            if not (name == "timeAdded" and key == "taint")
        }
    if isinstance(value, list):
        item_key = "taint" if key == "taints" else ("value" if key == "validValues" else "")
        return [_normal(item, item_key) for item in value]
    if key in _QUANTITY_FIELDS and isinstance(value, str):
        try:
            return quantities.parse(value)
        except quantities.QuantityError:
            return value
    return value


def same_devices(stored: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether a stored slice spec publishes what `desired` does (pool generation aside,
    quantities compared by value, taint times ignored). O(size)."""

    def comparable(spec: Mapping[str, Any]) -> Any:
        body = dict(spec)
        pool = dict(body.get("pool") or {})
        pool.pop("generation", None)
        body["pool"] = pool
        return _normal(body)

    try:
        return bool(comparable(stored) == comparable(desired))
    except (TypeError, ValueError):
        return False


def generation(stored: Mapping[str, Any]) -> int:
    """The pool generation of a stored slice spec (0 when unreadable)."""
    value = (stored.get("pool") or {}).get("generation") if isinstance(stored, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# --- silence taints (the sidecar's) ---------------------------------------------------


def _devices(obj: Mapping[str, Any]) -> list[Any]:
    spec = obj.get("spec")
    found = spec.get("devices") if isinstance(spec, Mapping) else None
    return found if isinstance(found, list) else []


def _has(device_body: Any, key: str) -> bool:
    taints = device_body.get("taints") if isinstance(device_body, Mapping) else None
    return isinstance(taints, list) and any(
        isinstance(taint, Mapping) and taint.get("key") == key for taint in taints
    )


def silenced(obj: Mapping[str, Any]) -> bool:
    """Whether every device of a stored slice carries the silence taint."""
    devices = _devices(obj)
    return all(_has(item, SILENT_TAINT) for item in devices)


def with_silence(obj: Mapping[str, Any], now: str) -> dict[str, Any]:
    """A copy of a stored slice with the silence taint (added at RFC 3339 time `now`) on
    every device that lacks it; the rest as stored (resourceVersion included: the write
    is conditional on it)."""
    fresh = copy.deepcopy(dict(obj))
    for item in _devices(fresh):
        if isinstance(item, dict) and not _has(item, SILENT_TAINT):
            stored = item.get("taints")
            taints: list[Any] = stored if isinstance(stored, list) else []
            item["taints"] = [
                *taints,
                {"key": SILENT_TAINT, "effect": NO_SCHEDULE, "timeAdded": now},
            ]
    return fresh


def without_silence(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a stored slice with the silence taint removed from every device."""
    fresh = copy.deepcopy(dict(obj))
    for item in _devices(fresh):
        if isinstance(item, dict) and _has(item, SILENT_TAINT):
            kept = [
                taint
                for taint in item["taints"]
                if not (isinstance(taint, Mapping) and taint.get("key") == SILENT_TAINT)
            ]
            if kept:
                item["taints"] = kept
            else:
                del item["taints"]
    return fresh


# --- claims --------------------------------------------------------------------------


class _Result(BaseModel):
    """One entry of `status.allocation.devices.results` (the fields gpuplace reads)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    request: str = Field(min_length=1, max_length=MAX_NAME * 2 + 1)
    driver: str = Field(min_length=1, max_length=MAX_NAME)
    pool: str = Field(min_length=1, max_length=MAX_NAME)
    device: str = Field(min_length=1, max_length=63)
    share_id: str | None = Field(None, alias="shareID", max_length=64)
    consumed_capacity: dict[str, str | int] | None = Field(
        None, alias="consumedCapacity", max_length=32
    )
    admin_access: bool | None = Field(None, alias="adminAccess")


class _Devices(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    results: list[_Result] = Field(default_factory=list, max_length=32)


class _Allocation(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    devices: _Devices = Field(default_factory=_Devices)


@dataclass(frozen=True, slots=True)
class Allocated:
    """One device of this driver allocated to a claim, in the engine's units."""

    request: str
    pool: str
    device: str
    share_id: str | None
    milli: int
    """Compute consumed, milli-GPU (1000: the whole GPU's)."""
    memory_mib: int
    admin: bool = False
    """An admin-access allocation (monitoring): it consumes nothing and caps nothing."""


def _whole_number(value: Decimal, what: str) -> int:
    if value != value.to_integral_value():
        raise DraError(f"consumed {what} {value} is not a whole number")
    return int(value)


def consumption(consumed: Mapping[str, object]) -> tuple[int, int]:
    """An allocation result's `consumedCapacity` → (milli-GPU, memory MiB): the grant the
    engine counts and the agent caps. Raises `DraError` when a capacity is missing, not a
    quantity, negative, compute above 1000, or memory not a whole MiB (the request policy's
    steps make every value the scheduler writes exact). O(capacities)."""
    values: dict[str, Decimal] = {}
    for name in CAPACITIES:
        raw = consumed.get(name)
        if not isinstance(raw, str | int) or isinstance(raw, bool):
            raise DraError(f"consumedCapacity has no {name}")
        try:
            values[name] = quantities.parse(raw)
        except quantities.QuantityError as error:
            raise DraError(f"consumedCapacity {name}: {error}") from error
        if values[name] < 0:
            raise DraError(f"consumedCapacity {name} {raw!r} is negative")
    milli = _whole_number(values[COMPUTE], COMPUTE)
    if milli > WHOLE:
        raise DraError(f"consumedCapacity compute {milli} is over a whole GPU ({WHOLE})")
    memory = _whole_number(values[MEMORY] / MIB, "memory (MiB)")
    return milli, memory


def capacity_requests(milli: int, memory_mib: int) -> dict[str, str]:
    """What a claim's request asks (`capacity.requests`) for a grant of `milli` and
    `memory_mib` on one GPU: the inverse of `consumption`. A whole GPU asks nothing (the
    policies' defaults are the whole device)."""
    if milli >= WHOLE and memory_mib == 0:
        return {}
    return {COMPUTE: str(milli), MEMORY: f"{memory_mib}Mi"}


def _object(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def allocated(claim: Mapping[str, Any]) -> tuple[Allocated, ...]:
    """The claim's allocation results of this driver, in their order. Raises `DraError`
    when the claim is not allocated or its results do not parse; results of other
    drivers are left out. O(results)."""
    status = _object(claim.get("status"))
    raw = status.get("allocation")
    if not isinstance(raw, Mapping):
        raise DraError("the claim is not allocated (no status.allocation)")
    try:
        allocation = _Allocation.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise DraError(f"status.allocation.{where}: {first['msg']}") from None
    found = []
    for result in allocation.devices.results:
        if result.driver != DRIVER:
            continue
        if result.admin_access:
            milli, memory = 0, 0
        else:
            if result.consumed_capacity is None:
                raise DraError(f"device {result.device}: no consumedCapacity in its result")
            try:
                milli, memory = consumption(result.consumed_capacity)
            except DraError as error:
                raise DraError(f"device {result.device}: {error}") from None
        found.append(
            Allocated(
                request=result.request,
                pool=result.pool,
                device=result.device,
                share_id=result.share_id,
                milli=milli,
                memory_mib=memory,
                admin=bool(result.admin_access),
            )
        )
    return tuple(found)


# --- selectors for claims (what the webhook writes) -------------------------------------


def uuid_selector(uuid: str) -> str:
    """A CEL device selector that holds for the GPU `uuid` only: how a claim is pinned to
    the device the engine chose (the node: the pod's node affinity; the pool is the node)."""
    return f'device.attributes["{DRIVER}"].{UUID} == {json.dumps(uuid)}'


def uuids_selector(uuids: Iterable[str]) -> str:
    """A CEL device selector that holds for the GPUs `uuids` only (one: `uuid_selector`),
    a device without a UUID attribute none of them: how a claim of N GPUs is pinned to the
    N the engine chose. O(len(uuids))."""
    options = [uuid_selector(uuid) for uuid in dict.fromkeys(uuids)]
    if not options:
        return "false"
    return f"{_holds_key(UUID)} && ({' || '.join(options)})"


_ATTRIBUTES = f'device.attributes["{DRIVER}"]'
_CAPACITY = f'device.capacity["{DRIVER}"]'


def _holds_key(name: str, of: str = _ATTRIBUTES) -> str:
    """CEL: the device has this driver's attribute (or capacity) `name`. A selector that
    reads one a device lacks is a CEL runtime error, and kube-scheduler then allocates
    the claim nowhere ("no such key", seen on v1.36.2): a GPU NVML could say nothing about
    must read as "not this one", never fail the pod. (`.?name.orValue(x)` does the same
    on the server; the `in` test is plain CEL, which the tests' evaluator reads too.)"""
    return f'"{name}" in {of}'


def model_selector(models: Iterable[str]) -> str:
    """A CEL device selector that holds for GPUs of any of `models` (GFD product strings),
    quoted safely (JSON string syntax is CEL's); a GPU without a model attribute is none
    of them."""
    options = " || ".join(
        f"{_ATTRIBUTES}.{MODEL} == {json.dumps(product(name))}" for name in models
    )
    return f"{_holds_key(MODEL)} && ({options})" if options else "false"


def nvlink_selector() -> str:
    """A CEL device selector that holds for GPUs in an NVLink domain (`nvlinkDomain` >= 0):
    with `matchAttribute: NVLINK_CONSTRAINT` it keeps a claim's GPUs in one domain (GPUs in
    none all read -1, which would match each other)."""
    return f"{_holds_key(NVLINK_DOMAIN)} && {_ATTRIBUTES}.{NVLINK_DOMAIN} >= 0"


def memory_selector(memory_mib: int) -> str:
    """A CEL device selector that holds for GPUs whose `memory` capacity (what the slice
    packs) is at least `memory_mib`: how a whole GPU asks for memory (it consumes all of
    it, so it cannot name a part of it)."""
    return (
        f"{_holds_key(MEMORY, _CAPACITY)} && "
        f'{_CAPACITY}.{MEMORY}.compareTo(quantity("{memory_mib}Mi")) >= 0'
    )
