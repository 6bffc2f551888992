"""A waiting gang of higher priority displaces lower-priority pods, all or nothing: the
real sidecar and gang controller against the local API over HTTP, as the gpuplace
ServiceAccount under the shipped RBAC (evictions through pods/eviction, budgets read
from policy/v1), the local API acting as kube-apiserver (budgets, graceful deletion)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpuplace.cluster import keys
from gpuplace.cluster.gang_marks import gated, plan_mark
from gpuplace.controllers import victims
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.gangs.controller import GangSettings
from tests.gangs.rig import Rig, check_grants, events, member, nodes, rig

SETTINGS = GangSettings(poll_seconds=0.2, settle_seconds=0.005, preempt_retry_seconds=0.3)
RUNNING = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}


async def running(
    r: Rig,
    name: str,
    node: str,
    *,
    count: int = 1,
    priority: int = 0,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod kube-scheduler bound through the extender to `node`, now running."""
    pod = objects.pod(name, percent=None, count=count, labels=labels)
    pod["spec"]["priority"] = priority
    uid = r.api.create(pod)["metadata"]["uid"]
    await r.h.synced(lambda: uid in r.h.sidecar.sync.pods)
    assert await r.h.bind(r.h.pod("default", name), node) == ""
    return r.api.patch("pods", name, {"status": RUNNING}, "default", subresource="status")


async def runner(
    r: Rig,
    name: str,
    gang: str,
    size: int,
    *,
    count: int,
    priority: int,
    annotations: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """A running gang of `size` members (planned, ungated and bound like any gang)."""
    for i in range(size):
        r.api.create(
            member(
                f"{name}{i}", gang, size, count=count, priority=priority, annotations=annotations
            )
        )
    await r.quiet()
    assert await r.schedule_ungated() == []
    for pod in r.gang_pods(gang):
        r.api.set_phase("default", pod["metadata"]["name"], "Running")
    await r.quiet()
    return r.gang_pods(gang)


def evicted(api: localapi.FakeApi) -> list[str]:
    """Pods the sidecar asked the API to evict (a refused request counts too)."""
    return sorted(
        call.path.split("/")[-2]
        for call in api.calls_to("POST", r"/pods/[^/]+/eviction$")
        if call.user == "system:serviceaccount:gpuplace:gpuplace"
    )


def terminating(api: localapi.FakeApi) -> list[str]:
    return sorted(
        pod["metadata"]["name"]
        for pod in api.objects("pods", "default")
        if pod["metadata"].get("deletionTimestamp")
    )


def kubelet_finishes(api: localapi.FakeApi) -> None:
    """The kubelet removes every terminating pod (its containers have stopped)."""
    for name in terminating(api):
        api.delete("pods", name, "default")


async def test_a_higher_priority_gang_displaces_exactly_the_pods_it_needs(
    server: localapi.Server,
) -> None:
    """gpu-0 is full of priority-0 pods; gpu-1 has two free GPUs, a priority-0 pod and a
    priority-100 one. A priority-100 gang of two 2-GPU members: one member takes the
    free GPUs, the other needs two pods of gpu-0 gone — exactly two, all of lower
    priority; the equal-priority pod stays."""
    nodes(server.api, 2)
    async with rig(server, settings=SETTINGS) as r:
        for i in range(4):
            await running(r, f"a{i}", "gpu-0")
        await running(r, "b0", "gpu-1")
        await running(r, "same", "gpu-1", priority=100)
        for i in range(2):
            r.api.create(member(f"w{i}", "train", 2, count=2, priority=100))
        await r.quiet()
        gone = evicted(r.api)
        assert len(gone) == 2 and set(gone) <= {"a0", "a1", "a2", "a3"}
        assert terminating(r.api) == gone  # gracefully: still there, containers stopping
        assert r.fences.owner == ("default", "train")
        assert r.fences.nodes == {"gpu-0", "gpu-1"}
        # no second preemption while its victims terminate, round after round
        await r.rounds(5)
        assert evicted(r.api) == gone
        assert all(gated(pod) for pod in r.gang_pods("train"))
        freed = [m for m in await events(r, "GpuPreempted")]
        assert len(freed) == 2 and all("for gang default/train" in m for m in freed)
        assert all("of node gpu-0" in m for m in freed)
        told = await events(r, "GpuPreemption")
        assert len(told) == 2 and all(f"default/{n}" in m for m in told for n in gone)
        # the fence keeps a late pod off gpu-1's free GPUs, which the gang will take
        late = objects.pod("late", percent=None, count=1)
        uid = r.api.create(late)["metadata"]["uid"]
        await r.h.synced(lambda: uid in r.h.sidecar.sync.pods)
        verdict = await r.h.filter(r.h.pod("default", "late"), ["gpu-0", "gpu-1"])
        assert verdict["NodeNames"] == []
        assert "held for gang default/train" in verdict["FailedNodes"]["gpu-1"]
        assert r.metric("gpuplace_gang_preemptions_total", {"result": "complete"}) == 1
        assert r.metric("gpuplace_gang_preemption_victims_total") == 2
        kubelet_finishes(r.api)
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("train"))
        assert await r.schedule_ungated() == ["late"]  # the gang has the freed GPUs
        marks = {plan_mark(pod).node for pod in r.gang_pods("train")}  # type: ignore[union-attr]
        assert marks == {"gpu-0", "gpu-1"}
        assert {p["metadata"]["name"] for p in r.pods()} >= {"b0", "same"}
        check_grants(r.api.objects("nodes"), r.pods_everywhere())
        assert r.fences.owner is None


