"""The DRA claim controller in a running sidecar (`--dra-claims`) against the local API with
the RBAC deploy/overlays/self-managed-dra ships: a pod the webhook sent to DRA nodes gets
its claim and loses its gate; the allocation kube-scheduler writes lands in the one ledger
(and the extender, asked about that GPU, finds it taken); what blocks a claim is said on
the pod; explain tells a DRA pod by its claim."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import jsonpatch
import pytest

from gpuplace.claims import controller as claims_controller
from gpuplace.cluster import dra, dra_claims, keys, nodes
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.dev.localapi.statuses import ApiStatusError
from gpuplace.extender import explaining
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement.ledger import GrantState
from gpuplace.webhook import admission, reviews
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import FixedCapabilities, paths_of
from tests.cluster.conftest import eventually
from tests.extender.conftest import Harness, harness
from tests.webhook import helpers

H100 = "NVIDIA-H100-80GB-HBM3"
DRA_TREE = "overlays/self-managed-dra"
NAMESPACE = "team-a"


def dra_node(name: str = "h100-0", gpus: int = 2) -> dict[str, Any]:
    return objects.node(
        name,
        gpus=gpus,
        model=H100,
        gpu_memory_mib=81559,
        uuids=True,  # what the node agent publishes: the claims are pinned by UUID
        labels={keys.NODE_DRA: "true"},
    )


def plugin_node(name: str = "a100-0") -> dict[str, Any]:
    return objects.node(name, gpus=2)


def webhook_pod(name: str, annotations: dict[str, str], *items: dict[str, Any]) -> dict[str, Any]:
    """A pod as the mutating webhook leaves it with --dra-claims=fallback over `items`."""
    inventory = nodes.inventory(items)
    judge = admission.Reviewer(
        WebhookConfig(node_agent=True, dra_claims="fallback"),
        FixedCapabilities(inventory.capabilities(), paths_of(inventory)),
    )
    pod = helpers.pod(annotations)
    pod["metadata"].update(name=name, namespace=NAMESPACE)
    review = helpers.review(pod, uid=f"review-{name}")
    decision = judge.mutate(reviews.AdmissionReview.model_validate(review).request)
    assert decision.allowed, decision.message
    mutated: dict[str, Any] = jsonpatch.apply_patch(pod, decision.ops)
    return mutated


def allocate(server: localapi.Server, claim: str, node: str, device: str, **consumed: str) -> None:
    """What kube-scheduler's DRA allocator writes (then it binds the pod)."""
    server.api.patch(
        "resource.k8s.io/resourceclaims",
        claim,
        {
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {
                                "request": dra_claims.REQUEST,
                                "driver": dra.DRIVER,
                                "pool": node,
                                "device": device,
                                "consumedCapacity": consumed,
                            }
                        ]
                    }
                }
            }
        },
        NAMESPACE,
        subresource="status",
    )


@pytest.fixture
async def server() -> AsyncIterator[localapi.Server]:
    api = localapi.FakeApi(bookmark_interval=0.2, access=localapi.Access.shipped(DRA_TREE))
    async with localapi.serve(api) as running:
        running.api.create(dra_node())
        running.api.create(plugin_node())
        yield running


@pytest.fixture
async def sidecar(server: localapi.Server) -> AsyncIterator[Harness]:
    async with harness(server, dra_claims="fallback", scheduler_lease="") as running:
        await running.synced(lambda: running.sidecar.not_ready_reason() is None)
        yield running


