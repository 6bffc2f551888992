"""Builders of realistic Node and Pod bodies (what kubelet, GPU Feature
Discovery and the webhook would have written), to `FakeApi.create`."""

from __future__ import annotations

import json
from typing import Any

from gpuplace.cluster import keys, quantities


def node(
    name: str,
    *,
    gpus: int = 8,
    model: str = "NVIDIA-A100-SXM4-80GB",
    gpu_memory_mib: int = 81920,
    cpu: str = "64",
    memory: str = "512Gi",
    pods: str = "110",
    enabled: bool = True,
    uuids: bool = False,
    nvlink: list[int] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node as a kubelet with GPU Feature Discovery reports it; opted in when `enabled`."""
    node_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        keys.GFD_COUNT: str(gpus),
        keys.GFD_PRODUCT: model,
        keys.GFD_MEMORY: str(gpu_memory_mib),
    }
    if enabled:
        node_labels[keys.NODE_ENABLED] = "true"
    node_labels.update(labels or {})
    annotations: dict[str, str] = {}
    if uuids or nvlink is not None:
        entries = []
        for index in range(gpus):
            entry: dict[str, Any] = {"index": index, "numa": index * 2 // max(gpus, 1)}
            if uuids:
                entry["uuid"] = f"GPU-{name}-{index:02d}"
            if nvlink is not None:
                entry["nvlink"] = nvlink[index]
            entries.append(entry)
        annotations[keys.NODE_GPUS] = json.dumps(entries)
    resources = {"cpu": cpu, "memory": memory, "pods": pods, "ephemeral-storage": "1Ti"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": node_labels, "annotations": annotations},
        "spec": {},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def pod(
    name: str,
    namespace: str = "default",
    *,
    percent: int | None = 50,
    memory: str | None = None,
    count: int | None = None,
    model: str | None = None,
    cpu: str = "1",
    host_memory: str = "1Gi",
    managed: bool = True,
    scheduler: str = "gpuplace",
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    gates: list[str] | None = None,
) -> dict[str, Any]:
    """A GPU pod as the mutating webhook leaves it: annotations, managed label, extended
    resources, scheduler name."""
    pod_annotations: dict[str, str] = {}
    if percent is not None:
        pod_annotations[keys.GPU_PERCENT] = str(percent)
    if memory is not None:
        pod_annotations[keys.GPU_MEMORY] = memory
    if count is not None:
        pod_annotations[keys.GPU_COUNT] = str(count)
    if model is not None:
        pod_annotations[keys.GPU_MODEL] = model
    pod_annotations.update(annotations or {})
    pod_labels = {"app": name}
    if managed:
        pod_labels[keys.MANAGED] = "true"
    pod_labels.update(labels or {})
    requests: dict[str, str] = {"cpu": cpu, "memory": host_memory}
    gpu_resources: dict[str, str] = {}
    if percent is None and count is None and memory is not None:
        # A memory-only share: the webhook sets gpu-memory (MiB) alone.
        mib, _ = quantities.to_mib(memory)
        gpu_resources[keys.RESOURCE_MEMORY] = str(mib)
    else:
        gpu_resources[keys.RESOURCE_PERCENT] = str((percent or 100) * (count or 1))
    requests.update(gpu_resources)
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": pod_labels,
            "annotations": pod_annotations,
        },
        "spec": {
            "schedulerName": scheduler,
            "containers": [
                {
                    "name": "main",
                    "image": "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
                    "resources": {
                        "requests": requests,
                        "limits": dict(gpu_resources),
                    },
                }
            ],
        },
    }
    if gates:
        body["spec"]["schedulingGates"] = [{"name": gate} for gate in gates]
    return body
