"""A lone pod on the DRA path preempts lower-priority pods (issue 47, point 1): kube-scheduler
answers "Preemption is not helpful" for a pod with a ResourceClaim, so the claim controller
chooses the victims with the engine, evicts them through the Eviction API and pins the
pod's claim to the GPUs they free. The real sidecar with `--dra-claims=fallback` against
the local API with the RBAC deploy/overlays/self-managed-dra ships; kube-scheduler's DRA
allocator is played by `allocate`, the garbage collector by `collect_garbage`."""

from __future__ import annotations

import dataclasses

from gpuplace.cluster import dra_claims, keys
from gpuplace.cluster.gang_marks import gated
from gpuplace.dev import localapi
from gpuplace.extender import explaining
from gpuplace.extender.workloads import PolicyHolder
from tests.claims.test_controller import (
    NAMESPACE,
    allocate,
    message,
    reasons,
    sidecar,
    unschedulable,
    users_claim,
)
from tests.claims.test_one_ledger import (
    WHOLE_H100,
    claimed,
    collect_garbage,
    dra_pod,
    pod_of,
    running_on,
    victims,
)
from tests.cluster.conftest import eventually
from tests.extender.conftest import Harness

ONE_GPU = {keys.GPU_COUNT: "1"}


def pin_of(server: localapi.Server, claim: str) -> str:
    stored = server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)
    return str((stored["metadata"].get("annotations") or {}).get(keys.CLAIM_PINNED, ""))


async def full_node(server: localapi.Server, sidecar: Harness, priorities: list[int]) -> list[str]:
    """h100-0's two GPUs each held by a running one-GPU DRA pod `low0`, `low1` of
    `priorities`: their UIDs, once in the ledger."""
    uids = []
    for i, priority in enumerate(priorities):
        server.api.create(dra_pod(f"low{i}", ONE_GPU, priority=priority))
        uids.append(await running_on(server, f"low{i}", f"gpu-{i}"))
    sync = sidecar.sidecar.sync
    await eventually(lambda: all(sync.ledger.get(uid) is not None for uid in uids))
    return uids


async def test_a_lone_dra_pod_evicts_one_lower_pod_and_is_pinned_to_the_gpu_it_frees(
    server: localapi.Server, sidecar: Harness
) -> None:
    """Both GPUs held by priority-0 pods (low1 of priority 5): a priority-100 pod of one
    GPU evicts exactly one, the lowest (kube-scheduler's rule), not both; its claim is
    pinned to that pod's GPU, its node nominated, its gate gone; once the victim is gone
    kube-scheduler allocates it there."""
    await full_node(server, sidecar, [0, 5])
    server.api.create(dra_pod("urgent", ONE_GPU, priority=100))
    claim = await claimed(server, "urgent")
    assert victims(server) == ["low0"]
    assert pin_of(server, claim) == "GPU-h100-0-00"  # low0's GPU
    assert pod_of(server, "urgent")["status"].get("nominatedNodeName") == "h100-0"
    await eventually(lambda: {"GpuPreempted"} <= reasons(server, "low0"))
    assert "for pod team-a/urgent (priority 100" in message(server, "low0", "GpuPreempted")
    assert "GPU 0 of node h100-0" in message(server, "low0", "GpuPreempted")
    await eventually(lambda: "GpuPreemption" in reasons(server, "urgent"))
    assert "evicted team-a/low0" in message(server, "urgent", "GpuPreemption")
    sample = sidecar.sidecar.registry.get_sample_value
    assert sample("gpuplace_dra_preemptions_total", {"result": "complete"}) == 1
    assert sample("gpuplace_dra_preemption_victims_total") == 1
    sync = sidecar.sidecar.sync
    uid = str(pod_of(server, "urgent")["metadata"]["uid"])
    await eventually(lambda: sync.pods[uid].nominated == "h100-0")
    await eventually(lambda: any(p.name == "low0" and p.deleting for p in sync.pods.values()))
    told = explaining.explain(
        sync, PolicyHolder(sync, "default", refresh_seconds=0.0), sync.pods[uid], claims=(claim,)
    )
    assert (
        "Preemption under way: gpuplace's claim controller nominated node h100-0 and evicted "
        f"{NAMESPACE}/low0 there for it"
    ) in " ".join(told.headline), told.headline
    # kube-scheduler finds no room while low0 terminates; then it is gone and allocated
    unschedulable(server, "urgent")
    assert collect_garbage(server) == ["low0"]
    allocate(server, claim, "h100-0", "gpu-0", **WHOLE_H100)
    server.api.bind(NAMESPACE, "urgent", "h100-0")
    await eventually(lambda: (g := sync.ledger.get(uid)) is not None and g.gpus == (0,))
    assert victims(server) == ["low0"]  # nothing more


