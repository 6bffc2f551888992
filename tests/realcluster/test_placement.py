"""The placements README promises, through the real chain: kubectl apply → kube-apiserver →
gpuplace's webhooks → the stock kube-scheduler with the shipped profile → the sidecar's
filter and bind → the assignment annotations and the Binding. Nodes are fake
GPU nodes of the test's own GPU model (objects.py)."""

from __future__ import annotations

from typing import Any

from tests.realcluster.conftest import Scope
from tests.realcluster.kit import Kubectl
from tests.realcluster.objects import gpu_node, grant, pod, wait_bound, wait_pending


def gpus_of(obj: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    found = grant(obj)
    return found["node"], tuple(int(gpu) for gpu in found["gpus"].split(","))


def test_a_share_gets_its_percent_and_memory_of_one_gpu(scope: Scope, kubectl: Kubectl) -> None:
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=2))
    asks = {
        "gpuplace.io/gpu-percent": "50",
        "gpuplace.io/gpu-memory": "20Gi",
        "gpuplace.io/gpu-model": scope.model,
    }
    kubectl.apply(pod("share", scope.namespace, asks))
    placed = wait_bound(kubectl, scope.namespace, "share")
    assert placed["spec"]["nodeName"] == scope.node("a")
    assert placed["spec"]["schedulerName"] == "gpuplace"
    found = grant(placed)
    assert (found["node"], found["milli"], found["memory-mib"]) == (scope.node("a"), "500", "20480")
    assert len(found["gpus"].split(",")) == 1
    resources = placed["spec"]["containers"][0]["resources"]
    # with the node agent component: the extended resources plus one gpuplace.io/gpu slot
    wanted = {"gpuplace.io/gpu-percent": "50", "gpuplace.io/gpu-memory": "20480"}
    assert resources["requests"] == {**wanted, "gpuplace.io/gpu": "1"}
    assert resources["limits"] == resources["requests"]
    assert placed["metadata"]["labels"]["gpuplace.io/managed"] == "true"


def test_whole_gpus_go_to_one_nvlink_domain(scope: Scope, kubectl: Kubectl) -> None:
    scope.add_nodes(
        gpu_node(scope.node("pcie"), model=scope.model, gpus=8, nvlink=[-1] * 8),
        gpu_node(scope.node("nvlink"), model=scope.model, gpus=8, nvlink=[0] * 4 + [1] * 4),
    )
    domains = {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
    required = {
        "gpuplace.io/gpu-count": "4",
        "gpuplace.io/gpu-topology": "required",
        "gpuplace.io/gpu-model": scope.model,
    }
    kubectl.apply(pod("required", scope.namespace, required))
    node, gpus = gpus_of(wait_bound(kubectl, scope.namespace, "required"))
    assert node == scope.node("nvlink")
    assert set(gpus) in domains.values(), gpus
    # preferred (the default for several GPUs): the other whole domain, not the PCIe node
    preferred = {"gpuplace.io/gpu-count": "4", "gpuplace.io/gpu-model": scope.model}
    kubectl.apply(pod("preferred", scope.namespace, preferred))
    node2, gpus2 = gpus_of(wait_bound(kubectl, scope.namespace, "preferred"))
    assert node2 == scope.node("nvlink")
    assert set(gpus2) in domains.values() and not set(gpus2) & set(gpus), (gpus, gpus2)
    # no NVLink domain has 4 free GPUs now: required waits though the PCIe node has 8
    kubectl.apply(pod("required-2", scope.namespace, required))
    wait_pending(kubectl, scope.namespace, "required-2")
    labels = kubectl.json("get", "node", scope.node("pcie"))["metadata"]["labels"]
    assert labels["gpuplace.io/nvlink-domain-size"] == "1"


def test_memory_only_shares_pack_together_and_never_mix_with_percent_shares(
    scope: Scope, kubectl: Kubectl
) -> None:
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=2))
    memory = {"gpuplace.io/gpu-memory": "8Gi", "gpuplace.io/gpu-model": scope.model}
    percent = {"gpuplace.io/gpu-percent": "25", "gpuplace.io/gpu-model": scope.model}
    kubectl.apply(pod("memory-1", scope.namespace, memory))
    first = gpus_of(wait_bound(kubectl, scope.namespace, "memory-1"))
    kubectl.apply(pod("memory-2", scope.namespace, memory))
    assert gpus_of(wait_bound(kubectl, scope.namespace, "memory-2")) == first
    kubectl.apply(pod("percent", scope.namespace, percent))
    other = gpus_of(wait_bound(kubectl, scope.namespace, "percent"))
    assert other[0] == first[0] and other[1] != first[1], "a percent share joined memory-only ones"
    kubectl.apply(pod("memory-3", scope.namespace, memory))
    assert gpus_of(wait_bound(kubectl, scope.namespace, "memory-3")) == first
    placed = kubectl.json("-n", scope.namespace, "get", "pod", "memory-3")
    assert grant(placed)["milli"] == "0" and grant(placed)["memory-mib"] == "8192"
    assert "gpuplace.io/gpu-percent" not in placed["spec"]["containers"][0]["resources"]["requests"]


