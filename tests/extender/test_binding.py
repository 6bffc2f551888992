"""bind under retries, crashes and concurrency; the ledger after restarts and deletions."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import assignments, keys, recording
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
        # one API write per bind: the Binding carries the assignment (no PATCH, so no
        # validating-webhook round trip inside it either)
        assert patches(server.api, "p") == 0
        assert len(server.api.calls_to("POST", "/pods/p/binding$")) == 1
        bound = h.pod("default", "p")
        assert bound["spec"]["nodeName"] == "n0"
        assert bound["metadata"]["annotations"][keys.ASSIGNED_NODE] == "n0"
        other = await h.bind(pod, "n1")
        assert "already bound to n0" in other


async def test_a_binding_of_unknown_outcome_keeps_its_gpus_for_the_retry(
    server: localapi.Server,
) -> None:
    """A 5xx may mean the write landed: the hold stays (nobody else takes those GPUs), the
    pod is neither bound nor annotated, and kube-scheduler's retry binds it there."""
    server.api.create(objects.node("n0", gpus=1))
    server.api.create(objects.node("n1", gpus=1))
    async with harness(server) as h:
        await ready(h)
        pod = server.api.create(objects.pod("p", percent=60))
        server.api.fail("POST", "/pods/p/binding$", 500, message="etcd timeout")
        error = await h.bind(pod, "n1")
        assert "etcd timeout" in error
        unbound = h.pod("default", "p")
        assert keys.ASSIGNED_NODE not in (unbound["metadata"].get("annotations") or {})
        assert "nodeName" not in unbound["spec"]
        uid = pod["metadata"]["uid"]
        grant = h.sidecar.sync.ledger.get(uid)
        assert grant is not None and grant.node == "n1"
        assert grant.state is GrantState.RESERVED
        # nobody else takes the held share
        other = server.api.create(objects.pod("other", percent=60))
        assert (await h.filter(other, ["n1"]))["NodeNames"] == []
        assert await h.bind(unbound, "n0") != ""  # not where the GPUs are held
        assert await h.bind(unbound, "n1") == ""
        assert patches(server.api, "p") == 0
        assert h.pod("default", "p")["spec"]["nodeName"] == "n1"
        await h.synced(lambda: confirmed(h, uid))
        final = h.sidecar.sync.ledger.get(uid)
        assert final is not None and (final.node, final.gpus) == (grant.node, grant.gpus)


async def test_a_refused_binding_frees_its_gpus_at_once(server: localapi.Server) -> None:
    """A 4xx means nothing was written: the hold goes with the answer."""
    server.api.create(objects.node("n0", gpus=1))
    async with harness(server) as h:
        await ready(h)
        pod = server.api.create(objects.pod("p", percent=60))
        server.api.fail("POST", "/pods/p/binding$", 403, message="forbidden")
        assert "forbidden" in await h.bind(pod, "n0")
        assert pod["metadata"]["uid"] not in h.sidecar.sync.ledger
        assert await h.bind(pod, "n0") == ""


async def test_a_crash_during_the_binding_leaves_no_grant_after_restart(
    server: localapi.Server,
) -> None:
    """The hold lived only in memory and the one write did not land: the restarted
    sidecar sees a pod with no grant, and binds it afresh."""
    server.api.create(objects.node("n0", gpus=1))
    pod = server.api.create(objects.pod("p", percent=60))
    async with harness(server) as h:
        await ready(h)
        server.api.fail("POST", "/pods/p/binding$", 503, times=1)
        assert await h.bind(pod, "n0") != ""
    async with harness(server) as restarted:
        await ready(restarted)
        assert pod["metadata"]["uid"] not in restarted.sidecar.sync.ledger
        assert await restarted.bind(h.pod("default", "p"), "n0") == ""
        assert restarted.pod("default", "p")["spec"]["nodeName"] == "n0"
        await restarted.synced(lambda: confirmed(restarted, pod["metadata"]["uid"]))


