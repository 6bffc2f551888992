"""Objects the tier's tests create: GPU nodes without a kubelet, and pods as a user
writes them.

A *fake GPU node* is a Node created through the API with what GPU Feature Discovery
would label (`nvidia.com/gpu.count`, `.product`, `.memory`), gpuplace's opt-in label,
optionally the topology annotation `gpuplace.io/gpus`, and a status written as a kubelet
would (allocatable CPU, memory, pods, and `gpuplace.io/gpu` slots as the node agent's
device plugin would make the kubelet offer: 100 per GPU); the `not-ready` taint the API
server puts on every new Node is lifted, as the kit does for its own node. No kubelet
stands behind it: kube-scheduler and the sidecar place and bind pods there, and they stay
Pending-bound, which is all a placement test needs. Each test gives its nodes a GPU
product of its own and its pods ask for it (`gpuplace.io/gpu-model`), so tests sharing
the cluster never place on each other's nodes.

Pods are busybox from the kit's local image, `terminationGracePeriodSeconds: 0` so that a
deletion or eviction of a pod on a node without a kubelet completes at once.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from gpuplace.agent import nvml
from tests.realcluster.kit import ROOT, Kubectl

BUSYBOX = "localhost/busybox:local"
SLOTS_PER_GPU = 100
H100_MIB = 81559
"""nvidia.com/gpu.memory of an H100 80GB HBM3 as GFD labels it (and NVML reads it)."""
GPU_FIXTURES = ROOT.parent / "shared" / "fixtures" / "gpu"
REAL_NODE_GPUS = 2
REAL_NODE_MODEL = "NVIDIA-H100-80GB-HBM3"
"""The kit's kubelet node as the node agent plays it: two H100s (GFD's product label)."""


def real_node_reading() -> dict[str, Any]:
    """What the node agent replays on the kit's node: two GPUs derived from the captured
    H100 (`../shared/fixtures/gpu/nvml-idle.json`)."""
    readings = GPU_FIXTURES / "nvml-idle.json"
    return nvml.derived(json.loads(readings.read_text()), REAL_NODE_GPUS)


def label_real_node(kubectl: Kubectl, node: str, *opt_in: str) -> None:
    """What GPU Feature Discovery would label on the kit's node (and `opt_in` labels)."""
    kubectl.run(
        "label", "node", node, "--overwrite", *opt_in,
        f"nvidia.com/gpu.count={REAL_NODE_GPUS}", f"nvidia.com/gpu.product={REAL_NODE_MODEL}",
        f"nvidia.com/gpu.memory={H100_MIB}",
    )  # fmt: skip


def wait_agent_devices(kubectl: Kubectl, node: str, timeout: float = 120) -> None:
    """Until the kubelet offers the node agent's `gpuplace.io/gpu` slots on `node` (its
    device plugin registered) and the sidecar advertises its GPUs there."""
    slots = str(SLOTS_PER_GPU * REAL_NODE_GPUS)
    kubectl.watch(
        ["nodes", "--field-selector", f"metadata.name={node}"],
        lambda seen: any(
            (obj["status"].get("allocatable") or {}).get("gpuplace.io/gpu") == slots
            and "gpuplace.io/gpu-percent" in (obj["status"].get("allocatable") or {})
            for obj in seen.values()
        ),
        timeout=timeout,
        what=f"the kubelet to offer {slots} gpuplace.io/gpu and the sidecar its GPUs",
    )


def gpu_node(
    name: str,
    *,
    model: str,
    gpus: int,
    memory_mib: int = H100_MIB,
    nvlink: Sequence[int] | None = None,
    labels: Mapping[str, str] | None = None,
    taints: Sequence[Mapping[str, str]] = (),
    unschedulable: bool = False,
) -> dict[str, Any]:
    """The Node object of a fake GPU node; `nvlink[i]` is GPU i's NVLink domain (-1:
    none), written to `gpuplace.io/gpus` as GFD's companions would."""
    meta: dict[str, Any] = {
        "name": name,
        "labels": {
            "kubernetes.io/hostname": name,
            "gpuplace.io/enabled": "true",
            "nvidia.com/gpu.count": str(gpus),
            "nvidia.com/gpu.product": model,
            "nvidia.com/gpu.memory": str(memory_mib),
            **(labels or {}),
        },
    }
    if nvlink is not None:
        entries = [
            {"index": index, "uuid": f"GPU-{name}-{index}", "numa": 0, "nvlink": domain}
            for index, domain in enumerate(nvlink)
        ]
        meta["annotations"] = {"gpuplace.io/gpus": json.dumps(entries)}
    spec: dict[str, Any] = {}
    if taints:
        spec["taints"] = [dict(taint) for taint in taints]
    if unschedulable:
        spec["unschedulable"] = True
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": spec}