async def test_a_preemptors_claim_deleted_while_its_victim_terminates_is_made_on_the_same_gpu(
    server: localapi.Server, sidecar: Harness
) -> None:
    """What a restart or a lost lease would leave (nothing of the preemption in memory but
    the pods): the claim is made again on the GPU its victim, still terminating, frees, and
    no pod is evicted a second time."""
    await full_node(server, sidecar, [0, 0])
    server.api.create(dra_pod("urgent", ONE_GPU, priority=100))
    claim = await claimed(server, "urgent")
    first = pin_of(server, claim)
    (victim,) = victims(server)
    assert pod_of(server, victim)["metadata"].get("deletionTimestamp")
    old = server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)["metadata"]["uid"]
    server.api.delete("resource.k8s.io/resourceclaims", claim, NAMESPACE)

    def remade() -> bool:
        stored = server.api.objects("resource.k8s.io/resourceclaims", NAMESPACE)
        return any(c["metadata"]["name"] == claim and c["metadata"]["uid"] != old for c in stored)

    await eventually(remade, timeout=15.0)
    assert pin_of(server, claim) == first
    assert victims(server) == [victim]


async def test_a_victims_claim_that_outlives_its_pod_is_waited_for_not_a_second_victim(
    server: localapi.Server, sidecar: Harness
) -> None:
    """The victim's pod is gone but its ResourceClaim still holds the GPU (the garbage
    collector has not deleted it yet) and kube-scheduler finds no room for the preemptor:
    rounds go by and the other low pod is not evicted; once the claim goes, the pin has
    room and stays."""
    await full_node(server, sidecar, [0, 0])
    server.api.create(dra_pod("urgent", ONE_GPU, priority=100))
    claim = await claimed(server, "urgent")
    (first,) = victims(server)
    pin = pin_of(server, claim)
    left = dra_claims.named(pod_of(server, first))
    server.api.delete("pods", first, NAMESPACE)  # the kubelet is done; the claim stays
    sync = sidecar.sidecar.sync
    await eventually(lambda: all(p.name != first for p in sync.pods.values()))
    unschedulable(server, "urgent")
    controller = sidecar.sidecar.claims
    assert controller is not None
    for poke in ("1", "2", "3"):  # a pod change wakes a round
        seen = controller.rounds
        server.api.patch("pods", "urgent", {"metadata": {"labels": {"poke": poke}}}, NAMESPACE)
        await eventually(lambda: controller.rounds > seen)  # noqa: B023
    assert victims(server) == [first]
    server.api.delete("resource.k8s.io/resourceclaims", left, NAMESPACE)
    uid = str(pod_of(server, "urgent")["metadata"]["uid"])
    await eventually(lambda: sync.ledger.get(f"{uid}") is None and not any(
        g.pod_uid != uid and g.node == "h100-0" and g.gpus == (int(pin[-2:]),)
        for g in sync.ledger
    ))  # fmt: skip
    assert pin_of(server, claim) == pin
    assert victims(server) == [first]


async def test_no_victim_of_equal_priority_and_never_for_preemption_policy_never(
    server: localapi.Server, sidecar: Harness
) -> None:
    """kube-scheduler's rules: only pods of strictly lower priority go, and a pod with
    `preemptionPolicy: Never` evicts nothing; both get their claim unpinned (first fit:
    kube-scheduler says why they wait) and lose their gate."""
    await full_node(server, sidecar, [100, 100])
    server.api.create(dra_pod("peer", ONE_GPU, priority=100))
    humble = dra_pod("humble", ONE_GPU, priority=1000)
    humble["spec"]["preemptionPolicy"] = "Never"
    server.api.create(humble)
    for name in ("peer", "humble"):
        claim = await claimed(server, name)
        assert pin_of(server, claim) == ""
    assert victims(server) == []