async def test_nothing_is_evicted_when_a_member_would_still_lack_room(
    server: localapi.Server,
) -> None:
    """gpu-0 holds priority-200 pods only; a priority-100 gang of two 4-GPU members
    could displace gpu-1's pods for one member but never find room for the other."""
    nodes(server.api, 2)
    async with rig(server, settings=SETTINGS) as r:
        for i in range(4):
            await running(r, f"high{i}", "gpu-0", priority=200)
            await running(r, f"low{i}", "gpu-1")
        for i in range(2):
            r.api.create(member(f"w{i}", "train", 2, count=4, priority=100))
        await r.quiet()
        await r.rounds(3)
        assert evicted(r.api) == [] and terminating(r.api) == []
        assert r.fences.owner is None
        assert r.metric("gpuplace_gang_preemptions_total", {"result": "complete"}) == 0


async def test_a_budget_that_forbids_a_victim_moves_the_preemption_or_stops_it(
    server: localapi.Server,
) -> None:
    """Two full nodes of priority-0 pods; a PodDisruptionBudget allows none of gpu-0's
    pods to go: the 2-member gang takes gpu-1 only. With gpu-1's pods covered too,
    nothing is evicted at all (no partial preemption)."""
    nodes(server.api, 2)
    async with rig(server, settings=SETTINGS) as r:
        for i in range(4):
            await running(r, f"a{i}", "gpu-0", labels={"team": "serving"})
            await running(r, f"b{i}", "gpu-1", labels={"team": "batch"})
        budget(r.api, "serving", {"team": "serving"}, allowed=0)
        budget(r.api, "batch", {"team": "batch"}, allowed=3)
        for i in range(2):
            r.api.create(member(f"w{i}", "train", 2, count=2, priority=100))
        await r.quiet()
        # gpu-1 has four victims but its budget allows three: nothing can be done
        assert evicted(r.api) == []
        assert r.fences.owner is None
        budget(r.api, "batch", {"team": "batch"}, allowed=4)
        r.clock.offset += 1.0  # budgets are read again after the retry time
        r.controller.wake()
        await r.quiet()
        await r.rounds(2)
        assert evicted(r.api) == ["b0", "b1", "b2", "b3"]
        assert r.fences.nodes == {"gpu-1"}
        status = r.api.get("policy/poddisruptionbudgets", "batch", "default")["status"]
        assert status["disruptionsAllowed"] == 0
        assert set(status["disruptedPods"]) == {"b0", "b1", "b2", "b3"}


