"""Kubernetes Node objects → the engine's `placement.inventory.Node`.

GPUs come from GPU Feature Discovery labels (`nvidia.com/gpu.count`,
`nvidia.com/gpu.product`, `nvidia.com/gpu.memory` in MiB) and, optionally, from
the node annotation `gpuplace.io/gpus` (a JSON list with one object per GPU:
`index`, `uuid`, `numa`, `nvlink`; absent fields default to no UUID, NUMA 0 and
no NVLink). Only nodes labelled `gpuplace.io/enabled=true` are gpuplace's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from cluster import keys, quantities
from placement.inventory import NO_NVLINK, Gpu, Inventory, Node


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
    gpus = _gpus(name, labels, annotations.get(keys.NODE_GPUS))
    return Node(name=name, cpu_milli=cpu, memory_mib=memory, gpus=gpus, max_pods=pods,
                labels=labels)


def _int_label(name: str, labels: Mapping[str, str], key: str) -> int:
    raw = labels.get(key, "0")
    try:
        value = int(raw)
    except ValueError as error:
        raise NodeError(f"node {name}: label {key}={raw!r} is not an integer") from error
    if value < 0:
        raise NodeError(f"node {name}: label {key}={raw!r} is negative")
    return value


def _gpus(name: str, labels: Mapping[str, str], topology: object) -> tuple[Gpu, ...]:
    count = _int_label(name, labels, keys.GFD_COUNT)
    memory = _int_label(name, labels, keys.GFD_MEMORY)
    model = labels.get(keys.GFD_PRODUCT, "")
    if count and not model:
        raise NodeError(f"node {name}: {keys.GFD_COUNT}={count} but no {keys.GFD_PRODUCT}")
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
    gpus = []
    for index in range(count):
        entry = details.get(index, {})
        try:
            gpus.append(
                Gpu(
                    index=index,
                    model=model,
                    memory_mib=memory,
                    uuid=str(entry.get("uuid", "")),
                    numa=int(entry.get("numa", 0)),
                    nvlink=int(entry.get("nvlink", NO_NVLINK)),
                )
            )
        except (TypeError, ValueError) as error:
            raise NodeError(f"node {name}: GPU {index} in {keys.NODE_GPUS}: {error}") from error
    return tuple(gpus)


def inventory(items: Iterable[Mapping[str, Any]], *, only_enabled: bool = True) -> Inventory:
    """A NodeList's items → Inventory of the gpuplace-enabled nodes. O(GPUs)."""
    return Inventory(parse(item) for item in items if is_enabled(item) or not only_enabled)
