"""The device plugin against a kubelet stand-in speaking the real gRPC over unix sockets:
registration, ListAndWatch, GetPreferredAllocation then Allocate as the kubelet calls
them, kubelet restarts, health changes, and every way Allocate may not find its pod."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gpuplace.agent import allocating, handover, plugin
from gpuplace.agent.deviceplugin import api_pb2
from gpuplace.cluster import keys
from tests.agent import kubelet as standin

MPS = handover.Mps(pipe_dir="/run/gpuplace/mps/pipe", shm_dir="/run/gpuplace/mps/shm")


@pytest.fixture
def directory() -> Iterator[Path]:
    # unix socket paths are limited to 107 bytes: keep the directory short
    path = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Node:
    """A plugin server and a kubelet stand-in sharing one device-plugins directory."""

    def __init__(self, directory: Path, gpus: list[handover.NodeGpu], **kwargs: object) -> None:
        self.gpus = gpus
        self.view = plugin.PodView()
        self.view.replace([])
        self.mps_ready = asyncio.Event()
        self.mps_ready.set()
        self.registry = CollectorRegistry()
        options = kwargs.pop("options", handover.Options(mps=MPS))
        self.server = plugin.PluginServer(
            node=standin.NODE,
            gpus=gpus,
            pods=self.view,
            options=options,  # type: ignore[arg-type]
            mps_ready=kwargs.pop("mps_ready", self.mps_ready),  # type: ignore[arg-type]
            directory=str(directory),
            slots_per_gpu=4,
            wait_seconds=0.4,
            poll_seconds=0.05,
            registry=self.registry,
            **kwargs,  # type: ignore[arg-type]
        )
        self.kubelet = standin.Kubelet(directory)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Node:
        await self.kubelet.start()
        self.task = asyncio.ensure_future(self.server.run(self.stop))
        await asyncio.wait_for(self.server.registered.wait(), 5)
        await self.kubelet.listed(1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        await self.task
        await self.kubelet.stop()

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def node(directory: Path) -> Callable[..., Node]:
    def make(gpus: list[handover.NodeGpu] | None = None, **kwargs: object) -> Node:
        return Node(directory, gpus if gpus is not None else standin.eight_gpus(), **kwargs)

    return make


def uuids(gpus: list[handover.NodeGpu], *indices: int) -> list[str]:
    return [gpus[index].uuid for index in indices]


async def test_registers_and_lists_slots_of_every_gpu(node: Callable[..., Node]) -> None:
    async with node() as n:
        [request] = n.kubelet.registrations
        assert request.version == "v1beta1"
        assert request.endpoint == "gpuplace.sock"
        assert request.resource_name == keys.RESOURCE_GPU
        assert request.options.get_preferred_allocation_available
        assert not request.options.pre_start_required
        assert len(n.kubelet.devices) == 8 * 4
        assert {allocating.gpu_of(device.ID) for device in n.kubelet.devices} == {
            gpu.uuid for gpu in n.gpus
        }
        assert all(device.health == "Healthy" for device in n.kubelet.devices)
        numa = {
            allocating.gpu_of(d.ID): [x.ID for x in d.topology.nodes] for d in n.kubelet.devices
        }
        assert numa[n.gpus[0].uuid] == [0] and numa[n.gpus[7].uuid] == [1]
        assert n.metric("gpuplace_agent_plugin_registered") == 1


async def test_the_real_fixture_gpu_has_no_numa_and_lists_none(node: Callable[..., Node]) -> None:
    async with node(standin.fixture_gpus()) as n:
        assert n.kubelet.devices and all(
            not device.HasField("topology") for device in n.kubelet.devices
        )


async def test_whole_gpus_exactly_the_grant_and_the_kubelet_records_them(
    node: Callable[..., Node],
) -> None:
    async with node() as n:
        granted = uuids(n.gpus, 2, 5)
        n.view.upsert(standin.pod("ddp", [2, 5], granted))
        answer = await n.kubelet.admit(2)
        assert [device.name for device in answer.cdi_devices] == [
            f"nvidia.com/gpu={uuid}" for uuid in granted
        ]
        assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": "void"}
        assert not answer.mounts  # whole GPUs never go through MPS
        # GetPreferredAllocation steered the kubelet onto slots of the granted GPUs
        assert {allocating.gpu_of(device) for device in n.kubelet.allocated} == set(granted)
        assert n.metric("gpuplace_agent_allocate_duration_seconds_count", result="exact") == 1


async def test_a_share_gets_mps_and_its_limits(node: Callable[..., Node]) -> None:
    async with node() as n:
        n.view.upsert(standin.pod("nb", [3], uuids(n.gpus, 3), milli=250, memory_mib=4096))
        answer = await n.kubelet.admit(1)
        assert [device.name for device in answer.cdi_devices] == [
            f"nvidia.com/gpu={n.gpus[3].uuid}"
        ]
        assert dict(answer.envs) == {
            "NVIDIA_VISIBLE_DEVICES": "void",
            "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
            # the ask and the H100's CUDA context at 25 % (144 + 5 × 25 MiB): issue 43
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4365M",
        }
        assert [(m.host_path, m.container_path) for m in answer.mounts] == [
            ("/run/gpuplace/mps/pipe", "/tmp/nvidia-mps"),
            ("/run/gpuplace/mps/shm", "/dev/shm"),
        ]


async def test_a_share_waits_for_mps_then_is_refused(node: Callable[..., Node]) -> None:
    async with node() as n:
        n.mps_ready.clear()
        n.view.upsert(standin.pod("nb", [0], uuids(n.gpus, 0), milli=500, memory_mib=1024))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await n.kubelet.admit(1)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "MPS" in str(refused.value.details())
        # the daemon comes up while the next admission waits: it is answered
        admitting = asyncio.ensure_future(n.kubelet.admit(1))
        await asyncio.sleep(0.1)
        n.mps_ready.set()
        answer = await admitting
        assert answer.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


async def test_whole_gpus_do_not_wait_for_mps(node: Callable[..., Node]) -> None:
    async with node() as n:
        n.mps_ready.clear()
        n.view.upsert(standin.pod("big", [1], uuids(n.gpus, 1)))
        answer = await n.kubelet.admit(1)
        assert "CUDA_MPS_PIPE_DIRECTORY" not in answer.envs


async def test_no_grant_no_gpu(node: Callable[..., Node]) -> None:
    async with node() as n:
        n.view.upsert(standin.pod("sneaky", [0], uuids(n.gpus, 0), assigned=False))
        n.view.upsert(standin.pod("elsewhere", [0], uuids(n.gpus, 0), node="gpu-node-2"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await n.kubelet.admit(1)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "grant" in str(refused.value.details())
        assert not n.kubelet.allocated
        assert n.metric("gpuplace_agent_allocate_duration_seconds_count", result="refused") == 1


async def test_allocate_waits_for_the_pod_view_to_catch_up(node: Callable[..., Node]) -> None:
    async with node() as n:
        n.server.wait_seconds = 3.0
        admitting = asyncio.ensure_future(n.kubelet.admit(1))
        await asyncio.sleep(0.2)
        n.view.upsert(standin.pod("late", [6], uuids(n.gpus, 6)))
        answer = await admitting
        assert answer.cdi_devices[0].name == f"nvidia.com/gpu={n.gpus[6].uuid}"


async def test_two_identical_pods_at_once_each_get_the_same_answer_once(
    node: Callable[..., Node],
) -> None:
    async with node() as n:
        for name in ("twin-a", "twin-b"):
            n.view.upsert(standin.pod(name, [4], uuids(n.gpus, 4), milli=300, memory_mib=2048))
        first, second = await asyncio.gather(n.kubelet.admit(1, "a"), n.kubelet.admit(1, "b"))
        assert first == second
        assert set(n.server.answered) == {"uid-twin-a", "uid-twin-b"}
        assert n.metric("gpuplace_agent_allocate_ambiguous_total") == 0
        # a third container with no pod left to answer for is refused
        with pytest.raises(grpc.aio.AioRpcError):
            await n.kubelet.admit(1, "c")


async def test_different_shares_on_one_gpu_go_in_creation_order(
    node: Callable[..., Node],
) -> None:
    async with node() as n:
        n.view.upsert(
            standin.pod("second", [4], uuids(n.gpus, 4), milli=200, created="2026-11-24T08:00:05Z")
        )
        n.view.upsert(
            standin.pod("first", [4], uuids(n.gpus, 4), milli=600, created="2026-11-24T08:00:01Z")
        )
        first = await n.kubelet.admit(1)
        second = await n.kubelet.admit(1)
        assert first.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60"
        assert second.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
        assert n.metric("gpuplace_agent_allocate_ambiguous_total") == 1


async def test_when_the_kubelet_picks_other_gpus_the_grant_wins(node: Callable[..., Node]) -> None:
    async with node() as n:
        n.kubelet.use_preferred = False  # the kubelet takes the first free slots: GPU 0's
        n.view.upsert(standin.pod("p", [7], uuids(n.gpus, 7)))
        answer = await n.kubelet.admit(1)
        assert allocating.granted_in(answer, n.server.options) == {n.gpus[7].uuid}
        assert n.metric("gpuplace_agent_allocate_duration_seconds_count", result="mismatch") == 1


async def test_slots_that_are_not_this_nodes_are_refused(node: Callable[..., Node]) -> None:
    async with node() as n:
        n.view.upsert(standin.pod("p", [0], uuids(n.gpus, 0)))
        for ids in (["GPU-00000000-0000-0000-0000-000000000000::0"], ["nvidia0"], []):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await n.kubelet.allocate(ids)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_count_the_grant_does_not_have_is_refused(node: Callable[..., Node]) -> None:
    async with node() as n:
        # the pod asks the kubelet for 2 slots but was granted one GPU: no such candidate
        n.view.upsert(standin.pod("odd", [0], uuids(n.gpus, 0), request=2))
        with pytest.raises(grpc.aio.AioRpcError):
            await n.kubelet.admit(2)


async def test_health_change_resends_the_list_and_refuses_the_sick_gpu(
    node: Callable[..., Node],
) -> None:
    async with node() as n:
        lists = n.kubelet.lists
        sick = [
            handover.NodeGpu(g.index, g.uuid, healthy=g.index != 2, numa=g.numa, minor=g.minor)
            for g in n.gpus
        ]
        n.server.set_gpus(sick)
        await n.kubelet.listed(lists + 1)
        unhealthy = {allocating.gpu_of(d.ID) for d in n.kubelet.devices if d.health == "Unhealthy"}
        assert unhealthy == {n.gpus[2].uuid}
        assert n.metric("gpuplace_agent_plugin_devices", health="Unhealthy") == 4
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await n.kubelet.allocate([allocating.device_id(n.gpus[2].uuid, 0)])
        n.view.upsert(standin.pod("p", [2], uuids(n.gpus, 2)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await n.kubelet.allocate([allocating.device_id(n.gpus[2].uuid, 0)])
        assert "unhealthy" in str(refused.value.details())


async def test_kubelet_restart_re_registers_and_keeps_serving(node: Callable[..., Node]) -> None:
    async with node() as n:
        n.view.upsert(standin.pod("before", [0], uuids(n.gpus, 0)))
        await n.kubelet.admit(1)
        await n.kubelet.restart()
        async with asyncio.timeout(5):
            while len(n.kubelet.registrations) < 2 or not n.kubelet.devices:
                await asyncio.sleep(0.02)
        assert n.server.socket_path.exists()
        n.view.upsert(standin.pod("after", [1], uuids(n.gpus, 1)))
        answer = await n.kubelet.admit(1)
        assert answer.cdi_devices[0].name == f"nvidia.com/gpu={n.gpus[1].uuid}"
        assert n.metric("gpuplace_agent_plugin_registrations_total", result="ok") == 2


async def test_registration_is_retried_until_the_kubelet_answers(directory: Path) -> None:
    gpus = standin.eight_gpus()
    view = plugin.PodView()
    server = plugin.PluginServer(
        node=standin.NODE,
        gpus=gpus,
        pods=view,
        options=handover.Options(),
        directory=str(directory),
        poll_seconds=0.05,
        registry=CollectorRegistry(),
    )
    stop = asyncio.Event()
    running = asyncio.ensure_future(server.run(stop))
    await asyncio.sleep(0.3)
    assert not server.registered.is_set()
    kubelet = standin.Kubelet(directory)
    await kubelet.start()
    try:
        await asyncio.wait_for(server.registered.wait(), 10)
        await kubelet.listed(1)
    finally:
        stop.set()
        await running
        await kubelet.stop()
    assert not server.socket_path.exists()


def running(pod: dict[str, Any]) -> dict[str, Any]:
    """`pod` once the kubelet started its GPU container."""
    pod["status"] = {
        "phase": "Running",
        "containerStatuses": [{"name": "train", "containerID": "containerd://abc"}],
    }
    return pod


async def test_a_started_container_is_never_answered_again(node: Callable[..., Node]) -> None:
    """The kubelet never allocates again for a container whose devices it holds
    (docs/node-agent.md, "Why no answer is given twice"): a call naming exactly a running
    pod's GPU is another container's, and it gets nothing."""
    async with node() as n:
        n.view.upsert(running(standin.pod("running", [5], uuids(n.gpus, 5))))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await n.kubelet.allocate([allocating.device_id(n.gpus[5].uuid, 3)])
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert not n.server.answered


async def test_a_pod_without_a_grant_gets_no_gpu_an_answered_pod_holds(
    node: Callable[..., Node],
) -> None:
    """Issue 30, 1: `whole-0` holds U0 and was answered; a bound pod with no grant that
    asks for one slot makes the kubelet call Allocate [U0::3]. It got U0 after the wait
    (the repeat tier); it must get nothing."""
    async with node() as n:
        n.view.upsert(standin.pod("whole-0", [0], uuids(n.gpus, 0)))
        first = await n.kubelet.admit(1)
        assert allocating.granted_in(first, n.server.options) == {n.gpus[0].uuid}
        n.view.upsert(standin.pod("intruder", [0], uuids(n.gpus, 0), assigned=False))
        answered = dict(n.server.answered)
        for slot in range(4):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await n.kubelet.allocate([allocating.device_id(n.gpus[0].uuid, slot)])
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert n.server.answered == answered
        assert n.metric("gpuplace_agent_allocate_duration_seconds_count", result="exact") == 1
        assert n.metric("gpuplace_agent_allocate_duration_seconds_count", result="refused") == 4


@pytest.mark.parametrize("slots_on", ["the waiting pod's GPU", "another GPU"])
async def test_a_pod_without_a_grant_gets_no_gpu_a_waiting_pod_was_granted(
    node: Callable[..., Node], slots_on: str
) -> None:
    """While a pod without a grant that asks for as many slots waits for admission, the
    kubelet may be allocating for it: nothing is given, neither the exact tier (slots on
    the granted GPU) nor the mismatch tier (slots elsewhere) may hand it the grant of a
    pod that has not started yet."""
    async with node() as n:
        n.view.upsert(standin.pod("granted", [0], uuids(n.gpus, 0), created="2026-11-24T08:00:00Z"))
        n.view.upsert(
            standin.pod(
                "intruder", [0], uuids(n.gpus, 0), assigned=False, created="2026-11-24T08:00:09Z"
            )
        )
        index = 0 if slots_on == "the waiting pod's GPU" else 3
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await n.kubelet.allocate([allocating.device_id(n.gpus[index].uuid, 1)])
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "research/intruder" in str(refused.value.details())
        assert not n.server.answered
        # the kubelet refuses the intruder's admission: once it has failed, the granted pod
        # is answered as before
        failed = standin.pod("intruder", [0], uuids(n.gpus, 0), assigned=False)
        failed["status"] = {"phase": "Failed", "reason": "UnexpectedAdmissionError"}
        n.view.upsert(failed)
        answer = await n.kubelet.admit(1)
        assert allocating.granted_in(answer, n.server.options) == {n.gpus[0].uuid}


async def test_a_pod_without_a_grant_that_fails_while_the_call_waits_lets_it_through(
    node: Callable[..., Node],
) -> None:
    """The kubelet refused the intruder just before (its status is on the way): the
    granted pod's Allocate waits for the pod view instead of failing too."""
    async with node() as n:
        n.server.wait_seconds = 3.0
        n.view.upsert(standin.pod("granted", [2], uuids(n.gpus, 2)))
        intruder = standin.pod("intruder", [0], uuids(n.gpus, 0), assigned=False)
        n.view.upsert(intruder)
        admitting = asyncio.ensure_future(n.kubelet.admit(1))
        await asyncio.sleep(0.2)
        assert not admitting.done()
        intruder = {**intruder, "status": {"phase": "Failed"}}
        n.view.upsert(intruder)
        answer = await asyncio.wait_for(admitting, 2)
        assert allocating.granted_in(answer, n.server.options) == {n.gpus[2].uuid}


