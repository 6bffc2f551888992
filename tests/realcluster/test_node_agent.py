"""The node agent on a real kubelet (docs/node-agent.md): `gpuplace node-agent` with
replayed NVML registers as the kubelet's device plugin on the kit's node; a GPU pod placed
by the sidecar starts, and what its container got is read back from the running container;
a pod without a grant gets no GPU; a kubelet restart; the agent's own writes under the
shipped admission policies."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.realcluster.conftest import Agent, Scope
from tests.realcluster.install import AGENT_ACCOUNT, AGENT_NAMESPACE
from tests.realcluster.kit import Cluster, Kubectl
from tests.realcluster.objects import REAL_NODE_GPUS, REAL_NODE_MODEL, gpu_node, grant, pod

DEVICES = "/var/run/nvidia-container-devices"


def metric(url: str, line_start: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)
    )


def running(obj: Mapping[str, Any] | None) -> bool:
    statuses = ((obj or {}).get("status") or {}).get("containerStatuses") or []
    return bool(statuses) and all("running" in (s.get("state") or {}) for s in statuses)


def start(kubectl: Kubectl, obj: dict[str, Any]) -> dict[str, Any]:
    """Create the pod and return it once its container runs."""
    kubectl.apply(obj)
    meta = obj["metadata"]
    found = kubectl.wait_object(
        "pods",
        meta["name"],
        running,
        namespace=meta["namespace"],
        timeout=120,
        what=f"{meta['namespace']}/{meta['name']} running",
    )
    assert found is not None
    return found


def inside(kubectl: Kubectl, obj: Mapping[str, Any], *command: str) -> str:
    """A command run in the pod's container (kubectl exec: the API server dials the
    kubelet). A kubelet that has just started answers "pod does not exist" until it has
    read its pods again, which nothing in the API shows: asked again for up to 60 s."""
    meta = obj["metadata"]
    args = ("-n", meta["namespace"], "exec", meta["name"], "--", *command)
    deadline = time.monotonic() + 60
    while True:
        done = kubectl.run(*args, check=False)
        if done.code == 0 or "pod does not exist" not in done.err:
            return done.check().out
        assert time.monotonic() < deadline, done.err
        time.sleep(0.5)


def environment(kubectl: Kubectl, obj: Mapping[str, Any]) -> dict[str, str]:
    lines = inside(kubectl, obj, "env").splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def gpu_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(("NVIDIA_", "CUDA_"))}


def mount_points(kubectl: Kubectl, obj: Mapping[str, Any]) -> set[str]:
    return {line.split()[1] for line in inside(kubectl, obj, "cat", "/proc/mounts").splitlines()}


def on_the_node(scope: Scope, agent: Agent, name: str, asks: Mapping[str, str]) -> dict[str, Any]:
    annotations = {"gpuplace.io/gpu-model": REAL_NODE_MODEL, **asks}
    return pod(
        name, scope.namespace, annotations, node_selector={"kubernetes.io/hostname": agent.node}
    )


def test_the_agent_registers_and_publishes_through_its_own_identity(
    node_agent: Agent, kubectl: Kubectl
) -> None:
    node = kubectl.json("get", "node", node_agent.node)
    slots = str(100 * REAL_NODE_GPUS)
    assert node["status"]["capacity"]["gpuplace.io/gpu"] == slots  # counted by the kubelet
    assert node["status"]["allocatable"]["gpuplace.io/gpu-percent"] == slots  # by the sidecar
    published = json.loads(node["metadata"]["annotations"]["gpuplace.io/gpus"])
    assert [gpu["uuid"] for gpu in published] == node_agent.uuids
    assert all(gpu["health"] == "healthy" for gpu in published)
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ",
        node["metadata"]["annotations"]["gpuplace.io/agent-heartbeat"],
    )
    assert metric(node_agent.metrics_url, "gpuplace_agent_plugin_registered") == 1
    kubeconfig = next(
        Path(arg.split("=", 1)[1])
        for arg in node_agent.process.argv
        if arg.startswith("--kubeconfig=")
    )
    whoami = kubectl.as_user(kubeconfig).json("auth", "whoami")["status"]["userInfo"]
    assert whoami["username"] == f"system:serviceaccount:{AGENT_NAMESPACE}:{AGENT_ACCOUNT}"
    assert whoami["extra"]["authentication.kubernetes.io/node-name"] == [node_agent.node]


def test_a_whole_gpu_pod_runs_with_exactly_its_granted_gpu(
    scope: Scope, kubectl: Kubectl, node_agent: Agent
) -> None:
    running_pod = start(
        kubectl, on_the_node(scope, node_agent, "whole", {"gpuplace.io/gpu-count": "1"})
    )
    granted = grant(running_pod)
    assert granted["node"] == node_agent.node and granted["uuids"] in node_agent.uuids
    # with the node agent the webhook writes no GPU env into the spec: Allocate is its source
    assert "env" not in running_pod["spec"]["containers"][0]
    assert gpu_env(environment(kubectl, running_pod)) == {"NVIDIA_VISIBLE_DEVICES": DEVICES}
    listed = inside(kubectl, running_pod, "ls", DEVICES).split()
    assert listed == [granted["uuids"]]  # the granted GPU, and no other
    assert f"{DEVICES}/{granted['uuids']}" in mount_points(kubectl, running_pod)
    # no device nodes: the NVIDIA runtime makes them from the list (docs/node-agent.md)
    assert not [
        d for d in inside(kubectl, running_pod, "ls", "/dev").split() if d.startswith("nvidia")
    ]


def test_a_share_runs_with_its_mps_limits_and_its_gpus_pipe_directory(
    scope: Scope, kubectl: Kubectl, node_agent: Agent
) -> None:
    asks = {"gpuplace.io/gpu-percent": "25", "gpuplace.io/gpu-memory": "4Gi"}
    running_pod = start(kubectl, on_the_node(scope, node_agent, "share", asks))
    granted = grant(running_pod)
    assert (granted["milli"], granted["memory-mib"]) == ("250", "4096")
    assert gpu_env(environment(kubectl, running_pod)) == {
        "NVIDIA_VISIBLE_DEVICES": DEVICES,
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
    }
    assert inside(kubectl, running_pod, "ls", DEVICES).split() == [granted["uuids"]]
    assert "/tmp/nvidia-mps" in mount_points(kubectl, running_pod)
    # the pipe directory is its own GPU's MPS control daemon's: its control socket is there
    assert "control" in inside(kubectl, running_pod, "ls", "/tmp/nvidia-mps").split()


def test_a_pod_without_a_grant_gets_no_gpu(
    scope: Scope, kubectl: Kubectl, node_agent: Agent
) -> None:
    plain = start(
        kubectl,
        pod("plain", scope.namespace, node_selector={"kubernetes.io/hostname": node_agent.node}),
    )
    assert gpu_env(environment(kubectl, plain)) == {}
    assert not any(point.startswith(DEVICES) for point in mount_points(kubectl, plain))
    # asking the kubelet for the agent's resource by hand in kube-system, where the webhooks do
    # not look: the shipped policy refuses it on admission (issue 30, point 1) ...
    sneaky = pod(
        f"{scope.namespace}-no-grant",
        "kube-system",
        node_selector={"kubernetes.io/hostname": node_agent.node},
        resources={"limits": {"gpuplace.io/gpu": "1"}},
    )
    refused = kubectl.apply(sneaky, check=False)
    assert refused.code != 0
    assert f"ValidatingAdmissionPolicy '{NEED_A_GRANT}'" in refused.err, refused.err
    assert "where gpuplace grants no GPUs" in refused.err, refused.err
    # ... and where that policy is not installed (or a pod slips past it), the kubelet calls
    # Allocate, the agent finds no grant, and the pod never runs
    binding = kubectl.json("get", "validatingadmissionpolicybinding", NEED_A_GRANT)
    kubectl.run("delete", "validatingadmissionpolicybinding", NEED_A_GRANT)
    try:
        _until_admission(kubectl, sneaky, refused=False)
        failed = kubectl.wait_object(
            "pods",
            sneaky["metadata"]["name"],
            lambda obj: obj is not None and obj["status"].get("phase") == "Failed",
            namespace="kube-system",
            timeout=90,
        )
        assert failed is not None
        assert failed["status"]["reason"] == "UnexpectedAdmissionError", failed["status"]
        message = failed["status"]["message"]
        stranger = f"kube-system/{sneaky['metadata']['name']}"
        assert f"{stranger} asks for 1 gpuplace.io/gpu slot(s) without a gpuplace grant" in (
            message
        ), failed["status"]
    finally:
        kubectl.run(
            "-n",
            "kube-system",
            "delete",
            "pod",
            sneaky["metadata"]["name"],
            "--wait=false",
            check=False,
        )
        for field in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
            binding["metadata"].pop(field, None)
        kubectl.apply(binding)
        probe = {**sneaky, "metadata": {**sneaky["metadata"], "name": f"{scope.namespace}-probe"}}
        _until_admission(kubectl, probe, refused=True, dry_run=True)


NEED_A_GRANT = "gpuplace-gpu-resources-need-a-grant"


def _until_admission(
    kubectl: Kubectl,
    body: dict[str, Any],
    *,
    refused: bool,
    dry_run: bool = False,
    timeout: float = 30.0,
) -> None:
    """Create `body` (only a server dry run with `dry_run`) until the API server's answer
    is `refused` or not: a policy binding's change reaches its admission a moment later."""
    args = ["create", "-f", "-", *(["--dry-run=server"] if dry_run else [])]
    deadline = time.monotonic() + timeout
    while True:
        done = kubectl.run(*args, input=json.dumps(body), check=False)
        if (done.code != 0) == refused:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"admission still {'allows' if refused else 'refuses'}: {done.err}"
            )
        time.sleep(0.5)