async def test_a_dra_pod_gets_its_claim_its_grant_and_its_event(
    server: localapi.Server, sidecar: Harness
) -> None:
    share = {keys.GPU_PERCENT: "30", keys.GPU_MEMORY: "8Gi", keys.GPU_MODEL: H100}
    body = webhook_pod("train", share, dra_node(), plugin_node())
    claim = dra_claims.named(body)
    created = server.api.create(body)
    uid = created["metadata"]["uid"]
    await eventually(lambda: not server.api.get("pods", "train", NAMESPACE)["spec"].get(
        "schedulingGates"
    ))  # fmt: skip
    stored = server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)
    assert stored["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "train", "uid": uid, "controller": True}
    ]
    assert stored["metadata"]["labels"] == {keys.MANAGED: "true"}
    # the engine's plan: gpu-0 of h100-0 (the default policy, an empty node), held
    assert stored["metadata"]["annotations"] == {keys.CLAIM_PINNED: "GPU-h100-0-00"}
    exactly = stored["spec"]["devices"]["requests"][0]["exactly"]
    # 8192 MiB + the H100's context at 30 % of threads (144 + 5 x 30): the whole MPS limit
    assert exactly["capacity"] == {"requests": {"compute": "300", "memory": "8486Mi"}}
    assert exactly["selectors"] == [
        {"cel": {"expression": dra.uuids_selector(["GPU-h100-0-00"])}},
        {"cel": {"expression": dra.model_selector([H100])}},
    ]
    sync = sidecar.sidecar.sync
    hold = sync.hold_of(uid)
    assert hold is not None and (hold.grant.node, hold.grant.gpus) == ("h100-0", (0,))
    # the planned node nominated before the gate went: kube-scheduler filters it first
    assert server.api.get("pods", "train", NAMESPACE)["status"]["nominatedNodeName"] == "h100-0"
    # kube-scheduler allocates it where it is pinned and binds the pod
    allocate(server, claim, "h100-0", "gpu-0", compute="300", memory="8486Mi")
    server.api.patch(
        "resource.k8s.io/resourceclaims",
        claim,
        {"status": {"reservedFor": [{"resource": "pods", "name": "train", "uid": uid}]}},
        NAMESPACE,
        subresource="status",
    )
    server.api.bind(NAMESPACE, "train", "h100-0")
    await eventually(lambda: (g := sync.ledger.get(uid)) is not None and g.node == "h100-0")
    grant = sync.ledger.get(uid)
    assert grant is not None
    assert (grant.gpus, grant.milli, grant.memory_mib) == ((0,), 300, 8192)
    await eventually(lambda: grant_state(sidecar, uid) is GrantState.CONFIRMED)
    await eventually(lambda: bool(reasons(server, "train")))
    assert reasons(server, "train") >= {"GpuClaimCreated", "GpusAssigned"}
    assigned = message(server, "train", "GpusAssigned")
    assert assigned == (
        f"kube-scheduler's DRA allocator gave it GPU 0 of node h100-0 (30%, 8486 MiB each, its "
        f"MPS memory limit) through ResourceClaim {NAMESPACE}/{claim}"
    )
    # the extender, asked about that node for a share that would not fit beside it, says no
    other = objects.pod("other", NAMESPACE, percent=80)
    other["metadata"]["uid"] = "uid-other"
    verdict = await sidecar.filter(other, ["h100-0"])
    assert "h100-0" in verdict["NodeNames"]  # gpu-1 is free
    whole = objects.pod("whole", NAMESPACE, percent=100, count=2)
    whole["metadata"]["uid"] = "uid-whole"
    verdict = await sidecar.filter(whole, ["h100-0"])
    assert verdict["NodeNames"] == []  # gpu-0 is the claim's
    # explain tells the DRA pod by its claim, against the DRA nodes only
    record = sync.pods[uid]
    told = explaining.explain(
        sync, PolicyHolder(sync, "default", refresh_seconds=0.0), record, claims=(claim,)
    )
    assert told.headline[0] == (
        f"Running on GPU 0 of node h100-0 (30%, 8486 MiB each: its MPS memory limit, the CUDA "
        f"context inside) through its ResourceClaim {NAMESPACE}/{claim}, allocated by "
        "kube-scheduler's DRA allocator on the GPUs gpuplace's engine planned (the claim "
        "pinned to them)."
    )
    assert sync.hold_of(uid) is None  # the claim's allocation took the plan's place
    assert [row.node for row in told.rows] == ["h100-0"]
    # the claim goes (the garbage collector, once the pod is deleted): its GPU is free again
    server.api.delete("pods", "train", NAMESPACE)
    server.api.patch(
        "resource.k8s.io/resourceclaims", claim, {"metadata": {"finalizers": None}}, NAMESPACE
    )
    server.api.delete("resource.k8s.io/resourceclaims", claim, NAMESPACE)
    await eventually(lambda: sync.ledger.get(uid) is None)
    assert (
        sidecar.sidecar.registry.get_sample_value(
            "gpuplace_dra_claims_total", {"result": "created"}
        )
        == 1
    )


def grant_state(sidecar: Harness, uid: str) -> GrantState | None:
    grant = sidecar.sidecar.sync.ledger.get(uid)
    return grant.state if grant is not None else None


def events(server: localapi.Server, pod: str) -> list[dict[str, Any]]:
    return [
        event
        for event in server.api.objects("events", NAMESPACE)
        if event["involvedObject"]["name"] == pod
    ]


