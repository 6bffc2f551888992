"""Kubernetes Node objects → the engine's `gpuplace.placement.inventory.Node`.

GPUs come from GPU Feature Discovery labels (`nvidia.com/gpu.count`,
`nvidia.com/gpu.product`, `nvidia.com/gpu.memory` in MiB) and from the node annotation
`gpuplace.io/gpus` (a JSON list with one object per GPU: `index`, `uuid`, `numa`,
`nvlink`; absent or null fields default to no UUID, NUMA 0 and no NVLink). When the
node agent wrote it (its entries carry `memoryMiB`), the annotation alone says how many
GPUs there are, their model (NVML's name, read in GFD's label form: `product`), the memory
the engine packs (`packableMiB`: what a client can get with MPS running) and what each MPS
client's CUDA context takes (`mpsContextMiB`), and which are unhealthy (`health`); the
labels stay the fallback. Without the agent's `packableMiB` a GPU packs its total less
`UNPUBLISHED_MARGIN_MIB`, and its context is its model's (`mps_limits.figures`). Only nodes labelled
`gpuplace.io/enabled=true` are gpuplace's. Their taints and cordon (`spec.taints`,
`spec.unschedulable`) ride along for the gang planner.

`record` is the node informer's transform: whether the node is gpuplace's, its engine
`Node` (or why it cannot be read), its node agent's last heartbeat, and the extended
resources its status currently advertises, so that `advertisement` can say what to
write only when it differs. `effective` closes a node to new GPU pods while its agent
is silent past the bound (or, where an agent is required, has never reported): a
function of the record and the clock, so the sidecar re-applies it as time passes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from gpuplace.cluster import keys, mps_limits, quantities, taints
from gpuplace.placement.inventory import NO_NVLINK, ClientContext, Gpu, Inventory, Node


class NodeError(ValueError):
    """A node whose labels or annotation gpuplace cannot read; names node and key."""


def is_enabled(node: Mapping[str, Any]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    return str(labels.get(keys.NODE_ENABLED, "")).lower() == "true"


def parse(node: Mapping[str, Any]) -> Node:
    """One Kubernetes Node (as the API sends it) → engine Node. O(GPUs)."""
    metadata = node.get("metadata") or {}
    name = str(metadata.get("name") or "")
    labels: dict[str, str] = {str(k): str(v) for k, v in (metadata.get("labels") or {}).items()}
    annotations = metadata.get("annotations") or {}
    status = node.get("status") or {}
    allocatable = status.get("allocatable") or status.get("capacity") or {}
    try:
        cpu = quantities.to_milli(allocatable.get("cpu", "0"))
        memory, _ = quantities.to_mib(allocatable.get("memory", "0"))
        pods = int(quantities.parse(allocatable.get("pods", "110")))
    except quantities.QuantityError as error:
        raise NodeError(f"node {name}: allocatable: {error}") from error
    agent = keys.AGENT_HEARTBEAT in annotations
    gpus = _gpus(name, labels, annotations.get(keys.NODE_GPUS), agent=agent)
    node_taints, unschedulable = taints.of_node(node)
    return Node(
        name=name,
        cpu_milli=cpu,
        memory_mib=memory,
        gpus=gpus,
        max_pods=pods,
        labels=labels,
        taints=node_taints,
        unschedulable=unschedulable,
    )


def _int_label(name: str, labels: Mapping[str, str], key: str) -> int:
    raw = labels.get(key, "0")
    try:
        value = int(raw)
    except ValueError as error:
        raise NodeError(f"node {name}: label {key}={raw!r} is not an integer") from error
    if value < 0:
        raise NodeError(f"node {name}: label {key}={raw!r} is negative")
    return value


def _gpus(
    name: str, labels: Mapping[str, str], topology: object, *, agent: bool = False
) -> tuple[Gpu, ...]:
    count = _int_label(name, labels, keys.GFD_COUNT)
    memory = _int_label(name, labels, keys.GFD_MEMORY)
    model = labels.get(keys.GFD_PRODUCT, "")
    details: dict[int, Mapping[str, Any]] = {}
    if topology:
        try:
            entries = json.loads(str(topology))
            if not isinstance(entries, list):
                raise TypeError("not a list")
            for entry in entries:
                details[int(entry["index"])] = entry
        except (ValueError, TypeError, KeyError) as error:
            raise NodeError(
                f"node {name}: annotation {keys.NODE_GPUS} must be a JSON list of "
                f'{{"index": N, "uuid": "GPU-…", "numa": N, "nvlink": N}}: {error}'
            ) from error
    # The agent's own list is the whole truth, empty included (NVML found no GPU, or
    # none it could count): the labels then no longer speak for the node.
    published = (agent and topology is not None) or (
        bool(details) and all("memoryMiB" in entry for entry in details.values())
    )
    if published:
        if sorted(details) != list(range(len(details))):
            raise NodeError(
                f"node {name}: annotation {keys.NODE_GPUS} lists GPU indices "
                f"{sorted(details)}, not 0..{len(details) - 1}"
            )
        count = len(details)
    elif count and not model:
        raise NodeError(f"node {name}: {keys.GFD_COUNT}={count} but no {keys.GFD_PRODUCT}")
    gpus = []
    for index in range(count):
        entry = details.get(index, {})
        try:
            gpu_model = product(entry.get("model")) or model
            gpus.append(
                Gpu(
                    index=index,
                    model=gpu_model,
                    memory_mib=packable(entry) if published else _less_margin(memory),
                    uuid=str(entry.get("uuid") or ""),
                    numa=_or(entry.get("numa"), 0),
                    nvlink=_or(entry.get("nvlink"), NO_NVLINK),
                    healthy=entry.get("health", HEALTHY) == HEALTHY,
                    context=_context(entry.get("mpsContextMiB"), gpu_model),
                )
            )
        except (TypeError, ValueError, AttributeError) as error:
            raise NodeError(f"node {name}: GPU {index} in {keys.NODE_GPUS}: {error}") from error
    return tuple(gpus)


UNPUBLISHED_MARGIN_MIB = 1024
"""MiB per GPU the engine leaves unpacked where no node agent publishes `packableMiB`
(GPU Feature Discovery's `nvidia.com/gpu.memory` is NVML's total): the H100's measured
driver reservation and MPS server (480 + 66 MiB; its agent publishes 80,960 of 81,559 MiB,
599 less) rounded up to a GiB, for drivers that keep more (docs/node-discovery.md)."""


def _less_margin(total_mib: int) -> int:
    return max(total_mib - UNPUBLISHED_MARGIN_MIB, 0)


def packable(entry: Mapping[str, Any]) -> int:
    """The memory the engine packs on a GPU the node agent published: its `packableMiB`,
    else (an agent that could not read the reservation, or an older one) its NVML total
    `memoryMiB` less `UNPUBLISHED_MARGIN_MIB`; 0 when neither is known."""
    known = entry.get("packableMiB")
    if known is not None:
        return _or(known, 0)
    return _less_margin(_or(entry.get("memoryMiB"), 0))


def _context(published: object, model: str) -> ClientContext:
    """What an MPS client's CUDA context takes on the GPU: as the agent published it
    (`{"base": MiB, "perPercent": MiB}`), else its model's figures (`mps_limits`)."""
    if published is None:
        return mps_limits.figures(model).context
    if not isinstance(published, Mapping):
        raise TypeError(f"mpsContextMiB {published!r} is not an object")
    return ClientContext(_or(published.get("base"), 0), _or(published.get("perPercent"), 0))