async def test_a_running_lower_gang_on_two_nodes_goes_whole_or_not_at_all(
    server: localapi.Server,
) -> None:
    nodes(server.api, 3)
    async with rig(server, settings=SETTINGS) as r:
        old = await runner(r, "old", "old", 2, count=4, priority=0)
        used = {pod["spec"]["nodeName"] for pod in old}
        assert len(used) == 2
        (free,) = {"gpu-0", "gpu-1", "gpu-2"} - used
        await running(r, "filler0", free, count=2, priority=300)
        await running(r, "filler1", free, count=2, priority=300)
        # a third member of the full gang stays gated and holds nothing: no victim
        r.api.create(member("old2", "old", 2, count=4, priority=0))
        await r.quiet()
        for i in range(2):
            r.api.create(member(f"w{i}", "new", 2, count=2, priority=100))
        await r.quiet()
        await r.rounds(2)
        # one of its nodes would do, but the old gang is one unit: both members go
        assert evicted(r.api) == ["old0", "old1"]
        assert all(gated(pod) for pod in r.gang_pods("old") if pod["metadata"]["name"] == "old2")
        kubelet_finishes(r.api)
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("new"))


async def test_a_gang_with_a_member_of_equal_priority_is_never_a_victim(
    server: localapi.Server,
) -> None:
    nodes(server.api, 2)
    async with rig(server, settings=SETTINGS) as r:
        r.api.create(member("old0", "old", 2, count=4, priority=0))
        r.api.create(member("old1", "old", 2, count=4, priority=100))
        await r.quiet()
        assert await r.schedule_ungated() == []
        await r.quiet()
        for i in range(2):
            r.api.create(member(f"w{i}", "new", 2, count=4, priority=100))
        await r.quiet()
        await r.rounds(3)
        assert evicted(r.api) == []


async def test_a_gang_whose_members_never_preempt_waits(server: localapi.Server) -> None:
    nodes(server.api, 1)
    async with rig(server, settings=SETTINGS) as r:
        for i in range(4):
            await running(r, f"a{i}", "gpu-0")
        r.api.create(member("w0", "train", 2, count=2, priority=100))
        never = {"preemptionPolicy": "Never"}
        r.api.create(member("w1", "train", 2, count=2, priority=100, extra=never))
        await r.quiet()
        await r.rounds(3)
        assert evicted(r.api) == []


async def test_an_eviction_refused_by_a_racing_budget_stops_keeps_the_fence_and_retries(
    server: localapi.Server,
) -> None:
    nodes(server.api, 1)
    async with rig(server, settings=SETTINGS) as r:
        for i in range(4):
            await running(r, f"a{i}", "gpu-0")
        # another disruption takes the budget between the pre-check and the eviction
        r.api.fail("POST", r"/pods/a1/eviction$", 429, message="Cannot evict pod ...")
        for i in range(2):
            r.api.create(member(f"w{i}", "train", 2, count=2, priority=100))
        await r.quiet()
        assert terminating(r.api) == ["a0"]
        assert r.fences.owner == ("default", "train")
        refused = await events(r, "GangPreemptionRefused")
        assert refused and "default/a1 was refused" in refused[0]
        assert "1 of 4 victims were evicted" in refused[0]
        assert r.metric("gpuplace_gang_preemptions_total", {"result": "partial"}) == 1
        # no new attempt while a0 terminates, nor before the retry time; then the rest go
        r.clock.offset += 1.0
        await r.rounds(3)
        assert set(evicted(r.api)) == {"a0", "a1"}
        kubelet_finishes(r.api)
        await r.quiet()
        r.clock.offset += 1.0
        await r.rounds(3)
        await r.quiet()
        assert set(evicted(r.api)) == {"a0", "a1", "a2", "a3"}
        kubelet_finishes(r.api)
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("train"))


