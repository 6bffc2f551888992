"""The DRA agent's ResourceSlice (gpuplace.agent.slices) through the real API client against
the local API, as the DRA agent's own ServiceAccount (the RBAC components/dra ships is
enforced): published from the captured H100's discovery, written again only when it
changes (health as a taint, the pool generation one higher), a sidecar's silence taint and
a stale slice of its driver removed, other drivers' slices and other nodes' left alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpuplace.agent import discovery, nvml, slices
from gpuplace.cluster import connecting, dra, kube
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from tests.agent.kubelet import gpu_fixture
from tests.cluster.conftest import eventually

NODE = "h100-0"


def two_h100s() -> discovery.Discovery:
    reading = nvml.Replay.load(gpu_fixture("nvml-idle.json")).reading
    return discovery.discover(nvml.Replay(nvml.derived(reading, 2)))


def test_every_gpu_nvml_can_name_is_published_healthy_or_not() -> None:
    found = two_h100s()
    devices = slices.gpu_devices(found)
    assert [(d.index, d.uuid, d.memory_mib) for d in devices] == [
        (gpu.index, gpu.uuid, gpu.memory_mib) for gpu in found.gpus
    ]
    assert devices[0].model == "NVIDIA H100 80GB HBM3" and devices[0].numa is None
    sick = replace(found.gpus[1], health=discovery.Health(False, ("XID 79",)))
    nameless = replace(found.gpus[0], uuid=None)
    assert [d.healthy for d in slices.gpu_devices(replace(found, gpus=(found.gpus[0], sick)))] == [
        True,
        False,
    ]
    assert slices.gpu_devices(replace(found, gpus=(nameless, sick))) == [
        replace(devices[1], healthy=False)
    ]
    assert slices.gpu_devices(None) == []


@pytest.fixture
async def server() -> AsyncIterator[localapi.Server]:
    enforced = localapi.FakeApi(
        bookmark_interval=0.05, access=localapi.Access.shipped(localapi.DRA_SHIPPED)
    )
    async with localapi.serve(enforced) as running:
        running.api.create(objects.node(NODE, gpus=0))
        yield running


class Running:
    def __init__(
        self,
        server: localapi.Server,
        api: kube.Kube,
        publisher: slices.SlicePublisher,
        registry: CollectorRegistry,
    ) -> None:
        self.server, self.api, self.publisher, self.registry = server, api, publisher, registry

    def stored(self) -> list[dict[str, Any]]:
        return self.server.api.objects(localapi.RESOURCE_SLICES)


@pytest.fixture
async def running(server: localapi.Server) -> AsyncIterator[Running]:
    api = kube.Kube(connecting.client_for(server.configuration(localapi.DRA_NODE_AGENT)))
    node_uid = server.api.get("nodes", NODE)["metadata"]["uid"]
    registry = CollectorRegistry()
    publisher = slices.SlicePublisher(api, NODE, node_uid, registry=registry)
    informer = slices.slice_informer(api, NODE, publisher)
    tasks = [asyncio.create_task(informer.run()), asyncio.create_task(publisher.run())]
    try:
        yield Running(server, api, publisher, registry)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await api.close()


async def test_the_slice_is_published_once_and_again_only_on_a_change(running: Running) -> None:
    publisher = running.publisher
    await asyncio.sleep(0.2)
    assert running.stored() == []  # nothing before the first discovery
    devices = slices.gpu_devices(two_h100s())
    publisher.set_gpus(devices)
    await asyncio.wait_for(publisher.published.wait(), 5)
    (stored,) = running.stored()
    assert stored["metadata"]["name"] == dra.slice_name(NODE)
    assert stored["metadata"]["ownerReferences"][0]["kind"] == "Node"
    assert dra.same_devices(stored["spec"], dra.slice_spec(NODE, devices))
    version = stored["metadata"]["resourceVersion"]
    publisher.set_gpus(list(devices))  # the same GPUs: no write
    await asyncio.sleep(0.3)
    assert running.stored()[0]["metadata"]["resourceVersion"] == version
    publisher.set_gpus([devices[0], replace(devices[1], healthy=False)])
    await eventually(lambda: "taints" in running.stored()[0]["spec"]["devices"][1])
    spec = running.stored()[0]["spec"]
    assert spec["devices"][1]["taints"] == [{"key": dra.UNHEALTHY_TAINT, "effect": "NoSchedule"}]
    assert spec["pool"]["generation"] == 2


async def test_a_silence_taint_and_a_stale_slice_go_and_others_stay(running: Running) -> None:
    publisher = running.publisher
    devices = slices.gpu_devices(two_h100s())
    publisher.set_gpus(devices)
    await asyncio.wait_for(publisher.published.wait(), 5)
    store = running.server.api
    name = dra.slice_name(NODE)
    silenced = dra.with_silence(store.get(localapi.RESOURCE_SLICES, name), "2026-12-01T15:00:00Z")
    store.patch(localapi.RESOURCE_SLICES, name, {"spec": silenced["spec"]})  # as the sidecar
    stale = dra.resource_slice(NODE, "", devices)
    stale["metadata"] = {"name": f"old-{name}"}
    theirs = json.loads(json.dumps(stale))
    theirs["metadata"] = {"name": "nvidia-on-h100-0"}
    theirs["spec"]["driver"] = "gpu.nvidia.com"
    elsewhere = dra.resource_slice("h100-1", "", devices)
    for body in (stale, theirs, elsewhere):
        store.create(body)
    await eventually(
        lambda: (
            {item["metadata"]["name"] for item in running.stored()}
            == {name, "nvidia-on-h100-0", dra.slice_name("h100-1")}
            and not dra.silenced(store.get(localapi.RESOURCE_SLICES, name))
        ),
        timeout=10,
    )
    ours = store.get(localapi.RESOURCE_SLICES, name)
    assert all("taints" not in device for device in ours["spec"]["devices"])


async def test_a_slice_the_kubelet_wiped_comes_back(running: Running) -> None:
    publisher = running.publisher
    publisher.set_gpus(slices.gpu_devices(two_h100s()))
    await asyncio.wait_for(publisher.published.wait(), 5)
    running.server.api.delete(localapi.RESOURCE_SLICES, dra.slice_name(NODE))
    await eventually(lambda: len(running.stored()) == 1, timeout=10)
    created = {"verb": "create", "result": "ok"}
    assert running.registry.get_sample_value("gpuplace_agent_slice_writes_total", created) == 2