def product(name: object) -> str:
    """An NVML device name as GPU Feature Discovery labels it in `nvidia.com/gpu.product`
    (spaces become '-': "NVIDIA H100 80GB HBM3" → "NVIDIA-H100-80GB-HBM3"), the form users
    write in `gpuplace.io/gpu-model` and the webhook's node affinity matches; "" for none."""
    return str(name).strip().replace(" ", "-") if name else ""


HEALTHY = "healthy"
"""The one `health` value that lets a GPU take new grants (absent counts as healthy:
hand-written annotations have none); any other, "unhealthy" included, closes the GPU."""


def _or(value: object, unknown: int) -> int:
    """An annotation integer; null (the agent's "NVML could not say") reads as `unknown`."""
    if value is None:
        return unknown
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"{value!r} is not an integer")
    return int(value)


def is_dra(node: Node) -> bool:
    """A node on the DRA path: labelled `gpuplace.io/dra=true` (its node agent is the DRA
    kubelet plugin; its GPUs are held through ResourceClaims only). O(1)."""
    return str(node.labels.get(keys.NODE_DRA, "")).lower() == "true"


def inventory(items: Iterable[Mapping[str, Any]], *, only_enabled: bool = True) -> Inventory:
    """A NodeList's items → Inventory of the gpuplace-enabled nodes. O(GPUs)."""
    return Inventory(parse(item) for item in items if is_enabled(item) or not only_enabled)


