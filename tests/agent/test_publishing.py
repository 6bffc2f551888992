"""Publishing the discovery and the heartbeat on the Node, through the real API client
against the fake API server, and reading them back as the sidecar does."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpuplace.agent import discovery, nvml, publishing
from gpuplace.cluster import connecting, keys, kube, nodes
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.placement.inventory import NO_NVLINK
from tests.agent.kubelet import gpu_fixture

H100 = nvml.Replay.load(gpu_fixture("nvml-idle.json")).reading


class Wall:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def server() -> AsyncIterator[localapi.Server]:
    async with localapi.serve(localapi.FakeApi(bookmark_interval=0.2)) as running:
        yield running


@pytest.fixture
async def api(server: localapi.Server) -> AsyncIterator[kube.Kube]:
    client = connecting.client_for(server.configuration(localapi.GPUPLACE))
    api = kube.Kube(client, timeout=5.0)
    yield api
    await api.close()


def bare_node(name: str) -> dict[str, Any]:
    """An opted-in node without GPU Feature Discovery labels: only the agent tells its GPUs."""
    body = objects.node(name, gpus=0)
    for key in (keys.GFD_COUNT, keys.GFD_PRODUCT, keys.GFD_MEMORY):
        body["metadata"]["labels"].pop(key)
    return body


def eight() -> dict[str, Any]:
    return nvml.derived(H100, 8, nvlink_domains=[range(4), range(4, 8)], numa=[0] * 4 + [1] * 4)


async def test_the_published_node_reads_back_as_the_discovered_gpus(
    server: localapi.Server, api: kube.Kube
) -> None:
    server.api.create(bare_node("gpu-1"))
    wall = Wall()
    publisher = publishing.Publisher(api, "gpu-1", nvml.Replay(eight()), wall=wall)
    assert await publisher.publish_once()
    stored = server.api.get("nodes", "gpu-1")
    annotations = stored["metadata"]["annotations"]
    assert annotations[keys.AGENT_HEARTBEAT] == "2027-01-15T08:00:00Z"
    entries = json.loads(annotations[keys.NODE_GPUS])
    assert entries[0] == {
        "index": 0,
        "uuid": "GPU-73fa5a53-ad78-0389-6c40-000000000000",
        "model": "NVIDIA H100 80GB HBM3",
        "memoryMiB": 81559,
        "packableMiB": 80960,
        "reservedMiB": 480,
        "mpsServerMiB": 66,
        "mpsContextMiB": {"base": 144, "perPercent": 5},
        "pci": "00000000:10:00.0",
        "numa": 0,
        "nvlink": 0,
        "peers": [1, 2, 3],
        "mig": False,
        "health": "healthy",
        "reasons": [],
    }
    record = nodes.record(stored)
    assert record.problem == ""
    assert record.heartbeat_at == wall.now
    assert record.node is not None
    gpus = record.node.gpus
    assert [gpu.uuid for gpu in gpus] == [entry["uuid"] for entry in entries]
    assert {gpu.memory_mib for gpu in gpus} == {80960}  # what a client can get (issue 43)
    assert record.node.nvlink_domains() == {0: (0, 1, 2, 3), 4: (4, 5, 6, 7)}
    assert [gpu.numa for gpu in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(gpu.healthy for gpu in gpus)


async def test_unknown_stays_null_on_the_node_and_the_sidecar_reads_it_as_no_nvlink(
    server: localapi.Server, api: kube.Kube
) -> None:
    server.api.create(objects.node("h100", gpus=1))
    await publishing.Publisher(api, "h100", nvml.Replay(H100), wall=Wall()).publish_once()
    stored = server.api.get("nodes", "h100")
    (entry,) = json.loads(stored["metadata"]["annotations"][keys.NODE_GPUS])
    assert entry["numa"] is None and entry["nvlink"] is None and entry["peers"] is None
    node = nodes.record(stored).node
    assert node is not None
    assert node.gpus[0].nvlink == NO_NVLINK
    # NVML's name as GPU Feature Discovery labels it, the form gpu-model annotations use
    assert node.gpus[0].model == "NVIDIA-H100-80GB-HBM3"


async def test_writes_only_on_change_or_when_the_heartbeat_is_due(
    server: localapi.Server, api: kube.Kube
) -> None:
    server.api.create(bare_node("gpu-1"))
    wall = Wall()
    replay = nvml.Replay(eight())
    heard: list[discovery.Discovery] = []
    publisher = publishing.Publisher(
        api, "gpu-1", replay, wall=wall, heartbeat_seconds=30, registry=CollectorRegistry()
    )
    publisher.on_change.append(heard.append)
    assert await publisher.publish_once()
    wall.now += 10
    assert not await publisher.publish_once()
    assert len(heard) == 1
    wall.now += 25
    assert await publisher.publish_once()
    beat = server.api.get("nodes", "gpu-1")["metadata"]["annotations"][keys.AGENT_HEARTBEAT]
    assert beat == publishing.heartbeat(wall.now)
    assert len(heard) == 1
    # GPU 6 counts an uncorrectable ECC error: written at once, before the heartbeat is due
    broken = copy.deepcopy(replay.reading)
    broken["gpus"][6]["ecc_uncorrected_volatile"] = 1
    replay.replace(broken)
    wall.now += 1
    assert await publisher.publish_once()
    assert heard[-1].unhealthy == (6,)
    node = nodes.record(server.api.get("nodes", "gpu-1")).node
    assert node is not None
    assert [gpu.healthy for gpu in node.gpus] == [True] * 6 + [False, True]
    assert publisher.writes.labels("ok")._value.get() == 3
    assert publisher.healthy()
    wall.now += 61
    assert not publisher.healthy()


async def test_a_failed_write_is_not_taken_for_written(api: kube.Kube) -> None:
    publisher = publishing.Publisher(api, "no-such-node", nvml.Replay(H100), wall=Wall())
    with pytest.raises(kube.ApiError) as raised:
        await publisher.publish_once()
    assert raised.value.not_found
    assert publisher.published is None and publisher.beat_at is None
    assert publisher.last_error.startswith("404")
    assert not publisher.healthy()


async def test_a_node_where_nvml_finds_no_gpu_offers_none_whatever_its_labels_say(
    server: localapi.Server, api: kube.Kube
) -> None:
    server.api.create(objects.node("broken", gpus=8))
    replay = nvml.Replay({"count": {"nvml_error": "Driver Not Loaded"}})
    publisher = publishing.Publisher(api, "broken", replay, wall=Wall())
    await publisher.publish_once()
    assert publisher.discovery is not None
    assert publisher.discovery.problems == ("nvml gpu count: Driver Not Loaded",)
    node = nodes.record(server.api.get("nodes", "broken")).node
    assert node is not None
    assert node.gpus == ()
