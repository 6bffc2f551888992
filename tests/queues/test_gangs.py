"""A queued gang is admitted by its queue as one unit (plan written with the queue gates on,
then every queue gate removed), then started by the gang controller (the gang gates
removed together); an elastic gang starts with what fits from `gang-min`, grows as GPUs
free and gives back its extras first to a reclaim."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from gpuplace.cluster import keys
from gpuplace.cluster.gang_marks import gated, plan_mark
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.webhook import mutating
from tests.cluster.conftest import eventually
from tests.gangs.rig import check_plans
from tests.queues.rig import Rig, events, gpuqueue, namespace, nodes, queued, rig, two_teams
from tests.queues.test_reclaiming import deleting, kubelet_finishes


@asynccontextmanager
async def team_a(server: localapi.Server, nominal: str, nodes_count: int) -> AsyncIterator[Rig]:
    """A rig over `nodes_count` 4-GPU nodes and team-a's GpuQueue of `nominal` GPUs."""
    nodes(server.api, nodes_count, gpus=4)
    namespace(server.api, "team-a", team="a")
    server.api.create(gpuqueue("team-a", nominal))
    async with rig(server) as r:
        yield r


def members(r: Rig, gang: str, namespace: str = "team-a") -> list[dict[str, Any]]:
    return [
        pod
        for pod in r.pods(namespace)
        if (pod["metadata"].get("labels") or {}).get(keys.GANG_LABEL) == gang
    ]


async def test_a_queued_gang_is_admitted_whole_then_started_by_the_gang_controller(
    server: localapi.Server,
) -> None:
    async with team_a(server, "6", 2) as r:
        # three of four members: the gang waits, holding nothing
        for i in range(3):
            r.api.create(queued(f"w{i}", "team-a", count=2, gang="train", size=4))
        await r.quiet()
        assert r.admitted() == []
        said = await events(r, "team-a", "QueueWaiting")
        assert said and all("of its 4 members exist" in message for message in said)
        # the fourth: 8 GPUs but the quota is 6: it still waits, now for quota
        r.api.create(queued("w3", "team-a", count=2, gang="train", size=4))
        await r.quiet()
        assert r.admitted() == []
        assert all(plan_mark(pod) is None for pod in members(r, "train"))
        # the quota grows to 8: admitted whole, and the gang controller ungates it
        r.api.patch(
            "gpuplace.io/gpuqueues",
            "team-a",
            {"spec": {"resources": [{"name": "gpus", "nominal": "8"}]}},
        )
        await r.quiet()
        assert r.admitted() == ["w0", "w1", "w2", "w3"]
        # then the gang controller settles the plan as its own: the gang gates go together
        await eventually(lambda: not any(gated(pod) for pod in members(r, "train")), 30.0)
        pods = members(r, "train")
        marks = [plan_mark(pod) for pod in pods]
        assert len({mark.id for mark in marks if mark is not None}) == 1 and None not in marks
        assert all(pod["metadata"]["annotations"][keys.GANG_COUNT] == "4" for pod in pods)
        # the queue's writes never removed a queue gate before every member was marked
        calls = r.api.calls_to("PATCH", r"/namespaces/team-a/pods/w\d$")
        ungates = [
            i for i, c in enumerate(calls) if "schedulingGates" in (c.body.get("spec") or {})
        ]
        marked = [
            i
            for i, c in enumerate(calls)
            if keys.GANG_PLAN in ((c.body.get("metadata") or {}).get("annotations") or {})
        ]
        assert len(marked) >= 4 and max(marked) < min(ungates)
        check_plans(r.pods("team-a"))
        assert await r.schedule() == []
        r.check()
        assert r.status("team-a")["admittedWorkloads"] == 1