ADVERTISED = (keys.RESOURCE_PERCENT, keys.RESOURCE_MEMORY)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A node as the sidecar keeps it (the node informer's cache entry)."""

    name: str
    uid: str
    enabled: bool
    node: Node | None
    """The engine's view; None when not enabled or unreadable."""
    problem: str = ""
    """Why an enabled node could not be read ("" when fine)."""
    capacity: Mapping[str, str] = field(default_factory=dict)
    """gpuplace's extended resources in status.capacity, as the API has them."""
    allocatable: Mapping[str, str] = field(default_factory=dict)
    """... and in status.allocatable."""
    domain_label: str | None = None
    """The node's `gpuplace.io/nvlink-domain-size` label (None: absent)."""
    heartbeat: str | None = None
    """The node agent's `gpuplace.io/agent-heartbeat` annotation (None: no agent ever
    reported on this node)."""
    heartbeat_at: float | None = None
    """That time in seconds since the epoch; None when absent or unreadable."""


def record(raw: Mapping[str, Any]) -> NodeRecord:
    """Node JSON → NodeRecord; never raises for a readable object. O(GPUs)."""
    metadata = raw.get("metadata") or {}
    status = raw.get("status") or {}
    capacity = status.get("capacity") or {}
    allocatable = status.get("allocatable") or {}
    ours_capacity = {key: str(capacity[key]) for key in ADVERTISED if key in capacity}
    ours_allocatable = {key: str(allocatable[key]) for key in ADVERTISED if key in allocatable}
    labels = metadata.get("labels") or {}
    domain = labels.get(keys.NVLINK_DOMAIN_SIZE)
    beat = (metadata.get("annotations") or {}).get(keys.AGENT_HEARTBEAT)
    enabled = is_enabled(raw)
    node: Node | None = None
    problem = ""
    if enabled:
        try:
            node = parse(raw)
        except (NodeError, ValueError) as error:
            problem = str(error)
    return NodeRecord(
        name=str(metadata.get("name") or ""),
        uid=str(metadata.get("uid") or ""),
        enabled=enabled,
        node=node,
        problem=problem,
        capacity=ours_capacity,
        allocatable=ours_allocatable,
        domain_label=str(domain) if domain is not None else None,
        heartbeat=None if beat is None else str(beat),
        heartbeat_at=None if beat is None else heartbeat_time(str(beat)),
    )


def heartbeat_time(text: str) -> float | None:
    """An RFC 3339 time with its zone → seconds since the epoch; None when unreadable."""
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return None if moment.tzinfo is None else moment.timestamp()


DEFAULT_AGENT_SILENCE = 120.0
"""Seconds without a heartbeat after which a node takes no new GPU pods (the agent
renews it every 30 s by default: four missed beats)."""


def closed_reason(
    record: NodeRecord, now: float, *, silence: float, require_agent: bool = False
) -> str:
    """Why new GPU pods must not go on the node now ("" = they may): its agent's
    heartbeat is older than `silence` seconds (0 = never close for silence) or
    unreadable, or it has none while `require_agent`. Stable while the cause lasts (it
    names the last heartbeat, not the time since), so the engine's node changes only
    when the verdict does. O(1)."""
    if record.heartbeat is None:
        if require_agent:
            return "no node agent has reported on this node (the sidecar requires one)"
        return ""
    if record.heartbeat_at is None:
        return f"node agent heartbeat {record.heartbeat[:64]!r} is not an RFC 3339 time"
    if silence > 0 and now - record.heartbeat_at > silence:
        return f"node agent silent since {record.heartbeat} (more than {silence:g}s)"
    return ""


def effective(
    record: NodeRecord, now: float, *, silence: float, require_agent: bool = False
) -> Node | None:
    """The record's engine node, closed (`Node.closed`) when `closed_reason` says so.
    The same object when nothing changes. O(1)."""
    node = record.node
    if node is None:
        return None
    why = closed_reason(record, now, silence=silence, require_agent=require_agent)
    return node if node.closed == why else replace(node, closed=why)


def advertisement(node: Node) -> dict[str, str]:
    """The extended resources a gpuplace node offers: 100 × GPUs and total GPU MiB."""
    return {
        keys.RESOURCE_PERCENT: str(100 * len(node.gpus)),
        keys.RESOURCE_MEMORY: str(sum(gpu.memory_mib for gpu in node.gpus)),
    }


def status_patch(record: NodeRecord) -> dict[str, Any] | None:
    """The nodes/status merge patch that makes the node advertise what it should, or None
    when it already does. An enabled node advertises `advertisement`; a node that is not
    (any more) gpuplace's loses the resources; an unreadable one is left alone."""
    if record.enabled and record.node is None:
        return None
    wanted: dict[str, str | None]
    if record.node is not None:
        wanted = dict(advertisement(record.node))
    else:
        wanted = dict.fromkeys(key for key in ADVERTISED if key in record.capacity)
        wanted.update(dict.fromkeys(key for key in ADVERTISED if key in record.allocatable))
        if not wanted:
            return None
    capacity_now = {key: record.capacity.get(key) for key in wanted}
    allocatable_now = {key: record.allocatable.get(key) for key in wanted}
    if capacity_now == wanted and allocatable_now == wanted:
        return None
    return {"status": {"capacity": wanted, "allocatable": wanted}}


def largest_nvlink_domain(node: Node) -> int:
    """GPUs in the node's largest NVLink domain; 1 when it has GPUs but no NVLink (each
    GPU is a domain of its own), 0 without GPUs. What required-topology affinity reads."""
    sizes = [len(members) for members in node.nvlink_domains().values()]
    return max(sizes, default=1 if node.gpus else 0)


def label_patch(record: NodeRecord) -> dict[str, Any] | None:
    """The node merge patch that keeps `gpuplace.io/nvlink-domain-size` right, or None.
    Enabled nodes carry it; a node that left gpuplace loses it; unreadable ones are left
    alone."""
    if record.node is not None:
        wanted: str | None = str(largest_nvlink_domain(record.node))
    elif record.enabled:
        return None
    else:
        wanted = None
    if record.domain_label == wanted:
        return None
    return {"metadata": {"labels": {keys.NVLINK_DOMAIN_SIZE: wanted}}}
