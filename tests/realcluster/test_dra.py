"""gpuplace on DRA on the real tier (docs/dra.md, issue 42 point 5): the shipped DRA
component applied on top of the install (`deploy/components/dra`), `gpuplace node-agent
--kubelet-plugin=dra` with the DRA DaemonSet's arguments and identity registered as the
kit's kubelet's DRA plugin (containerd 1.7 with CDI: `up --cdi`), NVML replayed, MPS played
by the stand-in; claims allocated by kube-scheduler's own DRA allocator (the cluster's
default scheduler, first fit) against the agent's ResourceSlice; what each container got is
read back from the running container.

The module borrows the one kubelet node from the device-plugin agent (`KubeletNode.lent`:
a node is on one path), labels it `gpuplace.io/dra=true` (and opted in) meanwhile, gives it
back unlabelled, and runs `gpuplace serve` with the component's arguments
(`--dra-silence-taints=true`, `--dra-claims=fallback`) and a short `--agent-silence-seconds`
meanwhile. The tests at the end write pods with the annotations alone: the webhook sends
them to the DRA node, the sidecar creates their claims, kube-scheduler allocates them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench import scheduler_throughput
from gpuplace.cluster import assignments, dra, dra_claims, keys
from tests.realcluster import install
from tests.realcluster.conftest import KubeletNode, Scope, derived_replay
from tests.realcluster.install import AGENT_NAMESPACE, GPUPLACE, Installation
from tests.realcluster.kit import Cluster, Kubectl, free_port
from tests.realcluster.objects import gpu_node, pod, priority_class, running, wait_bound
from tests.realcluster.processes import HostProcess, with_flags
from tests.realcluster.sessions import unusable
from tests.realcluster.test_node_agent import environment, gpu_env, inside, metric

DRA_ACCOUNT = "gpuplace-node-agent-dra"
DAEMONSET = install.DRA_DAEMONSET
SILENCE = 6
"""The sidecar's --agent-silence-seconds meanwhile (the agent beats every 2 s)."""
CDI_DIR = Path("/var/run/cdi")
DEVICES = "/var/run/nvidia-container-devices"
PIPE = "/tmp/nvidia-mps"


@dataclass
class DraNode:
    """The kit's node served by the DRA agent."""

    cluster: Cluster
    installation: Installation
    process: HostProcess
    node: str
    uuids: list[str]
    metrics_url: str
    plugin_dir: Path
    kubeconfig: Path

    @property
    def slice_name(self) -> str:
        return dra.slice_name(self.node)


@pytest.fixture(scope="module")
def dra_installed(gpuplace: Installation) -> list[dict[str, Any]]:
    """The DRA component applied (`kubectl apply -k`); the rendered objects."""
    overlay = install.dra_overlay(gpuplace)
    gpuplace.kubectl.run("apply", "-k", str(overlay))
    rendered = gpuplace.kubectl.run("kustomize", str(overlay)).out
    return [item for item in yaml.safe_load_all(rendered) if item]


def _clean_host(plugin_dir: Path) -> None:
    """What an agent of an earlier run left on the machine: its checkpoint, our specs."""
    with contextlib.suppress(FileNotFoundError):
        (plugin_dir / "checkpoint.json").unlink()
    for spec in CDI_DIR.glob(f"{dra.DRIVER}-claim_*.json"):
        spec.unlink()


@contextlib.contextmanager
def dra_serve(gpuplace: Installation, rendered: list[dict[str, Any]]) -> Iterator[None]:
    """`gpuplace serve` with the DRA component's arguments and a short silence bound."""
    shipped = gpuplace.serve
    shipped.stop()
    made = install.serve_process(gpuplace, rendered=rendered)
    argv = [made.argv[0], *with_flags(made.argv[1:], {"--agent-silence-seconds": str(SILENCE)})]
    assert "--dra-silence-taints=true" in argv, argv
    gpuplace.serve = HostProcess(
        "gpuplace serve (DRA)", argv, gpuplace.workdir / "serve-dra.log", ready_url=made.ready_url
    )
    try:
        gpuplace.serve.start()
        yield
    finally:
        gpuplace.serve.stop()
        gpuplace.serve = shipped
        shipped.start()


