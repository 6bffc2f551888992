"""Priority preemption on the real kube-scheduler (docs/extender.md, "preempt"): it picks
victims on node totals, and the sidecar's preempt verb narrows them to pods that free one
GPU set the preemptor fits on."""

from __future__ import annotations

import time

from tests.realcluster.conftest import Scope
from tests.realcluster.kit import Kubectl, Objects
from tests.realcluster.objects import gpu_node, grant, pod, priority_class, wait_bound


def test_a_higher_priority_pod_evicts_the_shares_of_exactly_one_gpu(
    scope: Scope, kubectl: Kubectl
) -> None:
    """Two GPUs, each full with two low-priority 50% shares. A high-priority pod wants a
    whole GPU: node totals say any two shares free 100%, but only the two of one GPU free
    a GPU. Exactly those two go; the other GPU's keep running."""
    evicts_the_shares_of_exactly_one_gpu(scope, kubectl)


def evicts_the_shares_of_exactly_one_gpu(scope: Scope, kubectl: Kubectl) -> None:
    """The test above (test_planning runs it with the planner too)."""
    name = scope.node("a")
    scope.add_nodes(gpu_node(name, model=scope.model, gpus=2))
    low, high = f"{scope.namespace}-low", f"{scope.namespace}-high"
    scope.create(priority_class(low, 100), priority_class(high, 1000))
    half = {"gpuplace.io/gpu-percent": "50", "gpuplace.io/gpu-model": scope.model}
    where = {}
    for index in range(4):
        kubectl.apply(pod(f"low-{index}", scope.namespace, half, priority_class=low))
        where[f"low-{index}"] = grant(wait_bound(kubectl, scope.namespace, f"low-{index}"))["gpus"]
    by_gpu = {gpu: sorted(p for p, g in where.items() if g == gpu) for gpu in set(where.values())}
    assert sorted(len(pods) for pods in by_gpu.values()) == [2, 2], where
    whole = {"gpuplace.io/gpu-count": "1", "gpuplace.io/gpu-model": scope.model}
    kubectl.apply(pod("urgent", scope.namespace, whole, priority_class=high))
    urgent = grant(wait_bound(kubectl, scope.namespace, "urgent", timeout=120))
    assert urgent["node"] == name and urgent["milli"] == "1000"

    def left(seen: Objects) -> list[str] | None:
        names = sorted(obj["metadata"]["name"] for obj in seen.values())
        return names if len(names) == 2 else None

    survivors = kubectl.watch(
        ["pods", "-n", scope.namespace, "--field-selector", "metadata.name!=urgent"],
        left,
        timeout=60,
        what="two low-priority pods left",
    )
    freed = urgent["gpus"]
    assert sorted(p for p in where if p not in survivors) == by_gpu[freed]
    assert all(where[p] != freed for p in survivors), (where, survivors, freed)


def test_an_elastic_gang_gives_its_newest_extra_first_then_goes_whole(
    scope: Scope, kubectl: Kubectl
) -> None:
    """A running elastic gang (4 members, gang-min 2) fills a 4-GPU node at low priority.
    A high-priority pod needing one GPU takes exactly one extra member (the newest of
    those kube-scheduler offered: among equal pods its choice is its own, and this plan
    started all four in the same second), never a core one; one needing three GPUs
    cannot leave the gang below gang-min, so the whole gang goes (docs/gangs.md,
    "Priority and preemption")."""
    name = scope.node("a")
    scope.add_nodes(gpu_node(name, model=scope.model, gpus=4))
    low, high = f"{scope.namespace}-low", f"{scope.namespace}-high"
    scope.create(priority_class(low, 100), priority_class(high, 1000))
    elastic = {
        "gpuplace.io/gpu-count": "1",
        "gpuplace.io/gpu-model": scope.model,
        "gpuplace.io/gang-name": "train",
        "gpuplace.io/gang-size": "4",
        "gpuplace.io/gang-min": "2",
    }
    for index in range(4):  # created one after the other: member 3 is the newest
        kubectl.apply(pod(f"train-{index}", scope.namespace, elastic, priority_class=low))
    members = [f"train-{index}" for index in range(4)]
    for member in members:
        wait_bound(kubectl, scope.namespace, member, timeout=120)
    one = {"gpuplace.io/gpu-count": "1", "gpuplace.io/gpu-model": scope.model}
    kubectl.apply(pod("urgent", scope.namespace, one, priority_class=high))
    assert grant(wait_bound(kubectl, scope.namespace, "urgent", timeout=120))["node"] == name

    def names(seen: Objects) -> list[str]:
        return sorted(obj["metadata"]["name"] for obj in seen.values())

    survivors = kubectl.watch(
        ["pods", "-n", scope.namespace, "-l", "gpuplace.io/gang=train"],
        lambda seen: names(seen) if len(seen) == 3 else None,
        timeout=60,
        what="three members left",
    )
    # one extra, and only it, went; the gang-min core stays
    assert survivors in (members[:3], [*members[:2], members[3]]), survivors

    three = {"gpuplace.io/gpu-count": "3", "gpuplace.io/gpu-model": scope.model}
    kubectl.apply(pod("bigger", scope.namespace, three, priority_class=high))
    assert grant(wait_bound(kubectl, scope.namespace, "bigger", timeout=120))["node"] == name
    deadline = time.monotonic() + 60
    while left := kubectl.json(
        "-n", scope.namespace, "get", "pods", "-l", "gpuplace.io/gang=train"
    )["items"]:
        assert time.monotonic() < deadline, [obj["metadata"]["name"] for obj in left]
        time.sleep(0.5)
    assert kubectl.json("-n", scope.namespace, "get", "pod", "urgent")["spec"]["nodeName"] == name
