"""Gangs on the real control plane (docs/gangs.md): scheduling gates lifted by the sidecar
with its shipped RBAC, members bound by the stock kube-scheduler, conditions and Events
as kubectl shows them; plans that respect what kube-scheduler respects (cordon, taints);
a waiting gang of higher priority evicting through the Eviction API, all or nothing
under PodDisruptionBudgets, on the kit's real node; an Indexed Job whose member fails
restarting as one gang, and a gang kept to one rack (issue 45)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.realcluster.conftest import Agent, Scope
from tests.realcluster.install import Installation
from tests.realcluster.kit import Kubectl, Objects
from tests.realcluster.objects import (
    BUSYBOX,
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


def job_pods(seen: Objects, job: str) -> dict[str, dict[str, Any]]:
    return {
        key.split("/")[-1]: obj
        for key, obj in seen.items()
        if (obj.get("metadata", {}).get("labels") or {}).get("job-name") == job
    }


def finished(obj: Mapping[str, Any]) -> bool:
    return (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def exit_code(obj: Mapping[str, Any]) -> int | None:
    """The exit code of the pod's container `main` once it terminated, else None."""
    for status in (obj.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == "main":
            done = (status.get("state") or {}).get("terminated")
            return None if done is None else int(done.get("exitCode", 0))
    return None


def run_of(obj: Mapping[str, Any]) -> str:
    raw = ((obj.get("metadata") or {}).get("annotations") or {}).get("gpuplace.io/gang-plan")
    if not raw:
        return ""
    mark = json.loads(raw)
    return str(mark.get("run") or mark["id"])


def test_a_failed_member_restarts_its_indexed_job_as_one_gang(
    scope: Scope, kubectl: Kubectl, node_agent: Agent
) -> None:
    """Issue 45, point 3: an Indexed Job of 3 one-GPU members, two on the kit's kubelet
    node (its two replayed GPUs) and one on an API-only node. One member's container exits
    3 (the first to start on the real node: a marker on the node's disk says so, its
    recreated self runs on). Within seconds gpuplace evicts the other two (the Eviction
    API writes their `DisruptionTarget`; the one on the API-only node is finished by the
    test as its kubelet would), each hears which member failed, and the Job's three
    recreated members start again as one new run, only once no member of the old run
    holds a GPU; the Job does not fail (the documented `podFailurePolicy` ignores the
    evictions: only the real failure counts against `backoffLimit`)."""
    other = scope.node("api")
    scope.add_nodes(gpu_node(other, model=REAL_NODE_MODEL, gpus=1))
    marks = Path("/tmp") / f"gpuplace-{scope.namespace}"
    shutil.rmtree(marks, ignore_errors=True)
    annotations = {
        "gpuplace.io/gpu-count": "1",
        "gpuplace.io/gpu-model": REAL_NODE_MODEL,
        "gpuplace.io/gang-name": "ddp",
        "gpuplace.io/gang-size": "3",
    }
    where = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "kubernetes.io/hostname",
                                "operator": "In",
                                "values": [node_agent.node, other],
                            }
                        ]
                    }
                ]
            }
        }
    }
    script = (
        "trap 'exit 143' TERM; "
        "if mkdir /marks/failed 2>/dev/null; then sleep 4; exit 3; fi; "
        "while true; do sleep 1; done"
    )
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "ddp", "namespace": scope.namespace},
        "spec": {
            "completionMode": "Indexed",
            "completions": 3,
            "parallelism": 3,
            "backoffLimit": 1,
            "podFailurePolicy": {
                "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]
            },
            "template": {
                "metadata": {"annotations": annotations},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 2,
                    "affinity": where,
                    "volumes": [
                        {
                            "name": "marks",
                            "hostPath": {"path": str(marks), "type": "DirectoryOrCreate"},
                        }
                    ],
                    "containers": [
                        {
                            "name": "main",
                            "image": BUSYBOX,
                            "imagePullPolicy": "Never",
                            "command": ["sh", "-c", script],
                            "volumeMounts": [{"name": "marks", "mountPath": "/marks"}],
                        }
                    ],
                },
            },
        },
    }
    try:
        kubectl.apply(job)
        first = kubectl.watch(
            ["pods", "-n", scope.namespace],
            lambda seen: (
                found
                if len(found := job_pods(seen, "ddp")) == 3 and all(map(bound, found.values()))
                else None
            ),
            timeout=120,
            what="the Job's 3 members bound as one gang",
        )
        assert {grant(obj)["node"] for obj in first.values()} == {node_agent.node, other}
        old_run = {run_of(obj) for obj in first.values()}
        assert len(old_run) == 1 and "" not in old_run
        on_api_node = next(name for name, obj in first.items() if obj["spec"]["nodeName"] == other)
        failed_at: dict[str, float] = {}
        evicted_at: dict[str, float] = {}
        seen_deleted: dict[str, str] = {}
        last: dict[str, dict[str, Any]] = {}  # the first run's pods as last seen (they go)
        created: dict[str, float] = {}  # when the Job had created all 3 members again
        played: set[str] = set()

        def restarted(seen: Objects) -> dict[str, dict[str, Any]] | None:
            pods = job_pods(seen, "ddp")
            now = time.monotonic()
            for name, obj in pods.items():
                if name not in first:
                    continue
                last[name] = obj
                if exit_code(obj) == 3:
                    failed_at.setdefault(name, now)
                if obj["metadata"].get("deletionTimestamp") and name not in evicted_at:
                    evicted_at[name] = now
                    kinds = [c["type"] for c in obj["status"].get("conditions", [])]
                    seen_deleted[name] = f"{obj['status'].get('phase')} {kinds}"
            # the API-only node's kubelet: an evicted pod's containers stop, it is Failed
            api_pod = pods.get(on_api_node)
            if (
                api_pod is not None
                and api_pod["metadata"].get("deletionTimestamp")
                and not finished(api_pod)
                and on_api_node not in played
            ):
                played.add(on_api_node)
                kubectl.run(
                    "-n",
                    scope.namespace,
                    "patch",
                    "pod",
                    on_api_node,
                    "--subresource=status",
                    "--type=merge",
                    "-p",
                    json.dumps({"status": {"phase": "Failed", "reason": "Terminated"}}),
                )
            # point 4 on the real control plane: no new member holds a grant while an old
            # one has not finished
            old_left = [o for n, o in pods.items() if n in first and not finished(o)]
            new = {n: o for n, o in pods.items() if n not in first}
            granted = [n for n, o in new.items() if grant(o).get("node")]
            assert not (old_left and granted), (
                f"new members {granted} hold GPUs beside old ones "
                f"{[o['metadata']['name'] for o in old_left]}"
            )
            if len(new) == 3:
                created.setdefault("all", now)
            if len(new) == 3 and all(map(bound, new.values())):
                return new
            return None

        new = kubectl.watch(
            ["pods", "-n", scope.namespace],
            restarted,
            timeout=180,
            what="the Job's recreated members started again as one gang",
        )
        again = time.monotonic()
        assert len(failed_at) == 1, (failed_at, seen_deleted)
        ((failed, failed_when),) = failed_at.items()
        taken = [name for name in first if name != failed]
        assert all(name in evicted_at for name in taken), (failed_at, seen_deleted)
        latest = max(evicted_at[name] for name in taken) - failed_when
        assert latest < 15, f"the others were taken down {latest:.1f}s after the failure"
        for name in taken:
            kinds = {c["type"]: c for c in last[name]["status"].get("conditions", [])}
            assert kinds["DisruptionTarget"]["reason"] == "EvictionByEvictionAPI", kinds
            ready = kinds["gpuplace.io/GangReady"]
            assert (ready["status"], ready["reason"]) == ("False", "GangRestarting"), ready
            message = kubectl.wait_event(scope.namespace, name, "GangRestarting")
            assert message.startswith(
                f"gang ddp restarts: member {scope.namespace}/{failed} failed: its container "
                "main exited with code 3; this member is evicted through the Eviction API"
            ), message
        told = kubectl.wait_event(scope.namespace, failed, "GangMemberFailed")
        assert told.startswith("this member failed (its container main exited with code 3)")
        new_run = {run_of(obj) for obj in new.values()}
        assert len(new_run) == 1 and not new_run & old_run
        assert {grant(obj)["node"] for obj in new.values()} == {node_agent.node, other}
        for name, obj in new.items():
            if obj["spec"]["nodeName"] == node_agent.node:
                kubectl.wait_object("pods", name, running, namespace=scope.namespace, timeout=90)
        status = kubectl.json("-n", scope.namespace, "get", "job", "ddp")["status"]
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        assert conditions.get("Failed") != "True", status
        assert status.get("failed") == 1, status  # the real failure; not the evictions
        assert status.get("active") == 3, status
        print(
            f"restart: the others taken down {latest:.1f}s after the member failed; the "
            f"Job's new members all created {created['all'] - failed_when:.1f}s and bound "
            f"{again - failed_when:.1f}s after it"
        )
    finally:
        kubectl.run("-n", scope.namespace, "delete", "job", "ddp", "--wait=false", check=False)
        # no kubelet finishes the pods on the API-only node: let them go at once
        for obj in kubectl.json("-n", scope.namespace, "get", "pods")["items"]:
            if obj["spec"].get("nodeName") == other:
                name = obj["metadata"]["name"]
                kubectl.run(
                    "-n", scope.namespace, "patch", "pod", name, "--type=merge",
                    "-p", '{"metadata":{"finalizers":null}}', check=False,
                )  # fmt: skip
                kubectl.run(
                    "-n", scope.namespace, "delete", "pod", name, "--grace-period=0",
                    "--force", "--wait=false", check=False,
                )  # fmt: skip
        shutil.rmtree(marks, ignore_errors=True)


