"""`gpuplace.cluster.gpu_bypass` on its own: the reasons it gives, each once and in order,
and the namespaces it judges (the rules themselves are held to the policy's CEL in
tests/deploy/test_admission_policy.py)."""

from __future__ import annotations

from typing import Any

from gpuplace.cluster import gpu_bypass, keys


def pod(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": spec}


def test_every_reason_once_in_the_order_of_the_spec() -> None:
    env = [
        {"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {"fieldPath": "x"}}},
        {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/mps"},
        {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/mps"},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"},
        {"name": "CUDA_VISIBLE_DEVICES", "value": "0"},
    ]
    found = pod(
        "p",
        "ns",
        containers=[{"name": "a", "env": env}],
        initContainers=[
            {
                "name": "b",
                "volumeMounts": [{"name": "v", "mountPath": "/run/nvidia-container-devices/0"}],
            }
        ],
    )
    found["metadata"]["annotations"] = {"cdi.k8s.io/x": "nvidia.com/gpu=0", "other": "1"}
    assert gpu_bypass.reasons(found) == [
        "container a reads NVIDIA_VISIBLE_DEVICES from valueFrom",
        "container a sets CUDA_MPS_PIPE_DIRECTORY",
        "container b mounts a volume at /run/nvidia-container-devices/0",
        "annotation cdi.k8s.io/x",
    ]


def test_a_namespace_not_listed_is_judged_by_its_name() -> None:
    env = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    pods = [
        pod("a", "gone", containers=[{"name": "c", "env": env}]),
        pod("b", "kube-system", containers=[{"name": "c", "env": env}]),
        pod("c", "trusted", containers=[{"name": "c", "env": env}]),
    ]
    namespaces = [{"metadata": {"name": "trusted", "labels": {keys.GPU_SYSTEM: "true"}}}]
    assert [f.namespace for f in gpu_bypass.findings(namespaces, pods)] == ["gone"]
    assert gpu_bypass.spared(namespaces) == ["trusted"]