def test_a_kubelet_restart_re_registers_and_keeps_serving(
    scope: Scope, kubectl: Kubectl, node_agent: Agent, cluster: Cluster
) -> None:
    before = start(
        kubectl, on_the_node(scope, node_agent, "before", {"gpuplace.io/gpu-count": "1"})
    )
    registrations = 'gpuplace_agent_plugin_registrations_total{result="ok"}'
    count = metric(node_agent.metrics_url, registrations)
    cluster.restart_kubelet()
    deadline = time.monotonic() + 90
    while metric(node_agent.metrics_url, registrations) <= count:
        assert time.monotonic() < deadline, "the agent did not register with the new kubelet"
        time.sleep(0.5)
    assert metric(node_agent.metrics_url, "gpuplace_agent_plugin_registered") == 1
    # the running container kept its GPU; a new pod gets one from the new kubelet
    still = kubectl.json("-n", scope.namespace, "get", "pod", "before")
    assert running(still) and still["status"]["containerStatuses"][0]["restartCount"] == 0
    assert inside(kubectl, still, "ls", DEVICES).split() == [grant(before)["uuids"]]
    after = start(kubectl, on_the_node(scope, node_agent, "after", {"gpuplace.io/gpu-count": "1"}))
    assert inside(kubectl, after, "ls", DEVICES).split() == [grant(after)["uuids"]]
    assert grant(after)["uuids"] != grant(before)["uuids"]


