"""Gangs on the real control plane (docs/gangs.md): scheduling gates lifted by the sidecar
with its shipped RBAC, members bound by the stock kube-scheduler, conditions and Events
as kubectl shows them; plans that respect what kube-scheduler respects (cordon, taints);
a waiting gang of higher priority evicting through the Eviction API, all or nothing
under PodDisruptionBudgets, on the kit's real node."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from tests.realcluster.conftest import Agent, Scope
from tests.realcluster.install import Installation
from tests.realcluster.kit import Kubectl, Objects
from tests.realcluster.objects import (
    REAL_NODE_MODEL,
    bound,
    gpu_node,
    grant,
    metric,
    observed,
    pod,
    priority_class,
    running,
    wait_bound,
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


def test_a_waiting_gang_evicts_all_or_nothing_through_the_eviction_api(
    scope: Scope, kubectl: Kubectl, gpuplace: Installation, node_agent: Agent
) -> None:
    """On the real node (two replayed GPUs, pods that really run): two low-priority
    whole-GPU pods, each under its own PodDisruptionBudget, and a complete gang of higher
    priority that needs both GPUs. While one budget allows no disruption, neither victim
    is evicted; once it allows one, both are, through the Eviction API, and the gang
    starts there."""
    low, high = f"{scope.namespace}-low", f"{scope.namespace}-high"
    scope.create(priority_class(low, 100), priority_class(high, 1000))
    on_node = {"kubernetes.io/hostname": node_agent.node}
    whole = {"gpuplace.io/gpu-count": "1", "gpuplace.io/gpu-model": REAL_NODE_MODEL}
    victims = ("victim-a", "victim-b")
    kubectl.apply(
        *(
            pod(
                name,
                scope.namespace,
                whole,
                priority_class=low,
                node_selector=on_node,
                labels={"app": name},
                grace=2,
            )
            for name in victims
        )
    )
    for name in victims:
        kubectl.wait_object("pods", name, running, namespace=scope.namespace, timeout=90)

    def budget(name: str, allowed: int) -> dict[str, Any]:
        """A budget for one bare pod (no controller: only an integer minAvailable counts)
        that allows `allowed` (0 or 1) disruptions."""
        return {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": scope.namespace},
            "spec": {"minAvailable": 1 - allowed, "selector": {"matchLabels": {"app": name}}},
        }

    kubectl.apply(budget("victim-a", 1), budget("victim-b", 0))
    for name, allowed in (("victim-a", 1), ("victim-b", 0)):
        observed(kubectl, scope.namespace, name, allowed)
    metrics = f"http://127.0.0.1:{gpuplace.ports.metrics}/metrics"
    plans = metric(metrics, "gpuplace_gang_preemption_plans_total")
    gang_annotations = {**whole, "gpuplace.io/gang-name": "urgent", "gpuplace.io/gang-size": "2"}
    kubectl.apply(
        *(
            pod(
                f"urgent-{i}",
                scope.namespace,
                gang_annotations,
                priority_class=high,
                node_selector=on_node,
            )
            for i in range(2)
        )
    )
    # the planner found victims and the budget pre-check refused the plan, twice (after
    # 10 s it looks again, as budgets change)
    deadline = time.monotonic() + 60
    while metric(metrics, "gpuplace_gang_preemption_plans_total") < plans + 2:
        assert time.monotonic() < deadline, "the gang never planned a preemption"
        time.sleep(0.5)
    for name in victims:
        obj = kubectl.json("-n", scope.namespace, "get", "pod", name)
        assert running(obj) and "deletionTimestamp" not in obj["metadata"], name
    assert metric(metrics, "gpuplace_gang_preemption_victims_total") == 0
    # the budget now allows it: both victims go through the Eviction API, then the gang
    evicted: set[str] = set()

    def both_evicted(seen: Objects) -> bool:
        for obj in seen.values():
            for condition in obj["status"].get("conditions", []):
                if condition["type"] == "DisruptionTarget" and condition.get("reason") == (
                    "EvictionByEvictionAPI"
                ):
                    evicted.add(obj["metadata"]["name"])
        return evicted == set(victims)

    kubectl.apply(budget("victim-b", 1))
    kubectl.watch(
        ["pods", "-n", scope.namespace, "-l", "app"],
        both_evicted,
        timeout=90,
        what="both victims evicted through the Eviction API",
    )
    started = members_bound(kubectl, scope.namespace, "urgent", 2)
    assert {grant(obj)["node"] for obj in started.values()} == {node_agent.node}
    for name in started:
        kubectl.wait_object(
            "pods", name.split("/")[1], running, namespace=scope.namespace, timeout=90
        )
    preempted = kubectl.wait_event(scope.namespace, "victim-a", "GpuPreempted")
    assert f"for gang {scope.namespace}/urgent" in preempted, preempted
    assert wait_bound(kubectl, scope.namespace, "urgent-0")