def test_identical_shares_fill_a_used_gpu_before_opening_another(
    scope: Scope, kubectl: Kubectl
) -> None:
    scope.add_nodes(
        gpu_node(scope.node("a"), model=scope.model, gpus=2),
        gpu_node(scope.node("b"), model=scope.model, gpus=2),
    )
    share = {
        "gpuplace.io/gpu-percent": "25",
        "gpuplace.io/gpu-memory": "10Gi",
        "gpuplace.io/gpu-model": scope.model,
    }
    places = []
    for index in range(5):
        kubectl.apply(pod(f"share-{index}", scope.namespace, share))
        places.append(gpus_of(wait_bound(kubectl, scope.namespace, f"share-{index}")))
    assert len(set(places[:4])) == 1, f"four 25% shares spread: {places[:4]}"
    # the fifth opens a GPU on the same node, leaving the other node whole
    assert places[4][0] == places[0][0] and places[4][1] != places[0][1], places


def test_a_node_opted_out_takes_no_new_gpu_pod_and_keeps_its_grants(
    scope: Scope, kubectl: Kubectl
) -> None:
    name, full = scope.node("a"), scope.node("full")
    scope.add_nodes(gpu_node(full, model=scope.model, gpus=1))
    whole = {"gpuplace.io/gpu-count": "1", "gpuplace.io/gpu-model": scope.model}
    kubectl.apply(pod("whole", scope.namespace, whole))
    assert gpus_of(wait_bound(kubectl, scope.namespace, "whole"))[0] == full
    scope.add_nodes(gpu_node(name, model=scope.model, gpus=1))
    share = {"gpuplace.io/gpu-percent": "25", "gpuplace.io/gpu-model": scope.model}
    kubectl.apply(pod("before", scope.namespace, share))
    before = grant(wait_bound(kubectl, scope.namespace, "before"))
    kubectl.run("label", "node", name, "gpuplace.io/enabled-")
    # admitted (a gpuplace node of its model exists), but that one is full
    kubectl.apply(pod("after", scope.namespace, share))
    wait_pending(kubectl, scope.namespace, "after")
    assert grant(kubectl.json("-n", scope.namespace, "get", "pod", "before")) == before
    # and it loses what the sidecar keeps on gpuplace nodes (docs/extender.md, "Nodes");
    # status writes are rate-limited per node (--node-status-min-interval-seconds, 30)
    left = kubectl.wait_object(
        "nodes",
        name,
        lambda node: (
            node is not None
            and not {"gpuplace.io/gpu-percent", "gpuplace.io/gpu-memory"}
            & set(node["status"].get("allocatable") or {})
            and "gpuplace.io/nvlink-domain-size" not in node["metadata"]["labels"]
        ),
        timeout=90,
        what=f"{name} to lose gpuplace's resources and label",
    )
    assert left is not None
