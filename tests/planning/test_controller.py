"""The planner against a fake API server and the real sidecar: plan, then pin.

Every pod behind the gate `gpuplace.io/place` is planned by the engine (the extender's
filter's own choice), handed its node (kube-scheduler's nominated node, or its affinity
pinned) and released; a plan gone stale is planned again, before its write or at filter;
no pod is ever held to a node it cannot use."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

import pytest

from gpuplace.cluster import assignments, keys, kube
from gpuplace.cluster.node_affinity import NAME_FIELD, NodeAffinity
from gpuplace.cluster.syncing import PLANNED
from gpuplace.dev import localapi
from gpuplace.placement.ledger import Grant
from tests.cluster.conftest import eventually
from tests.extender.conftest import Unschedulable
from tests.planning import rig as rigs
from tests.planning.rig import nodes, rig, share

pytestmark = pytest.mark.asyncio


def nominated(pod: dict[str, Any]) -> str | None:
    return (pod.get("status") or {}).get("nominatedNodeName")


def gpus(pod: dict[str, Any]) -> tuple[str, str]:
    annotations = pod["metadata"]["annotations"]
    return pod["spec"]["nodeName"], annotations[keys.ASSIGNED_GPUS]


async def cluster(r: rigs.Rig, count: int, gpus: int = 2) -> None:
    nodes(r.api, count, gpus=gpus)
    await r.h.synced(lambda: len(r.h.sidecar.sync.ledger.inventory) == count)


async def share_beside_a_running_one(r: rigs.Rig, count: int) -> tuple[str, dict[str, Any]]:
    """`count` nodes; a 25% share bound through the extender, then a second one behind the
    planner's gate: the node of the first, and the second as the planner released it."""
    await cluster(r, count)
    r.create(share("first", gates=()))
    first = await r.schedule("first")
    r.create(share("second"))
    return first, await r.released("second")


async def test_a_gated_pod_is_planned_nominated_and_bound_on_the_planned_gpu(
    server: localapi.Server,
) -> None:
    async with rig(server) as r:
        first, released = await share_beside_a_running_one(r, 3)
        # the engine packs the second share onto the first one's GPU: that node is handed over
        assert nominated(released) == first
        hold = r.h.sidecar.sync.hold_of(released["metadata"]["uid"])
        assert hold is not None and hold.owner == PLANNED and hold.grant.node == first
        assert not released["spec"].get("affinity", {}).get("nodeAffinity")
        assert await r.schedule("second") == first
        bound = r.pod("second")
        assert gpus(bound) == gpus(r.pod("first"))
        assert r.releases("nominated") == 1
        assert r.h.sidecar.sync.hold_of(released["metadata"]["uid"]) is None  # bound: confirmed


async def test_the_plan_is_the_choice_the_extenders_filter_makes(
    server: localapi.Server,
) -> None:
    """A sequence of shares and whole GPUs: each pod's planned node is one the extender's
    filter passes for it on the same ledger (the policy's best)."""
    rng = random.Random(3)
    async with rig(server) as r:
        await cluster(r, 4, gpus=4)
        names = [f"gpu-{i}" for i in range(4)]
        for index in range(14):
            count = rng.choice([None, None, None, 1, 2])
            percent = rng.choice([10, 25, 30, 50, 70])
            probe = share(f"probe-{index}", percent, gates=(), count=count)
            probe["metadata"]["uid"] = f"probe-{index}"
            best = set((await r.h.filter(probe, names))["NodeNames"])
            name = f"pod-{index}"
            r.create(share(name, percent, count=count))
            released = await r.released(name)
            assert nominated(released) in best, (index, nominated(released), best)
            assert await r.schedule(name) == nominated(released)
        assert r.releases("nominated") == 14


async def test_a_node_kube_scheduler_refuses_is_planned_again_at_filter(
    server: localapi.Server,
) -> None:
    """The nominated node fails kube-scheduler's own filters (something the engine does not
    see filled it): kube-scheduler offers every other node, and the extender's filter drops
    the plan and chooses among them: the pod is bound, never held to that node."""
    async with rig(server) as r:
        first, released = await share_beside_a_running_one(r, 2)
        assert nominated(released) == first
        rigs.refused.add(first)
        other = await r.schedule("second")
        assert other != first
        stale = r.h.sidecar.registry.get_sample_value("gpuplace_extender_stale_plans_total")
        assert stale == 1
        grant = r.h.sidecar.sync.ledger.get(released["metadata"]["uid"])
        assert grant is not None and grant.node == other


