"""bind under retries, crashes and concurrency; the ledger after restarts and deletions."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import keys, recording
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.placement.ledger import GrantState
from tests.extender.conftest import Harness, Unschedulable, harness


async def ready(h: Harness) -> None:
    await asyncio.wait_for(h.sidecar.sync.ready.wait(), 5)


def patches(api: localapi.FakeApi, name: str) -> int:
    return len(api.calls_to("PATCH", f"/pods/{name}$"))


def confirmed(h: Harness, uid: str) -> bool:
    grant = h.sidecar.sync.ledger.get(uid)
    return grant is not None and grant.state is GrantState.CONFIRMED


async def test_retried_bind_is_idempotent(server: localapi.Server) -> None:
    server.api.create(objects.node("n0", gpus=1))
    async with harness(server) as h:
        await ready(h)
        pod = server.api.create(objects.pod("p", percent=30))
        assert await h.bind(pod, "n0") == ""
        assert await h.bind(pod, "n0") == ""  # kube-scheduler retried: same answer
        assert patches(server.api, "p") == 1
        assert len(server.api.calls_to("POST", "/pods/p/binding$")) == 1
        other = await h.bind(pod, "n1")
        assert "already bound to n0" in other


async def test_crash_between_annotation_and_binding_is_repaired_by_next_bind(
    server: localapi.Server,
) -> None:
    server.api.create(objects.node("n0", gpus=1))
    server.api.create(objects.node("n1", gpus=1))
    async with harness(server) as h:
        await ready(h)
        pod = server.api.create(objects.pod("p", percent=60))
        server.api.fail("POST", "/pods/p/binding$", 500, message="etcd timeout")
        error = await h.bind(pod, "n1")
        assert "etcd timeout" in error
        annotated = h.pod("default", "p")
        assert annotated["metadata"]["annotations"][keys.ASSIGNED_NODE] == "n1"
        assert "nodeName" not in annotated["spec"]
        uid = pod["metadata"]["uid"]
        await h.synced(lambda: h.sidecar.sync.pods[uid].grant is not None)
        grant = h.sidecar.sync.ledger.get(uid)
        assert grant is not None and grant.state is GrantState.RESERVED
        # the retry is offered only the reserved node, and n0 is out for good
        verdict = await h.filter(annotated, ["n0", "n1"])
        assert verdict["NodeNames"] == ["n1"]
        assert "n0" in verdict["FailedAndUnresolvableNodes"]
        assert await h.bind(annotated, "n0") != ""  # not where the GPUs are reserved
        assert await h.bind(annotated, "n1") == ""
        assert patches(server.api, "p") == 1  # the assignment was not written twice
        assert h.pod("default", "p")["spec"]["nodeName"] == "n1"
        await h.synced(lambda: confirmed(h, uid))


async def test_crash_of_the_sidecar_after_annotating_is_repaired_after_restart(
    server: localapi.Server,
) -> None:
    server.api.create(objects.node("n0", gpus=1))
    pod = server.api.create(objects.pod("p", percent=60))
    async with harness(server) as h:
        await ready(h)
        server.api.fail("POST", "/pods/p/binding$", 503, times=1)
        assert await h.bind(pod, "n0") != ""
    async with harness(server) as restarted:
        await ready(restarted)
        grant = restarted.sidecar.sync.ledger.get(pod["metadata"]["uid"])
        assert grant is not None and grant.state is GrantState.RESERVED
        # no other pod can take what the crashed bind reserved
        big = server.api.create(objects.pod("big", percent=50))
        verdict = await restarted.filter(big, ["n0"])
        assert verdict["NodeNames"] == []
        assert await restarted.bind(h.pod("default", "p"), "n0") == ""
        assert restarted.pod("default", "p")["spec"]["nodeName"] == "n0"


async def test_restart_rebuilds_an_identical_ledger(server: localapi.Server) -> None:
    rng = random.Random(3)
    for index in range(4):
        server.api.create(objects.node(f"n{index}", gpus=4, uuids=index % 2 == 0))
    async with harness(server) as h:
        await ready(h)
        for index in range(14):
            kind = rng.choice(["share", "whole", "multi"])
            if kind == "share":
                body = objects.pod(f"p{index}", percent=rng.choice([10, 25, 50]), memory="4Gi")
            elif kind == "whole":
                body = objects.pod(f"p{index}", percent=None, count=1)
            else:
                body = objects.pod(f"p{index}", percent=None, count=2)
            pod = server.api.create(body)
            if index == 5:
                server.api.fail("POST", f"/pods/p{index}/binding$", 500)
                assert await h.bind(pod, await first_fit(h, pod)) != ""
                continue
            with contextlib.suppress(Unschedulable):  # stays pending, holds nothing
                await h.schedule(pod, rng)
        server.api.set_phase("default", "p1", "Succeeded")
        server.api.delete("pods", "p2", "default")
        sync = h.sidecar.sync
        await h.synced(lambda: settled(server.api, h))
        before = sync.ledger.snapshot()
    async with harness(server) as restarted:
        await ready(restarted)
        assert restarted.sidecar.sync.ledger.snapshot() == before
        states = {
            node: (state.free_milli, state.free_memory)
            for node in ("n0", "n1", "n2", "n3")
            if (state := restarted.sidecar.sync.ledger.state(node)) is not None
        }
        assert len(states) == 4


def settled(api: localapi.FakeApi, h: Harness) -> bool:
    """The ledger shows exactly the API's assignments (bound = CONFIRMED)."""
    expected = {}
    for pod in api.objects("pods"):
        notes = pod["metadata"].get("annotations") or {}
        if keys.ASSIGNED_NODE in notes and pod["status"].get("phase") not in (
            "Succeeded",
            "Failed",
        ):
            expected[pod["metadata"]["uid"]] = bool(pod["spec"].get("nodeName"))
    actual = {g.pod_uid: g.state is GrantState.CONFIRMED for g in h.sidecar.sync.ledger}
    return actual == expected


