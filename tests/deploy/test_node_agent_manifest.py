"""The node agent's DaemonSet as rendered: its privileges are exactly the ones
docs/node-agent.md states, its host paths are the ones the code uses, it runs on the nodes
the sidecar manages, and its arguments are ones `gpuplace node-agent` accepts."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from gpuplace import cli
from gpuplace.agent import mps
from gpuplace.cluster import keys
from gpuplace.wiring.agent_settings import AgentSettings
from tests.deploy import rendering
from tests.deploy.rendering import Obj, container, one, render

NAMESPACE = "kube-system"
ACCOUNT = "gpuplace-node-agent"


@pytest.fixture(scope="module")
def daemonset() -> Obj:
    return one(render(rendering.NODE_AGENT), "DaemonSet", "gpuplace-node-agent")


@pytest.fixture(scope="module")
def pod(daemonset: Obj) -> Obj:
    spec: Obj = daemonset["spec"]["template"]["spec"]
    return spec


def test_it_runs_on_the_nodes_gpuplace_manages(daemonset: Obj, pod: Obj) -> None:
    assert daemonset["metadata"]["namespace"] == NAMESPACE
    assert pod["nodeSelector"] == {keys.NODE_ENABLED: "true"}
    assert pod["priorityClassName"] == "system-node-critical"
    assert rendering.selects(
        daemonset["spec"]["selector"], daemonset["spec"]["template"]["metadata"]["labels"]
    )
    # restarting the agent ends every share's MPS server: never rolled behind one's back
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}


def test_its_privileges_are_the_stated_ones(pod: Obj) -> None:
    agent = container(pod, "node-agent")
    security = agent["securityContext"]
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    # root, for the kubelet's socket directory; SETUID/SETGID for MPS servers of any user
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["SETUID", "SETGID"]}
    assert pod["securityContext"]["runAsUser"] == 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for forbidden in ("hostIPC", "hostNetwork"):
        assert not pod.get(forbidden), forbidden
    # NVML names GPU processes by host PID: their /proc/<pid>/cgroup says which pod uses a
    # GPU (docs/node-agent.md "What pods use"), read under the container's own /proc
    assert pod["hostPID"] is True
    assert not any(arg.startswith("--proc-root") for arg in agent["args"])
    assert AgentSettings(node_name="n").proc_root == Path("/proc")
    assert not any(m["mountPath"].startswith("/proc") for m in agent["volumeMounts"])
    assert (
        set(agent["resources"]["requests"])
        == set(agent["resources"]["limits"])
        == {
            "cpu",
            "memory",
        }
    )


def test_its_host_paths_are_the_ones_the_code_uses(pod: Obj) -> None:
    agent = container(pod, "node-agent")
    volumes = {v["name"]: v for v in pod["volumes"]}
    host = {
        m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
        for m in agent["volumeMounts"]
        if "hostPath" in volumes[m["name"]]
    }
    args = cli.build_parser().parse_args(agent["args"])
    root = args.mps_root
    layout = mps.Layout(Path(root))
    assert host == {
        "/var/lib/kubelet/device-plugins": "/var/lib/kubelet/device-plugins",
        root: root,  # pipe and log directories at the same path inside and out
        "/dev/shm": str(layout.shm_directory),  # each MPS server's and its clients' shm
        "/var/run/nvidia-container-devices/all": "/dev/null",  # every GPU, through the toolkit
    }
    assert root == str(mps.Layout().root)


def test_its_arguments_and_env_are_settings_the_agent_has(pod: Obj) -> None:
    agent = container(pod, "node-agent")
    args = cli.build_parser().parse_args(agent["args"])
    assert args.command == "node-agent"
    # the strategy the shipped toolkit settings honour for unprivileged containers
    assert args.device_list_strategy == "volume-mounts"
    assert AgentSettings(node_name="n", device_list_strategy=args.device_list_strategy)
    env = {e["name"]: e for e in agent["env"]}
    assert env["GPUPLACE_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["GPUPLACE_POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert "node_name" in AgentSettings.model_fields
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "compute,utility"
    assert "NVIDIA_VISIBLE_DEVICES" not in env  # ignored for it too: it uses the mount
    (port,) = agent["ports"]
    assert port["containerPort"] == int(args.metrics_port)
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert agent["readinessProbe"]["httpGet"]["path"] == "/readyz"
    version = tomllib.loads((rendering.ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert agent["image"] == f"gpuplace:{version}"


def test_its_identity_is_the_one_the_policies_and_rbac_name(pod: Obj) -> None:
    objects = render(rendering.NODE_AGENT)
    assert pod["serviceAccountName"] == ACCOUNT
    account = one(objects, "ServiceAccount", ACCOUNT)
    assert account["metadata"]["namespace"] == NAMESPACE
    own_node = one(objects, "ValidatingAdmissionPolicy", "gpuplace-node-agent-own-node")
    (condition,) = own_node["spec"]["matchConditions"]
    assert f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}" in condition["expression"]
    bypass = one(objects, "ValidatingAdmissionPolicyBinding", "gpuplace-no-gpu-bypass")
    selector = bypass["spec"]["matchResources"]["namespaceSelector"]
    # its mount of every GPU is allowed only because its namespace is spared
    assert not rendering.selects(selector, {"kubernetes.io/metadata.name": NAMESPACE})


def test_its_metrics_are_reachable_from_monitoring_only() -> None:
    policy = one(render(rendering.NODE_AGENT), "NetworkPolicy", "gpuplace-node-agent")
    (ingress,) = policy["spec"]["ingress"]
    assert [p["port"] for p in ingress["ports"]] == [9090]
    (source,) = ingress["from"]
    assert source["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }


def test_the_node_agent_is_opt_in() -> None:
    """deploy/base and its overlays run the webhook's env path (GPU pods request only
    gpuplace.io/gpu-percent and gpu-memory, which the sidecar advertises): a cluster whose
    GPU nodes have no agent yet, or nodes that are API objects only, still places and binds.
    components/node-agent adds the DaemonSet, the no-bypass policies and --node-agent=true
    on the sidecar's container, together."""
    for tree in ("base", "overlays/self-managed", "overlays/cert-manager"):
        objects = render(tree)
        sidecar = container(one(objects, "Deployment", "gpuplace")["spec"]["template"]["spec"],
                            "gpuplace")  # fmt: skip
        assert "--node-agent=true" not in sidecar["args"], tree
        assert not [o for o in objects if o["kind"] in ("DaemonSet", "ValidatingAdmissionPolicy")]
    objects = render(rendering.NODE_AGENT)
    sidecar = container(one(objects, "Deployment", "gpuplace")["spec"]["template"]["spec"],
                        "gpuplace")  # fmt: skip
    assert sidecar["args"].count("--node-agent=true") == 1
    assert one(objects, "DaemonSet", ACCOUNT)
    assert one(objects, "ValidatingAdmissionPolicy", "gpuplace-no-gpu-bypass")