async def test_a_plan_gone_stale_before_its_write_writes_nothing_and_is_planned_again(
    server: localapi.Server,
) -> None:
    """Between the plan and its write a grant the planner did not make lands on the planned
    GPU (another writer's, seen by the informer): the write hands nothing over, and the
    next round plans the pod where there is room."""
    async with rig(server) as r:
        await cluster(r, 1, gpus=2)
        r.create(share("first", 60, gates=()))
        await r.schedule("first")
        used = gpus(r.pod("first"))[1]
        api = r.controller.writer.api
        original = api.patch_pod_status
        calls = 0

        async def conflict_once(namespace: str, name: str, patch: Any) -> dict[str, Any]:
            nonlocal calls
            calls += 1
            if calls == 1:
                # another writer takes the planned GPU's last 60% (a pod bound with an
                # assignment there), and the pod changed meanwhile: 409
                foreign = share("foreign", 60, gates=())
                foreign["metadata"]["annotations"].update(held_on(r, name, "gpu-0"))
                foreign["spec"]["nodeName"] = "gpu-0"
                r.create(foreign)
                await r.h.synced(lambda: r.h.sidecar.sync.pod("default", "foreign") is not None)
                raise kube.ApiError(409, "Conflict", "the object has been modified")
            return await original(namespace, name, patch)

        api.patch_pod_status = conflict_once  # type: ignore[method-assign]
        r.create(share("second", 30))
        released = await r.released("second")
        assert r.releases("stale") == 1
        # planned again: the one GPU with room left, not the one the foreign pod filled
        assert nominated(released) == "gpu-0"
        hold = r.h.sidecar.sync.hold_of(released["metadata"]["uid"])
        assert hold is not None and str(hold.grant.gpus[0]) != used
        assert not r.h.sidecar.sync.ledger.overcommitted(hold.grant)


def held_on(r: rigs.Rig, name: str, node: str) -> dict[str, str]:
    """Assignment annotations for the GPU the planner holds for pod `name` on `node`."""
    uid = r.pod(name)["metadata"]["uid"]
    hold = r.h.sidecar.sync.hold_of(uid)
    assert hold is not None and hold.grant.node == node
    foreign = Grant("foreign", node, hold.grant.gpus, 600, hold.grant.memory_mib)
    inventory = r.h.sidecar.sync.ledger.inventory
    return dict(assignments.annotations_for(foreign, inventory.get(node), datetime.now(UTC)))


async def test_a_pod_with_no_room_is_released_with_no_node(server: localapi.Server) -> None:
    async with rig(server) as r:
        await cluster(r, 1, gpus=1)
        r.create(share("whole", count=1, gates=()))
        await r.schedule("whole")
        r.create(share("late"))
        released = await r.released("late")
        assert nominated(released) is None
        assert r.releases("unplanned") == 1
        assert r.h.sidecar.sync.ledger.get(released["metadata"]["uid"]) is None
        with pytest.raises(Unschedulable):
            await r.schedule("late")


async def test_a_pod_waits_for_another_components_gate_first(server: localapi.Server) -> None:
    async with rig(server) as r:
        await cluster(r, 1)
        r.create(share("held", gates=("batch.example.com/admit", keys.PLACE_GATE)))
        await r.rounds(3)
        assert rigs.planner_gated(r.pod("held"))
        assert r.h.sidecar.sync.ledger.get(r.pod("held")["metadata"]["uid"]) is None
        r.api.patch(
            "pods", "held", {"spec": {"schedulingGates": [{"name": keys.PLACE_GATE}]}}, "default"
        )
        released = await r.released("held")
        assert nominated(released) == "gpu-0" and not released["spec"].get("schedulingGates")


async def test_higher_priority_is_planned_first(server: localapi.Server) -> None:
    """Two pods wait while another replica leads; once this one does, the one of higher
    priority gets the only GPU, the other is released with no node."""
    leads = [False]
    async with rig(server, active=lambda: leads[0]) as r:
        await cluster(r, 1, gpus=1)
        r.create(share("low", count=1, priority=10))
        r.create(share("high", count=1, priority=1000))
        await r.h.synced(lambda: len(r.controller.store.pods) == 2)
        await r.rounds(2)
        assert rigs.planner_gated(r.pod("low")) and rigs.planner_gated(r.pod("high"))
        leads[0] = True
        high, low = await r.released("high"), await r.released("low")
        assert nominated(high) == "gpu-0" and nominated(low) is None
        assert r.metric("gpuplace_plan_controller_leading") == 1