@pytest.fixture(scope="module")
def dra_node(
    cluster: Cluster,
    gpuplace: Installation,
    dra_installed: list[dict[str, Any]],
    kubelet_node: KubeletNode,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[DraNode]:
    if cluster.node_problem is not None:
        unusable(f"no kubelet node: {cluster.node_problem}")
    if cluster.cdi_problem is not None:
        unusable(f"the kubelet node has no CDI (`cluster.sh up --cdi`): {cluster.cdi_problem}")
    workdir = tmp_path_factory.mktemp("dra")
    replay, uuids = derived_replay(workdir)
    node = cluster.node_name
    kubelet_dir = Path(cluster.env["K8S_DEVICE_PLUGIN_DIR"]).parent
    plugin_dir = kubelet_dir / "plugins" / dra.DRIVER
    _clean_host(plugin_dir)
    port = free_port()
    process, mps = install.node_agent_process(
        gpuplace,
        node,
        replay,
        kubelet_dir / "device-plugins",
        port,
        daemonset=DAEMONSET,
        account=DRA_ACCOUNT,
        rendered=dra_installed,
        flags={
            "--device-plugin-dir": None,
            "--kubelet-plugins-dir": str(kubelet_dir / "plugins"),
            "--kubelet-registry-dir": str(kubelet_dir / "plugins_registry"),
            "--cdi-dir": str(CDI_DIR),
            "--heartbeat-seconds": "2",
            "--discover-seconds": "1",
        },
    )
    kubeconfig = Path(next(a for a in process.argv if a.startswith("--kubeconfig=")).split("=")[1])
    labels = ("gpuplace.io/enabled=true", f"{keys.NODE_DRA}=true")
    with kubelet_node.lent(), dra_serve(gpuplace, dra_installed), labelled(gpuplace, node, labels):
        try:
            process.start()
            yield DraNode(
                cluster,
                gpuplace,
                process,
                node,
                uuids,
                f"http://127.0.0.1:{port}/metrics",
                plugin_dir,
                kubeconfig,
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                if process.alive:
                    os.kill(process.pid, signal.SIGCONT)
            process.stop()
            gpuplace.kubectl.run(
                "delete", "resourceslice", dra.slice_name(node), "--ignore-not-found"
            )
            _clean_host(plugin_dir)
            shutil.rmtree(mps, ignore_errors=True)


@contextlib.contextmanager
def labelled(gpuplace: Installation, node: str, labels: tuple[str, ...]) -> Iterator[None]:
    """The node labelled as a DRA node for the block (the device-plugin agent's node after,
    with `gpuplace.io/enabled` as its own fixture left it)."""
    gpuplace.kubectl.run("label", "node", node, "--overwrite", *labels)
    try:
        yield
    finally:
        gpuplace.kubectl.run("label", "node", node, f"{keys.NODE_DRA}-")


# --- what the tests write ----------------------------------------------------------------


def share_claim(
    name: str, namespace: str, milli: int, memory_mib: int, *, pin: str | None = None
) -> dict[str, Any]:
    """A ResourceClaim written directly against the DeviceClass, as a user would; `pin`: on
    that GPU (by UUID) only, as the planner will pin a claim."""
    body: dict[str, Any] = {
        "apiVersion": dra.API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": dra.DEVICE_CLASS,
                            "capacity": {"requests": dra.capacity_requests(milli, memory_mib)},
                        },
                    }
                ]
            }
        },
    }
    if pin is not None:
        exactly = body["spec"]["devices"]["requests"][0]["exactly"]
        exactly["selectors"] = [{"cel": {"expression": dra.uuid_selector(pin)}}]
    return body


