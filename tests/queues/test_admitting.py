"""The queue controller admits queued pods against the local API (shipped RBAC), beside
the real extender verbs: in order, within quota, borrowing through its cohort, with its
status, Events and metrics."""

from __future__ import annotations

import asyncio
import dataclasses

from gpuplace.cluster import keys
from gpuplace.cluster.gang_marks import gated
from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from tests.queues.rig import FAST, events, gpuqueue, namespace, nodes, queued, rig, two_teams


async def test_queued_pods_are_admitted_within_quota_in_priority_then_age_order(
    server: localapi.Server,
) -> None:
    nodes(server.api, 2, gpus=4)
    namespace(server.api, "team-a", team="a")
    server.api.create(gpuqueue("team-a", "3"))
    # one round sees them all; creationTimestamp counts seconds
    server.api.create(queued("old", "team-a"))
    await asyncio.sleep(1.05)
    server.api.create(queued("young", "team-a"))
    await asyncio.sleep(1.05)
    server.api.create(queued("last", "team-a"))
    server.api.create(queued("urgent", "team-a", priority=100))
    async with rig(server) as r:
        await r.quiet()
        # three GPUs of quota: the urgent one, then the oldest two; `last` waits for quota
        assert r.admitted() == ["old", "urgent", "young"]
        assert r.waiting() == ["last"]
        for name in r.admitted():
            pod = r.pod(name)
            node = pod["metadata"]["annotations"][keys.ASSIGNED_NODE]
            assert NodeAffinity.of(pod).pinned_to() == node
        assert await r.schedule() == []
        r.check()
        status = r.status("team-a")
        assert status["admittedWorkloads"] == 3
        assert status["waitingWorkloads"] == 1 and status["waitingPods"] == 1
        assert status["resources"] == [
            {"name": "gpus", "model": "*", "used": "3", "borrowed": "0", "lent": "0"}
        ]
        assert status["conditions"][0]["type"] == "Active"
        assert status["conditions"][0]["status"] == "True"
        assert r.metric("gpuplace_queue_admitted_workloads", {"queue": "team-a"}) == 3
        assert r.metric("gpuplace_queue_waiting_pods", {"queue": "team-a"}) == 1
        assert r.metric("gpuplace_queue_admissions_total", {"queue": "team-a"}) == 3
        said = await events(r, "team-a", "QueueWaiting")
        assert len(said) == 1 and "quota" in said[0]
        assert len(await events(r, "team-a", "QueueAdmitted")) == 3
        # a pod finishes: its quota comes back and the next one is admitted
        r.finish("old")
        await r.quiet()
        assert r.admitted() == ["last", "old", "urgent", "young"]
        assert await r.schedule() == []
        r.check()


async def test_a_pod_is_admitted_only_where_a_gpu_is_free(server: localapi.Server) -> None:
    """Quota for 4 GPUs, but the only node has 2 free whole GPUs (2 run outside queues):
    a 4-GPU pod waits for a place rather than being admitted to wait for a GPU."""
    nodes(server.api, 1, gpus=4)
    namespace(server.api, "team-a", team="a")
    server.api.create(gpuqueue("team-a", "8"))
    async with rig(server) as r:
        r.api.create(objects.pod("outside", "default", percent=None, count=2))
        assert await r.schedule() == []
        r.api.create(queued("big", "team-a", count=4))
        r.api.create(queued("small", "team-a", count=2))
        await r.quiet()
        assert r.admitted() == ["small"]
        assert r.waiting() == ["big"]
        assert await r.schedule() == []
        r.check()
        said = await events(r, "team-a", "QueueWaiting")
        assert any("place" in message for message in said)


async def test_a_cohort_lends_idle_quota_and_the_status_shows_it(
    server: localapi.Server,
) -> None:
    nodes(server.api, 2, gpus=4)
    two_teams(server.api)
    async with rig(server) as r:
        for i in range(6):
            r.api.create(queued(f"a{i}", "team-a"))
        await r.quiet()
        assert r.admitted() == [f"a{i}" for i in range(6)]
        assert await r.schedule() == []
        r.check()
        a, b = r.status("team-a"), r.status("team-b")
        assert a["resources"][0]["used"] == "6" and a["resources"][0]["borrowed"] == "2"
        assert b["resources"][0]["lent"] == "2" and b["resources"][0]["used"] == "0"
        assert a["weightedShare"] > 0 and b["weightedShare"] == 0
        said = await events(r, "team-a", "QueueAdmitted")
        assert sum("borrowing from cohort research" in message for message in said) == 2