async def first_fit(h: Harness, pod: dict[str, Any]) -> str:
    verdict = await h.filter(pod, sorted(h.sidecar.sync.nodes))
    return str(verdict["NodeNames"][0])


async def test_deleted_or_finished_pods_free_their_gpus(server: localapi.Server) -> None:
    server.api.create(objects.node("n0", gpus=1))
    async with harness(server) as h:
        await ready(h)
        first = server.api.create(objects.pod("first", percent=None, count=1))
        await h.schedule(first)
        second = server.api.create(objects.pod("second", percent=None, count=1))
        assert (await h.filter(second, ["n0"]))["NodeNames"] == []
        server.api.delete("pods", "first", "default")
        await h.synced(lambda: first["metadata"]["uid"] not in h.sidecar.sync.ledger)
        await h.schedule(second)
        third = server.api.create(objects.pod("third", percent=None, count=1))
        server.api.set_phase("default", "second", "Failed")
        await h.synced(lambda: second["metadata"]["uid"] not in h.sidecar.sync.ledger)
        await h.schedule(third)


async def test_concurrent_binds_for_one_pod_do_not_double_grant(server: localapi.Server) -> None:
    server.api.create(objects.node("n0", gpus=2))
    server.api.fail("PATCH", "/pods/p$", 0, delay=0.2)
    async with harness(server) as h:
        await ready(h)
        pod = server.api.create(objects.pod("p", percent=40))
        results = await asyncio.gather(h.bind(pod, "n0"), h.bind(pod, "n0"))
        assert sorted(results)[0] == ""
        assert "in progress" in sorted(results)[1]
        assert len(h.sidecar.sync.ledger) == 1


async def test_pod_replaced_under_the_same_name_is_refused(server: localapi.Server) -> None:
    server.api.create(objects.node("n0", gpus=1))
    async with harness(server) as h:
        await ready(h)
        old = server.api.create(objects.pod("p", percent=40))
        server.api.delete("pods", "p", "default")
        server.api.create(objects.pod("p", percent=40))
        error = await h.bind(old, "n0")
        assert "replaced" in error or "no longer exists" in error
        assert len(h.sidecar.sync.ledger) == 0 or all(
            g.pod_uid != old["metadata"]["uid"] for g in h.sidecar.sync.ledger
        )


async def test_stale_reservation_is_released_by_the_reaper(server: localapi.Server) -> None:
    server.api.create(objects.node("n0", gpus=1))
    async with harness(server, reservation_timeout_seconds=0.05) as h:
        await ready(h)
        pod = server.api.create(objects.pod("p", percent=100))
        server.api.fail("POST", "/pods/p/binding$", 500)
        assert await h.bind(pod, "n0") != ""
        uid = pod["metadata"]["uid"]
        await h.synced(lambda: h.sidecar.sync.pods[uid].grant is not None)
        h.sidecar.reaper.wall = lambda: time.time() + 2  # assigned-at has 1 s resolution
        assert await h.sidecar.reaper.sweep() == 1
        await h.synced(lambda: uid not in h.sidecar.sync.ledger)
        assert keys.ASSIGNED_NODE not in h.pod("default", "p")["metadata"]["annotations"]
        await h.synced(
            lambda: any(
                e["reason"] == "GpuReservationExpired"
                for e in server.api.objects("events", "default")
            )
        )
        await h.schedule(h.pod("default", "p"))


async def test_metrics_are_exported(server: localapi.Server) -> None:
    server.api.create(objects.node("n0", gpus=2))
    async with harness(server) as h:
        await ready(h)
        await h.schedule(server.api.create(objects.pod("p", percent=50)))
        registry: CollectorRegistry = h.sidecar.registry
        assert registry.get_sample_value("gpuplace_ledger_allocated_milligpus") == 500
        assert registry.get_sample_value("gpuplace_ledger_capacity_milligpus") == 2000
        assert (
            registry.get_sample_value(
                "gpuplace_extender_request_duration_seconds_count", {"verb": "bind", "result": "ok"}
            )
            == 1
        )


async def test_stopping_while_the_api_takes_no_events_still_stops_cleanly(
    server: localapi.Server,
) -> None:
    """On stop the sidecar writes the Events still queued for at most 2 s; an API that does
    not take them (slow or hung) costs those Events, never a stop that raises and leaves
    the API client open (seen under load: TimeoutError out of `Sidecar.running`)."""
    server.api.create(objects.node("n0", gpus=1))
    stopped_at = 0.0
    async with harness(server) as h:
        await ready(h)
        server.api.fail("POST", "/events$", 0, delay=30.0, times=100)
        recorder = h.sidecar.recorder
        assert recorder is not None
        for n in range(3):
            subject = recording.Subject("default", f"p{n}", f"uid-{n}")
            recorder.emit(subject, "Normal", "Testing", f"event {n}")
        sidecar = h.sidecar
        stopped_at = time.monotonic()
    assert time.monotonic() - stopped_at < 10.0
    assert sidecar.api.api_client.rest_client.pool_manager.closed
