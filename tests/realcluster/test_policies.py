"""The shipped ValidatingAdmissionPolicy `gpuplace-no-gpu-bypass` judged by the real API
server, on the objects it really hands a policy (after decoding and defaulting: an env
value "" is not there at all), against what docs/node-agent.md ("No bypass") promises;
and `gpuplace preflight` naming, before it matters, the namespaces whose pods it refuses."""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Mapping
from typing import Any

import pytest

from tests.realcluster.conftest import Scope
from tests.realcluster.install import GPUPLACE
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


def preflight(kubectl: Kubectl) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [GPUPLACE, "preflight", "-o", "json", f"--kubeconfig={kubectl.kubeconfig}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def test_preflight_names_the_namespaces_whose_next_pods_the_api_server_refuses(
    scope: Scope, kubectl: Kubectl
) -> None:
    """Issue 46: a namespace of the GPU stack, created while labelled gpu-system (or
    before the policy), then unlabelled: its pods run on, and `gpuplace preflight` names
    it with each of them, as the real API server then refuses a copy of each; labelled
    again, preflight no longer names it and the API server admits the copies."""
    kubectl.run("label", "namespace", scope.namespace, "gpuplace.io/gpu-system=true")
    stack = {
        case: obj
        for case, (obj, _) in bypasses(scope.namespace).items()
        if case != "a forged assignment"  # a replacement carries no assignment
    }
    for obj in stack.values():
        obj["spec"]["nodeSelector"] = {"gpuplace.io/rc-nowhere": "true"}  # stored, never run
    kubectl.apply(*stack.values())
    kubectl.run("label", "namespace", scope.namespace, "gpuplace.io/gpu-system-")

    def copies() -> dict[str, Result]:
        made = {}
        for case, obj in stack.items():
            again = copy.deepcopy(obj)
            again["metadata"]["name"] += "-again"
            made[case] = dry_run(kubectl, again)
        return made

    code, found = preflight(kubectl)
    named = {f["namespace"]: f for f in found["refused"]}
    assert code == 1 and scope.namespace in named, found
    pods = sorted(obj["metadata"]["name"] for obj in stack.values())
    assert named[scope.namespace]["pods"] == pods
    admitted = [case for case, done in copies().items() if done.code == 0 or POLICY not in done.err]
    assert admitted == []

    kubectl.run("label", "namespace", scope.namespace, "gpuplace.io/gpu-system=true")
    _, found = preflight(kubectl)
    assert scope.namespace not in {f["namespace"] for f in found["refused"]}, found
    assert scope.namespace in found["spared"]
    refused = {case: done.err for case, done in copies().items() if done.code != 0}
    assert refused == {}