def add_nodes(kubectl: Kubectl, *nodes: Mapping[str, Any], timeout: float = 60) -> None:
    """Create fake GPU nodes, give them a kubelet-like status, lift the not-ready taint,
    and wait until the sidecar advertises their GPUs on their status (so it knows them)."""
    kubectl.apply(*nodes)
    for node in nodes:
        name = node["metadata"]["name"]
        gpus = int(node["metadata"]["labels"]["nvidia.com/gpu.count"])
        resources = {
            "cpu": "64",
            "memory": "512Gi",
            "pods": "110",
            "gpuplace.io/gpu": str(SLOTS_PER_GPU * gpus),
        }
        status = {
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "NoKubelet",
                        "message": "a Node object of the real-cluster tier: no kubelet runs it",
                    }
                ],
            }
        }
        kubectl.run(
            "patch", "node", name, "--subresource=status", "--type=merge", "-p", json.dumps(status)
        )
        kubectl.run("taint", "node", name, "node.kubernetes.io/not-ready-", check=False)
    names = {node["metadata"]["name"] for node in nodes}
    kubectl.watch(
        ["nodes", "-l", "gpuplace.io/enabled=true"],
        lambda seen: all(
            f"/{name}" in seen
            and "gpuplace.io/gpu-percent" in (seen[f"/{name}"]["status"].get("allocatable") or {})
            and not any(
                taint.get("key") == "node.kubernetes.io/not-ready"
                for taint in seen[f"/{name}"]["spec"].get("taints") or []
            )
            for name in names
        ),
        timeout=timeout,
        what=f"the sidecar to advertise GPUs on {sorted(names)}",
    )


def pod(
    name: str,
    namespace: str,
    annotations: Mapping[str, str] | None = None,
    *,
    priority_class: str | None = None,
    node_selector: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, str]] = (),
    command: Sequence[str] = ("sleep", "3600"),
    env: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    resources: Mapping[str, Any] | None = None,
    grace: int = 0,
) -> dict[str, Any]:
    """A pod as a user writes it: annotations ask for GPUs, gpuplace does the rest."""
    box: dict[str, Any] = {
        "name": "main",
        "image": BUSYBOX,
        "imagePullPolicy": "Never",
        "command": list(command),
    }
    if env:
        box["env"] = [{"name": key, "value": value} for key, value in env.items()]
    if resources:
        box["resources"] = dict(resources)
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace,
        "restartPolicy": "Never",
        "containers": [box],
    }
    if priority_class:
        spec["priorityClassName"] = priority_class
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [dict(item) for item in tolerations]
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if annotations:
        meta["annotations"] = dict(annotations)
    if labels:
        meta["labels"] = dict(labels)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def priority_class(name: str, value: int) -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name},
        "value": value,
    }


def grant(obj: Mapping[str, Any]) -> dict[str, str]:
    """A pod's assignment annotations (`gpuplace.io/assigned-*`), short keys."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    prefix = "gpuplace.io/assigned-"
    return {
        key[len(prefix) :]: value for key, value in annotations.items() if key.startswith(prefix)
    }


def bound(obj: Mapping[str, Any] | None) -> bool:
    """Bound to a node and granted there (the sidecar writes the grant before the Binding)."""
    return bool(obj and (obj.get("spec") or {}).get("nodeName") and grant(obj).get("node"))


def wait_bound(kubectl: Kubectl, namespace: str, name: str, timeout: float = 60) -> dict[str, Any]:
    """The pod once it is bound with its grant."""
    found = kubectl.wait_object(
        "pods", name, bound, namespace=namespace, timeout=timeout, what=f"{namespace}/{name} bound"
    )
    assert found is not None
    return found


def wait_pending(kubectl: Kubectl, namespace: str, name: str, timeout: float = 60) -> str:
    """The message of the pod's FailedScheduling Event, once kube-scheduler has tried it
    and found no node (the pod is then unbound)."""
    message = kubectl.wait_event(namespace, name, "FailedScheduling", timeout=timeout)
    obj = kubectl.json("-n", namespace, "get", "pod", name)
    assert not obj["spec"].get("nodeName"), f"{name} was bound to {obj['spec']['nodeName']}"
    return message


def running(obj: Mapping[str, Any] | None) -> bool:
    """Running and Ready (on the kit's kubelet node: the container really started)."""
    status = (obj or {}).get("status") or {}
    ready = [c for c in status.get("conditions", []) if c["type"] == "Ready"]
    return status.get("phase") == "Running" and bool(ready) and ready[0]["status"] == "True"


def observed(kubectl: Kubectl, namespace: str, name: str, allowed: int) -> None:
    """Until the disruption controller has observed the budget and allows `allowed`."""

    def done(pdb: dict[str, Any] | None) -> bool:
        status = (pdb or {}).get("status") or {}
        return (
            pdb is not None
            and status.get("observedGeneration") == pdb["metadata"]["generation"]
            and status.get("disruptionsAllowed") == allowed
        )

    kubectl.wait_object("poddisruptionbudgets", name, done, namespace=namespace)


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples (every label set) on a /metrics page."""
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if re.match(rf"{re.escape(name)}(\{{| )", line)
    )