async def test_a_budget_that_forbids_every_plan_keeps_the_pod_gated_and_says_why(
    server: localapi.Server, sidecar: Harness
) -> None:
    """A PodDisruptionBudget that allows no disruption of the low pods: nothing is evicted,
    the pod keeps its gate (each round plans it again, so room that frees is taken) with
    a Warning saying why; once the budget goes, the next attempt evicts."""
    controller = sidecar.sidecar.claims
    assert controller is not None
    controller.settings = dataclasses.replace(controller.settings, preempt_retry_seconds=0.3)
    controller.preemptions.retry_seconds = 0.3
    for i in range(2):
        body = dra_pod(f"low{i}", ONE_GPU)
        body["metadata"]["labels"]["app"] = "serving"
        server.api.create(body)
        await running_on(server, f"low{i}", f"gpu-{i}")
    sync = sidecar.sidecar.sync
    await eventually(lambda: all(sync.ledger.get(p.uid) is not None for p in sync.pods.values()))
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "serving", "namespace": NAMESPACE},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "serving"}}},
    }
    server.api.create(pdb)
    status = {
        "disruptionsAllowed": 0,
        "currentHealthy": 2,
        "desiredHealthy": 2,
        "expectedPods": 2,
        "observedGeneration": 1,
    }
    server.api.patch(
        "policy/poddisruptionbudgets",
        "serving",
        {"status": status},
        NAMESPACE,
        subresource="status",
    )
    server.api.create(dra_pod("urgent", ONE_GPU, priority=100))
    await eventually(lambda: "GpuPreemptionBlocked" in reasons(server, "urgent"), timeout=10.0)
    assert "PodDisruptionBudget" in message(server, "urgent", "GpuPreemptionBlocked")
    assert gated(pod_of(server, "urgent"), keys.DRA_GATE)
    assert dra_claims.named(pod_of(server, "urgent")) not in {
        c["metadata"]["name"] for c in server.api.objects("resource.k8s.io/resourceclaims")
    }
    assert victims(server) == []
    server.api.delete("policy/poddisruptionbudgets", "serving", NAMESPACE)
    # no pod changed: the round that polls (every `poll_seconds`) tries again
    await eventually(lambda: not gated(pod_of(server, "urgent"), keys.DRA_GATE), timeout=15.0)
    claim = await claimed(server, "urgent")
    assert len(victims(server)) == 1
    assert pin_of(server, claim) in ("GPU-h100-0-00", "GPU-h100-0-01")


async def test_gpus_a_race_takes_from_a_preemptor_give_it_a_new_plan_with_victims(
    server: localapi.Server, sidecar: Harness
) -> None:
    """The victim is gone, and before kube-scheduler allocates the preemptor's claim a
    user's own claim (first fit: the engine never saw it coming) takes the freed GPU:
    kube-scheduler finds no node. The controller plans the preemption again, evicts the
    other low pod and makes the claim again pinned to the GPU that one frees: never left
    pending with room (or lower-priority pods) in the cluster."""
    await full_node(server, sidecar, [0, 0])
    server.api.create(dra_pod("urgent", ONE_GPU, priority=100))
    claim = await claimed(server, "urgent")
    (first,) = victims(server)
    freed = pin_of(server, claim)
    device = f"gpu-{int(freed[-2:])}"
    old = server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)["metadata"]["uid"]
    assert collect_garbage(server) == [first]
    sync = sidecar.sidecar.sync
    await eventually(lambda: all(p.name != first for p in sync.pods.values()))
    server.api.create(users_claim("mine"))
    allocate(server, "mine", "h100-0", device, **WHOLE_H100)
    await eventually(lambda: (c := sync.claim(NAMESPACE, "mine")) is not None and bool(c.held))
    unschedulable(server, "urgent")
    other = "low1" if first == "low0" else "low0"
    await eventually(lambda: victims(server) == [first, other], timeout=15.0)

    def remade() -> bool:
        stored = server.api.objects("resource.k8s.io/resourceclaims", NAMESPACE)
        return any(c["metadata"]["name"] == claim and c["metadata"]["uid"] != old for c in stored)

    await eventually(remade, timeout=15.0)
    assert pin_of(server, claim) not in ("", freed)
    await eventually(lambda: "GpuClaimReplanned" in reasons(server, "urgent"))
    assert "its preemption frees" in message(server, "urgent", "GpuClaimReplanned")