async def test_a_pod_annotated_by_an_earlier_version_is_bound_without_a_new_assignment(
    server: localapi.Server,
) -> None:
    """Pods annotated but unbound (left by versions that wrote the assignment first, or
    by a gang plan) are RESERVED from the API; their bind writes only the Binding."""
    server.api.create(objects.node("n0", gpus=1))
    server.api.create(objects.node("n1", gpus=1))
    async with harness(server) as h:
        await ready(h)
        pod = server.api.create(objects.pod("p", percent=60))
        server.api.fail("POST", "/pods/p/binding$", 500)
        assert await h.bind(pod, "n1") != ""
        grant = h.sidecar.sync.ledger.get(pod["metadata"]["uid"])
        assert grant is not None
        notes = assignments.annotations_for(
            grant, h.sidecar.sync.ledger.inventory.get("n1"), datetime.now(UTC)
        )
    annotated = server.api.patch("pods", "p", {"metadata": {"annotations": notes}}, "default")
    async with harness(server) as restarted:
        await ready(restarted)
        uid = pod["metadata"]["uid"]
        await restarted.synced(lambda: uid in restarted.sidecar.sync.ledger)
        rebuilt = restarted.sidecar.sync.ledger.get(uid)
        assert rebuilt is not None and rebuilt.state is GrantState.RESERVED
        verdict = await restarted.filter(annotated, ["n0", "n1"])
        assert verdict["NodeNames"] == ["n1"]
        assert await restarted.bind(annotated, "n1") == ""
        assert server.api.calls_to("POST", "/pods/p/binding$")
        body = server.api.calls_to("POST", "/pods/p/binding$")[-1].body
        assert "annotations" not in body["metadata"]
        await restarted.synced(lambda: confirmed(restarted, uid))


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
            if index == 5:  # a bind whose outcome is unknown: its hold lives in memory only
                server.api.fail("POST", f"/pods/p{index}/binding$", 500)
                assert await h.bind(pod, await first_fit(h, pod)) != ""
                assert h.sidecar.sync.hold_of(pod["metadata"]["uid"]) is not None
                h.sidecar.sync.unhold(pod["metadata"]["uid"])  # its deadline, come early
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
    server.api.fail("POST", "/pods/p/binding$", 0, delay=0.2)
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


async def test_stale_reservations_are_released_by_the_reaper(server: localapi.Server) -> None:
    """A bind's hold whose Binding never landed expires at its deadline; a pod annotated
    but never bound (a gang plan, or an earlier version's first write) loses its
    assignment after the reservation timeout, with an Event. Both GPUs return."""
    server.api.create(objects.node("n0", gpus=1))
    server.api.create(objects.node("n1", gpus=1))
    async with harness(server, reservation_timeout_seconds=0.05) as h:
        await ready(h)
        pod = server.api.create(objects.pod("p", percent=100))
        server.api.fail("POST", "/pods/p/binding$", 500)
        assert await h.bind(pod, "n0") != ""
        uid = pod["metadata"]["uid"]
        assert h.sidecar.sync.hold_of(uid) is not None
        await asyncio.sleep(0.1)
        released = h.sidecar.registry.get_sample_value(
            "gpuplace_reservations_expired_total", {"kind": "hold"}
        )
        assert await h.sidecar.reaper.sweep() == 1
        assert uid not in h.sidecar.sync.ledger
        assert (
            h.sidecar.registry.get_sample_value(
                "gpuplace_reservations_expired_total", {"kind": "hold"}
            )
            == (released or 0) + 1
        )
        await h.schedule(h.pod("default", "p"))

        old = server.api.create(objects.pod("old", percent=100))
        grant_node = "n1" if h.pod("default", "p")["spec"]["nodeName"] == "n0" else "n0"
        notes = {
            keys.ASSIGNED_NODE: grant_node,
            keys.ASSIGNED_GPUS: "0",
            keys.ASSIGNED_UUIDS: "",
            keys.VISIBLE_DEVICES: "0",
            keys.ASSIGNED_MILLI: "1000",
            keys.ASSIGNED_MEMORY: "0",
            keys.ASSIGNED_AT: assignments.rfc3339(datetime.now(UTC)),
        }
        server.api.patch("pods", "old", {"metadata": {"annotations": notes}}, "default")
        old_uid = old["metadata"]["uid"]
        await h.synced(lambda: old_uid in h.sidecar.sync.ledger)
        h.sidecar.reaper.wall = lambda: time.time() + 2  # assigned-at has 1 s resolution
        assert await h.sidecar.reaper.sweep() == 1
        await h.synced(lambda: old_uid not in h.sidecar.sync.ledger)
        assert keys.ASSIGNED_NODE not in h.pod("default", "old")["metadata"]["annotations"]
        await h.synced(
            lambda: any(
                e["reason"] == "GpuReservationExpired"
                for e in server.api.objects("events", "default")
            )
        )
        await h.schedule(h.pod("default", "old"))


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