def reasons(server: localapi.Server, pod: str) -> set[str]:
    return {str(event["reason"]) for event in events(server, pod)}


def message(server: localapi.Server, pod: str, reason: str) -> str:
    return next(str(e["message"]) for e in events(server, pod) if e["reason"] == reason)


async def test_a_pod_another_component_gates_gets_its_claim_once_that_gate_goes(
    server: localapi.Server, sidecar: Harness
) -> None:
    """A batch system's gate before ours: no claim and no hold while it is on (the plan is
    made when the pod can run), then the claim, pinned, and our gate gone; theirs first."""
    body = webhook_pod("batch", {keys.GPU_PERCENT: "50", keys.GPU_MODEL: H100}, dra_node())
    body["spec"]["schedulingGates"].insert(0, {"name": "kueue.x-k8s.io/admission"})
    claim = dra_claims.named(body)
    uid = server.api.create(body)["metadata"]["uid"]
    sync = sidecar.sidecar.sync
    await eventually(lambda: sync.pods.get(uid) is not None)
    # rounds run on every pod change; give several the chance to (wrongly) plan it
    other = webhook_pod("free", {keys.GPU_PERCENT: "50", keys.GPU_MODEL: H100}, dra_node())
    server.api.create(other)
    await eventually(lambda: not server.api.get("pods", "free", NAMESPACE)["spec"].get(
        "schedulingGates"
    ))  # fmt: skip
    assert sync.hold_of(uid) is None
    with pytest.raises(ApiStatusError):
        server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)
    gates = server.api.get("pods", "batch", NAMESPACE)["spec"]["schedulingGates"]
    assert [gate["name"] for gate in gates] == ["kueue.x-k8s.io/admission", keys.DRA_GATE]
    server.api.patch(
        "pods", "batch", {"spec": {"schedulingGates": [{"name": keys.DRA_GATE}]}}, NAMESPACE
    )
    await eventually(lambda: not server.api.get("pods", "batch", NAMESPACE)["spec"].get(
        "schedulingGates"
    ))  # fmt: skip
    stored = server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)
    assert keys.CLAIM_PINNED in stored["metadata"]["annotations"]
    hold = sync.hold_of(uid)
    assert hold is not None and hold.grant.node == "h100-0"


async def test_a_refused_nomination_still_releases_the_pod(
    server: localapi.Server, sidecar: Harness
) -> None:
    """The nomination only spares kube-scheduler a search: when the API refuses it (an
    RBAC without pods/status), the pod is released all the same, its claim pinned."""
    server.api.fail("PATCH", "/pods/nominee/status$", 403, times=50)
    _, uid, first = await released_half_share(server, "nominee")
    assert keys.CLAIM_PINNED in first["metadata"]["annotations"]
    pod = server.api.get("pods", "nominee", NAMESPACE)
    assert not (pod.get("status") or {}).get("nominatedNodeName")
    hold = sidecar.sidecar.sync.hold_of(uid)
    assert hold is not None and hold.grant.node == "h100-0"


async def test_a_claim_of_that_name_owned_by_another_is_never_taken(
    server: localapi.Server, sidecar: Harness
) -> None:
    body = webhook_pod("late", {keys.GPU_PERCENT: "30", keys.GPU_MODEL: H100}, dra_node())
    claim = dra_claims.named(body)
    server.api.create(
        {
            "apiVersion": dra.API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {"name": claim, "namespace": NAMESPACE},
            "spec": {"devices": {"requests": []}},
        }
    )
    server.api.create(body)
    await eventually(lambda: "GpuClaimBlocked" in reasons(server, "late"))
    assert "exists and is not this pod's" in message(server, "late", "GpuClaimBlocked")
    gates = server.api.get("pods", "late", NAMESPACE)["spec"]["schedulingGates"]
    assert gates == [{"name": keys.DRA_GATE}]  # it stays gated: nothing runs on a stranger's claim
    blocked = sidecar.sidecar.registry.get_sample_value(
        "gpuplace_dra_claims_total", {"result": "blocked"}
    )
    assert blocked is not None and blocked >= 1


async def test_a_claim_created_before_a_restart_is_found_not_made_again(
    server: localapi.Server, sidecar: Harness
) -> None:
    body = webhook_pod("again", {keys.GPU_PERCENT: "50", keys.GPU_MODEL: H100}, dra_node())
    claim = dra_claims.named(body)
    server.api.fail("POST", "/resourceclaims$", 500)  # the first creation fails: a round retries
    created = server.api.create(body)
    await eventually(
        lambda: not server.api.get("pods", "again", NAMESPACE)["spec"].get("schedulingGates"),
        timeout=15.0,
    )
    owner = server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)["metadata"][
        "ownerReferences"
    ]
    assert owner[0]["uid"] == created["metadata"]["uid"]


