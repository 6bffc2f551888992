"""GpuQueues on the real control plane (docs/queues.md, issue 29 point 7): the shipped
GpuQueue CRD and RBAC, the real webhook putting queued pods behind the queue gate, the
queue controller admitting them through the real API server (its writes judged by the
shipped webhooks and policies) and the stock kube-scheduler binding what it admitted.

Checked: a queue never uses more than its quota; a queued pod is admitted only where a
GPU is free for it, so every admitted pod is bound (none admitted and unplaceable); a
queued gang is admitted whole or not at all; a reclaim evicts exactly the borrowed pods
needed, through the Eviction API, and not while a PodDisruptionBudget forbids it (on the
kit's real node, where pods run: the API server ignores budgets for Pending pods); one
whole GPU rather than two shares where either frees the same (issue 41).

`gpuplace serve` runs with `--queues=true` for this module (the shipped Deployment leaves
the queue controller off) and with the Deployment's arguments again after it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from tests.realcluster import install
from tests.realcluster.conftest import Agent, Scope
from tests.realcluster.install import Installation
from tests.realcluster.kit import Kubectl, Objects
from tests.realcluster.objects import (
    REAL_NODE_MODEL,
    bound,
    gpu_node,
    grant,
    observed,
    pod,
    running,
    wait_bound,
)

GATE = "gpuplace.io/queue"
QUEUE = "gpuplace.io/queue"


@pytest.fixture(scope="module", autouse=True)
def queues_on(gpuplace: Installation) -> Iterator[None]:
    """`gpuplace serve --queues=true` while this module runs; as shipped after it."""
    shipped = gpuplace.serve
    shipped.stop()
    gpuplace.serve = install.serve_process(gpuplace, queues=True)
    try:
        gpuplace.serve.start()
        yield
    finally:
        gpuplace.serve.stop()
        gpuplace.serve = shipped
        shipped.start()


def gpuqueue(
    name: str,
    namespace: str,
    nominal: int,
    *,
    model: str,
    cohort: str | None = None,
    borrowing: int | None = None,
) -> dict[str, Any]:
    """A queue of `nominal` whole GPUs of `model` for the pods of `namespace` that name it
    (`borrowing`: its borrowing limit)."""
    line = {"name": "gpus", "model": model, "nominal": str(nominal)}
    if borrowing is not None:
        line["borrowingLimit"] = str(borrowing)
    spec: dict[str, Any] = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "resources": [line],
    }
    if cohort is not None:
        spec["cohort"] = cohort
    return {
        "apiVersion": "gpuplace.io/v1alpha1",
        "kind": "GpuQueue",
        "metadata": {"name": name},
        "spec": spec,
    }


def queued(scope: Scope, name: str, queue: str, gpus: int = 1, **extra: Any) -> dict[str, Any]:
    """A pod asking for `gpus` whole GPUs of the test's model, in `queue`."""
    annotations = {
        "gpuplace.io/gpu-count": str(gpus),
        "gpuplace.io/gpu-model": extra.pop("model", scope.model),
        QUEUE: queue,
        **extra.pop("annotations", {}),
    }
    return pod(name, scope.namespace, annotations, **extra)


def outside(scope: Scope, kubectl: Kubectl, gpus: int) -> dict[str, Any]:
    """Pod `outside` (in no queue) holding `gpus` whole GPUs of the test's model, bound."""
    annotations = {"gpuplace.io/gpu-count": str(gpus), "gpuplace.io/gpu-model": scope.model}
    kubectl.apply(pod("outside", scope.namespace, annotations))
    return wait_bound(kubectl, scope.namespace, "outside")


def gated(obj: Mapping[str, Any] | None) -> bool:
    gates = ((obj or {}).get("spec") or {}).get("schedulingGates") or []
    return any(gate.get("name") == GATE for gate in gates)


def pods(kubectl: Kubectl, namespace: str) -> dict[str, dict[str, Any]]:
    listed = kubectl.json("-n", namespace, "get", "pods")
    return {item["metadata"]["name"]: item for item in listed["items"]}


def settled(kubectl: Kubectl, scope: Scope, admitted: set[str], waiting: set[str]) -> Objects:
    """Until exactly `admitted` are bound (ungated, with their grants) and `waiting` are
    still gated and unbound; fails on any pod admitted but not bound in the end."""

    def done(seen: Objects) -> Objects | None:
        by_name = {key.split("/")[-1]: obj for key, obj in seen.items()}
        if set(by_name) != admitted | waiting:
            return None
        if not all(bound(by_name[name]) and not gated(by_name[name]) for name in admitted):
            return None
        if not all(gated(by_name[name]) and not bound(by_name[name]) for name in waiting):
            return None
        return dict(seen)

    return kubectl.watch(
        ["pods", "-n", scope.namespace],
        done,
        timeout=90,
        what=f"{sorted(admitted)} admitted and bound, {sorted(waiting)} waiting",
    )


