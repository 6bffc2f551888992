"""`gpuplace node-agent --kubelet-plugin=dra` composed as it runs on a DRA node: the real API
client against the local API as the DRA agent's own ServiceAccount (the RBAC
overlays/self-managed-dra ships is enforced), NVML replayed (8 GPUs derived from the captured
H100), MPS daemons from the stand-in, the DRA kubelet stand-in registering it and preparing a
claim allocated as kube-scheduler v1.36.2 allocates. On a node whose runtime drops CDI
devices it refuses to start, saying why."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from gpuplace import cli
from gpuplace.cluster import dra, keys
from gpuplace.commands import node_agent
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.wiring.agent_settings import AgentSettings
from tests.agent.dra_kubelet import DraKubelet, ref
from tests.agent.test_preparing import captured
from tests.gpuplace.test_node_agent_command import NODE, STANDIN, eight_gpus, until


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="drac", dir="/tmp"))  # short: socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


def runtime(server: localapi.Server, reported: str) -> None:
    server.api.patch(
        "nodes",
        NODE,
        {"status": {"nodeInfo": {"containerRuntimeVersion": reported}}},
        subresource="status",
    )


@pytest.fixture
async def api() -> AsyncIterator[localapi.Server]:
    enforced = localapi.FakeApi(
        bookmark_interval=0.2, access=localapi.Access.shipped(localapi.DRA_SHIPPED)
    )
    async with localapi.serve(enforced) as running:
        running.api.create(objects.node(NODE, gpus=0))
        yield running


def settings(api: localapi.Server, root: Path, **values: Any) -> AgentSettings:
    fields: dict[str, Any] = {
        "kubelet_plugin": "dra",
        "node_name": NODE,
        "kubeconfig": api.kubeconfig(root / "kubeconfig", localapi.DRA_NODE_AGENT),
        "nvml_replay": eight_gpus(root),
        "kubelet_plugins_dir": root / "plugins",
        "kubelet_registry_dir": root / "registry",
        "cdi_dir": root / "cdi",
        "metrics_address": "127.0.0.1",
        "metrics_port": 0,
        "mps_root": root / "mps",
        "mps_control": f"{__import__('sys').executable} {STANDIN}",
        "mps_probe_seconds": 0.05,
        "mps_start_timeout_seconds": 5.0,
        "discover_seconds": 0.1,
        "allocate_wait_seconds": 1.0,
    }
    fields.update(values)
    return AgentSettings(**fields)


def for_this_node(claim: dict[str, Any]) -> dict[str, Any]:
    """A captured claim (allocated on the kit's `local-node`) as if allocated here."""
    moved = copy.deepcopy(claim)
    for result in moved["status"]["allocation"]["devices"]["results"]:
        result["pool"] = NODE
    return moved


def allocated(api: localapi.Server, claim: dict[str, Any]) -> dict[str, Any]:
    """`claim` created, then its allocation written as kube-scheduler writes it (status)."""
    meta = claim["metadata"]
    body = {"apiVersion": claim["apiVersion"], "kind": claim["kind"], "spec": claim["spec"]}
    body["metadata"] = {"name": meta["name"], "namespace": meta["namespace"]}
    api.api.create(body, meta["namespace"])
    return api.api.patch(
        localapi.RESOURCE_CLAIMS,
        meta["name"],
        {"status": claim["status"]},
        meta["namespace"],
        subresource="status",
    )


async def test_the_dra_agent_publishes_its_slice_registers_and_prepares(
    api: localapi.Server, root: Path
) -> None:
    runtime(api, "containerd://1.7.24")
    process = await node_agent.compose(settings(api, root), CollectorRegistry(), base_env={})
    assert process.plugin is None and process.dra is not None  # a node is on one path
    stop = asyncio.Event()
    running = asyncio.create_task(process.server.run(stop))
    kubelet = DraKubelet(root / "registry")
    try:
        await asyncio.wait_for(process.server.started.wait(), 20)
        base = f"http://127.0.0.1:{process.server.port('ops')}"
        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                async with http.get(f"{base}/readyz") as response:
                    return response.status == 200

            async def reasons() -> Any:
                async with http.get(f"{base}/readyz") as response:
                    return (await response.json()).get("reasons", {})

            async def published() -> bool:
                return bool(api.api.objects(localapi.RESOURCE_SLICES))

            await until(published)
            assert "not registered with the kubelet" in json.dumps(await reasons())
            await kubelet.register()
            await until(ready)
            stored = api.api.get(localapi.RESOURCE_SLICES, dra.slice_name(NODE))
            node = api.api.get("nodes", NODE)
            assert stored["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]
            assert len(stored["spec"]["devices"]) == 8
            uuids = [d["attributes"]["uuid"]["string"] for d in stored["spec"]["devices"]]
            annotated = json.loads(node["metadata"]["annotations"][keys.NODE_GPUS])
            assert uuids == [gpu["uuid"] for gpu in annotated]  # the heartbeat stays too
            claim = allocated(api, for_this_node(captured("claim-share-30.json")))
            answer = await kubelet.prepare(ref(claim))
            prepared = answer.claims[claim["metadata"]["uid"]]
            assert prepared.error == ""
            assert prepared.devices[0].device_name == "gpu-0"
            spec = json.loads(
                (
                    root / "cdi" / f"gpu.gpuplace.io-claim_{claim['metadata']['uid']}.json"
                ).read_text()
            )
            env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
            mounts = {
                m["containerPath"]: m["hostPath"]
                for m in spec["devices"][0]["containerEdits"]["mounts"]
            }
            assert mounts["/tmp/nvidia-mps"] == str(root / "mps" / uuids[0] / "pipe")
            assert not (root / "device-plugins").exists()
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
    # stopped: its sockets are gone, so the kubelet knows; the checkpoint stays
    assert not (root / "registry" / f"{dra.DRIVER}-reg.sock").exists()
    assert (root / "plugins" / dra.DRIVER / "checkpoint.json").is_file()


async def test_a_runtime_that_drops_cdi_devices_refuses_dra_mode(
    api: localapi.Server, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runtime(api, "containerd://1.6.20")
    with pytest.raises(node_agent.StartRefused, match=r"containerd://1\.6\.20 drops CDI devices"):
        await node_agent.compose(settings(api, root), CollectorRegistry(), base_env={})
    assert not (root / "registry").exists()
    assert api.api.objects(localapi.RESOURCE_SLICES) == []


def test_the_command_exits_1_saying_why(root: Path) -> None:
    async def main() -> int:
        async with localapi.serve(
            localapi.FakeApi(access=localapi.Access.shipped(localapi.DRA_SHIPPED))
        ) as server:
            server.api.create(objects.node(NODE, gpus=0))
            runtime(server, "cri-o://1.22.0")
            config = settings(server, root)
            args = [f"--{name.replace('_', '-')}={value}" for name, value in
                    config.model_dump(exclude_defaults=True).items()]  # fmt: skip
            return await asyncio.to_thread(cli.main, ["node-agent", *args])

    assert asyncio.run(main()) == 1


def test_envvar_cannot_serve_dra() -> None:
    with pytest.raises(ValueError, match="cannot serve DRA"):
        AgentSettings(node_name="n", kubelet_plugin="dra", device_list_strategy="envvar")
