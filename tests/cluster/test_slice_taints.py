"""The sidecar's silence taints (gpuplace.cluster.slice_taints) through the real API client
against the local API, as the sidecar's ServiceAccount with the RBAC components/dra ships:
a DRA node whose agent stopped its heartbeat gets gpu.gpuplace.io/agent-silent on every
device, once per silence; a node speaking, a node with no agent, and a device-plugin node
(no slice: one read per silence) get nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry

from gpuplace.cluster import connecting, dra, keys, kube, nodes, slice_taints
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects

NOW = 1_796_000_000.0  # 2026-11-30
SILENCE = 120.0


def record(name: str, beat: float | None) -> nodes.NodeRecord:
    body = objects.node(name, gpus=1)
    if beat is not None:
        body["metadata"].setdefault("annotations", {})[keys.AGENT_HEARTBEAT] = (
            datetime.fromtimestamp(beat, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        )
    return nodes.record(body)


@pytest.fixture
async def server() -> AsyncIterator[localapi.Server]:
    enforced = localapi.FakeApi(access=localapi.Access.shipped(localapi.DRA_SHIPPED))
    async with localapi.serve(enforced) as running:
        for name in ("silent", "speaking"):
            running.api.create(
                dra.resource_slice(name, "", [dra.GpuDevice(0, f"GPU-{name}", 81559)])
            )
        yield running


@pytest.fixture
async def api(server: localapi.Server) -> AsyncIterator[kube.Kube]:
    made = kube.Kube(connecting.client_for(server.configuration(localapi.GPUPLACE)))
    yield made
    await made.close()


async def test_only_a_silent_dra_nodes_devices_are_tainted_once(
    server: localapi.Server, api: kube.Kube
) -> None:
    registry = CollectorRegistry()
    writer = slice_taints.SilenceTaints(api, silence=SILENCE, wall=lambda: NOW, registry=registry)
    records = [
        record("silent", NOW - SILENCE - 1),
        record("speaking", NOW - 5),
        record("no-agent", None),
        record("device-plugin", NOW - 600),  # silent too, but has no slice
    ]
    assert await writer.check(records) == ["silent"]
    stored = server.api.get(localapi.RESOURCE_SLICES, dra.slice_name("silent"))
    assert stored["spec"]["devices"][0]["taints"] == [
        {"key": dra.SILENT_TAINT, "effect": "NoSchedule", "timeAdded": "2026-11-30T00:53:20Z"}
    ]
    assert not dra.silenced(server.api.get(localapi.RESOURCE_SLICES, dra.slice_name("speaking")))
    reads = len(server.api.calls_to("GET", "/apis/resource.k8s.io/v1/resourceslices/"))
    assert await writer.check(records) == []  # once per silence, no read again
    assert len(server.api.calls_to("GET", "/apis/resource.k8s.io/v1/resourceslices/")) == reads
    sample = registry.get_sample_value
    assert sample("gpuplace_slice_silence_taints_total", {"result": "tainted"}) == 1
    assert sample("gpuplace_slice_silence_taints_total", {"result": "no-slice"}) == 1


async def test_a_node_silent_again_is_judged_again(server: localapi.Server, api: kube.Kube) -> None:
    clock = [NOW]
    writer = slice_taints.SilenceTaints(api, silence=SILENCE, wall=lambda: clock[0])
    assert await writer.check([record("silent", NOW - SILENCE - 1)]) == ["silent"]
    name = dra.slice_name("silent")
    cleared = dra.without_silence(server.api.get(localapi.RESOURCE_SLICES, name))
    server.api.patch(localapi.RESOURCE_SLICES, name, {"spec": cleared["spec"]})  # the agent
    assert await writer.check([record("silent", NOW)]) == []  # it speaks
    clock[0] = NOW + 2 * SILENCE
    assert await writer.check([record("silent", NOW)]) == ["silent"]


async def test_no_bound_no_taints(api: kube.Kube) -> None:
    writer = slice_taints.SilenceTaints(api, silence=0, wall=lambda: NOW)
    assert await writer.check([record("silent", NOW - 10_000)]) == []


async def test_a_refused_write_is_tried_again(server: localapi.Server) -> None:
    # the sidecar without the DRA component's RBAC
    plain = localapi.FakeApi(access=localapi.Access.shipped())
    async with localapi.serve(plain) as running:
        running.api.create(dra.resource_slice("silent", "", [dra.GpuDevice(0, "GPU-0", 1024)]))
        made = kube.Kube(connecting.client_for(running.configuration(localapi.GPUPLACE)))
        try:
            writer = slice_taints.SilenceTaints(made, silence=SILENCE, wall=lambda: NOW)
            assert await writer.check([record("silent", NOW - SILENCE - 1)]) == []
            assert writer.handled == set()  # not handled: the next check tries again
        finally:
            await made.close()
