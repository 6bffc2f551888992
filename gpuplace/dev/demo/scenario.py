"""The demo's workload: the pods researchers and services submit, in arrival order, as
`kubectl apply` hands them to kube-apiserver (after the API server's defaulting, before
admission). Only annotations ask for GPUs; nothing here knows where pods will go or
whether they will be admitted: the real webhook and extender decide that.

The mix: whole and multi-GPU training jobs with NVLink topology, GPU shares (notebooks,
model serving, embeddings, T4 inference), memory-only shares (GPU memory alone, packed
onto one GPU by memory), a complete gang and an incomplete one, pods the
webhook must refuse (a typo, a malformed value, a contradiction, more memory than any
GPU has, a forged assignment), and a whole T4 asked for once every T4 already serves a
share (it stays pending, and says why). Pure data: no I/O.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import keys

A100 = "NVIDIA-A100-SXM4-80GB"
H100 = "NVIDIA-H100-80GB-HBM3"
A100_PCIE = "NVIDIA-A100-PCIE-40GB"
L4 = "NVIDIA-L4"
T4 = "Tesla-T4"

PYTORCH = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
TRITON = "nvcr.io/nvidia/tritonserver:24.10-py3"
VLLM = "vllm/vllm-openai:v0.6.3"
JUPYTER = "quay.io/jupyter/pytorch-notebook:cuda12-2024-11-18"


@dataclass(frozen=True, slots=True)
class User:
    """Who submits (the AdmissionReview's userInfo)."""

    username: str
    groups: tuple[str, ...] = ("system:authenticated",)


RESEARCHER = User("alice@example.com", ("researchers", "system:authenticated"))
SERVICE = User(
    "system:serviceaccount:serving:deployer",
    ("system:serviceaccounts", "system:serviceaccounts:serving", "system:authenticated"),
)
PLATFORM = User(
    "system:serviceaccount:platform:trainer-operator",
    ("system:serviceaccounts", "system:serviceaccounts:platform", "system:authenticated"),
)


@dataclass(frozen=True, slots=True)
class Submission:
    pod: dict[str, Any]
    user: User

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def annotations(self) -> dict[str, str]:
        return dict(self.pod["metadata"].get("annotations") or {})


def pod(
    namespace: str,
    name: str,
    annotations: dict[str, str],
    *,
    image: str = PYTORCH,
    cpu: str = "4",
    memory: str = "16Gi",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod as kube-apiserver holds it when admission starts: the user's manifest plus
    the server's defaults (no uid, resourceVersion or creationTimestamp yet)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": name, **(labels or {})},
            "annotations": dict(annotations),
        },
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "resources": {"requests": {"cpu": cpu, "memory": memory}},
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File",
                }
            ],
            "dnsPolicy": "ClusterFirst",
            "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority",
            "priority": 0,
            "restartPolicy": "Never" if namespace != "serving" else "Always",
            "schedulerName": "default-scheduler",
            "securityContext": {},
            "serviceAccount": "default",
            "serviceAccountName": "default",
            "terminationGracePeriodSeconds": 30,
            "tolerations": [
                {
                    "effect": "NoExecute",
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "tolerationSeconds": 300,
                },
                {
                    "effect": "NoExecute",
                    "key": "node.kubernetes.io/unreachable",
                    "operator": "Exists",
                    "tolerationSeconds": 300,
                },
            ],
        },
        "status": {"phase": "Pending", "qosClass": "Burstable"},
    }


def _share(percent: int, memory: str, models: str | None = None) -> dict[str, str]:
    values = {keys.GPU_PERCENT: str(percent), keys.GPU_MEMORY: memory}
    if models:
        values[keys.GPU_MODEL] = models
    return values


def _whole(count: int, models: str | None = None, topology: str | None = None) -> dict[str, str]:
    values = {keys.GPU_COUNT: str(count)}
    if models:
        values[keys.GPU_MODEL] = models
    if topology:
        values[keys.GPU_TOPOLOGY] = topology
    return values


def _gang(name: str, size: int, timeout: str) -> dict[str, str]:
    return {keys.GANG_NAME: name, keys.GANG_SIZE: str(size), keys.GANG_TIMEOUT: timeout}


