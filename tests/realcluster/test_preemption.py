"""Priority preemption on the real kube-scheduler (docs/extender.md, "preempt"): it picks
victims on node totals, and the sidecar's preempt verb narrows them to pods that free one
GPU set the preemptor fits on."""

from __future__ import annotations

from tests.realcluster.conftest import Scope
from tests.realcluster.kit import Kubectl, Objects
from tests.realcluster.objects import gpu_node, grant, pod, priority_class, wait_bound


def test_a_higher_priority_pod_evicts_the_shares_of_exactly_one_gpu(
    scope: Scope, kubectl: Kubectl
) -> None:
    """Two GPUs, each full with two low-priority 50% shares. A high-priority pod wants a
    whole GPU: node totals say any two shares free 100%, but only the two of one GPU free
    a GPU. Exactly those two go; the other GPU's keep running."""
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
