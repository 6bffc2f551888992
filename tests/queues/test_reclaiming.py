"""A queue takes back what its cohort lent: exactly the needed borrowed workloads are
evicted through the Eviction API (PodDisruptionBudgets honoured, `DisruptionTarget` set,
which a Job's podFailurePolicy ignores), and the waiting workload is admitted on their
GPUs once they are gone."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from gpuplace.cluster import assignments, keys
from gpuplace.dev import localapi
from tests.gangs.rig import Clock
from tests.queues.rig import (
    FAST,
    Rig,
    events,
    gpuqueue,
    namespace,
    nodes,
    queued,
    rig,
    two_teams,
)


def deleting(api: localapi.FakeApi) -> list[str]:
    """Pods being deleted (evicted and not yet gone), by name."""
    return sorted(
        pod["metadata"]["name"]
        for pod in api.objects("pods")
        if pod["metadata"].get("deletionTimestamp")
    )


def kubelet_finishes(api: localapi.FakeApi) -> None:
    """The kubelets stop every pod being deleted."""
    for pod in api.objects("pods"):
        if pod["metadata"].get("deletionTimestamp"):
            api.delete("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])


def budget(api: localapi.FakeApi, namespace: str, labels: dict[str, str], allowed: int) -> None:
    """A PodDisruptionBudget as the disruption controller keeps its status."""
    api.create(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "keep", "namespace": namespace},
            "spec": {"selector": {"matchLabels": labels}, "maxUnavailable": allowed},
        }
    )
    status = {
        "disruptionsAllowed": allowed,
        "currentHealthy": 6,
        "desiredHealthy": 6 - allowed,
        "expectedPods": 6,
        "observedGeneration": 1,
    }
    api.patch(
        "policy/poddisruptionbudgets", "keep", {"status": status}, namespace, subresource="status"
    )


async def borrowing_a(r: Rig) -> None:
    """docs/queues.md's example, steps 1-2: a runs six 1-GPU pods (2 borrowed), b one
    2-GPU pod; the 8 GPUs are full."""
    for i in range(6):
        r.api.create(queued(f"a{i}", "team-a"))
        await r.quiet()  # one at a time: a5 and a4 are the most recently admitted
        r.clock.offset += 2.0  # `assigned-at` counts seconds
    assert await r.schedule() == []
    r.api.create(queued("b0", "team-b", count=2))
    await r.quiet()
    assert r.admitted("team-b") == ["b0"]
    assert await r.schedule() == []
    assert r.status("team-a")["resources"][0]["borrowed"] == "2"


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for item in (pod.get("status") or {}).get("conditions") or []:
        if item.get("type") == kind:
            return dict(item)
    return None


async def test_reclaim_evicts_exactly_the_needed_borrowed_pods(server: localapi.Server) -> None:
    nodes(server.api, 2, gpus=4)
    two_teams(server.api)
    async with rig(server) as r:
        await borrowing_a(r)
        r.api.create(queued("b1", "team-b", count=2))
        await r.quiet()
        # the two most recently admitted of a's pods, and only they, are being evicted
        assert deleting(r.api) == ["a4", "a5"]
        for name in ("a4", "a5"):
            target = condition(r.pod(name), "DisruptionTarget")
            assert target is not None and target["reason"] == "EvictionByEvictionAPI"
        assert r.waiting("team-b") == ["b1"]
        evictions = r.api.calls_to("POST", r"/pods/a\d/eviction$")
        assert len(evictions) == 2
        assert all(call.body["deleteOptions"]["preconditions"]["uid"] for call in evictions)
        said = await events(r, "team-b", "QueueReclaiming")
        assert len(said) == 1 and "a4" in said[0] and "a5" in said[0]
        assert len(await events(r, "team-a", "GpuPreempted")) == 2
        assert r.metric("gpuplace_queue_reclaims_total", {"queue": "team-b"}) == 1
        assert r.metric("gpuplace_queue_preempted_pods_total", {"queue": "team-a"}) == 2
        # rounds go on while the victims terminate: nothing more is evicted
        await r.rounds(3)
        assert len(r.api.calls_to("POST", r"/eviction$")) == 2
        kubelet_finishes(r.api)
        await r.quiet()
        assert r.admitted("team-b") == ["b0", "b1"]
        assert await r.schedule() == []
        r.check()
        assert r.status("team-a")["resources"][0]["borrowed"] == "0"
        assert r.status("team-b")["resources"][0]["used"] == "4"


async def test_a_disruption_budget_blocks_the_reclaim_and_nothing_is_evicted(
    server: localapi.Server,
) -> None:
    nodes(server.api, 2, gpus=4)
    two_teams(server.api)
    async with rig(server) as r:
        await borrowing_a(r)
        budget(r.api, "team-a", {keys.QUEUE_LABEL: "team-a"}, allowed=1)
        r.api.create(queued("b1", "team-b", count=2))
        await r.quiet()
        # two victims are needed and the budget allows one: none is evicted
        assert deleting(r.api) == []
        assert r.api.calls_to("POST", r"/eviction$") == []
        said = await events(r, "team-b", "QueueReclaimBlocked")
        assert len(said) == 1 and "PodDisruptionBudget" in said[0], said
        assert r.waiting("team-b") == ["b1"]
        # the budget allows two: the reclaim goes through (after its retry wait)
        budget_status = {"disruptionsAllowed": 2}
        r.api.patch(
            "policy/poddisruptionbudgets",
            "keep",
            {"status": budget_status},
            "team-a",
            subresource="status",
        )
        r.clock.offset += 1.0
        await asyncio.sleep(FAST.poll_seconds)  # a budget is no event: the next poll decides
        await r.quiet()
        assert deleting(r.api) == ["a4", "a5"]
        kubelet_finishes(r.api)
        await r.quiet()
        assert r.admitted("team-b") == ["b0", "b1"]
        r.check()


async def test_reclaim_never_below_the_victims_nominal(server: localapi.Server) -> None:
    """a uses only its nominal: a waiting b pod beyond the free GPUs does not evict it."""
    nodes(server.api, 2, gpus=4)
    two_teams(server.api)
    async with rig(server) as r:
        for i in range(4):
            r.api.create(queued(f"a{i}", "team-a"))
        r.api.create(queued("b0", "team-b", count=4))
        await r.quiet()
        assert await r.schedule() == []
        r.api.create(queued("b1", "team-b", count=1))
        await r.quiet()
        assert deleting(r.api) == []
        assert r.waiting("team-b") == ["b1"]
        r.check()


async def test_a_reclaim_in_flight_survives_a_restart(server: localapi.Server) -> None:
    nodes(server.api, 2, gpus=4)
    two_teams(server.api)
    async with rig(server) as r:
        await borrowing_a(r)
        r.api.create(queued("b1", "team-b", count=2))
        await r.quiet()
        assert deleting(r.api) == ["a4", "a5"]
    async with rig(server) as r:
        await r.quiet()
        # the new controller reads the victims as leaving from the pods: no new eviction
        assert len(r.api.calls_to("POST", r"/eviction$")) == 2
        kubelet_finishes(r.api)
        await r.quiet()
        assert r.admitted("team-b") == ["b0", "b1"]
        r.check()


@dataclass
class Stopped(Clock):
    """A wall clock that does not move (but by `offset`): every admission reads the same
    instant, as admissions within one second did in whole-second `assigned-at`."""

    at: float = field(default_factory=lambda: float(int(time.time())))

    def __call__(self) -> float:
        return self.at + self.offset


def lending_teams(api: localapi.FakeApi) -> None:
    """Issue 41's queues: a and b of 2 GPUs each in one cohort, a may borrow 2."""
    namespace(api, "team-a", team="a")
    namespace(api, "team-b", team="b")
    api.create(gpuqueue("team-a", "2", cohort="research", borrowing="2"))
    api.create(gpuqueue("team-b", "2", cohort="research"))