async def test_a_queue_without_a_cohort_never_borrows(server: localapi.Server) -> None:
    nodes(server.api, 2, gpus=4)
    namespace(server.api, "team-a", team="a")
    server.api.create(gpuqueue("team-a", "2"))
    async with rig(server) as r:
        for i in range(4):
            r.api.create(queued(f"a{i}", "team-a"))
        await r.quiet()
        assert len(r.admitted()) == 2 and len(r.waiting()) == 2
        r.check()


async def test_a_restart_rebuilds_the_same_admissions(server: localapi.Server) -> None:
    nodes(server.api, 2, gpus=4)
    two_teams(server.api)
    for i in range(3):
        server.api.create(queued(f"a{i}", "team-a", count=2))
    async with rig(server) as r:
        await r.quiet()
        first = r.admitted()
        assert len(first) == 3  # 6 GPUs: 4 of its own, 2 borrowed
        assert await r.schedule() == []
        status = r.status("team-a")
    server.api.create(queued("a3", "team-a", count=2))
    async with rig(server) as r:
        await r.quiet()
        # the new controller reads the three admissions from the pods and counts them
        # once: 6 of the cohort's 8 GPUs are used, so a3 (2 GPUs) is admitted and a4
        # (1 more) waits for quota
        assert r.admitted() == ["a0", "a1", "a2", "a3"]
        assert r.status("team-a")["resources"][0]["used"] == "8"
        assert status["resources"][0]["used"] == "6"
        assert await r.schedule() == []
        r.check()
        r.api.create(queued("a4", "team-a", count=1))
        await r.quiet()
        assert "a4" in r.waiting()
        r.check()


async def test_rounds_wait_for_the_leader(server: localapi.Server) -> None:
    nodes(server.api, 1, gpus=4)
    namespace(server.api, "team-a", team="a")
    server.api.create(gpuqueue("team-a", "4"))
    leading = False
    async with rig(server, active=lambda: leading) as r:
        r.api.create(queued("a0", "team-a"))
        await r.rounds(3)
        assert r.waiting() == ["a0"]
        assert r.metric("gpuplace_queue_controller_leading") == 0
        leading = True
        await r.quiet()
        assert r.admitted() == ["a0"]
        assert gated(r.pod("a0"), keys.QUEUE_GATE) is False


async def test_a_cluster_without_queued_pods_runs_no_round_per_bind(
    server: localapi.Server,
) -> None:
    """With a GpuQueue but no pod in any queue, binds of other GPU pods change the ledger
    without making the controller decide again: a round is an O(nodes) copy of the
    ledger, and one per bind stalled the extender's verbs behind it. The first queued pod
    brings the rounds back."""
    nodes(server.api, 2, gpus=4)
    namespace(server.api, "team-a", team="a")
    server.api.create(gpuqueue("team-a", "2"))
    slow = dataclasses.replace(FAST, poll_seconds=3600.0)
    # no new typical workload either (a new policy is a change that makes a round)
    async with rig(server, settings=slow, workload_refresh_seconds=3600.0) as r:
        # the first GPU pod replaces the fallback typical workload: a new policy, a round
        r.api.create(objects.pod("outside-first", "default", percent=None, count=1))
        assert await r.schedule() == []
        await r.quiet()
        decided = r.controller.decisions
        before = r.h.sidecar.sync.ledger.generation
        for index in range(3):
            r.api.create(objects.pod(f"outside-{index}", "default", percent=None, count=1))
        assert await r.schedule() == []
        assert r.h.sidecar.sync.ledger.generation > before
        await r.rounds(3)
        assert r.controller.decisions == decided
        r.api.create(queued("first", "team-a"))
        await r.quiet()
        assert r.controller.decisions > decided
        assert r.admitted() == ["first"]