def test_the_agent_may_write_only_its_own_nodes_gpuplace_annotations(
    scope: Scope, kubectl: Kubectl, node_agent: Agent, cluster: Cluster
) -> None:
    other = scope.node("other")
    scope.add_nodes(gpu_node(other, model=scope.model, gpus=1))
    kubeconfig = next(
        Path(arg.split("=", 1)[1])
        for arg in node_agent.process.argv
        if arg.startswith("--kubeconfig=")
    )

    def patch(node: str, meta: Mapping[str, Any]) -> tuple[int, str]:
        """As the agent writes: a `nodes` PATCH (its role has no get)."""
        return cluster.patch_as(kubeconfig, f"/api/v1/nodes/{node}", {"metadata": meta})

    assert patch(node_agent.node, {"annotations": {"gpuplace.io/probe": "1"}})[0] == 200
    assert patch(node_agent.node, {"annotations": {"gpuplace.io/probe": None}})[0] == 200
    policy = "ValidatingAdmissionPolicy 'gpuplace-node-agent-own-node'"
    refused = {
        "another node": patch(other, {"annotations": {"gpuplace.io/probe": "1"}}),
        "a label": patch(node_agent.node, {"labels": {"example.com/x": "1"}}),
        "another annotation": patch(node_agent.node, {"annotations": {"example.com/x": "1"}}),
    }
    words = {
        "another node": "the gpuplace node agent may change only the Node it runs on",
        "a label": "the gpuplace node agent may change only gpuplace.io/ annotations of its Node",
        "another annotation": "may change only gpuplace.io/ annotations of its Node",
    }
    wrong = {
        case: body
        for case, (status, body) in refused.items()
        if status != 403 or policy not in body or words[case] not in body
    }
    assert wrong == {}