async def test_a_pod_that_becomes_a_victim_without_a_ledger_change_is_seen(
    server: localapi.Server,
) -> None:
    """a3's Binding fails once: annotated but unbound, it holds its GPU and is no victim
    (the gang's plan finds none and is not made again while nothing changes). Its bind
    then succeeds: the ledger only confirms the grant (its generation stays), but a3 is
    now a bound victim, and the gang preempts without waiting for an unrelated change."""
    nodes(server.api, 1)
    async with rig(server, settings=SETTINGS) as r:
        for i in range(3):
            await running(r, f"a{i}", "gpu-0")
        late = objects.pod("a3", percent=None, count=1)
        late["spec"]["priority"] = 0
        uid = r.api.create(late)["metadata"]["uid"]
        await r.h.synced(lambda: uid in r.h.sidecar.sync.pods)
        r.api.fail("POST", r"/pods/a3/binding$", 500)
        assert "a3" in await r.h.bind(r.h.pod("default", "a3"), "gpu-0")
        for i in range(2):
            r.api.create(member(f"w{i}", "train", 2, count=2, priority=100))
        await r.quiet()
        await r.rounds(2)
        assert evicted(r.api) == []
        generation = r.h.sidecar.sync.ledger.generation
        assert await r.h.bind(r.h.pod("default", "a3"), "gpu-0") == ""
        await r.h.synced(lambda: r.h.sidecar.sync.pods[uid].bound)
        assert r.h.sidecar.sync.ledger.generation == generation
        r.clock.offset += 1.0  # a plan that found nothing is not made again at once
        await r.rounds(3)
        await r.quiet()
        assert evicted(r.api) == ["a0", "a1", "a2", "a3"]


async def test_one_preemption_at_a_time_so_its_fence_keeps_what_it_freed(
    server: localapi.Server,
) -> None:
    """Both nodes are full of priority-0 pods; gangs `high` (200) and `mid` (100) each
    need a whole node. Only one gang preempts at a time: with one fence, a second
    preemption in the same round would free GPUs nothing holds, a late pod would take
    them, and `mid` would evict again. `mid` preempts once `high` has started."""
    nodes(server.api, 2)
    async with rig(server, settings=SETTINGS) as r:
        for n in range(2):
            for i in range(4):
                await running(r, f"n{n}p{i}", f"gpu-{n}")
        for name, priority in (("high", 200), ("mid", 100)):
            for i in range(2):
                r.api.create(member(f"{name}{i}", name, 2, count=2, priority=priority))
        await r.quiet()
        await r.rounds(3)
        first = evicted(r.api)
        assert len(first) == 4 and len({name[:2] for name in first}) == 1, first
        assert r.fences.owner == ("default", "high")
        kubelet_finishes(r.api)
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("high"))
        await r.rounds(3)
        await r.quiet()
        second = sorted(set(evicted(r.api)) - set(first))
        assert len(second) == 4 and len({name[:2] for name in second}) == 1, second
        assert len(evicted(r.api)) == 8  # nobody evicted twice
        assert r.fences.owner == ("default", "mid")
        kubelet_finishes(r.api)
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("mid"))
        check_grants(r.api.objects("nodes"), r.pods_everywhere())


async def test_a_lost_lease_round_neither_evicts_again_nor_frees_the_nodes(
    server: localapi.Server,
) -> None:
    """A failed Lease read makes the replica a follower for a round: it drops its fence
    and what it remembers of the preemption. Back in the lead, it reads from the cluster
    that its victims are terminating: no eviction is sent again (no second Event or
    count), the fence is rebuilt on the same nodes, and the gang starts once they go."""
    nodes(server.api, 1)
    leading = [True]
    async with rig(server, settings=SETTINGS, active=lambda: leading[0]) as r:
        for i in range(4):
            await running(r, f"a{i}", "gpu-0")
        for i in range(2):
            r.api.create(member(f"w{i}", "train", 2, count=2, priority=100))
        await r.quiet()
        first = evicted(r.api)
        assert first == ["a0", "a1", "a2", "a3"]
        assert r.fences.owner == ("default", "train")
        leading[0] = False
        r.controller.wake()
        await r.h.synced(lambda: r.fences.owner is None)
        leading[0] = True
        await r.rounds(3)
        assert evicted(r.api) == first
        assert r.fences.owner == ("default", "train") and r.fences.nodes == {"gpu-0"}
        assert len(await events(r, "GpuPreempted")) == 4
        assert r.metric("gpuplace_gang_preemptions_total", {"result": "complete"}) == 1
        kubelet_finishes(r.api)
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("train"))
        assert r.fences.owner is None