async def test_without_the_dra_component_the_sidecar_says_what_rbac_it_lacks() -> None:
    api = localapi.FakeApi(bookmark_interval=0.2, access=localapi.Access.shipped())
    async with (
        localapi.serve(api) as server,
        harness(server, dra_claims="fallback", scheduler_lease="") as running,
    ):
        await eventually(lambda: "resourceclaims" in str(running.sidecar.not_ready_reason()))
        assert "check its RBAC" in str(running.sidecar.not_ready_reason())


def test_the_controller_keeps_dra_pods_only() -> None:
    body = webhook_pod("p", {keys.GPU_PERCENT: "30"}, dra_node())
    assert copy.deepcopy(body)["spec"]["schedulingGates"] == [{"name": keys.DRA_GATE}]
    assert claims_controller.RESULTS == (
        "created",
        "existing",
        "blocked",
        "refused",
        "replanned",
        "remade",
    )


async def test_a_pin_kube_scheduler_refuses_with_room_is_made_again_once(
    server: localapi.Server, sidecar: Harness
) -> None:
    """kube-scheduler refuses a pinned claim though its GPU has room (seen once in a
    600-pod burst on v1.36.2; it would try the pod again only after 5 minutes): once the
    refusal has lasted `remake_seconds` and the engine still chooses that GPU, the claim
    is made again on it, so that kube-scheduler requeues the pod, and only once however
    long the pod stays unschedulable (a reason the engine does not see must not remake it
    every round)."""
    controller = sidecar.sidecar.claims
    assert controller is not None
    controller.settings = dataclasses.replace(controller.settings, remake_seconds=0.3)
    claim, uid, first = await released_half_share(server, "refused")
    pin = first["metadata"]["annotations"][keys.CLAIM_PINNED]
    sync = sidecar.sidecar.sync
    unschedulable(server, "refused")
    await eventually(lambda: sync.pods[uid].unschedulable)

    def uid_now() -> str | None:
        stored = server.api.objects("resource.k8s.io/resourceclaims", NAMESPACE)
        again = [c for c in stored if c["metadata"]["name"] == claim]
        return str(again[0]["metadata"]["uid"]) if again else None

    await eventually(lambda: uid_now() not in (None, first["metadata"]["uid"]), timeout=15.0)
    second = server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)
    assert second["metadata"]["annotations"][keys.CLAIM_PINNED] == pin  # the same GPU
    sample = sidecar.sidecar.registry.get_sample_value
    assert sample("gpuplace_dra_claims_total", {"result": "remade"}) == 1
    assert sample("gpuplace_dra_claims_total", {"result": "replanned"}) == 0
    await eventually(lambda: "GpuClaimReplanned" in reasons(server, "refused"))
    assert "have room in its ledger" in message(server, "refused", "GpuClaimReplanned")
    # still unschedulable: rounds go by, well past remake_seconds, and the claim stays
    await eventually(lambda: sync.claim(NAMESPACE, claim) is not None)
    for poke in ("1", "2", "3"):  # a pod change wakes a round
        seen = controller.rounds
        await asyncio.sleep(0.4)
        labels = {"metadata": {"labels": {"poke": poke}}}
        server.api.patch("pods", "refused", labels, NAMESPACE)
        await eventually(lambda: controller.rounds > seen, timeout=10.0)  # noqa: B023
    assert uid_now() == second["metadata"]["uid"]
    assert sample("gpuplace_dra_claims_total", {"result": "remade"}) == 1


async def released_half_share(
    server: localapi.Server, name: str
) -> tuple[str, str, dict[str, Any]]:
    """A 50 % H100 share on the DRA path, created and released by the claim controller:
    its claim's name, the pod's UID, its claim as first made."""
    body = webhook_pod(name, {keys.GPU_PERCENT: "50", keys.GPU_MODEL: H100}, dra_node())
    claim = dra_claims.named(body)
    uid = str(server.api.create(body)["metadata"]["uid"])
    await eventually(lambda: not server.api.get("pods", name, NAMESPACE)["spec"].get(
        "schedulingGates"
    ))  # fmt: skip
    return claim, uid, server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)


