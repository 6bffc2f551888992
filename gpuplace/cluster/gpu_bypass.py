"""Which existing pods the node agent's no-bypass admission policy would refuse again.

`gpuplace-no-gpu-bypass` (deploy/components/node-agent/admission-policy.yaml) refuses a
new pod that reaches a GPU by itself, in every namespace but kube-system and those
labelled `gpuplace.io/gpu-system=true` (`keys.GPU_SYSTEM`). It judges only pods being
created, so a namespace whose running pods do that (the GPU Operator's, DCGM's, GPU
Feature Discovery's) finds out when one of them is replaced and refused: a DaemonSet pod
that does not come back, a node's GPU stack gone. `gpuplace preflight` reads every pod
and names those namespaces (`findings`) before that happens.

A pod is judged as the policy judges the creation of a pod with its spec (`reasons`):
- a container or init container with env `NVIDIA_VISIBLE_DEVICES` other than `void`,
  `none` or empty, or read through `valueFrom`, or any `CUDA_MPS_*`;
- a volume mount under `/var/run/nvidia-container-devices` or `/run/nvidia-container-devices`;
- a `cdi.k8s.io/` annotation.
Not judged: the rule on gpuplace's assignment annotations (a replacement pod carries
none), ephemeral containers (a replacement has none), and on a pod gpuplace's webhook
mutated (`gpuplace.io/managed=true`) the GPU env that webhook writes itself
(`WEBHOOK_ENV`): its replacement goes through the webhook again, which writes none with
`--node-agent=true`. What such a pod's template held under that env is not seen here.

tests/deploy/test_admission_policy.py holds these rules to the policy's CEL on the same
pods; tests/realcluster/test_policies.py to the real API server. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuplace.cluster import keys

SPARED_NAMESPACE = "kube-system"
"""The one namespace the policy's binding never judges, labelled or not."""
NO_GPU_VALUES = ("void", "none", "")
"""NVIDIA_VISIBLE_DEVICES values that ask the runtime for no GPU (allowed)."""
DEVICE_LIST_PATHS = ("/var/run/nvidia-container-devices", "/run/nvidia-container-devices")
WEBHOOK_ENV = {
    "NVIDIA_VISIBLE_DEVICES": {
        "fieldRef": {
            "apiVersion": "v1",
            "fieldPath": f"metadata.annotations['{keys.VISIBLE_DEVICES}']",
        }
    },
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": None,
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": {
        "fieldRef": {
            "apiVersion": "v1",
            "fieldPath": f"metadata.annotations['{keys.MPS_MEMORY_LIMIT}']",
        }
    },
}
"""The GPU env gpuplace's webhook writes without the node agent: name -> its `valueFrom`
(None: a plain value)."""


def judged(namespace: str, labels: Mapping[str, str]) -> bool:
    """Whether the policy's binding judges the pods of `namespace` with `labels`. O(1)."""
    return namespace != SPARED_NAMESPACE and labels.get(keys.GPU_SYSTEM) != "true"


def _written_by_the_webhook(entry: Mapping[str, Any]) -> bool:
    name = entry.get("name")
    if name not in WEBHOOK_ENV:
        return False
    value_from = WEBHOOK_ENV[name]
    if value_from is None:
        return "valueFrom" not in entry
    return entry.get("valueFrom") == value_from


def _env_reason(container: str, entry: Mapping[str, Any]) -> str | None:
    name = str(entry.get("name") or "")
    if name == "NVIDIA_VISIBLE_DEVICES":
        if "valueFrom" in entry:
            return f"container {container} reads NVIDIA_VISIBLE_DEVICES from valueFrom"
        value = entry.get("value") or ""
        if value not in NO_GPU_VALUES:
            return f"container {container} sets NVIDIA_VISIBLE_DEVICES={value}"
    elif name.startswith("CUDA_MPS_"):
        return f"container {container} sets {name}"
    return None


def reasons(pod: Mapping[str, Any]) -> list[str]:
    """Why the policy would refuse a new pod with `pod`'s spec and annotations (see the
    module docstring); [] when it would not. O(containers × (env + mounts) + annotations)."""
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    managed = (metadata.get("labels") or {}).get(keys.MANAGED) == "true"
    found: list[str] = []
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        name = str(container.get("name") or "")
        for entry in container.get("env") or []:
            if managed and _written_by_the_webhook(entry):
                continue
            why = _env_reason(name, entry)
            if why is not None:
                found.append(why)
        for mount in container.get("volumeMounts") or []:
            path = str(mount.get("mountPath") or "")
            if path.startswith(DEVICE_LIST_PATHS):
                found.append(f"container {name} mounts a volume at {path}")
    for key in metadata.get("annotations") or {}:
        if key.startswith("cdi.k8s.io/"):
            found.append(f"annotation {key}")
    return list(dict.fromkeys(found))


@dataclass
class Finding:
    """One namespace whose pods the policy would refuse: how many, and why (each reason
    once, with the first pod that has it)."""

    namespace: str
    pods: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    """reason -> the first pod (by name) that has it."""


def findings(
    namespaces: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
) -> list[Finding]:
    """The judged namespaces with pods the policy would refuse again, by name. A pod whose
    namespace is not among `namespaces` is judged by its namespace's name alone.
    O(pods × their size + namespaces)."""
    labels = {
        str((ns.get("metadata") or {}).get("name")): (ns.get("metadata") or {}).get("labels") or {}
        for ns in namespaces
    }
    found: dict[str, Finding] = {}
    for pod in sorted(pods, key=lambda p: str((p.get("metadata") or {}).get("name"))):
        metadata = pod.get("metadata") or {}
        namespace = str(metadata.get("namespace") or "")
        if not judged(namespace, labels.get(namespace, {})):
            continue
        why = reasons(pod)
        if not why:
            continue
        finding = found.setdefault(namespace, Finding(namespace))
        name = str(metadata.get("name") or "")
        finding.pods.append(name)
        for reason in why:
            finding.reasons.setdefault(reason, name)
    return [found[namespace] for namespace in sorted(found)]


def spared(namespaces: Iterable[Mapping[str, Any]]) -> list[str]:
    """The namespaces the policy does not judge (kube-system, and those labelled
    `gpuplace.io/gpu-system=true`), by name. O(namespaces)."""
    names = []
    for ns in namespaces:
        metadata = ns.get("metadata") or {}
        if not judged(str(metadata.get("name")), metadata.get("labels") or {}):
            names.append(str(metadata.get("name")))
    return sorted(names)