async def test_a_preemption_attempt_makes_a_bounded_number_of_plans(
    server: localapi.Server,
) -> None:
    """Twenty 2-GPU nodes, each full with one pod of a budget that allows no eviction;
    each plan of a 2 × 2-GPU gang picks two of them, the pre-check refuses both, and the
    next plan goes without them: an attempt stops after `PASSES` plans (not 11), and
    the gang is blocked, not preempting."""
    nodes(server.api, 20, gpus=2)
    settings = replace(SETTINGS, preempt_retry_seconds=600.0)
    async with rig(server, settings=settings) as r:
        for n in range(20):
            await running(r, f"p{n:02}", f"gpu-{n}", count=2, labels={"team": "serving"})
        budget(r.api, "serving", {"team": "serving"}, allowed=0)
        for i in range(2):
            r.api.create(member(f"w{i}", "train", 2, count=2, priority=100))
        await r.quiet()
        await r.rounds(3)
        assert evicted(r.api) == []
        assert r.metric("gpuplace_gang_preemption_plans_total") == victims.PASSES


async def test_a_replacement_member_preempts_at_its_gangs_lowest_priority(
    server: localapi.Server,
) -> None:
    """A started gang of priority 0 (that runs on without a member: `gang-on-failure:
    continue`) lost a member; its replacement has priority 100. The gang's priority is
    its lowest member's, running ones included: 0, so the priority-50 pods that took the
    lost member's GPUs are not evicted for it."""
    nodes(server.api, 2)
    async with rig(server, settings=SETTINGS) as r:
        carry_on = {keys.GANG_ON_FAILURE: "continue"}
        old = await runner(r, "g", "g", 2, count=4, priority=0, annotations=carry_on)
        lost = old[1]["metadata"]["name"]
        where = old[1]["spec"]["nodeName"]
        r.api.delete("pods", lost, "default")
        await r.quiet()
        for i in range(4):
            await running(r, f"mid{i}", where, priority=50)
        r.api.create(member("g-new", "g", 2, count=4, priority=100, annotations=carry_on))
        await r.quiet()
        await r.rounds(3)
        assert evicted(r.api) == []
        assert r.fences.owner is None


async def test_an_eviction_without_an_answer_may_have_gone_through(
    server: localapi.Server,
) -> None:
    """a1's eviction gets no answer within the client's timeout, yet the API carries it
    out afterwards: the controller stops, says the outcome is unknown, and once a1
    shows its deletion it is not evicted again; the rest go on the retry."""
    nodes(server.api, 1)
    async with rig(server, settings=SETTINGS) as r:
        for i in range(4):
            await running(r, f"a{i}", "gpu-0")
        r.h.sidecar.api.timeout = 0.3
        r.api.fail("POST", r"/pods/a1/eviction$", 0, delay=0.6)
        for i in range(2):
            r.api.create(member(f"w{i}", "train", 2, count=2, priority=100))
        await r.h.synced(lambda: terminating(r.api) == ["a0", "a1"])
        await r.quiet()
        refused = await events(r, "GangPreemptionRefused")
        assert refused and "default/a1 was refused (its outcome is unknown" in refused[0]
        r.clock.offset += 1.0
        await r.rounds(3)
        assert evicted(r.api) == ["a0", "a1"]  # nothing more while both terminate
        kubelet_finishes(r.api)
        await r.quiet()
        r.clock.offset += 1.0
        await r.rounds(3)
        await r.quiet()
        assert evicted(r.api) == ["a0", "a1", "a2", "a3"]
        kubelet_finishes(r.api)
        await r.quiet()
        assert not any(gated(pod) for pod in r.gang_pods("train"))


def budget(api: localapi.FakeApi, name: str, labels: dict[str, str], *, allowed: int) -> None:
    """A PodDisruptionBudget as the disruption controller keeps its status."""
    body = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"selector": {"matchLabels": labels}, "maxUnavailable": allowed},
    }
    try:
        api.get("policy/poddisruptionbudgets", name, "default")
    except localapi.ApiStatusError:
        api.create(body)
    status = {
        "disruptionsAllowed": allowed,
        "currentHealthy": 4,
        "desiredHealthy": 4 - allowed,
        "expectedPods": 4,
        "observedGeneration": 1,
    }
    api.patch(
        "policy/poddisruptionbudgets",
        name,
        {"status": status},
        "default",
        subresource="status",
    )
