"""The DRA kubelet plugin over real gRPC on unix sockets, with the DRA kubelet stand-in
(tests/agent/dra_kubelet.py) and claims kube-scheduler v1.36.2 allocated
(tests/agent/fixtures/dra/): registration, a claim prepared into its CDI spec and
checkpoint, the kubelet's retries answered as before without the API, an agent restarted
answering and unpreparing what it prepared, specs written back or removed at start, a
share waiting for its MPS daemon, the health stream."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gpuplace.agent import claim_files, handover, kubeletplugin, preparing
from gpuplace.agent.draplugin import health_pb2, registration_pb2
from tests.agent.dra_kubelet import Claims, DraKubelet, ref
from tests.agent.test_preparing import GPUS, MPS, NODE, captured

SHARE = captured("claim-share-30.json")
OTHER = captured("claim-share-60.json")
WHOLE = captured("claim-extended-resource.json")


@pytest.fixture
def dirs() -> Iterator[dict[str, Path]]:
    root = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))  # short: socket paths
    made = {name: root / name for name in ("plugins", "registry", "cdi")}
    yield made
    shutil.rmtree(root, ignore_errors=True)


class Node:
    """One plugin on `dirs`, its kubelet stand-in and its claims; `restart()` is a new
    agent process on the same directories."""

    def __init__(self, dirs: dict[str, Path], claims: Claims, ready: set[str]) -> None:
        self.dirs, self.claims, self.ready = dirs, claims, ready
        self.kubelet = DraKubelet(dirs["registry"])
        self.stop = asyncio.Event()
        self.plugin = self._plugin()
        self.task: asyncio.Task[None] | None = None

    def _plugin(self) -> kubeletplugin.KubeletPlugin:
        made = kubeletplugin.KubeletPlugin(
            node=NODE,
            claims=self.claims,
            options=handover.Options(handover.Strategy.VOLUME_MOUNTS, mps=MPS),
            mps_ready=lambda uuid: uuid in self.ready,
            plugins_dir=str(self.dirs["plugins"]),
            registry_dir=str(self.dirs["registry"]),
            cdi_dir=str(self.dirs["cdi"]),
            wait_seconds=0.5,
            poll_seconds=0.05,
            health_seconds=0.2,
            registry=CollectorRegistry(),
        )
        made.set_gpus(GPUS)
        return made

    async def start(self) -> None:
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.plugin.run(self.stop))
        await self.kubelet.register()
        await asyncio.wait_for(self.plugin.registered.wait(), 5)

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            await asyncio.wait_for(self.task, 10)

    async def restart(self) -> None:
        await self.close()
        self.plugin = self._plugin()
        await self.start()

    def spec(self, claim: dict[str, Any]) -> Path:
        return self.dirs["cdi"] / preparing.spec_file(claim["metadata"]["uid"])

    def checkpoint(self) -> dict[str, Any]:
        found: dict[str, Any] = json.loads((self.plugin.plugin_dir / "checkpoint.json").read_text())
        return found


@pytest.fixture
async def node(dirs: dict[str, Path]) -> AsyncIterator[Node]:
    made = Node(dirs, Claims(SHARE, OTHER, WHOLE), {gpu.uuid for gpu in GPUS})
    await made.start()
    try:
        yield made
    finally:
        await made.close()


async def test_it_registers_as_the_kubelet_expects(node: Node) -> None:
    info = node.kubelet.info
    assert info is not None
    assert (info.type, info.name) == ("DRAPlugin", "gpu.gpuplace.io")
    assert list(info.supported_versions) == ["v1.DRAPlugin"]
    assert info.endpoint == str(node.dirs["plugins"] / "gpu.gpuplace.io" / "dra.sock")
    assert node.plugin.not_ready_reason() is None


async def test_a_refused_registration_is_the_reason_it_is_not_ready(dirs: dict[str, Path]) -> None:
    made = Node(dirs, Claims(), set())
    await made.plugin.registration.NotifyRegistrationStatus(
        registration_pb2.RegistrationStatus(plugin_registered=False, error="version skew"),
        None,
    )
    assert made.plugin.not_ready_reason() == (
        "the DRA plugin is not registered with the kubelet (it refused: version skew)"
    )


async def test_a_claim_is_prepared_into_its_cdi_spec_and_checkpoint(node: Node) -> None:
    answer = (await node.kubelet.prepare(ref(SHARE))).claims[SHARE["metadata"]["uid"]]
    assert answer.error == ""
    (device,) = answer.devices
    result = SHARE["status"]["allocation"]["devices"]["results"][0]
    assert (device.pool_name, device.device_name) == (NODE, "gpu-0")
    assert list(device.request_names) == ["gpu"]
    assert device.share_id == result["shareID"]
    uid = SHARE["metadata"]["uid"]
    assert list(device.cdi_device_ids) == [f"gpu.gpuplace.io/claim=gpu-0-{uid}"]
    spec = json.loads(node.spec(SHARE).read_text())
    env = dict(item.split("=", 1) for item in spec["devices"][0]["containerEdits"]["env"])
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    (recorded,) = node.checkpoint()["claims"]
    assert (recorded["uid"], recorded["devices"][0]["milli"]) == (uid, 300)
    assert recorded["spec"] == spec


async def test_the_kubelets_retries_are_answered_as_before_without_the_api(node: Node) -> None:
    first = await node.kubelet.prepare(ref(SHARE), ref(WHOLE))
    reads = node.claims.reads
    again = await node.kubelet.prepare(ref(SHARE), ref(WHOLE), ref(SHARE))
    assert again == first and node.claims.reads == reads
    assert len(node.checkpoint()["claims"]) == 2


async def test_a_restarted_agent_serves_and_unprepares_what_it_prepared(node: Node) -> None:
    first = await node.kubelet.prepare(ref(SHARE), ref(OTHER))
    node.spec(OTHER).unlink()  # /var/run is a tmpfs: a reboot clears it, the kubelet remembers
    stray = node.dirs["cdi"] / preparing.spec_file("0f0e0d0c-0b0a-4909-8807-060504030201")
    stray.write_text("{}")  # written just before a crash, never recorded
    foreign = node.dirs["cdi"] / "nvidia.yaml"
    foreign.write_text("cdiVersion: 0.5.0\n")
    node.claims.claims.clear()  # and the API is away
    await node.restart()
    assert node.spec(OTHER).is_file() and not stray.exists() and foreign.exists()
    assert await node.kubelet.prepare(ref(SHARE), ref(OTHER)) == first
    done = await node.kubelet.unprepare(ref(SHARE))
    assert done.claims[SHARE["metadata"]["uid"]].error == ""
    assert not node.spec(SHARE).exists() and node.spec(OTHER).exists()
    assert [claim["uid"] for claim in node.checkpoint()["claims"]] == [OTHER["metadata"]["uid"]]


async def test_unprepare_is_idempotent_and_removes_a_spec_recorded_or_not(node: Node) -> None:
    await node.kubelet.prepare(ref(SHARE))
    unknown = ("ns", "gone", "7d9c9f7e-2f4c-4e0a-9c1b-3a2b1c0d9e8f")
    orphan = node.dirs["cdi"] / preparing.spec_file(unknown[2])
    orphan.write_text("{}")
    done = await node.kubelet.unprepare(ref(SHARE), ref(SHARE), unknown, ("ns", "x", "../x"))
    assert {uid: entry.error for uid, entry in done.claims.items()} == {
        SHARE["metadata"]["uid"]: "",
        unknown[2]: "",
        "../x": "'../x' is not a claim UID",
    }
    assert not node.spec(SHARE).exists() and not orphan.exists()
    assert node.checkpoint()["claims"] == []


async def test_what_cannot_be_prepared_is_the_claims_error_and_writes_nothing(node: Node) -> None:
    unallocated = {**SHARE, "metadata": {**SHARE["metadata"], "name": "pending"}, "status": {}}
    node.claims.put(unallocated)
    missing = ("team-a", "nobody", "3c2b1a09-8f7e-4d6c-9b5a-493827161504")
    answer = await node.kubelet.prepare(ref(unallocated), missing, ("", "x", "y"))
    errors = {uid: entry.error for uid, entry in answer.claims.items()}
    assert errors[SHARE["metadata"]["uid"]] == (
        "claim team-a/pending: the claim is not allocated (no status.allocation)"
    )
    assert errors[missing[2]].startswith("claim team-a/nobody: cannot be read: 404 NotFound")
    assert errors["y"] == "claim ''/'x': namespace and name are required"
    assert not node.dirs["cdi"].exists() or list(node.dirs["cdi"].iterdir()) == []
    assert not (node.plugin.plugin_dir / "checkpoint.json").exists()


async def test_a_share_waits_for_its_mps_daemon(dirs: dict[str, Path]) -> None:
    made = Node(dirs, Claims(SHARE, WHOLE), set())
    await made.start()
    try:
        answer = await made.kubelet.prepare(ref(SHARE), ref(WHOLE))
        errors = {uid: entry.error for uid, entry in answer.claims.items()}
        assert errors[SHARE["metadata"]["uid"]].endswith(
            "a GPU share needs the MPS control daemon, which is not ready"
        )
        assert errors[WHOLE["metadata"]["uid"]] == ""  # a whole GPU needs none

        async def daemon_up() -> None:
            await asyncio.sleep(0.1)
            made.ready.add(GPUS[0].uuid)
            made.plugin.mps_changed()

        late = asyncio.create_task(daemon_up())
        answer = await made.kubelet.prepare(ref(SHARE))
        await late
        assert answer.claims[SHARE["metadata"]["uid"]].error == ""
    finally:
        await made.close()


async def test_the_health_stream_says_each_devices_health(node: Node) -> None:
    (first,) = await node.kubelet.health()
    assert [(d.device.pool_name, d.device.device_name, d.health) for d in first.devices] == [
        (NODE, "gpu-0", health_pb2.HEALTHY),
        (NODE, "gpu-1", health_pb2.HEALTHY),
    ]
    assert first.devices[0].health_check_timeout_seconds > 0.2 * 3

    async def sicken() -> None:
        await asyncio.sleep(0.05)
        node.plugin.set_gpus(
            [GPUS[0], handover.NodeGpu(1, GPUS[1].uuid, healthy=False, reasons=("XID 79",))]
        )

    task = asyncio.create_task(sicken())
    seen = await node.kubelet.health(3)
    await task
    last = seen[-1].devices[1]
    assert (last.health, last.message) == (health_pb2.UNHEALTHY, "XID 79")


async def test_a_vanished_socket_is_served_again(node: Node) -> None:
    node.plugin.registration_socket.unlink()
    for _ in range(100):
        if node.plugin.registration_socket.exists():
            break
        await asyncio.sleep(0.02)
    await node.kubelet.register()
    assert (await node.kubelet.prepare(ref(WHOLE))).claims[WHOLE["metadata"]["uid"]].error == ""


async def test_too_many_claims_in_one_call_are_refused_unread(node: Node) -> None:
    claims = [("ns", f"c{i}", f"00000000-0000-4000-8000-{i:012d}") for i in range(65)]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await node.kubelet.prepare(*claims)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert node.claims.reads == 0


def test_an_unreadable_checkpoint_is_moved_aside_and_no_spec_is_removed(tmp_path: Path) -> None:
    plugin_dir, cdi = tmp_path / "plugin", tmp_path / "cdi"
    plugin_dir.mkdir()
    cdi.mkdir()
    (plugin_dir / "checkpoint.json").write_text('{"version": 1, "claims": [{"uid": 3')
    kept = cdi / preparing.spec_file(SHARE["metadata"]["uid"])
    kept.write_text("{}")
    files = claim_files.ClaimFiles(plugin_dir, cdi)
    assert files.load() == {}
    assert (plugin_dir / "checkpoint.json.unreadable").exists()
    assert files.orphans({}) == []  # a running pod's spec is not taken away
    files.save([])
    assert files.orphans({}) == [SHARE["metadata"]["uid"]]


async def test_the_stand_in_refuses_a_plugin_the_kubelet_would_refuse(
    dirs: dict[str, Path],
) -> None:
    made = Node(dirs, Claims(), set())
    made.plugin.registration.endpoint = "/nowhere/dra.sock"
    made.task = asyncio.create_task(made.plugin.run(made.stop))
    try:
        with pytest.raises(AssertionError, match="does not exist"):
            await made.kubelet.register()
        assert made.plugin.not_ready_reason() is not None
    finally:
        await made.close()