def test_a_gang_asking_one_rack_lands_in_one_leaving_the_others_gpus_alone(
    scope: Scope, kubectl: Kubectl
) -> None:
    """Issue 45, point 3: nodes labelled into two racks, rack a one 3-GPU node, rack b two
    2-GPU nodes. Fewest nodes alone would put three members on a1 and one in rack b; a gang
    of 4 asking one rack lands in rack b whole, and a1's three free GPUs are left alone. A
    gang of 5 could never fit one rack: the webhook refuses it at admission, naming what
    each rack holds."""
    rack = "example.com/rack"
    scope.add_nodes(
        gpu_node(scope.node("a1"), model=scope.model, gpus=3, labels={rack: "a"}),
        gpu_node(scope.node("b1"), model=scope.model, gpus=2, labels={rack: "b"}),
        gpu_node(scope.node("b2"), model=scope.model, gpus=2, labels={rack: "b"}),
    )
    domain = {"gpuplace.io/gang-domain": rack}
    refused = kubectl.apply(member(scope, "big-0", "big", 5, annotations=domain), check=False)
    assert refused.code != 0
    assert (
        "gpuplace.io/gang-domain=example.com/rack (gpuplace.io/gang-domain-policy: required): "
        "no example.com/rack could ever hold the gang's 5 members of 1 whole GPU of "
    ) in refused.err, refused.err
    assert "each: with every node idle the most one holds is 4 (b 4, a 3)" in refused.err
    kubectl.apply(*(member(scope, f"rack-{i}", "rack", 4, annotations=domain) for i in range(4)))
    placed = members_bound(kubectl, scope.namespace, "rack", 4)
    nodes = sorted(grant(obj)["node"] for obj in placed.values())
    assert nodes == sorted([scope.node("b1")] * 2 + [scope.node("b2")] * 2), nodes
    event = kubectl.wait_event(scope.namespace, "rack-0", "GangPlaced")
    assert f"{scope.node('a1')}" not in event