def status_line(found: Mapping[str, Any] | None) -> dict[str, str]:
    """A GpuQueue's status of its one quota line, as the controller wrote it."""
    lines = ((found or {}).get("status") or {}).get("resources") or [{}]
    return {key: str(value) for key, value in lines[0].items()}


def wait_status(kubectl: Kubectl, queue: str, **wanted: str) -> None:
    """Until the queue's status line says `wanted` (e.g. used="3")."""
    kubectl.wait_object(
        "gpuqueues",
        queue,
        lambda found: all(status_line(found).get(k) == v for k, v in wanted.items()),
        what=f"GpuQueue {queue} status {wanted}",
    )


def test_quota_holds_and_a_queued_pod_is_admitted_only_where_a_gpu_is_free(
    scope: Scope, kubectl: Kubectl
) -> None:
    """A queue of 3 GPUs on a 4-GPU node, 2 of them held by a pod outside any queue:
    of three queued 1-GPU pods two are admitted (no GPU for the third: it waits, `place`,
    admitted to nothing); when the outside pod goes, the third is admitted and a fourth
    waits for quota (3 of 3 used). Every admitted pod is bound by kube-scheduler."""
    queue = scope.namespace
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=4))
    scope.create(gpuqueue(queue, scope.namespace, 3, model=scope.model))
    assert not gated(outside(scope, kubectl, 2))
    kubectl.apply(*(queued(scope, f"q-{i}", queue) for i in range(3)))
    settled(kubectl, scope, {"outside", "q-0", "q-1"}, {"q-2"})
    why = kubectl.wait_event(scope.namespace, "q-2", "QueueWaiting", contains="(place)")
    assert f"waiting in GpuQueue {queue} (place)" in why, why
    kubectl.run("-n", scope.namespace, "delete", "pod", "outside", "--wait=true")
    settled(kubectl, scope, {"q-0", "q-1", "q-2"}, set())
    kubectl.apply(queued(scope, "q-3", queue))
    seen = settled(kubectl, scope, {"q-0", "q-1", "q-2"}, {"q-3"})
    why = kubectl.wait_event(scope.namespace, "q-3", "QueueWaiting", contains="(quota)")
    assert f"waiting in GpuQueue {queue} (quota)" in why, why
    gpus = [grant(obj)["gpus"] for obj in seen.values() if bound(obj)]
    assert len(gpus) == len(set(gpus)) == 3  # three GPUs, none twice
    wait_status(kubectl, queue, used="3", borrowed="0")


def test_a_queued_gang_is_admitted_whole_or_not_at_all(scope: Scope, kubectl: Kubectl) -> None:
    """A gang of three 1-GPU members in a queue of 4 on a 4-GPU node: incomplete, nothing
    is admitted; complete while an outside pod holds 2 GPUs, still nothing (no member is
    admitted alone); once the GPUs free, all three are admitted and bound together."""
    queue = scope.namespace
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=4))
    scope.create(gpuqueue(queue, scope.namespace, 4, model=scope.model))
    gang = {"gpuplace.io/gang-name": "train", "gpuplace.io/gang-size": "3"}
    kubectl.apply(*(queued(scope, f"m-{i}", queue, annotations=gang) for i in range(2)))
    kubectl.wait_event(scope.namespace, "m-0", "QueueWaiting")
    outside(scope, kubectl, 2)
    kubectl.apply(queued(scope, "m-2", queue, annotations=gang))
    why = kubectl.wait_event(scope.namespace, "m-2", "QueueWaiting", contains="(place)")
    assert f"GpuQueue {queue}" in why, why
    members = {f"m-{i}" for i in range(3)}
    now = pods(kubectl, scope.namespace)
    assert all(gated(now[name]) and not bound(now[name]) for name in members), now
    kubectl.run("-n", scope.namespace, "delete", "pod", "outside", "--wait=true")
    seen = settled(kubectl, scope, members, set())
    nodes = {obj["spec"]["nodeName"] for obj in seen.values()}
    assert nodes == {scope.node("a")}


