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
        # the ask and the H100's CUDA context at 25 % (144 + 5 × 25), as the agent publishes
        # it for its GPU (issue 43)
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4365M",
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


def host_pids(uid: str, command: str) -> list[int]:
    """Host PIDs of the processes named `command` in pod `uid`'s cgroup (the kit's kubelet:
    cgroupfs, cgroup v1, `/kubepods/<class>/pod<uid>/<container>`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"pod{uid}" in (entry / "cgroup").read_text() and (
                (entry / "comm").read_text().strip() == command
            ):
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile
    return sorted(found)


def with_clients(replay: Path, index: int, pids: list[int], each_bytes: int) -> None:
    """The agent's replayed reading, with `pids` as MPS clients of GPU `index`, each holding
    `each_bytes` (DERIVED for this test, marked so); written whole, then renamed over the
    file the agent follows (`--nvml-replay`)."""
    reading = json.loads(replay.read_text())
    gpu = reading["gpus"][index]
    clients = [{"pid": pid, "usedGpuMemory": each_bytes} for pid in pids]
    gpu["mps_processes"] = clients
    gpu["compute_processes"] = list(clients)
    gpu["memory"]["used"] += each_bytes * len(pids)
    reading["derived"] = f"{reading.get('derived', '')}; MPS clients {pids} on GPU {index}"
    written = replay.with_name(replay.name + ".next")
    written.write_text(json.dumps(reading))
    written.replace(replay)


def agent_events(kubectl: Kubectl, namespace: str, uid: str, reason: str) -> list[dict[str, Any]]:
    listed = kubectl.json("-n", namespace, "get", "events", "--field-selector",
                          f"involvedObject.uid={uid},reason={reason}")  # fmt: skip
    items: list[dict[str, Any]] = listed["items"]
    return items


def audit_lines(agent: Agent, uid: str) -> list[dict[str, Any]]:
    """The agent's audit lines about pod `uid` (its stdout, in its log)."""
    lines = []
    for line in agent.process.log.read_text(errors="replace").splitlines():
        if line.startswith('{"time"') and f'"uid": "{uid}"' in line:
            lines.append(json.loads(line))
    return lines


def eventually(what: str, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"not seen in {timeout:g} s: {what}"
        time.sleep(0.25)


def test_a_pod_whose_two_processes_exceed_its_grant_is_caught_and_evicted(
    scope: Scope, kubectl: Kubectl, node_agent: Agent
) -> None:
    """Issue 43, point 3, on the kit's kubelet: a share's pod runs two processes; the
    replayed NVML names their host PIDs as its GPU's MPS clients, each holding 80 % of the
    grant. Within one sampling interval (2 s here): an Event on the pod, the metric, an
    audit line; the eviction is refused while a PodDisruptionBudget allows none, then
    done through the Eviction API once it does."""
    asks = {"gpuplace.io/gpu-percent": "25", "gpuplace.io/gpu-memory": "4Gi"}
    body = on_the_node(scope, node_agent, "two", asks)
    body["spec"]["containers"][0]["command"] = ["sh", "-c", "sleep 3600 & sleep 3600 & wait"]
    body["metadata"]["labels"] = {"app": "two"}
    running_pod = start(kubectl, body)
    uid = running_pod["metadata"]["uid"]
    pids = eventually("the pod's two processes", lambda: host_pids(uid, "sleep")[:2] or None)
    assert len(host_pids(uid, "sleep")) == 2
    index = node_agent.uuids.index(grant(running_pod)["uuids"])
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "two", "namespace": scope.namespace},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "two"}}},
    }
    kubectl.apply(budget)
    eventually(
        "the disruption controller's budget status",
        lambda: (
            kubectl.json("-n", scope.namespace, "get", "pdb", "two")
            .get("status", {})
            .get("currentHealthy")
            == 1
        ),
    )
    original = node_agent.replay.read_text()
    try:
        began = time.monotonic()
        with_clients(node_agent.replay, index, pids, int(0.8 * 4096) << 20)
        (event,) = eventually(
            "the GpuOverGrant Event",
            lambda: [
                e
                for e in agent_events(kubectl, scope.namespace, uid, "GpuOverGrant")
                if "hold 6552 MiB" in e["message"]
            ],
        )
        caught = time.monotonic() - began
        print(f"over-grant caught {caught:.2f} s after the replay named the clients")
        assert caught < 2 + 10, f"caught after {caught:.1f} s"  # one 2 s interval, slack
        assert event["type"] == "Warning" and "more than its grant of 4096 MiB" in event["message"]
        assert event["reportingComponent"] == "gpuplace.io/node-agent"
        series = (
            f'gpuplace_pod_gpu_over_grant{{gpu="{index}",kind="memory",namespace="'
            f'{scope.namespace}",node="{node_agent.node}",pod="two"'
        )
        assert metric(node_agent.metrics_url, series) == 1
        lines = eventually("the audit lines", lambda: audit_lines(node_agent, uid))
        memory = next(line for line in lines if line["kind"] == "memory")
        assert (memory["event"], memory["decision"], memory["processes"]) == (
            "overGrant",
            "evicting",
            2,
        )
        assert memory["usedBytes"] == 2 * (int(0.8 * 4096) << 20)
        # the budget allows no disruption: refused (429), the pod stays
        refused = eventually(
            "the refused eviction",
            lambda: agent_events(kubectl, scope.namespace, uid, "GpuOverGrantEviction"),
        )
        assert "PodDisruptionBudget allows no disruption now" in refused[0]["message"]
        assert any(line["decision"] == "evictionRefused" for line in audit_lines(node_agent, uid))
        still = kubectl.json("-n", scope.namespace, "get", "pod", "two")
        assert running(still) and not still["metadata"].get("deletionTimestamp")
        # once the budget allows it, the next sample evicts it through the Eviction API
        kubectl.run("-n", scope.namespace, "delete", "pdb", "two")
        eventually(
            "the eviction",
            lambda: any(line["decision"] == "evicted" for line in audit_lines(node_agent, uid)),
        )

        def going() -> bool:
            listed = kubectl.json("-n", scope.namespace, "get", "pods", "--field-selector",
                                  "metadata.name=two")["items"]  # fmt: skip
            return not listed or bool(listed[0]["metadata"].get("deletionTimestamp"))

        eventually("the evicted pod going", going)
    finally:
        written = node_agent.replay.with_name(node_agent.replay.name + ".next")
        written.write_text(original)
        written.replace(node_agent.replay)
