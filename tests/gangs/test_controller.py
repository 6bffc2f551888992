"""The gang controller against the fake API server, beside the real extender verbs."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from gpuplace.cluster import assignments, keys
from gpuplace.cluster.gang_marks import PlanMark, gated, plan_mark
from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.controllers import pinning
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.gangs.controller import GangSettings
from gpuplace.placement.ledger import Grant
from tests.gangs.rig import (
    check_grants,
    check_plans,
    condition,
    events,
    member,
    nodes,
    other,
    rig,
)


async def test_a_complete_gang_is_planned_narrowed_and_ungated_together(
    server: localapi.Server,
) -> None:
    nodes(server.api, 3)
    async with rig(server) as r:
        for i in range(4):
            r.api.create(member(f"w{i}", "train", 4, count=2))
        await r.quiet()
        pods = r.gang_pods("train")
        assert not any(gated(pod) for pod in pods)
        marks = [plan_mark(pod) for pod in pods]
        assert all(mark is not None for mark in marks)
        assert len({mark.id for mark in marks if mark is not None}) == 1
        # two 2-GPU members per 4-GPU node: the gang spans 2 nodes, not 3
        assert len({mark.node for mark in marks if mark is not None}) == 2
        for pod in pods:
            mark = plan_mark(pod)
            assert mark is not None
            assert NodeAffinity.of(pod).pinned_to() == mark.node
            assert pod["metadata"]["annotations"][keys.ASSIGNED_NODE] == mark.node
        # every affinity change obeyed the gated-pod rules, and no gate was removed
        # before every member was annotated and narrowed
        calls = r.api.calls_to("PATCH", r"/namespaces/default/pods/w\d$")
        ungates = [
            i for i, c in enumerate(calls) if "schedulingGates" in (c.body.get("spec") or {})
        ]
        writes = [
            i
            for i, c in enumerate(calls)
            if keys.GANG_PLAN in ((c.body.get("metadata") or {}).get("annotations") or {})
            or "affinity" in (c.body.get("spec") or {})
        ]
        assert len(ungates) == 4 and max(writes) < min(ungates)
        for call in calls:
            affinity = (call.body.get("spec") or {}).get("affinity")
            if affinity is not None:
                original = member("x", "train", 4)["spec"].get("affinity")
                assert pinning.narrows(original, affinity) is None
        # kube-scheduler then binds each member to its planned node through the extender
        assert await r.schedule_ungated() == []
        for pod in r.gang_pods("train"):
            mark = plan_mark(pod)
            assert mark is not None and pod["spec"]["nodeName"] == mark.node
        check_grants(r.api.objects("nodes"), r.pods_everywhere())
        assert r.metric("gpuplace_gang_placements_total") == 1
        assert (await events(r)).count("GangPlaced") == 4


async def test_an_incomplete_gang_waits_holding_nothing(server: localapi.Server) -> None:
    nodes(server.api, 2)
    async with rig(server) as r:
        for i in range(3):
            r.api.create(member(f"w{i}", "train", 4, count=1))
        await r.quiet()
        assert all(gated(pod) and plan_mark(pod) is None for pod in r.gang_pods("train"))
        assert len(r.h.sidecar.sync.ledger) == 0
        assert r.metric("gpuplace_gangs_waiting") == 1
        assert "3 of 4 exist" in " ".join(await events(r, "GangIncomplete"))
        r.api.create(member("w3", "train", 4, count=1))
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("train"))
        assert r.metric("gpuplace_gangs_waiting") == 0
        check_plans(r.pods_everywhere())


async def test_a_member_deleted_before_the_start_leaves_the_rest_waiting(
    server: localapi.Server,
) -> None:
    nodes(server.api, 2)
    async with rig(server) as r:
        for i in range(3):
            r.api.create(member(f"w{i}", "train", 4, count=1))
        await r.quiet()
        r.api.delete("pods", "w1", "default")
        r.api.create(member("w3", "train", 4, count=1))
        await r.quiet()
        assert all(gated(pod) for pod in r.gang_pods("train"))
        r.api.create(member("w4", "train", 4, count=1))
        await r.quiet()
        assert len(r.gang_pods("train")) == 4
        assert not any(gated(pod) for pod in r.gang_pods("train"))


async def test_a_member_beyond_the_gang_size_stays_gated_with_an_event(
    server: localapi.Server,
) -> None:
    nodes(server.api, 2)
    async with rig(server) as r:
        for i in range(5):
            r.api.create(member(f"w{i}", "train", 4, count=1))
        await r.quiet()
        pods = {pod["metadata"]["name"]: pod for pod in r.gang_pods("train")}
        ungated = sorted(name for name, pod in pods.items() if not gated(pod))
        assert len(ungated) == 4
        (extra,) = [name for name in pods if name not in ungated]
        assert plan_mark(pods[extra]) is None
        assert any("already has its 4 members" in m for m in await events(r, "GangFull"))
        check_plans(r.pods_everywhere())


async def test_a_failed_plan_write_is_rolled_back_then_retried(server: localapi.Server) -> None:
    nodes(server.api, 2)
    async with rig(server) as r:
        r.api.fail("PATCH", r"/pods/w2$", 500, times=1)
        for i in range(4):
            r.api.create(member(f"w{i}", "train", 4, count=1))
        await r.quiet()
        assert r.metric("gpuplace_gang_rollbacks_total") >= 1
        pods = r.gang_pods("train")
        assert not any(gated(pod) for pod in pods)
        assert len({mark.id for mark in map(plan_mark, pods) if mark is not None}) == 1
        check_plans(r.pods_everywhere())
        check_grants(r.api.objects("nodes"), r.pods_everywhere())


async def test_two_gangs_that_fit_only_alone_never_both_hold_part(
    server: localapi.Server,
) -> None:
    nodes(server.api, 2)  # 8 GPUs
    async with rig(server) as r:
        for i in range(3):
            r.api.create(member(f"a{i}", "alpha", 3, count=2))
            r.api.create(member(f"b{i}", "beta", 3, count=2))
        await r.quiet()
        alpha = [gated(pod) for pod in r.gang_pods("alpha")]
        beta = [gated(pod) for pod in r.gang_pods("beta")]
        # exactly one gang started; the other holds nothing
        assert sorted([all(alpha), all(beta)]) == [False, True]
        assert not any(alpha) or not any(beta)
        waiting = "beta" if all(beta) else "alpha"
        assert all(plan_mark(pod) is None for pod in r.gang_pods(waiting))
        assert len(r.h.sidecar.sync.ledger) == 3
        started = "alpha" if waiting == "beta" else "beta"
        for pod in r.gang_pods(started):
            r.api.delete("pods", pod["metadata"]["name"], "default")
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods(waiting))
        check_plans(r.pods_everywhere())


async def test_higher_priority_gangs_go_first(server: localapi.Server) -> None:
    server.api.create(objects.node("gpu-0", gpus=4))
    # both gangs exist before the controller starts: one round sees them together
    for i in range(2):
        server.api.create(member(f"a{i}", "a-low", 2, count=2, priority=0))
        server.api.create(member(f"z{i}", "z-high", 2, count=2, priority=1000))
    async with rig(server) as r:
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("z-high"))
        assert all(gated(pod) for pod in r.gang_pods("a-low"))


async def test_older_gangs_go_first_at_equal_priority(server: localapi.Server) -> None:
    server.api.create(objects.node("gpu-0", gpus=4))
    for i in range(2):
        server.api.create(member(f"z{i}", "z-old", 2, count=2))
    await asyncio.sleep(1.1)  # creationTimestamp has whole seconds
    for i in range(2):
        server.api.create(member(f"a{i}", "a-new", 2, count=2))
    async with rig(server) as r:
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("z-old"))
        assert all(gated(pod) for pod in r.gang_pods("a-new"))


async def test_members_keep_to_their_own_node_constraints(server: localapi.Server) -> None:
    for i in range(3):
        server.api.create(objects.node(f"gpu-{i}", gpus=4, labels={"zone": f"z{i % 2}"}))
    async with rig(server) as r:
        for i in range(3):
            r.api.create(
                member(f"w{i}", "train", 3, count=2, extra={"nodeSelector": {"zone": "z1"}})
            )
        await r.quiet()
        # only gpu-1 is in z1 and it holds two members: the gang cannot fit
        assert all(gated(pod) for pod in r.gang_pods("train"))
        messages = await events(r, "GangUnschedulable")
        assert messages and "never fit" in messages[0]
        assert len(r.h.sidecar.sync.ledger) == 0


async def test_a_gang_that_times_out_says_why_holds_nothing_and_starts_when_room_frees(
    server: localapi.Server,
) -> None:
    nodes(server.api, 1, gpus=4)
    async with rig(server) as r:
        r.api.create(other("blocker", count=2))
        await r.quiet()
        assert await r.schedule_ungated() == []
        for i in range(2):
            r.api.create(member(f"w{i}", "train", 2, count=2, timeout="30s"))
        await r.quiet()
        assert all(condition(pod) is None for pod in r.gang_pods("train"))
        assert any("waiting for room" in m for m in await events(r, "GangWaiting"))
        r.clock.offset = 31.0
        await r.quiet()
        for pod in r.gang_pods("train"):
            found = condition(pod)
            assert found is not None and found["status"] == "False"
            assert found["reason"] == "GangUnschedulable"
            assert "1 of 2 gang members fit now" in found["message"]
            assert gated(pod) and plan_mark(pod) is None
        assert len(await events(r, "GangTimeout")) == 2
        assert r.metric("gpuplace_gang_timeouts_total", {"reason": "unplaceable"}) == 1
        held = {grant.pod_uid for grant in r.h.sidecar.sync.ledger}
        assert held == {r.api.get("pods", "blocker", "default")["metadata"]["uid"]}
        # capacity frees: the gang is tried again and starts; the condition turns True
        r.api.delete("pods", "blocker", "default")
        await r.quiet()
        for pod in r.gang_pods("train"):
            assert not gated(pod)
            found = condition(pod)
            assert found is not None and (found["status"], found["reason"]) == (
                "True",
                "GangPlaced",
            )
        # conditions written through pods/status kept the scheduler's own condition
        assert all(
            any(c["type"] == "PodScheduled" for c in pod["status"]["conditions"])
            for pod in r.gang_pods("train")
        )
        assert r.metric("gpuplace_gang_placements_total") == 1


async def test_an_incomplete_gang_times_out_with_its_own_reason(server: localapi.Server) -> None:
    nodes(server.api, 1)
    async with rig(server) as r:
        r.api.create(member("w0", "train", 3, count=1, timeout="1m"))
        await r.quiet()
        r.clock.offset = 61.0
        await r.quiet()
        found = condition(r.gang_pods("train")[0])
        assert found is not None and found["reason"] == "GangIncomplete"
        assert "only 1 of 3 members exist" in found["message"]
        assert r.metric("gpuplace_gang_timeouts_total", {"reason": "incomplete"}) == 1


def planned(
    name: str, gang: str, size: int, *, plan_id: str, node: str, gpus: tuple[int, ...]
) -> dict[str, Any]:
    """A member as a crashed controller left it: plan mark and assignment written."""
    pod = member(name, gang, size, count=len(gpus))
    grant = Grant(name, node, gpus, 1000, 0)
    written = assignments.annotations_for(grant, None, datetime.now(UTC))
    written[keys.GANG_PLAN] = PlanMark(plan_id, size, node).encode()
    pod["metadata"]["annotations"].update(written)
    return pod


def layout(size: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"gpu-{i // 2}", (2 * (i % 2), 2 * (i % 2) + 1)) for i in range(size)]


async def test_restart_finishes_a_fully_written_plan(server: localapi.Server) -> None:
    nodes(server.api, 2)
    for i, (node, gpus) in enumerate(layout(4)):
        server.api.create(planned(f"w{i}", "train", 4, plan_id="p1", node=node, gpus=gpus))
    async with rig(server) as r:
        await r.quiet()
        pods = r.gang_pods("train")
        assert not any(gated(pod) for pod in pods)
        assert {mark.id for mark in map(plan_mark, pods) if mark is not None} == {"p1"}
        for pod in pods:
            mark = plan_mark(pod)
            assert mark is not None
            assert NodeAffinity.of(pod).pinned_to() == mark.node
        assert await r.schedule_ungated() == []
        check_grants(r.api.objects("nodes"), r.pods_everywhere())


async def test_restart_finishes_a_half_ungated_gang(server: localapi.Server) -> None:
    nodes(server.api, 2)
    for i, (node, gpus) in enumerate(layout(4)):
        pod = planned(f"w{i}", "train", 4, plan_id="p1", node=node, gpus=gpus)
        if i < 2:
            del pod["spec"]["schedulingGates"]
        server.api.create(pod)
    async with rig(server) as r:
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("train"))
        check_plans(r.pods_everywhere())


async def test_restart_rolls_back_a_partly_written_plan_and_plans_again(
    server: localapi.Server,
) -> None:
    nodes(server.api, 2)
    for i, (node, gpus) in enumerate(layout(4)):
        if i < 2:
            server.api.create(planned(f"w{i}", "train", 4, plan_id="p1", node=node, gpus=gpus))
        else:
            server.api.create(member(f"w{i}", "train", 4, count=2))
    async with rig(server) as r:
        await r.quiet()
        pods = r.gang_pods("train")
        marks = {mark.id for mark in map(plan_mark, pods) if mark is not None}
        assert len(marks) == 1 and "p1" not in marks
        assert not any(gated(pod) for pod in pods)
        assert r.metric("gpuplace_gang_rollbacks_total") == 1
        check_plans(r.pods_everywhere())
        check_grants(r.api.objects("nodes"), r.pods_everywhere())


async def test_restart_rolls_back_a_plan_that_lost_a_member(server: localapi.Server) -> None:
    nodes(server.api, 2)
    for i, (node, gpus) in enumerate(layout(4)[:3]):
        server.api.create(planned(f"w{i}", "train", 4, plan_id="p1", node=node, gpus=gpus))
    async with rig(server) as r:
        await r.quiet()
        pods = r.gang_pods("train")
        assert all(gated(pod) and plan_mark(pod) is None for pod in pods)
        assert not any(assignments.assigned(pod) for pod in pods)
        assert len(r.h.sidecar.sync.ledger) == 0
        assert len(await events(r, "GangPlanRolledBack")) == 3


async def test_a_crash_while_writing_leaves_all_or_nothing(server: localapi.Server) -> None:
    nodes(server.api, 2)
    async with rig(server) as r:
        # the last member's plan write hangs; the sidecar dies meanwhile
        r.api.fail("PATCH", r"/pods/w3$", 0, delay=1.0)
        for i in range(4):
            r.api.create(member(f"w{i}", "train", 4, count=2))
        await r.h.synced(lambda: sum(plan_mark(p) is not None for p in r.gang_pods("train")) >= 3)
        for task in r.tasks:
            task.cancel()
    check_plans(server.api.objects("pods"))
    await asyncio.sleep(1.2)
    async with rig(server) as r:
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("train"))
        check_plans(r.pods_everywhere())
        assert await r.schedule_ungated() == []
        check_grants(r.api.objects("nodes"), r.pods_everywhere())


async def test_a_starving_gang_gets_a_capacity_hold_that_other_gangs_respect(
    server: localapi.Server,
) -> None:
    nodes(server.api, 3, gpus=4)
    settings = GangSettings(poll_seconds=0.2, settle_seconds=0.005, starve_after_seconds=60)
    async with rig(server, settings=settings) as r:
        for name in ("x", "y", "z"):
            r.api.create(other(name, count=3))
        await r.quiet()
        assert await r.schedule_ungated() == []
        # the big gang wants two whole nodes; each node has one GPU free. It may not
        # preempt (preemptionPolicy Never), so it waits and drains nodes towards it
        never = {"preemptionPolicy": "Never"}
        for i in range(2):
            r.api.create(member(f"big{i}", "big", 2, count=4, priority=10, extra=never))
        await r.quiet()
        assert r.fences.current is None
        r.clock.offset = 61.0
        await r.quiet()
        fence = r.fences.current
        assert fence is not None and fence.owner == ("default", "big")
        assert len(fence.nodes) == 2
        outside = next(n for n in ("gpu-0", "gpu-1", "gpu-2") if n not in fence.nodes)
        assert r.fences.blocks("someone", next(iter(fence.nodes)))
        assert r.fences.blocks("someone", outside) is None
        assert r.metric("gpuplace_gang_fenced_nodes") == 2
        assert await events(r, "GangCapacityHeld")
        # a small gang that fits anywhere goes only where the fence is not
        for i in range(2):
            r.api.create(member(f"small{i}", "small", 2, percent=50, priority=0))
        await r.quiet()
        for small in r.gang_pods("small"):
            mark = plan_mark(small)
            assert mark is not None and mark.node == outside
        # the pods on fenced nodes finish: the big gang starts and the fence goes
        for pod in r.pods_everywhere():
            if pod["spec"].get("nodeName") in fence.nodes:
                r.api.delete("pods", pod["metadata"]["name"], "default")
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("big"))
        assert r.fences.current is None


async def test_only_the_leading_replica_plans(server: localapi.Server) -> None:
    nodes(server.api, 2)
    leading = [False]
    async with rig(server, active=lambda: leading[0]) as r:
        for i in range(2):
            r.api.create(member(f"w{i}", "train", 2, count=1))
        await asyncio.sleep(0.5)
        assert all(gated(pod) and plan_mark(pod) is None for pod in r.gang_pods("train"))
        assert not r.api.calls_to("PATCH", "/pods/")
        leading[0] = True
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("train"))


async def test_an_elastic_gang_starts_with_what_fits_and_grows_as_gpus_free(
    server: localapi.Server,
) -> None:
    nodes(server.api, 1)
    async with rig(server) as r:
        r.api.create(other("busy", count=2))
        assert await r.schedule_ungated() == []
        for i in range(4):
            pod = member(f"e{i}", "elastic", 4, count=1)
            pod["metadata"]["annotations"][keys.GANG_MIN] = "2"
            r.api.create(pod)
        await r.quiet()
        started = sorted(p["metadata"]["name"] for p in r.gang_pods("elastic") if not gated(p))
        assert started == ["e0", "e1"]  # 2 GPUs free: gang-min 2 of its 4 members
        counts = {
            p["metadata"]["name"]: p["metadata"]["annotations"].get(keys.GANG_COUNT)
            for p in r.gang_pods("elastic")
        }
        assert counts["e0"] == counts["e1"] == "2"
        assert await r.schedule_ungated() == []
        r.api.delete("pods", "busy", "default")
        await r.quiet()
        assert not any(gated(p) for p in r.gang_pods("elastic"))
        grown = {
            p["metadata"]["name"]: p["metadata"]["annotations"].get(keys.GANG_COUNT)
            for p in r.gang_pods("elastic")
        }
        assert grown["e2"] == grown["e3"] == "4"
        assert await r.schedule_ungated() == []
        check_grants(r.api.objects("nodes"), r.pods_everywhere())