def test_a_reclaim_evicts_one_whole_gpu_where_two_shares_free_the_same(
    scope: Scope, kubectl: Kubectl
) -> None:
    """Issue 41 on the real control plane: one 4-GPU node, queues a and b of 2 GPUs each
    in a cohort (a may borrow 2). A pod outside any queue holds all four GPUs while a's
    six 50% shares a-0..a-5 and one whole GPU a-7 are created, so that they are all
    admitted in one round (within one second: whole-second `assigned-at` tied them) once
    it goes: the shares two per GPU on GPUs 0-2, a-7 on GPU 3, admitted last. b then
    asks one whole GPU inside its nominal: a-7 alone, or two shares of one GPU, give back
    one GPU of quota and one free GPU, and exactly a-7 is evicted."""
    a, b = f"{scope.namespace}-a", f"{scope.namespace}-b"
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=4))
    scope.create(
        gpuqueue(a, scope.namespace, 2, model=scope.model, cohort=scope.namespace, borrowing=2),
        gpuqueue(b, scope.namespace, 2, model=scope.model, cohort=scope.namespace),
    )
    outside(scope, kubectl, 4)
    shares = [f"a-{i}" for i in range(6)]
    half = {"gpuplace.io/gpu-percent": "50", "gpuplace.io/gpu-model": scope.model, QUEUE: a}
    kubectl.apply(*(pod(name, scope.namespace, half) for name in shares), queued(scope, "a-7", a))
    kubectl.wait_event(scope.namespace, "a-7", "QueueWaiting", contains="(place)")
    kubectl.run("-n", scope.namespace, "delete", "pod", "outside", "--wait=true")
    seen = settled(kubectl, scope, {*shares, "a-7"}, set())
    by_name = {key.split("/")[-1]: obj for key, obj in seen.items()}
    gpus = {name: grant(obj)["gpus"] for name, obj in by_name.items()}
    assert sorted(gpus[name] for name in shares) == ["0", "0", "1", "1", "2", "2"], gpus
    assert gpus["a-7"] == "3", gpus
    stamps = {name: grant(obj)["at"] for name, obj in by_name.items()}
    assert max(stamps, key=lambda name: stamps[name]) == "a-7", stamps  # admitted last
    wait_status(kubectl, a, used="4", borrowed="2")
    kubectl.apply(queued(scope, "b-1", b))
    reclaim = kubectl.wait_event(scope.namespace, "b-1", "QueueReclaiming")
    assert f"evicted {scope.namespace}/a-7;" in reclaim, reclaim
    settled(kubectl, scope, {*shares, "b-1"}, set())  # a-7 is gone, b-1 runs on GPU 3
    now = pods(kubectl, scope.namespace)
    assert all("deletionTimestamp" not in now[name]["metadata"] for name in shares), now
    assert grant(now["b-1"])["gpus"] == "3"
    wait_status(kubectl, a, used="3", borrowed="1")


def test_a_reclaim_evicts_exactly_the_borrowed_pod_needed_and_waits_for_its_budget(
    scope: Scope, kubectl: Kubectl, node_agent: Agent
) -> None:
    """On the real node (two replayed GPUs, pods that run): queues a and b of one GPU
    each in one cohort. a runs two 1-GPU pods, one of them on b's idle quota; b's pod
    needs a GPU: a reclaim. While the borrowed pod's budget allows no disruption nothing
    is evicted (`QueueReclaimBlocked`); once it allows one, exactly that pod (the most
    recently admitted) is evicted through the Eviction API and b's pod runs in its
    place; a's other pod runs on."""
    a, b = f"{scope.namespace}-a", f"{scope.namespace}-b"
    cohort = scope.namespace
    scope.create(
        gpuqueue(a, scope.namespace, 1, model=REAL_NODE_MODEL, cohort=cohort),
        gpuqueue(b, scope.namespace, 1, model=REAL_NODE_MODEL, cohort=cohort),
    )
    on_node = {"kubernetes.io/hostname": node_agent.node}

    def on_real_node(name: str, queue: str) -> dict[str, Any]:
        return queued(
            scope,
            name,
            queue,
            model=REAL_NODE_MODEL,
            node_selector=on_node,
            labels={"app": name},
            grace=2,
        )

    kubectl.apply(on_real_node("a-first", a))
    kubectl.wait_object("pods", "a-first", running, namespace=scope.namespace, timeout=90)
    kubectl.apply(on_real_node("a-borrows", a))
    kubectl.wait_object("pods", "a-borrows", running, namespace=scope.namespace, timeout=90)
    wait_status(kubectl, a, used="2", borrowed="1")

    def budget(allowed: int) -> dict[str, Any]:
        return {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "a-borrows", "namespace": scope.namespace},
            "spec": {
                "minAvailable": 1 - allowed,
                "selector": {"matchLabels": {"app": "a-borrows"}},
            },
        }

    kubectl.apply(budget(0))
    observed(kubectl, scope.namespace, "a-borrows", 0)
    kubectl.apply(on_real_node("b-needs", b))
    blocked = kubectl.wait_event(scope.namespace, "b-needs", "QueueReclaimBlocked", timeout=90)
    assert "PodDisruptionBudget" in blocked, blocked
    now = pods(kubectl, scope.namespace)
    for name in ("a-first", "a-borrows"):
        assert running(now[name]) and "deletionTimestamp" not in now[name]["metadata"], name
    assert gated(now["b-needs"])
    kubectl.apply(budget(1))
    # the controller retries a refused reclaim after 10 s; then exactly a-borrows goes
    kubectl.wait_object("pods", "b-needs", running, namespace=scope.namespace, timeout=120)
    gone = kubectl.wait_event(scope.namespace, "a-borrows", "GpuPreempted")
    assert f"GpuQueue {b} needs it" in gone, gone
    reclaim = kubectl.wait_event(scope.namespace, "b-needs", "QueueReclaiming")
    assert f"evicted {scope.namespace}/a-borrows;" in reclaim, reclaim
    now = pods(kubectl, scope.namespace)
    assert running(now["a-first"]) and "deletionTimestamp" not in now["a-first"]["metadata"]
    assert "a-borrows" not in now or now["a-borrows"]["metadata"].get("deletionTimestamp")
    wait_status(kubectl, a, used="1", borrowed="0")
    wait_status(kubectl, b, used="1", lent="0")