async def test_a_pod_without_a_grant_asking_another_count_blocks_nothing(
    node: Callable[..., Node],
) -> None:
    async with node() as n:
        n.view.upsert(standin.pod("pair", [0, 1], uuids(n.gpus, 0, 1), assigned=False))
        n.view.upsert(standin.pod("granted", [4], uuids(n.gpus, 4)))
        answer = await n.kubelet.admit(1)
        assert allocating.granted_in(answer, n.server.options) == {n.gpus[4].uuid}


async def test_a_refused_allocate_leaves_no_trace(node: Callable[..., Node]) -> None:
    """Issue 30, 2: `[[U0::1], ["nope"]]` is refused whole; `q-0` (granted U0) was still
    recorded as answered, so a retry of `[[U0::1]]` got another pod's GPU (U4) after the
    wait. A refusal changes nothing: the retry gets U0, exactly."""
    async with node() as n:
        n.view.upsert(standin.pod("q-0", [0], uuids(n.gpus, 0), created="2026-11-24T08:00:00Z"))
        n.view.upsert(standin.pod("q-1", [4], uuids(n.gpus, 4), created="2026-11-24T08:00:05Z"))
        slot = allocating.device_id(n.gpus[0].uuid, 1)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await n.kubelet._stub().Allocate(
                api_pb2.AllocateRequest(
                    container_requests=[
                        api_pb2.ContainerAllocateRequest(devices_ids=[slot]),
                        api_pb2.ContainerAllocateRequest(devices_ids=["nope"]),
                    ]
                )
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert not n.server.answered
        answer = await n.kubelet.allocate([slot])
        assert allocating.granted_in(answer, n.server.options) == {n.gpus[0].uuid}
        assert set(n.server.answered) == {"uid-q-0"}
        assert n.metric("gpuplace_agent_allocate_duration_seconds_count", result="exact") == 1


@pytest.mark.parametrize(
    "method",
    [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ],
)
async def test_an_undecodable_request_is_invalid_argument_in_one_log_line(
    node: Callable[..., Node], method: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 30, 8: bytes that are no protobuf message got UNKNOWN ("Unexpected
    DecodeError") and a traceback in the agent's log."""
    async with node() as n:
        assert n.kubelet._channel is not None
        path = f"/v1beta1.DevicePlugin/{method}"
        raw = b"\xff\xff\xff\xff"
        caplog.clear()
        with caplog.at_level(logging.INFO), pytest.raises(grpc.aio.AioRpcError) as refused:
            if method == "ListAndWatch":
                async for _ in n.kubelet._channel.unary_stream(path)(raw):
                    pass
            else:
                await n.kubelet._channel.unary_unary(path)(raw)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert method in str(refused.value.details())
        records = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(records) == 1, [r.getMessage() for r in records]
        assert records[0].exc_info is None and records[0].name.startswith("gpuplace.")
        assert not n.server.answered


async def test_stop_ends_the_plugin_while_no_kubelet_answers(directory: Path) -> None:
    server = plugin.PluginServer(
        node=standin.NODE,
        gpus=standin.eight_gpus(),
        pods=plugin.PodView(),
        options=handover.Options(),
        directory=str(directory),
        registry=CollectorRegistry(),
    )
    stop = asyncio.Event()
    running = asyncio.ensure_future(server.run(stop))
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.wait_for(running, 3)
    assert not server.socket_path.exists()


async def test_a_share_waits_for_the_daemon_of_its_own_gpu(node: Callable[..., Node]) -> None:
    ready: set[str] = set()
    async with node(mps_ready=lambda uuid: uuid in ready) as n:
        n.server.wait_seconds = 3.0
        n.view.upsert(standin.pod("a", [2], uuids(n.gpus, 2), milli=500, memory_mib=1024))
        ready.add(n.gpus[5].uuid)  # another GPU's daemon does not count
        n.server.mps_changed()
        admitting = asyncio.ensure_future(n.kubelet.admit(1))
        await asyncio.sleep(0.2)
        assert not admitting.done()
        ready.add(n.gpus[2].uuid)
        n.server.mps_changed()
        answer = await asyncio.wait_for(admitting, 2)
        assert answer.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


async def test_an_empty_preferred_allocation_is_answered_at_once(
    node: Callable[..., Node],
) -> None:
    """Issue 43: a GetPreferredAllocation naming no container waited the whole allocate
    wait (5 s by default) before its empty answer; there is no pod to wait for."""
    async with node() as n:
        n.server.wait_seconds = 5.0  # the agent's default --allocate-wait-seconds
        started = asyncio.get_running_loop().time()
        answer = await n.kubelet._stub().GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest()
        )
        took = asyncio.get_running_loop().time() - started
        assert list(answer.container_responses) == []
        assert took < 1.0, f"an empty request took {took:.2f} s"
