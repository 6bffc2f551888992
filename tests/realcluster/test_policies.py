"""The shipped ValidatingAdmissionPolicy `gpuplace-no-gpu-bypass` judged by the real API
server, on the objects it really hands a policy (after decoding and defaulting: an env
value "" is not there at all), against what docs/node-agent.md ("No bypass") promises."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from tests.realcluster.conftest import Scope
from tests.realcluster.kit import Kubectl, Result
from tests.realcluster.objects import pod

POLICY = "ValidatingAdmissionPolicy 'gpuplace-no-gpu-bypass'"
ENV_MESSAGE = "a container sets NVIDIA_VISIBLE_DEVICES (other than void, none or empty) or"


def dry_run(kubectl: Kubectl, obj: Mapping[str, Any]) -> Result:
    """`kubectl apply --dry-run=server`: admitted or refused as a creation would be."""
    return kubectl.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False)


@pytest.mark.parametrize("value", ["void", "none", ""])
def test_a_pod_may_ask_the_runtime_for_no_gpu(scope: Scope, kubectl: Kubectl, value: str) -> None:
    """docs/node-agent.md: NVIDIA_VISIBLE_DEVICES set to `void`, `none` or empty is
    allowed (how CPU-only pods from CUDA images keep the runtime from handing them any).
    The API server drops an empty `value` before a policy sees the container."""
    cpu_only = pod("cpu-only", scope.namespace, env={"NVIDIA_VISIBLE_DEVICES": value})
    done = dry_run(kubectl, cpu_only)
    assert done.code == 0, done.err


def with_env_from_field(obj: dict[str, Any]) -> dict[str, Any]:
    obj["spec"]["containers"][0]["env"] = [
        {
            "name": "NVIDIA_VISIBLE_DEVICES",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['gpus']"}},
        }
    ]
    return obj


def bypasses(namespace: str) -> dict[str, tuple[dict[str, Any], str]]:
    """A pod per way in the policy closes, and the words of its refusal."""
    mounted = pod("mounts", namespace)
    mounted["spec"]["volumes"] = [{"name": "all", "hostPath": {"path": "/dev/null"}}]
    mounted["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "all", "mountPath": "/var/run/nvidia-container-devices/all"}
    ]
    return {
        "all GPUs by env": (
            pod("env-all", namespace, env={"NVIDIA_VISIBLE_DEVICES": "all"}),
            ENV_MESSAGE,
        ),
        "GPUs from a field": (with_env_from_field(pod("env-field", namespace)), ENV_MESSAGE),
        "its own MPS limit": (
            pod("mps", namespace, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}),
            ENV_MESSAGE,
        ),
        "the device-list mount": (
            mounted,
            "mounts a volume under /var/run/nvidia-container-devices",
        ),
        "a CDI annotation": (
            pod("cdi", namespace, {"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}),
            "a cdi.k8s.io/ annotation asks the container runtime for devices directly",
        ),
        "a forged assignment": (
            pod("forged", namespace, {"gpuplace.io/assigned-uuids": "GPU-0"}),
            "writes the GPU assignment annotations; admin may not set, change or remove them",
        ),
    }


def test_each_way_around_a_grant_is_refused_by_the_api_server(
    scope: Scope, kubectl: Kubectl
) -> None:
    wrong = {}
    for case, (obj, words) in bypasses(scope.namespace).items():
        done = dry_run(kubectl, obj)
        if done.code == 0 or POLICY not in done.err or words not in done.err:
            wrong[case] = done.err or "admitted"
    assert wrong == {}


def test_kube_system_and_gpu_system_namespaces_are_spared(scope: Scope, kubectl: Kubectl) -> None:
    kubectl.run("label", "namespace", scope.namespace, "gpuplace.io/gpu-system=true")
    for namespace in (scope.namespace, "kube-system"):
        obj = pod("dcgm", namespace, env={"NVIDIA_VISIBLE_DEVICES": "all"})
        done = dry_run(kubectl, obj)
        assert done.code == 0, (namespace, done.err)