async def admit_one_by_one(r: Rig, names: list[str]) -> None:
    for name in names:
        r.api.create(queued(name, "team-a"))
        await r.quiet()
        assert name in r.admitted("team-a")
    assert await r.schedule() == []


def admitted_at(r: Rig, name: str) -> float:
    found = assignments.assigned_at(r.pod(name))
    assert found is not None
    return found


async def test_the_most_recently_admitted_goes_first_within_one_second(
    server: localapi.Server,
) -> None:
    """Issue 41: a admits a0..a3 one after another, all within one second (the clock
    does not move at all): b's pod takes back a3, the last one admitted, not a0 (the
    first by name, which a tie in whole seconds used to evict)."""
    nodes(server.api, 1, gpus=4)
    lending_teams(server.api)
    async with rig(server, clock=Stopped(), gangs=False) as r:
        await admit_one_by_one(r, ["a0", "a1", "a2", "a3"])
        times = [admitted_at(r, f"a{i}") for i in range(4)]
        assert times == sorted(times) and len(set(times)) == 4
        assert times[-1] - times[0] < 1.0
        r.api.create(queued("b0", "team-b"))
        await r.quiet()
        assert deleting(r.api) == ["a3"]
        kubelet_finishes(r.api)
        await r.quiet()
        assert r.admitted("team-b") == ["b0"]
        r.check()


async def test_the_admission_order_survives_a_restart_on_a_clock_behind(
    server: localapi.Server,
) -> None:
    """Issue 41, across a restart: a0..a2 are admitted, the sidecar restarts (its ledger
    and the admission order rebuilt from the pods) on a clock 10 s behind the first
    one's (a lease moved to a host whose clock is behind), and admits a3: a3 is still
    the most recently admitted, and the one b's pod takes back."""
    nodes(server.api, 1, gpus=4)
    lending_teams(server.api)
    first = Stopped()
    async with rig(server, clock=first, gangs=False) as r:
        await admit_one_by_one(r, ["a0", "a1", "a2"])
    async with rig(server, clock=Stopped(at=first.at - 10.0), gangs=False) as r:
        await r.quiet()
        await admit_one_by_one(r, ["a3"])
        assert admitted_at(r, "a3") > max(admitted_at(r, f"a{i}") for i in range(3))
        r.api.create(queued("b0", "team-b"))
        await r.quiet()
        assert deleting(r.api) == ["a3"]
        r.check()