async def test_a_pod_released_unpinned_preempts_once_a_lower_pod_holds_gpus(
    server: localapi.Server, sidecar: Harness
) -> None:
    """Both GPUs held at the preemptor's own priority: no victim, so its claim is made
    unpinned (first fit) and it is released. One of them goes and, before kube-scheduler
    gives the freed GPU to the waiting pod, a priority-0 pod takes it. The waiting pod,
    still unschedulable, now has a victim: that pod is evicted and its claim made again
    pinned to the GPU it frees."""
    await full_node(server, sidecar, [100, 100])
    server.api.create(dra_pod("urgent", ONE_GPU, priority=100))
    claim = await claimed(server, "urgent")
    assert pin_of(server, claim) == ""
    old = server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)["metadata"]["uid"]
    unschedulable(server, "urgent")
    low0 = dra_claims.named(pod_of(server, "low0"))
    server.api.delete("pods", "low0", NAMESPACE)  # it completed: the pod and its claim go
    collect_garbage(server)
    if low0 in {
        c["metadata"]["name"] for c in server.api.objects("resource.k8s.io/resourceclaims")
    }:
        server.api.delete("resource.k8s.io/resourceclaims", low0, NAMESPACE)
    server.api.create(dra_pod("sneak", ONE_GPU))
    await running_on(server, "sneak", "gpu-0")
    await eventually(lambda: victims(server) == ["sneak"], timeout=15.0)

    def remade() -> bool:
        stored = server.api.objects("resource.k8s.io/resourceclaims", NAMESPACE)
        return any(c["metadata"]["name"] == claim and c["metadata"]["uid"] != old for c in stored)

    await eventually(remade, timeout=15.0)
    assert pin_of(server, claim) == "GPU-h100-0-00"
    assert "its preemption frees" in message(server, "urgent", "GpuClaimReplanned")


async def test_while_a_preemption_is_under_way_lower_pods_keep_off_its_node(
    server: localapi.Server, sidecar: Harness
) -> None:
    """gpu-0 holds a priority-0 50 % share, gpu-1 a whole GPU of priority 100. A priority-100
    pod of one whole GPU evicts the share and is pinned to gpu-0. While the share
    terminates, a priority-0 50 % pod would fit only in gpu-0's free half — the GPU the
    preemption frees: it is not planned there but waits behind its gate, told why (an
    unpinned claim would let kube-scheduler's first fit take it too). Once the preemptor
    is placed, the node is free to it again."""
    server.api.create(dra_pod("low", {keys.GPU_PERCENT: "50"}))
    low = await claimed(server, "low")
    asked = server.api.get("resource.k8s.io/resourceclaims", low, NAMESPACE)["spec"]["devices"]
    half = asked["requests"][0]["exactly"]["capacity"]["requests"]
    allocate(server, low, "h100-0", "gpu-0", **half)
    server.api.bind(NAMESPACE, "low", "h100-0")
    server.api.create(dra_pod("keep", ONE_GPU, priority=100))
    await running_on(server, "keep", "gpu-1")
    sync = sidecar.sidecar.sync
    await eventually(lambda: len(list(sync.ledger)) == 2)
    server.api.create(dra_pod("urgent", ONE_GPU, priority=100))
    claim = await claimed(server, "urgent")
    assert victims(server) == ["low"]
    assert pin_of(server, claim) == "GPU-h100-0-00"
    server.api.create(dra_pod("small", {keys.GPU_PERCENT: "50"}))
    await eventually(lambda: "GpuClaimBlocked" in reasons(server, "small"), timeout=10.0)
    said = message(server, "small", "GpuClaimBlocked")
    assert "node h100-0 is held for another pod's preemption" in said, said
    assert gated(pod_of(server, "small"), keys.DRA_GATE)
    assert collect_garbage(server) == ["low"]
    allocate(server, claim, "h100-0", "gpu-0", **WHOLE_H100)
    server.api.bind(NAMESPACE, "urgent", "h100-0")
    small = await claimed(server, "small")  # no room left: unpinned, first fit
    assert pin_of(server, small) == ""
    assert victims(server) == ["low"]


__all__ = ["sidecar"]