def test_a_reclaimed_job_pod_is_replaced_and_does_not_fail_its_job(
    scope: Scope, kubectl: Kubectl, node_agent: Agent
) -> None:
    """Point 3's Job rule (docs/queues.md, "Jobs"), on the real Job controller: a Job of
    queue a with `backoffLimit: 0` and the documented `podFailurePolicy` (Ignore on
    `DisruptionTarget`) runs two 1-GPU pods, one on b's idle quota; b's pod reclaims it.
    The Job does not fail (no `Failed` condition, nothing counted against its backoff
    limit of 0: the rule matched the `DisruptionTarget` the eviction set), and the Job
    controller's replacement waits behind the queue gate for a's quota."""
    a, b = f"{scope.namespace}-ja", f"{scope.namespace}-jb"
    scope.create(
        gpuqueue(a, scope.namespace, 1, model=REAL_NODE_MODEL, cohort=scope.namespace),
        gpuqueue(b, scope.namespace, 1, model=REAL_NODE_MODEL, cohort=scope.namespace),
    )
    on_node = {"kubernetes.io/hostname": node_agent.node}
    member = queued(scope, "unused", a, model=REAL_NODE_MODEL, node_selector=on_node, grace=2)
    template = {
        "metadata": {"annotations": member["metadata"]["annotations"]},
        "spec": member["spec"],
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "sweep", "namespace": scope.namespace},
        "spec": {
            "parallelism": 2,
            "completions": 2,
            "backoffLimit": 0,
            "podFailurePolicy": {
                "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]
            },
            "template": template,
        },
    }
    kubectl.apply(job)

    def job_pods(seen: Objects) -> dict[str, dict[str, Any]]:
        return {
            key.split("/")[-1]: obj
            for key, obj in seen.items()
            if (obj.get("metadata", {}).get("labels") or {}).get("job-name") == "sweep"
        }

    def both_running(seen: Objects) -> dict[str, dict[str, Any]] | None:
        found = job_pods(seen)
        return found if len(found) == 2 and all(map(running, found.values())) else None

    first = kubectl.watch(
        ["pods", "-n", scope.namespace], both_running, timeout=120, what="both Job pods running"
    )
    wait_status(kubectl, a, used="2", borrowed="1")
    kubectl.apply(
        queued(scope, "b-needs", b, model=REAL_NODE_MODEL, node_selector=on_node, grace=2)
    )
    kubectl.wait_object("pods", "b-needs", running, namespace=scope.namespace, timeout=120)
    reclaim = kubectl.wait_event(scope.namespace, "b-needs", "QueueReclaiming")
    (evicted,) = [name for name in first if f"evicted {scope.namespace}/{name};" in reclaim]
    (kept,) = set(first) - {evicted}

    def replaced(seen: Objects) -> dict[str, dict[str, Any]] | None:
        found = job_pods(seen)
        new = [obj for name, obj in found.items() if name not in first]
        if not new or not gated(new[0]) or bound(new[0]):
            return None
        return found if running(found.get(kept)) else None

    kubectl.watch(
        ["pods", "-n", scope.namespace],
        replaced,
        timeout=120,
        what="the Job's replacement gated in its queue, the kept pod running",
    )
    status = kubectl.json("-n", scope.namespace, "get", "job", "sweep")["status"]
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    assert conditions.get("Failed") != "True", status
    assert status.get("failed", 0) == 0, status  # nothing counted against backoffLimit
    assert status.get("active") == 2, status  # the kept pod and its replacement
