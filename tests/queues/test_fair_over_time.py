"""Fair sharing over time and capacity holds on the real queue controller (the rig: the
local API over HTTP, the sidecar's informers and extender verbs): a starving multi-GPU
pod of the queue furthest below its fair share gets a node held, nothing else is
admitted there, it is admitted once the node drains and the hold goes; the hold moves to
a node where fewer GPUs of pods that stay are held; each queue's past
share is written into its status and read back by a restarted controller."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime

import pytest

from gpuplace.dev import localapi
from gpuplace.placement.fences import QUEUED, Fence
from tests.gangs.rig import Clock

from .rig import FAST, Rig, events, gpuqueue, namespace, nodes, queued, rig

HOLDING = dataclasses.replace(FAST, hold_after_seconds=60.0)
REMEMBERING = dataclasses.replace(FAST, half_life_seconds=3600.0)


def lab(api: localapi.FakeApi) -> None:
    """Two nodes of 2 GPUs; team-a (nominal 1) borrows; team-b (nominal 3) may not
    reclaim: only the hold gets its 2-GPU pod a node."""
    nodes(api, 2, gpus=2)
    namespace(api, "team-a", team="a")
    namespace(api, "team-b", team="b")
    api.create(gpuqueue("team-a", "1", cohort="lab"))
    api.create(gpuqueue("team-b", "3", cohort="lab", reclaim="Never"))


def node_of(r: Rig, name: str, namespace: str = "team-a") -> str:
    return str(r.pod(name, namespace)["spec"].get("nodeName") or "")


async def later(r: Rig) -> None:
    """Rounds after the clock moved: past the poll time, so that they decide."""
    await asyncio.sleep(FAST.poll_seconds + 0.05)
    await r.rounds(2)


async def start(r: Rig, name: str) -> None:
    r.api.create(queued(name, "team-a"))
    await r.quiet()
    assert await r.schedule() == []


async def starving(r: Rig, name: str) -> Fence:
    """A 2-GPU pod of team-b, waiting past the hold time: the fence held for it."""
    r.api.create(queued(name, "team-b", count=2))
    await r.quiet()
    r.clock.offset += 61
    await later(r)
    fence = r.h.sidecar.fences.current
    assert fence is not None and fence.kind == QUEUED and fence.owner == ("team-b", name)
    return fence


async def three_of_a(r: Rig) -> None:
    """team-a runs three 1-GPU pods: it borrows 2 of the cohort's 4 (share 0.5)."""
    for i in range(3):
        await start(r, f"a{i}")


async def test_a_starving_pod_gets_a_node_held_until_it_fits(server: localapi.Server) -> None:
    lab(server.api)
    async with rig(server, settings=HOLDING) as r:
        await three_of_a(r)
        r.api.create(queued("b0", "team-b", count=2))
        await r.quiet()
        assert r.waiting("team-b") == ["b0"]
        fences = r.h.sidecar.fences
        assert fences.current is None  # not starving yet
        r.clock.offset += 61
        await later(r)
        fence = fences.current
        assert fence is not None and fence.kind == QUEUED
        assert fence.owner == ("team-b", "b0") and len(fence.nodes) == 1
        (held,) = fence.nodes
        said = await events(r, "team-b", "QueueCapacityHeld")
        assert len(said) == 1 and held in said[0] and "team-b" in said[0]
        assert r.metric("gpuplace_queue_held_nodes") == 1
        await later(r)
        decided = r.controller.last
        assert decided is not None
        (b0,) = (w for w in decided.waiting if w.key == "team-b/b0")
        assert b0.held == fence.nodes  # its reclaims look there first
        assert all(not w.held for w in decided.waiting if w is not b0)
        # fill the other node; then a GPU free on the held node goes to nobody else
        other = next(
            n["metadata"]["name"] for n in r.api.objects("nodes") if n["metadata"]["name"] != held
        )
        extra = 3
        while sum(node_of(r, f"a{i}") == other for i in range(extra)) < 2:
            await start(r, f"a{extra}")
            extra += 1
        on_held = [f"a{i}" for i in range(extra) if node_of(r, f"a{i}") == held]
        if len(on_held) == 2:
            r.finish(on_held.pop())
            await r.quiet()
        r.api.create(queued("late", "team-a"))
        await r.quiet()
        assert "late" in r.waiting("team-a")  # quota would cover it: the node is held
        assert r.waiting("team-b") == ["b0"]
        for name in on_held:
            r.finish(name)
        await r.quiet()
        assert r.admitted("team-b") == ["b0"]
        assert await r.schedule() == []
        assert r.waiting("team-a") == ["late"]  # no room left for it
        assert node_of(r, "b0", "team-b") == held
        assert fences.current is None
        assert r.metric("gpuplace_queue_held_nodes") == 0
        r.check()


