"""Gangs on the real control plane (docs/gangs.md): scheduling gates lifted by the sidecar
with its shipped RBAC, members bound by the stock kube-scheduler, conditions and Events
as kubectl shows them; plans that respect what kube-scheduler respects (cordon, taints)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.realcluster.conftest import Scope
from tests.realcluster.kit import Kubectl, Objects
from tests.realcluster.objects import (
    bound,
    gpu_node,
    grant,
    pod,
)

GATE = "gpuplace.io/gang"


def gated(obj: Mapping[str, Any] | None) -> bool:
    gates = ((obj or {}).get("spec") or {}).get("schedulingGates") or []
    return any(gate.get("name") == GATE for gate in gates)


def member(scope: Scope, name: str, gang: str, size: int, **extra: Any) -> dict[str, Any]:
    annotations = {
        "gpuplace.io/gpu-count": "1",
        "gpuplace.io/gpu-model": scope.model,
        "gpuplace.io/gang-name": gang,
        "gpuplace.io/gang-size": str(size),
        **extra.pop("annotations", {}),
    }
    return pod(name, scope.namespace, annotations, **extra)


def members_bound(kubectl: Kubectl, namespace: str, gang: str, size: int) -> Objects:
    return kubectl.watch(
        ["pods", "-n", namespace, "-l", f"gpuplace.io/gang={gang}"],
        lambda seen: dict(seen) if len(seen) == size and all(map(bound, seen.values())) else None,
        timeout=90,
        what=f"all {size} members of gang {gang} bound",
    )


def test_a_gang_waits_gated_until_complete_then_starts_as_one(
    scope: Scope, kubectl: Kubectl
) -> None:
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=4))
    kubectl.apply(*(member(scope, f"train-{i}", "train", 3) for i in range(2)))
    message = kubectl.wait_event(scope.namespace, "train-0", "GangIncomplete")
    assert message == (
        "waiting for all members of gang train: 2 of 3 exist; no GPU is held until all do"
    )
    for name in ("train-0", "train-1"):
        obj = kubectl.json("-n", scope.namespace, "get", "pod", name)
        assert gated(obj) and grant(obj) == {}, name
        assert obj["metadata"]["labels"]["gpuplace.io/gang"] == "train"
    kubectl.apply(member(scope, "train-2", "train", 3))
    placed = members_bound(kubectl, scope.namespace, "train", 3)
    assert not any(map(gated, placed.values()))
    spots = {(grant(obj)["node"], grant(obj)["gpus"]) for obj in placed.values()}
    assert len(spots) == 3 and {node for node, _ in spots} == {scope.node("a")}, spots
    placed_event = kubectl.wait_event(scope.namespace, "train-2", "GangPlaced")
    assert placed_event.startswith(f"gang train placed: 3 members on 1 node ({scope.node('a')} ×3)")


def test_an_incomplete_gang_times_out_holding_nothing(scope: Scope, kubectl: Kubectl) -> None:
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=2))
    kubectl.apply(
        member(scope, "alone-0", "alone", 2, annotations={"gpuplace.io/gang-timeout": "3s"})
    )
    message = kubectl.wait_event(scope.namespace, "alone-0", "GangTimeout", timeout=60)
    assert message.startswith("gang alone: only 1 of 2 members exist after its gang-timeout of 3s")
    obj = kubectl.json("-n", scope.namespace, "get", "pod", "alone-0")
    condition = next(
        c for c in obj["status"].get("conditions", []) if c["type"] == "gpuplace.io/GangReady"
    )
    assert (condition["status"], condition["reason"]) == ("False", "GangIncomplete")
    assert gated(obj) and grant(obj) == {}


def test_gang_plans_skip_cordoned_and_tainted_nodes_as_kube_scheduler_does(
    scope: Scope, kubectl: Kubectl
) -> None:
    """Two-GPU nodes are the tightest fit for a two-member gang, but one is cordoned and
    the other tainted NoSchedule: kube-scheduler would never bind members there, so the
    plan must take the free four-GPU node; a gang that tolerates the taint may use it."""
    cordoned, tainted, free = scope.node("cordoned"), scope.node("tainted"), scope.node("free")
    taint = {"key": "example.com/maintenance", "value": "true", "effect": "NoSchedule"}
    scope.add_nodes(
        gpu_node(cordoned, model=scope.model, gpus=2, unschedulable=True),
        gpu_node(tainted, model=scope.model, gpus=2, taints=[taint]),
        gpu_node(free, model=scope.model, gpus=4),
    )
    kubectl.apply(*(member(scope, f"plain-{i}", "plain", 2) for i in range(2)))
    placed = members_bound(kubectl, scope.namespace, "plain", 2)
    assert {grant(obj)["node"] for obj in placed.values()} == {free}
    # four members that tolerate the taint: the tainted node and the free node's other two
    # GPUs hold them; the cordoned node still not (they do not tolerate unschedulable)
    tolerate = [{"key": "example.com/maintenance", "operator": "Exists", "effect": "NoSchedule"}]
    kubectl.apply(
        *(member(scope, f"tolerant-{i}", "tolerant", 4, tolerations=tolerate) for i in range(4))
    )
    tolerant = members_bound(kubectl, scope.namespace, "tolerant", 4)
    nodes = sorted(grant(obj)["node"] for obj in tolerant.values())
    assert nodes == sorted([free, free, tainted, tainted]), nodes
