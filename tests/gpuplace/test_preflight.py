"""`gpuplace preflight` against the local API (issue 46): it names the namespaces whose
pods the node agent's no-bypass policy would refuse when they are next created (the GPU
Operator's, DCGM's, before they are labelled `gpuplace.io/gpu-system=true`), and nothing
else: not kube-system, not a labelled namespace, not a pod that asks for no GPU, not a
GPU pod carrying the env gpuplace's webhook wrote. The same against the real API server:
tests/realcluster/test_policies.py; the rules against the policy's CEL:
tests/deploy/test_admission_policy.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuplace import cli
from gpuplace.cluster import gpu_bypass, keys
from gpuplace.commands import preflight
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects

Obj = dict[str, Any]


def namespace(name: str, **labels: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def plain(name: str, namespace: str, env: dict[str, str] | None = None, **extra: Any) -> Obj:
    # the container named as its pod, less the pod's suffix
    container: Obj = {"name": name.rsplit("-", 1)[0], "image": "nvcr.io/nvidia/gpu-operator"}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    container.update(extra.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, **extra},
        "spec": {"containers": [container]},
    }


def gpu_stack(api: localapi.FakeApi) -> None:
    """A cluster with the GPU Operator's namespace unlabelled, DCGM's labelled, and the
    pods that must not be named."""
    for name, labels in (
        ("gpu-operator", {}),
        ("dcgm", {keys.GPU_SYSTEM: "true"}),
        ("kube-system", {}),
        ("research", {}),
        ("spoofed", {keys.GPU_SYSTEM: "yes"}),  # only "true" spares
    ):
        api.create(namespace(name, **labels))
    api.create(
        plain("nvidia-device-plugin-abcde", "gpu-operator", {"NVIDIA_VISIBLE_DEVICES": "all"})
    )
    api.create(
        plain("gpu-feature-discovery-fghij", "gpu-operator", {"NVIDIA_VISIBLE_DEVICES": "all"})
    )
    mounted = {
        "volumeMounts": [{"name": "d", "mountPath": "/var/run/nvidia-container-devices/all"}]
    }
    api.create(plain("nvidia-validator-klmno", "gpu-operator", container=mounted))
    api.create(plain("dcgm-exporter-pqrst", "dcgm", {"NVIDIA_VISIBLE_DEVICES": "all"}))
    api.create(plain("nvidia-smi-node-0", "kube-system", {"NVIDIA_VISIBLE_DEVICES": "all"}))
    api.create(plain("cpu-job", "research", {"NVIDIA_VISIBLE_DEVICES": "void"}))
    api.create(plain("mps-tuner", "spoofed", {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}))
    # a GPU pod as gpuplace's webhook left it without the node agent: its env is the
    # webhook's, and its replacement is mutated again
    share = objects.pod("notebook", "research", percent=25)
    share["spec"]["containers"][0]["env"] = [
        {"name": name, **({"valueFrom": source} if source else {"value": "25"})}
        for name, source in gpu_bypass.WEBHOOK_ENV.items()
    ]
    api.create(share)


def run(server: localapi.ThreadedServer, tmp_path: Path, *args: str, user: Any = None) -> int:
    config = server.server.kubeconfig(tmp_path / "kubeconfig", user or localapi.ADMIN)
    return cli.main(["preflight", *args, "--kubeconfig", str(config)])


def test_it_names_the_unlabelled_gpu_stack_and_how_to_trust_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with localapi.serve_in_thread() as server:
        server.call(lambda: gpu_stack(server.api))
        assert run(server, tmp_path) == 1
        table = capsys.readouterr().out
        assert run(server, tmp_path, "-o", "json") == 1
        shown = json.loads(capsys.readouterr().out)
    lines = table.splitlines()
    assert lines[0].split() == ["NAMESPACE", "PODS", "WHY", "E.G."]
    assert lines[1].split()[:2] == ["gpu-operator", "3"]
    # each reason once, with the first pod (by name) that has it
    assert "container gpu-feature-discovery sets NVIDIA_VISIBLE_DEVICES=all" in lines[1]
    assert lines[1].endswith("gpu-feature-discovery-fghij")
    assert lines[2].split() == [
        "container", "nvidia-device-plugin", "sets", "NVIDIA_VISIBLE_DEVICES=all",
        "nvidia-device-plugin-abcde",
    ]  # fmt: skip
    assert lines[3].split()[-1] == "nvidia-validator-klmno"
    assert (
        "container nvidia-validator mounts a volume at /var/run/nvidia-container-devices/all"
        in lines[3]
    )
    assert lines[4].split()[:2] == ["spoofed", "1"]
    assert "container mps sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in lines[4]
    label = "  kubectl label namespace {} gpuplace.io/gpu-system=true --overwrite"
    assert label.format("gpu-operator") in lines and label.format("spoofed") in lines
    assert "not judged: dcgm, kube-system" in table
    for quiet in ("dcgm-exporter", "nvidia-smi", "cpu-job", "notebook", "research"):
        assert quiet not in table, quiet
    assert [f["namespace"] for f in shown["refused"]] == ["gpu-operator", "spoofed"]
    assert shown["refused"][0]["pods"] == [
        "gpu-feature-discovery-fghij",
        "nvidia-device-plugin-abcde",
        "nvidia-validator-klmno",
    ]
    assert shown["spared"] == ["dcgm", "kube-system"]
    assert shown["podsRead"] == 8


def test_labelled_it_has_nothing_to_say_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with localapi.serve_in_thread() as server:

        def labelled() -> None:
            gpu_stack(server.api)
            for name in ("gpu-operator", "spoofed"):
                server.api.patch(
                    "namespaces", name, {"metadata": {"labels": {keys.GPU_SYSTEM: "true"}}}
                )

        server.call(labelled)
        assert run(server, tmp_path) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert said.startswith("No namespace has pods the node agent's admission policy")
    assert (
        "(8 pods in 5 namespaces read; not judged: dcgm, gpu-operator, kube-system, spoofed)"
        in said
    )


def test_credentials_that_cannot_list_namespaces_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with localapi.serve_in_thread(localapi.FakeApi(access=localapi.Access.shipped())) as server:
        assert run(server, tmp_path, user=localapi.NODE_AGENT) == 2
    error = capsys.readouterr().err
    assert error.startswith("gpuplace preflight: the API answered 403 Forbidden: "), error


def test_the_policy_it_names_is_the_shipped_one() -> None:
    policy = (
        Path(__file__).resolve().parents[2] / "deploy/components/node-agent/admission-policy.yaml"
    )
    assert f"name: {preflight.POLICY}\n" in policy.read_text()