async def test_a_follower_releases_nothing(server: localapi.Server) -> None:
    async with rig(server, active=lambda: False) as r:
        await cluster(r, 1)
        r.create(share("waits"))
        await r.h.synced(lambda: len(r.controller.store.pods) == 1)
        await r.rounds(3)
        assert rigs.planner_gated(r.pod("waits"))
        assert r.metric("gpuplace_plan_pods_gated") == 1
        assert r.metric("gpuplace_plan_controller_leading") == 0


async def test_when_no_replica_can_tell_who_leads_pods_go_unplanned(
    server: localapi.Server,
) -> None:
    """The Lease read is refused (RBAC): nobody would plan, so the pods are released with
    no node (the extender's filter places them) and told why, once."""
    why = "gpuplace cannot read kube-scheduler's Lease gpuplace/gpuplace-scheduler (403)"
    async with rig(server, active=lambda: False, blocked=lambda: why) as r:
        await cluster(r, 1)
        r.create(share("flows"))
        released = await r.released("flows")
        assert nominated(released) is None and r.releases("unplanned") == 1
        assert await r.schedule("flows") == "gpu-0"
        recorder = r.h.sidecar.recorder
        assert recorder is not None
        await recorder.drain()
        found = [
            e for e in r.api.objects("events", "default") if e["reason"] == "PlanControllerBlocked"
        ]
        assert len(found) == 1 and found[0]["message"].startswith(why)


async def test_a_refused_hand_over_releases_with_no_node(server: localapi.Server) -> None:
    """pods/status patch forbidden (RBAC): the pod is released with no node rather than
    kept gated."""
    async with rig(server) as r:
        await cluster(r, 1)

        async def forbidden(namespace: str, name: str, patch: Any) -> dict[str, Any]:
            raise kube.ApiError(403, "Forbidden", "cannot patch resource pods/status")

        r.controller.writer.api.patch_pod_status = forbidden  # type: ignore[method-assign]
        r.create(share("refused"))
        released = await r.released("refused")
        assert nominated(released) is None
        assert (r.releases("failed"), r.releases("unplanned")) == (1, 1)
        assert r.h.sidecar.sync.ledger.get(released["metadata"]["uid"]) is None
        assert await r.schedule("refused") == "gpu-0"


async def test_the_affinity_pin_narrows_and_ungates_in_one_write(server: localapi.Server) -> None:
    async with rig(server, pin="affinity") as r:
        await cluster(r, 2)
        r.create(share("first", gates=()))
        first = await r.schedule("first")
        pod = share("second")
        pod["spec"]["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": keys.NODE_ENABLED, "operator": "In", "values": ["true"]}
                            ]
                        },
                        {
                            "matchExpressions": [
                                {"key": keys.GFD_COUNT, "operator": "Gt", "values": ["0"]}
                            ]
                        },
                    ]
                }
            }
        }
        before = len(r.api.calls_to("PATCH", "/pods/second"))
        r.create(pod)
        released = await r.released("second")
        assert len(r.api.calls_to("PATCH", "/pods/second")) - before == 1
        assert not r.api.calls_to("PATCH", "/pods/second/status")
        assert NodeAffinity.of(released).pinned_to() == first
        terms = released["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        pin = {"key": NAME_FIELD, "operator": "In", "values": [first]}
        assert all(term["matchFields"] == [pin] for term in terms)
        assert nominated(released) is None and r.releases("pinned") == 1
        assert await r.schedule("second") == first


async def test_after_a_restart_a_released_pod_binds_on_its_nominated_node(
    server: localapi.Server,
) -> None:
    """A crash loses the holds only: the nominated node is still tried first, and taken
    while it fits."""
    async with rig(server) as r:
        first, released = await share_beside_a_running_one(r, 3)
        r.h.sidecar.sync.unhold(released["metadata"]["uid"])  # as a restarted sidecar has it
        assert await r.schedule("second") == first
        await eventually(lambda: bool(r.pod("second")["spec"].get("nodeName")))