async def test_an_elastic_gang_starts_with_what_fits_and_grows(server: localapi.Server) -> None:
    async with team_a(server, "8", 1) as r:
        r.api.create(objects.pod("outside", "default", percent=None, count=2))
        assert await r.schedule() == []
        for i in range(4):
            r.api.create(queued(f"e{i}", "team-a", count=1, gang="elastic", size=4, minimum=2))
        await r.quiet()
        # two GPUs are free: it starts with 2 of its 4 members (gang-min 2)
        assert r.admitted() == ["e0", "e1"]
        assert await r.schedule() == []
        started = members(r, "elastic")
        counts = {
            pod["metadata"]["name"]: (pod["metadata"].get("annotations") or {}).get(keys.GANG_COUNT)
            for pod in started
        }
        assert counts["e0"] == counts["e1"] == "2"
        # the pod outside goes: the gang grows by its missing members
        r.api.delete("pods", "outside", "default")
        await r.quiet()
        assert r.admitted() == ["e0", "e1", "e2", "e3"]
        assert await r.schedule() == []
        r.check()
        grown = {
            pod["metadata"]["name"]: pod["metadata"]["annotations"].get(keys.GANG_COUNT)
            for pod in members(r, "elastic")
        }
        assert grown["e2"] == grown["e3"] == "4"


async def test_a_reclaim_takes_an_elastic_gangs_extras_first(server: localapi.Server) -> None:
    nodes(server.api, 2, gpus=4)
    two_teams(server.api)
    async with rig(server) as r:
        for i in range(3):
            r.api.create(queued(f"a{i}", "team-a", count=2, gang="wide", size=3, minimum=1))
        r.api.create(queued("a-solo", "team-a", count=1))
        await r.quiet()
        assert r.admitted() == ["a-solo", "a0", "a1", "a2"]  # 7 GPUs: 3 borrowed
        assert await r.schedule() == []
        r.api.create(queued("b0", "team-b", count=2))
        await r.quiet()
        # one 2-GPU extra of the elastic gang is given back, not the whole gang nor a-solo
        gone = deleting(r.api)
        assert len(gone) == 1 and gone[0] in ("a1", "a2")
        kubelet_finishes(r.api)
        await r.quiet()
        assert r.admitted("team-b") == ["b0"]
        assert await r.schedule() == []
        r.check()


def test_the_webhook_gives_an_elastic_member_its_count_through_the_downward_api() -> None:
    env = mutating.gang_count_env()
    assert env["name"] == "GPUPLACE_GANG_COUNT"
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == (
        f"metadata.annotations['{keys.GANG_COUNT}']"
    )


async def test_a_queued_gang_that_loses_a_member_restarts_through_its_queue(
    server: localapi.Server,
) -> None:
    """Issue 45: a queued gang's member fails; the gang controller evicts the others, and
    the members its owner creates again wait behind the queue gate until the old run has
    stopped (quota and room free beside it notwithstanding), then are admitted whole as a
    new run, through the queue."""
    async with team_a(server, "8", 2) as r:
        for i in range(3):
            r.api.create(queued(f"w{i}", "team-a", count=1, gang="train", size=3))
        await r.quiet()
        await eventually(lambda: not any(gated(pod) for pod in members(r, "train")), 30.0)
        assert await r.schedule() == []
        first = {plan_mark(pod).run_id for pod in members(r, "train")}  # type: ignore[union-attr]
        failed = {
            "phase": "Failed",
            "containerStatuses": [{"name": "main", "state": {"terminated": {"exitCode": 1}}}],
        }
        r.api.patch("pods", "w1", {"status": failed}, "team-a", subresource="status")
        await eventually(lambda: deleting(r.api) == ["w0", "w2"], 30.0)
        for i in range(3):
            r.api.create(queued(f"n{i}", "team-a", count=1, gang="train", size=3))
        await r.quiet()
        await r.quiet()
        assert not [name for name in r.admitted() if name.startswith("n")]
        said = await events(r, "team-a", "QueueWaiting")
        assert any("gang train restarts after a member failed" in message for message in said)
        kubelet_finishes(r.api)
        await r.quiet()
        await eventually(
            lambda: (
                not any(
                    gated(pod) for pod in members(r, "train") if pod["metadata"]["name"][0] == "n"
                )
            ),
            30.0,
        )
        new = [pod for pod in members(r, "train") if pod["metadata"]["name"][0] == "n"]
        runs = {plan_mark(pod).run_id for pod in new}  # type: ignore[union-attr]
        assert len(runs) == 1 and not runs & first
        assert await r.schedule() == []
        r.check()