async def test_no_hold_for_the_queue_already_ahead_of_the_others(
    server: localapi.Server, caplog: pytest.LogCaptureFixture
) -> None:
    lab(server.api)
    async with rig(server, settings=HOLDING) as r:
        await three_of_a(r)
        r.api.create(queued("a-big", "team-a", count=2))  # team-a is the one borrowing
        await r.quiet()
        r.clock.offset += 61
        await later(r)
        assert r.waiting("team-a") == ["a-big"]
        assert r.h.sidecar.fences.current is None
    # holds without the past share: measured to cost allocation for nothing, said so
    assert "capacity holds without fair sharing over time" in caplog.text


async def test_the_past_share_is_written_and_read_back_after_a_restart(
    server: localapi.Server,
) -> None:
    lab(server.api)
    async with rig(server, settings=REMEMBERING) as r:
        await three_of_a(r)
        r.clock.offset += 3600  # one half-life later
        await later(r)
        r.api.create(queued("b0", "team-b"))  # a change: a round writes the statuses
        await r.quiet()
        status = r.status("team-a")
        assert status["weightedShare"] == 500
        # written when its share last changed: the hour of decay since is no reason to
        # write, the status still gives it exactly (0 then, 0.5 held since)
        assert status["pastShare"] < 5
        assert status["pastShareTime"]
        assert r.status("team-b")["pastShare"] == 0
        assert r.metric("gpuplace_queue_past_weighted_share", {"queue": "team-a"}) == pytest.approx(
            0.25, abs=0.005
        )
        offset = r.clock.offset
    # down for an hour (team-a's pods ran on), then a new leader
    async with rig(server, settings=REMEMBERING, clock=Clock(offset + 3600)) as again:
        await later(again)
        past = again.controller.history
        assert past is not None
        assert past.past(again.clock())["team-a"] == pytest.approx(0.375, abs=0.01)


async def test_a_gangs_fence_goes_first_and_the_hold_comes_back_after(
    server: localapi.Server,
) -> None:
    lab(server.api)
    # no gang controller: it would lift the stand-in gang fence below (no such gang)
    async with rig(server, settings=HOLDING, gangs=False) as r:
        await three_of_a(r)
        held = await starving(r, "b0")
        fences = r.h.sidecar.fences
        # a starving gang's fence, as the gang controller holds it: never replaced
        gang = Fence(("team-x", "train"), held.nodes, frozenset({"gang-uid"}), r.clock())
        fences.hold(gang)
        await later(r)
        assert fences.current == gang
        assert r.metric("gpuplace_queue_held_nodes") == 0
        fences.release()  # the gang started or timed out
        await later(r)
        again = fences.current
        assert again is not None and again.kind == QUEUED and again.owner == ("team-b", "b0")
        assert r.metric("gpuplace_queue_held_nodes") == 1


async def test_leading_again_reads_back_what_the_other_leader_wrote(
    server: localapi.Server,
) -> None:
    lab(server.api)
    leading = [True]
    async with rig(server, settings=REMEMBERING, active=lambda: leading[0]) as r:
        await three_of_a(r)
        await later(r)
        history = r.controller.history
        assert history is not None and history.past(r.clock())["team-a"] < 0.01
        leading[0] = False  # another replica leads for a while and writes its view
        await later(r)
        stamp = datetime.fromtimestamp(r.clock(), UTC).isoformat().replace("+00:00", "Z")
        other = {"weightedShare": 500, "pastShare": 900, "pastShareTime": stamp}
        r.api.patch("gpuplace.io/gpuqueues", "team-a", {"status": other}, subresource="status")
        leading[0] = True
        await later(r)
        assert history.past(r.clock())["team-a"] == pytest.approx(0.9, abs=0.01)


async def test_the_hold_moves_to_a_node_where_fewer_gpus_stay(server: localapi.Server) -> None:
    """Three nodes, each with one pod of team-b (its own: it never leaves for b's 2-GPU
    pod) and one of team-a (borrowing: it could): the hold takes one of them; once b's pod
    on another node is done, that node has fewer GPUs that stay and the hold moves."""
    nodes(server.api, 3, gpus=2)
    namespace(server.api, "team-a", team="a")
    namespace(server.api, "team-b", team="b")
    server.api.create(gpuqueue("team-a", "1", cohort="lab"))
    server.api.create(gpuqueue("team-b", "5", cohort="lab", reclaim="Never"))
    async with rig(server, settings=HOLDING) as r:
        for i in range(3):
            for name, team in ((f"b{i}", "team-b"), (f"a{i}", "team-a")):
                r.api.create(queued(name, team))
                await r.quiet()
                assert await r.schedule() == []
        where = {f"b{i}": node_of(r, f"b{i}", "team-b") for i in range(3)}
        assert len(set(where.values())) == 3  # one pod of b on each node
        (held,) = (await starving(r, "big")).nodes
        fences = r.h.sidecar.fences
        other = next(name for name, node in where.items() if node != held)
        r.finish(other, "team-b")
        await r.quiet()
        await later(r)
        moved = fences.current
        assert moved is not None and moved.owner == ("team-b", "big")
        assert moved.nodes == {where[other]}
        said = await events(r, "team-b", "QueueCapacityHeld")
        assert any(where[other] in message for message in said)
        assert r.waiting("team-b") == ["big"]
        r.check()