def claiming(name: str, scope: Scope, node: str, claim: str, *, template: bool = False) -> Any:
    """A pod on the kit's node whose container uses the claim `claim` (or a claim made
    from the template `claim`)."""
    body = pod(name, scope.namespace, node_selector={"kubernetes.io/hostname": node})
    source = "resourceClaimTemplateName" if template else "resourceClaimName"
    body["spec"]["resourceClaims"] = [{"name": "gpu", source: claim}]
    body["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return body


def start(kubectl: Kubectl, *objects: dict[str, Any]) -> list[dict[str, Any]]:
    """Create the objects; return the pods among them once each runs."""
    kubectl.apply(*objects)
    found = []
    for obj in objects:
        if obj["kind"] != "Pod":
            continue
        meta = obj["metadata"]
        ran = kubectl.wait_object(
            "pods", meta["name"], running, namespace=meta["namespace"], timeout=120
        )
        assert ran is not None
        found.append(ran)
    return found


def allocation(kubectl: Kubectl, namespace: str, claim: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = kubectl.json("-n", namespace, "get", "resourceclaim", claim)[
        "status"
    ]["allocation"]["devices"]["results"]
    return results


def share_env(milli: int, memory_mib: int) -> dict[str, str]:
    return {
        "NVIDIA_VISIBLE_DEVICES": DEVICES,
        "CUDA_MPS_PIPE_DIRECTORY": PIPE,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(-(-milli // 10)),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={memory_mib}M",
    }


def spec_of(kubectl: Kubectl, namespace: str, claim: str) -> Path:
    uid = kubectl.json("-n", namespace, "get", "resourceclaim", claim)["metadata"]["uid"]
    return CDI_DIR / f"{dra.DRIVER}-claim_{uid}.json"


def recorded_claims(dra_node: DraNode) -> set[tuple[str, str]]:
    """(name, namespace) of the claims in the agent's checkpoint (earlier tests' claims may
    still be there: their namespaces go without waiting)."""
    recorded = json.loads((dra_node.plugin_dir / "checkpoint.json").read_text())
    return {(claim["name"], claim["namespace"]) for claim in recorded["claims"]}


def until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# --- the tests ------------------------------------------------------------------------------


def test_the_dra_agent_registers_and_publishes_its_nodes_slice(
    dra_node: DraNode, kubectl: Kubectl
) -> None:
    found = kubectl.json("get", "resourceslice", dra_node.slice_name)
    spec = found["spec"]
    assert (spec["driver"], spec["nodeName"], spec["pool"]["name"]) == (
        dra.DRIVER,
        dra_node.node,
        dra_node.node,
    )
    node_uid = kubectl.json("get", "node", dra_node.node)["metadata"]["uid"]
    assert found["metadata"]["ownerReferences"][0]["uid"] == node_uid
    devices = spec["devices"]
    assert [d["name"] for d in devices] == ["gpu-0", "gpu-1"]
    assert [d["attributes"]["uuid"]["string"] for d in devices] == dra_node.uuids
    assert devices[0]["attributes"]["model"] == {"string": "NVIDIA-H100-80GB-HBM3"}
    assert devices[0]["capacity"]["compute"]["value"] == "1k"  # the API's form of 1000
    assert all(d["allowMultipleAllocations"] and "taints" not in d for d in devices)
    assert metric(dra_node.metrics_url, "gpuplace_agent_dra_registered") == 1
    whoami = kubectl.as_user(dra_node.kubeconfig).json("auth", "whoami")["status"]["userInfo"]
    assert whoami["username"] == f"system:serviceaccount:{AGENT_NAMESPACE}:{DRA_ACCOUNT}"


def test_two_shares_on_one_gpu_run_with_their_limits_and_a_share_that_fits_waits(
    scope: Scope, kubectl: Kubectl, dra_node: DraNode
) -> None:
    ns, node = scope.namespace, dra_node.node
    thirty, sixty = share_claim("share-30", ns, 300, 8192), share_claim("share-60", ns, 600, 16384)
    whole = pod("whole", ns, node_selector={"kubernetes.io/hostname": node})
    whole["spec"]["containers"][0]["resources"] = {"limits": {dra.EXTENDED_RESOURCE: "1"}}
    a, b, w = start(
        kubectl,
        thirty,
        sixty,
        claiming("a", scope, node, "share-30"),
        claiming("b", scope, node, "share-60"),
        whole,
    )
    # kube-scheduler's first fit: both shares on gpu-0, the whole GPU on gpu-1
    assert allocation(kubectl, ns, "share-30")[0]["device"] == "gpu-0"
    assert allocation(kubectl, ns, "share-60")[0]["device"] == "gpu-0"
    claim = w["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    assert allocation(kubectl, ns, claim)[0]["device"] == "gpu-1"
    # the whole of the slice's memory capacity: the agent's packable figure (NVML's total
    # less the driver's reservation and the MPS server's own memory, docs/dra.md)
    slice_memory = kubectl.json("get", "resourceslice", dra_node.slice_name)["spec"]["devices"][1][
        "capacity"
    ]["memory"]["value"]
    assert slice_memory == "80960Mi"
    assert allocation(kubectl, ns, claim)[0]["consumedCapacity"] == {
        "compute": "1k",
        "memory": slice_memory,
    }
    # each container's environment read back is its grant
    assert gpu_env(environment(kubectl, a)) == share_env(300, 8192)
    assert gpu_env(environment(kubectl, b)) == share_env(600, 16384)
    assert gpu_env(environment(kubectl, w)) == {"NVIDIA_VISIBLE_DEVICES": DEVICES}
    assert inside(kubectl, a, "ls", DEVICES).split() == [dra_node.uuids[0]]
    assert inside(kubectl, w, "ls", DEVICES).split() == [dra_node.uuids[1]]
    assert "control" in inside(kubectl, a, "ls", PIPE).split()  # its GPU's MPS daemon
    # a third share fits on neither GPU: it waits, with kube-scheduler's reason
    template = {
        "apiVersion": dra.API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "share-50", "namespace": ns},
        "spec": {"spec": share_claim("x", ns, 500, 8192)["spec"]},
    }
    kubectl.apply(template, claiming("c", scope, node, "share-50", template=True))
    message = kubectl.wait_event(ns, "c", "FailedScheduling", timeout=60)
    assert "cannot allocate all claims" in message, message
    # deleting a pod calls NodeUnprepareResources (its CDI spec goes) and frees its share
    spec = spec_of(kubectl, ns, "share-60")
    unprepared = metric(dra_node.metrics_url, 'gpuplace_agent_dra_unprepare_total{result="ok"}')
    assert spec.is_file()
    kubectl.run("-n", ns, "delete", "pod", "b", "--wait=true")
    until(lambda: not spec.exists(), 60, "share-60's CDI spec to be removed")
    assert (
        metric(dra_node.metrics_url, 'gpuplace_agent_dra_unprepare_total{result="ok"}')
        == unprepared + 1
    )
    kubectl.run("-n", ns, "delete", "resourceclaim", "share-60", "--wait=true")
    c = kubectl.wait_object("pods", "c", running, namespace=ns, timeout=120)
    assert c is not None
    claim_c = c["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    assert allocation(kubectl, ns, claim_c)[0]["device"] == "gpu-0"
    assert gpu_env(environment(kubectl, c)) == share_env(500, 8192)


def test_a_restarted_agent_keeps_serving_its_prepared_claims(
    scope: Scope, kubectl: Kubectl, dra_node: DraNode
) -> None:
    ns, node = scope.namespace, dra_node.node
    (first,) = start(
        kubectl, share_claim("share-40", ns, 400, 4096), claiming("first", scope, node, "share-40")
    )
    spec = spec_of(kubectl, ns, "share-40")
    dra_node.process.kill()  # a crash, not a shutdown
    dra_node.process.start()
    still = kubectl.json("-n", ns, "get", "pod", "first")
    assert running(still) and still["status"]["containerStatuses"][0]["restartCount"] == 0
    assert spec.is_file()
    assert ("share-40", ns) in recorded_claims(dra_node)  # the checkpoint read back
    # a second pod of the prepared claim starts from the spec the restarted agent kept
    (second,) = start(kubectl, claiming("second", scope, node, "share-40"))
    assert gpu_env(environment(kubectl, second)) == share_env(400, 4096)
    assert gpu_env(environment(kubectl, first)) == share_env(400, 4096)
    # and once both are gone the restarted agent unprepares it
    kubectl.run("-n", ns, "delete", "pod", "first", "second", "--wait=true")
    until(lambda: not spec.exists(), 60, "share-40's CDI spec to be removed")
    assert ("share-40", ns) not in recorded_claims(dra_node)


def _silence_taints(kubectl: Kubectl, name: str) -> list[list[str]]:
    found = kubectl.json("get", "resourceslice", name)
    return [
        [t["key"] for t in device.get("taints") or [] if t["key"] == dra.SILENT_TAINT]
        for device in found["spec"]["devices"]
    ]


def test_a_silent_agents_devices_get_a_noschedule_taint(
    scope: Scope, kubectl: Kubectl, dra_node: DraNode
) -> None:
    ns, node = scope.namespace, dra_node.node
    os.kill(dra_node.process.pid, signal.SIGSTOP)  # alive, registered, and silent
    try:
        kubectl.watch(
            ["resourceslices", "--field-selector", f"metadata.name={dra_node.slice_name}"],
            lambda seen: any(
                all(
                    any(
                        t["key"] == dra.SILENT_TAINT and t["effect"] == "NoSchedule"
                        for t in device.get("taints") or []
                    )
                    for device in obj["spec"]["devices"]
                )
                for obj in seen.values()
            ),
            timeout=60,
            what="the sidecar's silence taint on every device",
        )
        pinned = share_claim("late", ns, 100, 1024, pin=dra_node.uuids[1])
        kubectl.apply(pinned, claiming("late", scope, node, "late"))
        message = kubectl.wait_event(ns, "late", "FailedScheduling", timeout=60)
        assert "cannot allocate all claims" in message, message
    finally:
        os.kill(dra_node.process.pid, signal.SIGCONT)
    # speaking again, the agent writes its slice as it knows it: no taint
    until(
        lambda: _silence_taints(kubectl, dra_node.slice_name) == [[], []],
        60,
        "the agent to drop the silence taint",
    )
    late = kubectl.wait_object("pods", "late", running, namespace=ns, timeout=120)
    assert late is not None
    # pinned to gpu-1 by its UUID, where first fit would have taken gpu-0
    assert allocation(kubectl, ns, "late")[0]["device"] == "gpu-1"


def test_each_identity_writes_only_what_its_policy_allows(
    scope: Scope, kubectl: Kubectl, dra_node: DraNode
) -> None:
    other = scope.node("other")
    scope.add_nodes(gpu_node(other, model=scope.model, gpus=1))
    theirs = dra.resource_slice(other, "", [dra.GpuDevice(0, "GPU-x", 1024)])
    del theirs["metadata"]["ownerReferences"]
    agent = kubectl.as_user(dra_node.kubeconfig)
    refused = agent.run("create", "-f", "-", input=json.dumps(theirs), check=False)
    assert refused.code != 0
    assert "ValidatingAdmissionPolicy 'gpuplace-node-agent-own-slices'" in refused.err
    assert "may write only the ResourceSlice of the Node it runs on" in refused.err
    # the sidecar may add its silence taint, and change nothing else
    sidecar = dra_node.installation.sa_kubeconfig("gpuplace", "gpuplace")
    stored = kubectl.json("get", "resourceslice", dra_node.slice_name)
    stored["spec"]["devices"][0]["attributes"]["model"] = {"string": "forged"}
    forged = kubectl.as_user(sidecar).run(
        "replace", "-f", "-", input=json.dumps(stored), check=False
    )
    assert forged.code != 0
    assert "gpuplace's sidecar may only add the taint gpu.gpuplace.io/agent-silent" in forged.err


def test_dra_mode_refuses_a_runtime_without_cdi(
    scope: Scope, kubectl: Kubectl, gpuplace: Installation, dra_installed: list[dict[str, Any]]
) -> None:
    """A node whose runtime drops CDI devices (containerd 1.6, what the kit installs by
    default): the agent says why and does not start (exit 1), so no pod runs uncapped."""
    old = scope.node("containerd16")
    scope.add_nodes(gpu_node(old, model=scope.model, gpus=1))
    kubectl.run(
        "patch", "node", old, "--subresource=status", "--type=merge", "-p",
        json.dumps({"status": {"nodeInfo": {"containerRuntimeVersion": "containerd://1.6.20"}}}),
    )  # fmt: skip
    kubeconfig = gpuplace.sa_kubeconfig(AGENT_NAMESPACE, DRA_ACCOUNT, kind="Node", name=old)
    with tempfile.TemporaryDirectory(prefix="dra16", dir="/tmp") as root:
        done = subprocess.run(
            [
                GPUPLACE, "node-agent", "--kubelet-plugin=dra", f"--node-name={old}",
                f"--kubeconfig={kubeconfig}", "--mps=false", "--metrics-address=127.0.0.1",
                "--metrics-port=0", f"--kubelet-plugins-dir={root}/plugins",
                f"--kubelet-registry-dir={root}/registry", f"--cdi-dir={root}/cdi",
                f"--nvml-replay={derived_replay(Path(root))[0]}",
            ],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr[-2000:]
        assert "containerd://1.6.20 drops CDI devices" in done.stderr, done.stderr[-2000:]
        assert "containerd >= 1.7.2" in done.stderr
        assert not Path(root, "registry").exists()  # it never offered itself to the kubelet
    assert not kubectl.exists("resourceslice", dra.slice_name(old))


# --- the annotations alone (issue 42, points 3-5): the webhook, the sidecar, kube-scheduler ----

H100 = "NVIDIA-H100-80GB-HBM3"
CONTEXT = {300: 144 + 5 * 30, 600: 144 + 5 * 60, 500: 144 + 5 * 50}
"""The H100's CUDA context at a share's threads (`mps_limits.MODELS`, as the agent publishes
it), which a claim gpuplace writes adds to the pod's memory: its MPS limit holds it."""


def annotated(name: str, scope: Scope, **asks: str) -> dict[str, Any]:
    """A pod as a user writes it: annotations only (an H100, so that only the DRA node
    could hold it and `--dra-claims=fallback` sends it there)."""
    annotations = {
        "gpuplace.io/gpu-model": H100,
        **{k.replace("_", "-"): v for k, v in asks.items()},
    }
    return pod(
        name,
        scope.namespace,
        {f"gpuplace.io/{k}" if "/" not in k else k: v for k, v in annotations.items()},
    )


def claim_of(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    """The ResourceClaim gpuplace made for pod `name`."""
    body = kubectl.json("-n", namespace, "get", "pod", name)
    claim: dict[str, Any] = kubectl.json(
        "-n", namespace, "get", "resourceclaim", dra_claims.named(body)
    )
    return claim


def explain(kubectl: Kubectl, namespace: str, name: str) -> str:
    done = subprocess.run(
        [GPUPLACE, "explain", f"{namespace}/{name}", f"--kubeconfig={kubectl.kubeconfig}"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout


def test_pods_written_with_the_annotations_alone_run_on_the_dra_node_with_their_grants(
    scope: Scope, kubectl: Kubectl, dra_node: DraNode
) -> None:
    ns, node = scope.namespace, dra_node.node
    a, b, w = start(
        kubectl,
        annotated("a", scope, gpu_percent="30", gpu_memory="8Gi"),
        annotated("b", scope, gpu_percent="60", gpu_memory="16Gi"),
        annotated("w", scope, gpu_count="1"),
    )
    # the webhook named a claim and gated the pod, the sidecar made the claim and ungated it
    assert [c["name"] for c in a["spec"]["resourceClaims"]] == [dra_claims.ENTRY]
    assert a["spec"]["containers"][0]["resources"] == {"claims": [{"name": dra_claims.ENTRY}]}
    assert a["spec"]["schedulerName"] == "default-scheduler" and not a["spec"].get(
        "schedulingGates"
    )
    claim_a = claim_of(kubectl, ns, "a")
    assert claim_a["metadata"]["ownerReferences"][0]["uid"] == a["metadata"]["uid"]
    # the engine planned them in creation order (a, b, w), each claim pinned: the devices
    # below do not depend on the order kube-scheduler allocates them in
    assert claim_a["metadata"]["annotations"][keys.CLAIM_PINNED] == dra_node.uuids[0]
    results = claim_a["status"]["allocation"]["devices"]["results"]
    assert [(r["device"], r["consumedCapacity"]) for r in results] == [
        ("gpu-0", {"compute": "300", "memory": f"{8192 + CONTEXT[300]}Mi"})
    ]
    assert (
        claim_of(kubectl, ns, "b")["status"]["allocation"]["devices"]["results"][0]["device"]
        == "gpu-0"
    )
    whole = claim_of(kubectl, ns, "w")["status"]["allocation"]["devices"]["results"]
    assert [r["device"] for r in whole] == ["gpu-1"]
    # each container's environment read back is its grant (the limit: ask + context)
    assert gpu_env(environment(kubectl, a)) == share_env(300, 8192 + CONTEXT[300])
    assert gpu_env(environment(kubectl, b)) == share_env(600, 16384 + CONTEXT[600])
    assert gpu_env(environment(kubectl, w)) == {"NVIDIA_VISIBLE_DEVICES": DEVICES}
    assert inside(kubectl, w, "ls", DEVICES).split() == [dra_node.uuids[1]]
    assert "kube-scheduler's DRA allocator gave it GPU 0 of node" in kubectl.wait_event(
        ns, "a", "GpusAssigned"
    )
    assert kubectl.wait_event(ns, "a", "GpuClaimCreated").startswith(
        f"created ResourceClaim {ns}/{dra_claims.named(a)} for 30% of one GPU"
    )
    # the sidecar's ledger holds them: explain reads it as the sidecar rebuilds it
    told = explain(kubectl, ns, "a")
    assert (
        f"Running on GPU 0 of node {node} (30%, {8192 + CONTEXT[300]} MiB each: its MPS "
        "memory limit, the CUDA context inside) through its ResourceClaim"
    ) in told, told
    row = next(line for line in told.splitlines() if line.startswith(node + " "))
    assert " 40/0 " in row, told  # a set aside: gpu-0 holds b (60 %), gpu-1 the whole GPU
    # a third share fits no GPU: it waits, with kube-scheduler's reason, and explain says so
    kubectl.apply(annotated("c", scope, gpu_percent="50", gpu_memory="8Gi"))
    message = kubectl.wait_event(ns, "c", "FailedScheduling", timeout=60)
    assert "cannot allocate all claims" in message, message
    waiting = explain(kubectl, ns, "c")
    assert "waits for kube-scheduler's DRA allocator" in waiting, waiting
    assert "cannot allocate all claims" in waiting, waiting
    # deleting a pod frees its share: its claim goes with it, and the third one runs
    claim_b = dra_claims.named(b)
    spec = spec_of(kubectl, ns, claim_b)
    kubectl.run("-n", ns, "delete", "pod", "b", "--wait=true")
    until(lambda: not kubectl.exists("-n", ns, "resourceclaim", claim_b), 60, "b's claim to go")
    until(lambda: not spec.exists(), 60, "b's CDI spec to be removed (NodeUnprepareResources)")
    c = kubectl.wait_object("pods", "c", running, namespace=ns, timeout=120)
    assert c is not None
    assert (
        claim_of(kubectl, ns, "c")["status"]["allocation"]["devices"]["results"][0]["device"]
        == "gpu-0"
    )
    assert gpu_env(environment(kubectl, c)) == share_env(500, 8192 + CONTEXT[500])


def test_identical_quarter_shares_fill_the_used_gpu_before_the_empty_one_that_sorts_first(
    scope: Scope, kubectl: Kubectl, dra_node: DraNode
) -> None:
    """Plan, then pin on the DRA node (issue 47, point 3): gpu-1 holds a user's 25 % claim
    (pinned there by UUID), gpu-0 is empty. kube-scheduler's first fit would put each new
    25 % share on gpu-0, whose name sorts first; the engine fills the used gpu-1 first,
    each claim pinned to its UUID, and opens gpu-0 only once gpu-1 is full."""
    ns, node = scope.namespace, dra_node.node

    def others() -> list[str]:
        items = kubectl.json("get", "resourceclaims", "-A")["items"]
        return [c["metadata"]["name"] for c in items if c["metadata"]["namespace"] != ns]

    until(lambda: not others(), 120, "earlier tests' claims to go (both GPUs empty)")
    used = share_claim("used", ns, 250, 4096, pin=dra_node.uuids[1])
    start(kubectl, used, claiming("user", scope, node, "used"))
    assert allocation(kubectl, ns, "used")[0]["device"] == "gpu-1"
    quarters = start(
        kubectl,
        *(annotated(f"q{i}", scope, gpu_percent="25", gpu_memory="4Gi") for i in range(3)),
    )
    for q in quarters:
        name = q["metadata"]["name"]
        claim = claim_of(kubectl, ns, name)
        assert claim["metadata"]["annotations"][keys.CLAIM_PINNED] == dra_node.uuids[1], name
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [r["device"] for r in results] == ["gpu-1"], name
    assert "pinned to the GPU gpuplace planned" in kubectl.wait_event(ns, "q0", "GpuClaimCreated")
    told = explain(kubectl, ns, "q0")
    assert "on the GPUs gpuplace's engine planned" in told, told
    (last,) = start(kubectl, annotated("q3", scope, gpu_percent="25", gpu_memory="4Gi"))
    claim = claim_of(kubectl, ns, "q3")
    assert claim["metadata"]["annotations"][keys.CLAIM_PINNED] == dra_node.uuids[0]
    assert [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]] == ["gpu-0"]
    assert gpu_env(environment(kubectl, last)) == share_env(250, 4096 + 144 + 5 * 25)
    user_told = explain(kubectl, ns, "user")
    assert "the pod's own claim, which gpuplace's engine does not plan" in user_told, user_told


def test_a_gangs_dra_members_get_the_gpus_its_plan_chose(
    scope: Scope, kubectl: Kubectl, dra_node: DraNode
) -> None:
    """A gang of two 50 % DRA members: the gang controller plans both on the DRA node and
    writes each member's GPUs; only then is each member's claim made, pinned to its planned
    GPU, and kube-scheduler allocates exactly there (issue 47, point 3). Started on empty
    GPUs: with the last test's claims still going, kube-scheduler once refused a member's
    planned GPU that gpuplace's ledger had seen freed, and the member was re-pinned to the
    other GPU of its planned node (`GpuClaimReplanned`; CI on 6519640), which is the race
    path, told apart below."""
    ns, node = scope.namespace, dra_node.node
    until(lambda: not kubectl.json("get", "resourceclaims", "-A")["items"], 120, "empty GPUs")
    members = start(
        kubectl,
        *(
            annotated(f"m{i}", scope, gpu_percent="50", gang_name="pair", gang_size="2")
            for i in range(2)
        ),
    )
    for member in members:
        name = member["metadata"]["name"]
        planned = assignments.grant_of(member)
        assert planned is not None and planned.node == node, name
        claim = claim_of(kubectl, ns, name)
        pin = claim["metadata"]["annotations"][keys.CLAIM_PINNED]
        devices = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
        assert member["spec"]["nodeName"] == node
        if pin != ",".join(dra_node.uuids[gpu] for gpu in planned.gpus):
            # the race: re-pinned on the node its plan chose, and told so
            said = kubectl.wait_event(ns, name, "GpuClaimReplanned", timeout=10)
            assert "on other GPUs of the node its plan chose" in said, said
            assert devices == [f"gpu-{dra_node.uuids.index(pin)}"], name
            continue
        assert devices == [f"gpu-{gpu}" for gpu in planned.gpus], name


def ranks(scope: Scope, kubectl: Kubectl) -> tuple[str, str]:
    """Two PriorityClasses of the scope's (100 and 1,000), once both GPUs are empty: their
    names."""
    low, high = f"{scope.namespace}-low", f"{scope.namespace}-high"
    scope.create(priority_class(low, 100), priority_class(high, 1000))
    until(lambda: not kubectl.json("get", "resourceclaims", "-A")["items"], 120, "empty GPUs")
    return low, high


def ranked(body: dict[str, Any], priority: str) -> dict[str, Any]:
    body["spec"]["priorityClassName"] = priority
    return body


def test_a_gangs_preemption_frees_the_gpu_its_plan_needs(
    scope: Scope, kubectl: Kubectl, dra_node: DraNode
) -> None:
    """gpu-0 holds a low-priority whole-GPU DRA pod, gpu-1 a 50 % share of the gang's own
    priority. A gang of two 50 % DRA members fits only where the low pod is: the gang
    controller evicts it (not the share of equal priority), plans both members on the DRA
    node, and each member's claim is pinned to the GPU its plan chose and allocated there,
    one of them on the freed gpu-0 (issue 47, point 3)."""
    ns, node = scope.namespace, dra_node.node
    low, high = ranks(scope, kubectl)
    start(kubectl, ranked(annotated("low", scope, gpu_count="1"), low))
    assert [r["device"] for r in allocation(kubectl, ns, dra_claims.named(
        kubectl.json("-n", ns, "get", "pod", "low")
    ))] == ["gpu-0"]  # fmt: skip
    start(kubectl, ranked(annotated("keep", scope, gpu_percent="50"), high))
    assert [r["device"] for r in claim_of(kubectl, ns, "keep")["status"]["allocation"][
        "devices"]["results"]] == ["gpu-1"]  # fmt: skip
    gang = {"gpu_percent": "50", "gang_name": "urgent", "gang_size": "2"}
    members = start(kubectl, *(ranked(annotated(f"u{i}", scope, **gang), high) for i in range(2)))
    assert not kubectl.exists("-n", ns, "pod", "low")
    assert kubectl.exists("-n", ns, "pod", "keep")
    devices = []
    for member in members:
        name = member["metadata"]["name"]
        planned = assignments.grant_of(member)
        assert planned is not None and planned.node == node, name
        claim = claim_of(kubectl, ns, name)
        assert claim["metadata"]["annotations"][keys.CLAIM_PINNED] == ",".join(
            dra_node.uuids[gpu] for gpu in planned.gpus
        ), name
        found = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
        assert found == [f"gpu-{gpu}" for gpu in planned.gpus], name
        devices.extend(found)
    assert "gpu-0" in devices, devices


def test_a_lone_high_priority_dra_pod_preempts_and_gets_the_gpu_it_frees(
    scope: Scope, kubectl: Kubectl, dra_node: DraNode
) -> None:
    """gpu-0 holds a low-priority whole-GPU DRA pod, gpu-1 a whole-GPU pod of the
    preemptor's own priority. A lone high-priority whole-GPU DRA pod: kube-scheduler alone
    answers "Preemption is not helpful" for a claim; the claim controller evicts the low pod
    (not the one of equal priority), pins the pod's claim to the GPU it frees, and
    kube-scheduler allocates it there once the low pod is gone (issue 47, point 1)."""
    ns = scope.namespace
    low, high = ranks(scope, kubectl)
    start(kubectl, ranked(annotated("low", scope, gpu_count="1"), low))
    start(kubectl, ranked(annotated("keep", scope, gpu_count="1"), high))
    freed = next(
        int(r["device"].removeprefix("gpu-"))
        for r in claim_of(kubectl, ns, "low")["status"]["allocation"]["devices"]["results"]
    )
    (urgent,) = start(kubectl, ranked(annotated("urgent", scope, gpu_count="1"), high))
    assert not kubectl.exists("-n", ns, "pod", "low")
    assert kubectl.exists("-n", ns, "pod", "keep")
    claim = claim_of(kubectl, ns, "urgent")
    assert claim["metadata"]["annotations"][keys.CLAIM_PINNED] == dra_node.uuids[freed]
    found = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
    assert found == [f"gpu-{freed}"]
    assert urgent["spec"]["nodeName"] == dra_node.node
    said = kubectl.wait_event(ns, "urgent", "GpuPreemption")
    assert f"evicted {ns}/low" in said, said


def test_a_mixed_cluster_keeps_each_pod_on_one_path_and_one_ledger(
    scope: Scope, kubectl: Kubectl, dra_node: DraNode
) -> None:
    """A device-plugin node (a Node object, the extender binds there) beside the DRA node:
    a pod only it could hold takes the device-plugin path (kept off DRA nodes), an H100 pod
    the DRA path; a claim a user wrote holds its GPU in the same ledger."""
    ns, node = scope.namespace, dra_node.node
    plugin = scope.node("plugin")
    scope.add_nodes(gpu_node(plugin, model=scope.model, gpus=1))
    mine = share_claim("mine", ns, 1000, 0)  # a user's claim: a whole GPU, first fit: gpu-0
    start(kubectl, mine, claiming("user", scope, node, "mine"))
    assert allocation(kubectl, ns, "mine")[0]["device"] == "gpu-0"
    kubectl.apply(
        pod("old", ns, {"gpuplace.io/gpu-model": scope.model, "gpuplace.io/gpu-percent": "50"})
    )
    (dra_pod,) = start(kubectl, annotated("new", scope, gpu_percent="40", gpu_memory="4Gi"))
    old = wait_bound(kubectl, ns, "old")
    assert old["spec"]["nodeName"] == plugin and "resourceClaims" not in old["spec"]
    terms = old["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert {"key": keys.NODE_DRA, "operator": "NotIn", "values": ["true"]} in terms[
        "nodeSelectorTerms"
    ][0]["matchExpressions"]
    # the DRA pod went to gpu-1: gpu-0 is the user's claim's, in kube-scheduler's books and ours
    assert (
        claim_of(kubectl, ns, "new")["status"]["allocation"]["devices"]["results"][0]["device"]
        == "gpu-1"
    )
    told = explain(kubectl, ns, "new")
    row = next(line for line in told.splitlines() if line.startswith(node + " "))
    assert " 0/100 " in row, told  # gpu-0: the user's claim; gpu-1: this pod's, set aside
    assert plugin not in told  # a DRA pod is weighed against DRA nodes only
    told_old = explain(kubectl, ns, "old")
    assert f"Running on node {plugin} with GPU 0 (50%" in told_old, told_old
    assert not any(line.startswith(node + " ") for line in told_old.splitlines()), told_old
    user_told = explain(kubectl, ns, "user")
    assert f"Holds GPU 0 of node {node} (whole" in user_told, user_told
    assert gpu_env(environment(kubectl, dra_pod)) == share_env(400, 4096 + 144 + 5 * 40)


async def test_the_throughput_bench_binds_dra_pods_through_their_pinned_claims(
    dra_node: DraNode,
) -> None:
    """`bench/scheduler_throughput.py --dra` at a tiny size on the DRA serve, so that it
    cannot rot: its DRA nodes (Node objects with the slice the agent would write) take
    its DRA pods, each through a claim the controller pinned, beside the extender's and
    the plain pods; the figures that say what bounds DRA mode are there."""
    result = await scheduler_throughput.measure(
        dra_node.installation, nodes=2, pods=3, timeout=120, dra_nodes=True, percent=50
    )
    for kind in ("gpuplace", "plain", "dra"):
        assert (result[kind]["pods"], result[kind]["bound"]) == (3, 3), result
    assert result["placed_on"] == {"gpuplace": "gpu", "plain": "plain", "dra": "dra"}
    assert result["ask"] == "50% of a GPU"
    assert result["planner"]["gpuplace_dra_claims/created"] >= 3, result
    writes = result["api_writes"]["by_verb"]
    assert writes["POST resourceclaims"] == 3, writes  # one claim a DRA pod
    # what the cluster's kube-scheduler writes for each: the allocation, and the Binding
    assert writes["PUT resourceclaims/status"] >= 3, writes
    # (its DRA plugin's own times are sampled, one cycle in ten: at 9 cycles maybe none)
    plain = result["kube_scheduler"]["plain"]
    assert plain["attempt"]["calls"] >= 6, plain
