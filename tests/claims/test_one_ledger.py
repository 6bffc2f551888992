"""Gangs, priority preemption and queue quota see pods on the DRA path (issue 42, point 4):
the real sidecar with `--dra-claims=fallback`, its claim controller, the gang and queue
controllers wired as the sidecar wires them, against the local API with the RBAC
deploy/overlays/self-managed-dra ships. kube-scheduler's DRA allocator is played by
`allocate` (what it writes), the garbage collector by deleting a deleted pod's claim."""

from __future__ import annotations

from typing import Any

from gpuplace.cluster import assignments, dra_claims, keys
from gpuplace.cluster.gang_marks import gated, plan_mark
from gpuplace.dev import localapi
from gpuplace.gangs.controller import GangSettings
from gpuplace.placement.requests import WHOLE
from gpuplace.queues import events
from tests.claims.test_controller import (
    H100,
    NAMESPACE,
    allocate,
    dra_node,
    plugin_node,
    unschedulable,
    users_claim,
    webhook_pod,
)
from tests.cluster.conftest import eventually
from tests.gangs import rig as gang_rig
from tests.queues import rig as queue_rig

WHOLE_H100 = {"compute": "1k", "memory": "80960Mi"}
"""What a whole GPU's allocation consumes of the slice's capacities (the H100 packs 80,960 MiB)."""
SETTINGS = GangSettings(poll_seconds=0.2, settle_seconds=0.005, preempt_retry_seconds=0.3)


def dra_pod(name: str, annotations: dict[str, str], *, priority: int = 0) -> dict[str, Any]:
    """A pod the webhook sent to the DRA node (an H100: only that node has one)."""
    body = webhook_pod(name, {keys.GPU_MODEL: H100, **annotations}, dra_node(), plugin_node())
    assert dra_claims.named(body), "the webhook sent it the device-plugin way"
    body["spec"]["priority"] = priority
    return body


def queued(body: dict[str, Any], queue: str) -> dict[str, Any]:
    """`body` queued as the webhook with GpuQueues leaves it (`tests.queues.rig.queued`):
    the queue annotation, label and gate beside the DRA gate."""
    body["metadata"]["annotations"][keys.QUEUE] = queue
    body["metadata"]["labels"][keys.QUEUE_LABEL] = queue
    body["spec"]["schedulingGates"].append({"name": keys.QUEUE_GATE})
    return body


def pod_of(server: localapi.Server, name: str) -> dict[str, Any]:
    found: dict[str, Any] = server.api.get("pods", name, NAMESPACE)
    return found


async def claimed(server: localapi.Server, name: str) -> str:
    """Until the claim controller made `name`'s claim and removed the DRA gate: the claim."""
    await eventually(lambda: not gated(pod_of(server, name), keys.DRA_GATE))
    claim = dra_claims.named(pod_of(server, name))
    assert server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)
    return claim


async def running_on(server: localapi.Server, name: str, device: str) -> str:
    """kube-scheduler's part for an ungated DRA pod of one whole GPU: allocate its claim on
    `device` of h100-0, bind, and the kubelet runs it. Its UID."""
    claim = await claimed(server, name)
    allocate(server, claim, "h100-0", device, **WHOLE_H100)
    server.api.bind(NAMESPACE, name, "h100-0")
    server.api.set_phase(NAMESPACE, name, "Running")
    return str(pod_of(server, name)["metadata"]["uid"])


def collect_garbage(server: localapi.Server) -> list[str]:
    """The kubelet removes terminating pods, the garbage collector their claims (and
    kube-scheduler's finalizer goes with the allocation): the pods removed."""
    gone = []
    for pod in server.api.objects("pods", NAMESPACE):
        if pod["metadata"].get("deletionTimestamp"):
            server.api.delete("pods", pod["metadata"]["name"], NAMESPACE)
            gone.append(pod["metadata"]["name"])
            claim = dra_claims.named(pod)
            if claim:
                server.api.delete("resource.k8s.io/resourceclaims", claim, NAMESPACE)
    return sorted(gone)


