"""Managed nodes advertise their GPU totals and NVLink domain label, written only when they
differ; nodes leaving gpuplace lose them. Events are created once, then counted."""

from __future__ import annotations

import asyncio
import contextlib

from gpuplace.cluster import advertising, keys, kube, nodes, recording
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from tests.cluster.conftest import eventually


async def settle(advertiser: advertising.Advertiser, server: localapi.Server) -> None:
    for name in [n["metadata"]["name"] for n in server.api.objects("nodes")]:
        advertiser.observe(nodes.record(server.api.get("nodes", name)))
    await advertiser.flush()


async def test_totals_and_label_written_once(server: localapi.Server, api: kube.Kube) -> None:
    server.api.create(objects.node("a", gpus=4, gpu_memory_mib=81920, nvlink=[0, 0, 0, 1]))
    server.api.create(objects.node("b", gpus=2, gpu_memory_mib=15360))
    server.api.create(objects.node("cpu", gpus=0, enabled=False))
    advertiser = advertising.Advertiser(api, min_interval=0.0)
    await settle(advertiser, server)
    a = server.api.get("nodes", "a")
    for where in ("capacity", "allocatable"):
        assert a["status"][where][keys.RESOURCE_PERCENT] == "400"
        # what the engine packs: GPU Feature Discovery's figure less the stated margin of
        # nodes without the node agent (issue 43)
        assert a["status"][where][keys.RESOURCE_MEMORY] == str(
            4 * (81920 - nodes.UNPUBLISHED_MARGIN_MIB)
        )
        assert a["status"][where]["cpu"] == "64"
    assert a["metadata"]["labels"][keys.NVLINK_DOMAIN_SIZE] == "3"
    assert server.api.get("nodes", "b")["metadata"]["labels"][keys.NVLINK_DOMAIN_SIZE] == "1"
    assert keys.RESOURCE_PERCENT not in server.api.get("nodes", "cpu")["status"]["capacity"]
    writes = len(server.api.calls_to("PATCH", "/api/v1/nodes/"))
    assert writes == 4  # status + label, for a and b
    await settle(advertiser, server)
    assert len(server.api.calls_to("PATCH", "/api/v1/nodes/")) == writes  # nothing changed


async def test_node_leaving_gpuplace_loses_them(server: localapi.Server, api: kube.Kube) -> None:
    server.api.create(objects.node("a", gpus=2))
    advertiser = advertising.Advertiser(api, min_interval=0.0)
    await settle(advertiser, server)
    server.api.patch("nodes", "a", {"metadata": {"labels": {keys.NODE_ENABLED: None}}})
    await settle(advertiser, server)
    a = server.api.get("nodes", "a")
    assert keys.RESOURCE_PERCENT not in a["status"]["capacity"]
    assert keys.RESOURCE_MEMORY not in a["status"]["allocatable"]
    assert keys.NVLINK_DOMAIN_SIZE not in a["metadata"]["labels"]


async def test_failures_are_retried_after_the_interval(
    server: localapi.Server, api: kube.Kube
) -> None:
    server.api.create(objects.node("a", gpus=1))
    server.api.fail("PATCH", "/nodes/a/status$", 500)
    advertiser = advertising.Advertiser(api, min_interval=0.05)
    task = asyncio.create_task(advertiser.run())
    try:
        advertiser.observe(nodes.record(server.api.get("nodes", "a")))
        await eventually(
            lambda: keys.RESOURCE_PERCENT in server.api.get("nodes", "a")["status"]["capacity"]
        )
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_repeated_events_are_counted_not_duplicated(
    server: localapi.Server, api: kube.Kube
) -> None:
    pod = server.api.create(objects.pod("p"))
    recorder = recording.Recorder(api, instance="test")
    subject = recording.Subject("default", "p", pod["metadata"]["uid"])
    for _ in range(3):
        recorder.emit(
            subject, recording.WARNING, "FailedGpuPlacement", "0/1 nodes: 1 wrong GPU model"
        )
    recorder.emit(
        subject, recording.NORMAL, "GpusAssigned", "assigned GPU 0 of node n0 (whole each)"
    )
    await recorder.drain()
    events = {e["reason"]: e for e in server.api.objects("events", "default")}
    assert events["FailedGpuPlacement"]["count"] == 3
    assert events["FailedGpuPlacement"]["involvedObject"]["name"] == "p"
    assert events["FailedGpuPlacement"]["source"] == {"component": "gpuplace"}
    assert events["GpusAssigned"]["type"] == "Normal"
    assert len(server.api.objects("events", "default")) == 2
    recorder.emit(subject, recording.NORMAL, "Long", "x" * 5000)
    await recorder.drain()
    assert (
        len(
            server.api.get(
                "events",
                next(
                    e["metadata"]["name"]
                    for e in server.api.objects("events", "default")
                    if e["reason"] == "Long"
                ),
                "default",
            )["message"]
        )
        == recording.MAX_MESSAGE
    )