def unschedulable(server: localapi.Server, pod: str) -> None:
    """What kube-scheduler writes when no node fits (its DRA plugin: the pinned GPU is full)."""
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    server.api.patch(
        "pods", pod, {"status": {"conditions": [condition]}}, NAMESPACE, subresource="status"
    )


def users_claim(name: str) -> dict[str, Any]:
    """A ResourceClaim a user wrote against gpuplace's DeviceClass: one whole GPU."""
    return {
        "apiVersion": dra.API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "devices": {
                "requests": [
                    {"name": dra_claims.REQUEST, "exactly": {"deviceClassName": dra.DRIVER}}
                ]
            }
        },
    }


async def test_a_pinned_claim_whose_gpu_is_taken_meanwhile_is_planned_anew(
    server: localapi.Server, sidecar: Harness
) -> None:
    """A 50 % share is planned on gpu-0 and its claim pinned there; before kube-scheduler
    allocates it, a user's own claim takes all of gpu-0 (first fit: the engine never saw
    it coming) and kube-scheduler finds no node for the pod. The controller plans again
    (gpu-1 has room), deletes the claim and makes it pinned to gpu-1: the pod is never
    left pending with room in the cluster. The user's claim is served (first fit) and
    explain says so."""
    sync = sidecar.sidecar.sync
    claim, uid, first = await released_half_share(server, "racer")
    assert first["metadata"]["annotations"] == {keys.CLAIM_PINNED: "GPU-h100-0-00"}
    server.api.create(users_claim("mine"))
    allocate(server, "mine", "h100-0", "gpu-0", compute="1k", memory="80960Mi")
    await eventually(lambda: (c := sync.claim(NAMESPACE, "mine")) is not None and bool(c.held))
    unschedulable(server, "racer")

    def repinned() -> bool:
        stored = server.api.objects("resource.k8s.io/resourceclaims", NAMESPACE)
        again = [c for c in stored if c["metadata"]["name"] == claim]
        return bool(again) and again[0]["metadata"]["uid"] != first["metadata"]["uid"]

    await eventually(repinned, timeout=15.0)
    second = server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)
    assert second["metadata"]["annotations"] == {keys.CLAIM_PINNED: "GPU-h100-0-01"}
    assert second["metadata"]["ownerReferences"][0]["uid"] == uid
    await eventually(lambda: "GpuClaimReplanned" in reasons(server, "racer"))
    assert "taken meanwhile" in message(server, "racer", "GpuClaimReplanned")
    sample = sidecar.sidecar.registry.get_sample_value
    assert sample("gpuplace_dra_claims_total", {"result": "replanned"}) == 1
    hold = sync.hold_of(uid)
    assert hold is not None and hold.grant.gpus == (1,)
    # the same word again (kube-scheduler's condition is older than the new claim) and the
    # same plan: the claim stays
    await eventually(lambda: sync.claim(NAMESPACE, claim) is not None)
    controller = sidecar.sidecar.claims
    assert controller is not None
    await eventually(lambda: sync.pods[uid].unschedulable)
    seen = controller.rounds
    await eventually(lambda: controller.rounds >= seen + 2)
    assert sample("gpuplace_dra_claims_total", {"result": "replanned"}) == 1
    # explain: the pinned claim waits; the user's own claim was kube-scheduler's first fit
    told = explaining.explain(
        sync, PolicyHolder(sync, "default", refresh_seconds=0.0), sync.pods[uid], claims=(claim,)
    )
    assert "pinned to the GPU gpuplace planned (GPU-h100-0-01)" in told.headline[0]
    users = explaining.claims_lines(sync, NAMESPACE, ["mine"])
    assert users == [
        "Holds GPU 0 of node h100-0 (whole, 80960 MiB each) through ResourceClaim "
        f"{NAMESPACE}/mine (DRA: kube-scheduler's first fit over the DRA nodes' devices; the "
        "pod's own claim, which gpuplace's engine does not plan), counted in gpuplace's "
        "ledger."
    ]
    server.api.create(users_claim("later"))
    await eventually(lambda: sync.claim(NAMESPACE, "later") is not None)
    assert explaining.claims_lines(sync, NAMESPACE, ["later"]) == [
        f"Its own ResourceClaim {NAMESPACE}/later waits for kube-scheduler's DRA allocator, "
        "which takes the first device that fits (gpuplace's engine does not plan a claim a "
        "user writes; the gpuplace.io annotations do)."
    ]