async def test_a_gang_of_dra_pods_preempts_lower_dra_pods_and_is_planned_on_the_dra_node(
    server: localapi.Server,
) -> None:
    """h100-0's two GPUs are held through the claims of two priority-0 DRA pods. A
    priority-100 gang of two one-GPU DRA members: the gang controller finds room only by
    evicting both (their grants are the claims, in the one ledger), plans both members on
    h100-0 (never a100-0: their affinity says DRA), pins them there and ungates them
    together; only then are their claims made, each pinned to its planned GPU."""
    async with gang_rig.rig(
        server, settings=SETTINGS, dra_claims="fallback", scheduler_lease=""
    ) as r:
        sync = r.h.sidecar.sync
        uids = []
        for i in range(2):
            server.api.create(dra_pod(f"low{i}", {keys.GPU_COUNT: "1"}))
            uids.append(await running_on(server, f"low{i}", f"gpu-{i}"))
        await eventually(lambda: all(sync.ledger.get(uid) is not None for uid in uids))
        state = sync.ledger.state("h100-0")
        assert state is not None and state.free_milli == [0, 0]
        gang = {keys.GANG_NAME: "train", keys.GANG_SIZE: "2", keys.GPU_COUNT: "1"}
        for i in range(2):
            member = dra_pod(f"w{i}", gang, priority=100)
            assert set(g["name"] for g in member["spec"]["schedulingGates"]) == {
                keys.GANG_GATE,
                keys.DRA_GATE,
            }
            server.api.create(member)
        # no claim while the gang gate holds them: it is made on the gang's plan
        for i in range(2):
            assert gated(pod_of(server, f"w{i}"), keys.DRA_GATE)
            assert dra_claims.named(pod_of(server, f"w{i}")) not in claim_names(server)
        await eventually(lambda: sorted(victims(server)) == ["low0", "low1"], timeout=15)
        freed = await gang_rig.events(r, "GpuPreempted")
        assert freed == [] or all("for gang" in message for message in freed)
        assert collect_garbage(server) == ["low0", "low1"]
        await eventually(lambda: all(sync.ledger.get(uid) is None for uid in uids))
        await eventually(
            lambda: not any(gated(pod_of(server, f"w{i}"), keys.GANG_GATE) for i in range(2)),
            timeout=15,
        )
        members = [pod_of(server, f"w{i}") for i in range(2)]
        marks = [plan_mark(pod) for pod in members]
        assert all(mark is not None and mark.node == "h100-0" for mark in marks), marks
        planned = [assignments.grant_of(pod) for pod in members]
        assert sorted(gpu for grant in planned if grant is not None for gpu in grant.gpus) == [0, 1]
        for i, grant in enumerate(planned):
            assert grant is not None
            claim = await claimed(server, f"w{i}")
            stored = server.api.get("resource.k8s.io/resourceclaims", claim, NAMESPACE)
            # pinned to the GPU the gang's plan chose for that member
            assert stored["metadata"]["annotations"] == {
                keys.CLAIM_PINNED: f"GPU-h100-0-{grant.gpus[0]:02d}"
            }
        for pod in members:
            terms = pod["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]["nodeSelectorTerms"]
            assert all(
                {"key": keys.NODE_DRA, "operator": "In", "values": ["true"]}
                in term["matchExpressions"]
                for term in terms
            ), terms


def claim_names(server: localapi.Server) -> set[str]:
    return {c["metadata"]["name"] for c in server.api.objects("resource.k8s.io/resourceclaims")}


def victims(server: localapi.Server) -> list[str]:
    """Pods the sidecar asked the API to evict."""
    return [
        call.path.split("/")[-2]
        for call in server.api.calls_to("POST", r"/pods/[^/]+/eviction$")
        if call.user == "system:serviceaccount:gpuplace:gpuplace"
    ]


async def test_a_queue_counts_its_dra_pods_against_its_quota_and_admits_them_to_the_dra_node(
    server: localapi.Server,
) -> None:
    """A queue of one GPU for team-a: its first DRA pod (a whole H100) is admitted onto the
    DRA node (its plan on h100-0, its claim made), the second waits for quota though
    h100-0 still has a free GPU; the first one's claim gone, the second is admitted."""
    queue_rig.namespace(server.api, NAMESPACE, team="a")
    server.api.create(queue_rig.gpuqueue("team-a", "1"))
    async with queue_rig.rig(server, dra_claims="fallback", scheduler_lease="") as r:
        sync = r.h.sidecar.sync
        for name in ("q0", "q1"):
            server.api.create(queued(dra_pod(name, {keys.GPU_COUNT: "1"}), "team-a"))
        await eventually(lambda: not gated(pod_of(server, "q0"), keys.QUEUE_GATE), timeout=15)
        assert planned_node(pod_of(server, "q0")) == "h100-0"
        uid = await running_on(server, "q0", "gpu-0")
        await eventually(lambda: (g := sync.ledger.get(uid)) is not None and g.milli == WHOLE)
        assert gated(pod_of(server, "q1"), keys.QUEUE_GATE)
        await eventually(lambda: bool(waiting(server, "q1")), timeout=15)
        assert any("quota" in message for message in waiting(server, "q1")), waiting(server, "q1")
        # gpu-1 of the DRA node was free all along: the quota held q1, counting q0's claim
        state = sync.ledger.state("h100-0")
        assert state is not None and state.free_milli == [0, WHOLE]
        sample = r.h.sidecar.registry.get_sample_value  # the sidecar's /metrics count them
        assert sample("gpuplace_ledger_allocated_milligpus") == WHOLE  # q0's claim
        # q0's last gate goes in the informer's next event, which may come after the claim's
        await eventually(lambda: sample("gpuplace_pending_pods", {"reason": "gated"}) == 1)
        assert gated(pod_of(server, "q1"), keys.QUEUE_GATE)
        claim = dra_claims.named(pod_of(server, "q0"))
        server.api.delete("pods", "q0", NAMESPACE)
        server.api.delete("resource.k8s.io/resourceclaims", claim, NAMESPACE)
        await eventually(lambda: not gated(pod_of(server, "q1"), keys.QUEUE_GATE), timeout=15)
        assert planned_node(pod_of(server, "q1")) == "h100-0"


def planned_node(pod: dict[str, Any]) -> str:
    """The node a queue's admission planned `pod` on (its assignment annotations)."""
    grant = assignments.grant_of(pod)
    return grant.node if grant is not None else ""


def waiting(server: localapi.Server, pod: str) -> list[str]:
    """The messages of `pod`'s QueueWaiting Events."""
    return [
        str(event["message"])
        for event in server.api.objects("events", NAMESPACE)
        if event["involvedObject"]["name"] == pod and event["reason"] == events.WAITING
    ]


async def test_a_gang_members_pin_taken_meanwhile_moves_to_free_gpus_of_its_planned_node(
    server: localapi.Server,
) -> None:
    """A gang of two 50 % DRA members is planned on h100-0 and their claims pinned there;
    a user's claim then takes the whole GPU member w0 was pinned to (first fit: the engine
    never saw it coming) and kube-scheduler finds no node for w0. Its affinity names
    h100-0 for good, so the engine chooses again among h100-0's GPUs only: the claim is
    made again on the other GPU, and w0 is not left pending with room on its node."""
    async with gang_rig.rig(
        server, settings=SETTINGS, dra_claims="fallback", scheduler_lease=""
    ) as r:
        sync = r.h.sidecar.sync
        gang = {keys.GANG_NAME: "pair", keys.GANG_SIZE: "2", keys.GPU_PERCENT: "50"}
        for i in range(2):
            server.api.create(dra_pod(f"w{i}", gang))
        claims = [await claimed(server, f"w{i}") for i in range(2)]
        first = server.api.get("resource.k8s.io/resourceclaims", claims[0], NAMESPACE)
        pin = first["metadata"]["annotations"][keys.CLAIM_PINNED]
        taken = int(pin.rsplit("-", 1)[1])
        grant = assignments.grant_of(pod_of(server, "w0"))
        assert grant is not None and grant.node == "h100-0" and grant.gpus == (taken,)
        server.api.create(users_claim("mine"))
        allocate(server, "mine", "h100-0", f"gpu-{taken}", **WHOLE_H100)
        await eventually(lambda: (c := sync.claim(NAMESPACE, "mine")) is not None and bool(c.held))
        unschedulable(server, "w0")

        def repinned() -> str | None:
            stored = server.api.objects("resource.k8s.io/resourceclaims", NAMESPACE)
            again = [c for c in stored if c["metadata"]["name"] == claims[0]]
            if not again or again[0]["metadata"]["uid"] == first["metadata"]["uid"]:
                return None
            return str(again[0]["metadata"]["annotations"][keys.CLAIM_PINNED])

        await eventually(lambda: repinned() is not None, timeout=15.0)
        assert repinned() == f"GPU-h100-0-{1 - taken:02d}"
        told = [
            event["message"]
            for event in server.api.objects("events", NAMESPACE)
            if event.get("reason") == "GpuClaimReplanned"
        ]
        assert any("other GPUs of the node its plan chose" in message for message in told), told
        # the gang's plan is not touched: its node and the member's affinity stay
        mark = plan_mark(pod_of(server, "w0"))
        assert mark is not None and mark.node == "h100-0"