def submissions() -> list[Submission]:
    """Every pod of the demo, in the order they arrive. A fresh copy on each call."""
    out: list[Submission] = []

    def add(user: User, body: dict[str, Any]) -> None:
        out.append(Submission(copy.deepcopy(body), user))

    r, s, p = RESEARCHER, SERVICE, PLATFORM
    add(r, pod("research", "llm-pretrain", _whole(8, A100, "required"), cpu="64", memory="512Gi"))
    for i in range(1, 5):
        add(
            r,
            pod(
                "research", f"h100-train-{i}", _whole(6, H100, "required"), cpu="48", memory="256Gi"
            ),
        )
    add(r, pod("research", "notebook-alice", _share(25, "4Gi"), image=JUPYTER, cpu="2"))
    for i in range(1, 4):
        add(
            r,
            pod(
                "research",
                f"finetune-{i}",
                _whole(2, A100_PCIE, "required"),
                cpu="16",
                memory="64Gi",
            ),
        )
    add(r, pod("research", "typo", {"gpuplace.io/gpu-precent": "50"}))
    for i in range(1, 5):
        add(
            s,
            pod(
                "serving",
                f"llm-serve-{i}",
                _share(50, "30Gi", f"{A100},{H100}"),
                image=VLLM,
                cpu="8",
                memory="32Gi",
            ),
        )
    add(r, pod("research", "notebook-bob", _share(25, "4Gi"), image=JUPYTER, cpu="2"))
    add(r, pod("research", "fifty", {keys.GPU_PERCENT: "fifty"}))
    for i in range(1, 7):
        add(s, pod("serving", f"embed-{i}", _share(30, "6Gi", L4), image=TRITON, memory="8Gi"))
    add(r, pod("research", "notebook-carol", _share(25, "4Gi"), image=JUPYTER, cpu="2"))
    add(r, pod("research", "huge-model", _whole(1) | {keys.GPU_MEMORY: "100Gi"}))
    for i in range(1, 9):
        add(
            s,
            pod(
                "serving",
                f"t4-infer-{i}",
                _share(40, "8Gi", T4),
                image=TRITON,
                cpu="2",
                memory="8Gi",
            ),
        )
    add(r, pod("research", "notebook-dan", _share(25, "4Gi"), image=JUPYTER, cpu="2"))
    add(r, pod("research", "half-of-two", _whole(2) | {keys.GPU_PERCENT: "50"}))
    add(r, pod("research", "l4-single", _whole(1, L4), cpu="8", memory="32Gi"))
    add(r, pod("research", "rl-pair", _whole(2), cpu="16", memory="64Gi"))
    add(
        r,
        pod(
            "research",
            "grab-gpus",
            _share(50, "20Gi")
            | {
                keys.ASSIGNED_NODE: "dgx-h100-01",
                keys.ASSIGNED_GPUS: "6,7",
            },
        ),
    )
    for i in range(4):
        add(
            p,
            pod(
                "platform",
                f"ddp-resnet-{i}",
                _whole(2, A100) | _gang("ddp-resnet", 4, "10m"),
                cpu="16",
                memory="128Gi",
                labels={"training.example.com/job": "ddp-resnet"},
            ),
        )
    add(r, pod("research", "notebook-erin", _share(25, "4Gi"), image=JUPYTER, cpu="2"))
    for i in range(2):
        add(
            p,
            pod(
                "platform",
                f"sweep-{i}",
                _whole(1) | _gang("sweep", 3, "30m"),
                cpu="8",
                memory="32Gi",
                labels={"training.example.com/job": "sweep"},
            ),
        )
    for i in range(1, 3):
        # GPU memory alone, as gpushare/GAS/KAI users ask: no compute reserved (a warning
        # says so); the second packs onto the first's GPU (two 9Gi and their CUDA contexts
        # fit an L4's 23,034 MiB less the margin of nodes without the node agent).
        add(r, pod("research", f"eval-{i}", {keys.GPU_MEMORY: "9Gi"}, cpu="2"))
    add(s, pod("serving", "t4-batch", _whole(1, T4), image=TRITON, cpu="4", memory="16Gi"))
    return out


def short_model(model: str) -> str:
    """'NVIDIA-A100-SXM4-80GB' → 'A100-SXM4', 'NVIDIA-H100-80GB-HBM3' → 'H100',
    'Tesla-T4' → 'T4'."""
    parts = model.removeprefix("NVIDIA-").removeprefix("Tesla-").split("-")
    kept = []
    for part in parts:
        if part.endswith("GB") or part.startswith("HBM"):
            break
        kept.append(part)
    return "-".join(kept) or model


def asks(annotations: dict[str, str]) -> str:
    """What a pod asks for, in a few words: '25% + 4Gi', '8× A100-SXM4-80GB NVLink'."""
    count = annotations.get(keys.GPU_COUNT)
    percent = annotations.get(keys.GPU_PERCENT)
    memory = annotations.get(keys.GPU_MEMORY)
    models = annotations.get(keys.GPU_MODEL)
    parts: list[str] = []
    if count is not None and count != "1":
        parts.append(f"{count} GPUs" if percent is None else f"{count}×{percent}%")
    elif percent is not None:
        parts.append(f"{percent}%" if percent.isdigit() else repr(percent))
    elif count is not None:
        parts.append("1 GPU")
    elif memory:
        parts.append("memory")
    if memory:
        parts.append(f"{memory}")
    if models:
        parts.append("|".join(short_model(model) for model in models.split(",")))
    if annotations.get(keys.GPU_TOPOLOGY) == "required":
        parts.append("NVLink")
    if keys.GANG_NAME in annotations:
        parts.append(f"gang {annotations[keys.GANG_NAME]}/{annotations.get(keys.GANG_SIZE)}")
    unknown = [
        k for k in annotations if k.startswith(keys.PREFIX) and k not in keys.USER_ANNOTATIONS
    ]
    if unknown:
        parts.append("+" + ",".join(k.removeprefix(keys.PREFIX) for k in unknown))
    return " ".join(parts) or "-"
