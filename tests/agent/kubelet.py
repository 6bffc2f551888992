"""A kubelet stand-in: the device manager's side of the device-plugin API, over real gRPC
on unix sockets, as kubelet's pkg/kubelet/cm/devicemanager does it.

- serves Registration on `<dir>/kubelet.sock`; Register checks the version, answers,
  then dials the plugin at `<dir>/<endpoint>` and follows its ListAndWatch stream (the
  latest list is the node's capacity: healthy devices are allocatable);
- `admit(count)` is what the kubelet does for one container that requests `count` of the
  resource: free healthy devices; GetPreferredAllocation first when the plugin offers it
  (its answer is used only when it is valid: the right size, free devices, must-include
  kept), else the first free ones; then Allocate with those IDs; on success they are the
  container's (the checkpoint);
- `restart()` is a kubelet restart: its server goes, every socket in the directory is
  removed (the device manager empties it at start), and a new server listens on a new
  `kubelet.sock`; allocations survive (they are checkpointed).

Plus the pods the plugin reads (`pod`), built with the sidecar's own assignment code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gpuplace.agent import allocating, handover, plugin
from gpuplace.agent.deviceplugin import api_pb2, api_pb2_grpc
from gpuplace.cluster import assignments, keys, mps_limits
from gpuplace.placement.ledger import Grant, GrantState

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "gpu"
NODE = "gpu-node-1"


def gpu_fixture(name: str) -> Path:
    """The captured GPU reading `name` (../shared/fixtures/gpu); where ../shared is absent,
    the test skips, saying why (the whole module, when called while it is imported)."""
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(
            f"GPU fixture {name} not found at {FIXTURES} (../shared)", allow_module_level=True
        )
    return path


def fixture_gpus() -> list[handover.NodeGpu]:
    """The real H100 of `nvml-idle.json` (NUMA: "Not Supported" there, so unknown)."""
    readings = json.loads(gpu_fixture("nvml-idle.json").read_text())
    return [
        handover.NodeGpu(
            index=gpu["index"],
            uuid=gpu["uuid"],
            numa=gpu["numa_node"] if isinstance(gpu["numa_node"], int) else None,
            minor=gpu["minor"],
            context=mps_limits.figures(gpu["name"]).context,
        )
        for gpu in readings["gpus"]
    ]


def eight_gpus() -> list[handover.NodeGpu]:
    """DERIVED, not read: eight GPUs made from the fixture's one (UUID's last block and
    minor varied, NUMA 0 for the first four and 1 for the rest), for an 8-GPU node."""
    real = fixture_gpus()[0]
    stem = real.uuid[: -len("000000000000")]
    return [
        handover.NodeGpu(
            index=i, uuid=f"{stem}{i:012x}", numa=i // 4, minor=i, context=real.context
        )
        for i in range(8)
    ]


def pod(
    name: str,
    gpus: Sequence[int],
    uuids: Sequence[str],
    *,
    milli: int = 1000,
    memory_mib: int = 0,
    node: str = NODE,
    created: str = "2026-11-24T08:00:00Z",
    request: int | None = None,
    assigned: bool = True,
) -> dict[str, Any]:
    """A bound gpuplace pod as the API returns it, its assignment written by
    `gpuplace.cluster.assignments` (the sidecar's code) and its GPU container asking for slots."""
    grant = Grant(
        pod_uid=f"uid-{name}",
        node=node,
        gpus=tuple(gpus),
        milli=milli,
        memory_mib=memory_mib,
        cpu_milli=0,
        host_memory_mib=0,
        state=GrantState.CONFIRMED,
    )
    annotations = assignments.annotations_for(grant, None, datetime(2026, 11, 24, tzinfo=UTC))
    annotations[keys.ASSIGNED_UUIDS] = ",".join(uuids)
    annotations[keys.VISIBLE_DEVICES] = ",".join(uuids)
    count = len(gpus) if request is None else request
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "research",
            "uid": f"uid-{name}",
            "creationTimestamp": created,
            "labels": {keys.MANAGED: "true"},
            "annotations": annotations if assigned else {},
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "sidecar", "image": "busybox"},
                {
                    "name": "train",
                    "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                    "resources": {
                        "requests": {keys.RESOURCE_GPU: str(count)},
                        "limits": {keys.RESOURCE_GPU: str(count)},
                    },
                },
            ],
        },
        "status": {"phase": "Pending"},
    }


def plugin_server(
    gpus: Sequence[handover.NodeGpu],
    pods: Sequence[dict[str, Any]],
    directory: Path,
    options: handover.Options | None = None,
    **settings: Any,
) -> plugin.PluginServer:
    """A real plugin for NODE serving `pods`, its MPS ready, on its own metrics registry;
    `settings` are further PluginServer arguments (slots_per_gpu, wait_seconds, ...)."""
    view = plugin.PodView()
    view.replace(list(pods))
    ready = asyncio.Event()
    ready.set()
    return plugin.PluginServer(
        node=NODE,
        gpus=gpus,
        pods=view,
        options=options or handover.Options(mps=handover.Mps("/run/gpuplace/mps")),
        mps_ready=ready,
        directory=str(directory),
        registry=CollectorRegistry(),
        **settings,
    )


class Kubelet(api_pb2_grpc.RegistrationServicer):
    """See the module docstring."""

    def __init__(self, directory: Path, *, use_preferred: bool = True) -> None:
        self.directory = directory
        self.use_preferred = use_preferred
        self.registrations: list[api_pb2.RegisterRequest] = []
        self.devices: list[api_pb2.Device] = []
        self.lists = 0
        self.allocated: dict[str, str] = {}
        """Device ID → the container it was allocated to (the checkpoint)."""
        self.options = api_pb2.DevicePluginOptions()
        self.preferred: list[list[str]] = []
        self.stream_ended: grpc.StatusCode | None = None
        """How the last ListAndWatch stream ended, when it ended with an error."""
        self._server: Any = None
        self._channel: Any = None
        self._following: asyncio.Task[None] | None = None
        self._listed = asyncio.Event()

    async def start(self) -> None:
        server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.directory / 'kubelet.sock'}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        """Stop following the plugin and serving; the channel and server are closed
        whatever the following task ended with (a gRPC server left running is torn down
        by the garbage collector later, inside another test, on a closed loop)."""
        try:
            if self._following is not None:
                self._following.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._following
        finally:
            if self._channel is not None:
                await self._channel.close()
            if self._server is not None:
                await self._server.stop(0)

    async def restart(self) -> None:
        await self.stop()
        for entry in self.directory.iterdir():
            entry.unlink()
        self.devices = []
        await self.start()

    async def Register(  # noqa: N802
        self, request: api_pb2.RegisterRequest, context: Any
    ) -> api_pb2.Empty:
        if request.version != "v1beta1":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unsupported version")
        self.registrations.append(request)
        if self._following is not None:
            self._following.cancel()
        self._following = asyncio.ensure_future(self._follow(request.endpoint))
        return api_pb2.Empty()

    async def _follow(self, endpoint: str) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = grpc.aio.insecure_channel(f"unix://{self.directory / endpoint}")
        stub = api_pb2_grpc.DevicePluginStub(self._channel)
        self.options = await stub.GetDevicePluginOptions(api_pb2.Empty())
        try:
            async for listing in stub.ListAndWatch(api_pb2.Empty()):
                self.devices = list(listing.devices)
                self.lists += 1
                self._listed.set()
                self._listed = asyncio.Event()
        except grpc.aio.AioRpcError as error:
            # as the kubelet's device manager: a stream that ends (the plugin stopped or
            # restarted; under load gRPC says UNAVAILABLE "Stream removed") is logged and
            # left, never raised into whoever stops the kubelet
            self.stream_ended = error.code()

    async def listed(self, lists: int, timeout: float = 5.0) -> None:
        """Wait until the plugin has sent at least `lists` device lists."""
        async with asyncio.timeout(timeout):
            while self.lists < lists:
                await self._listed.wait()

    def _stub(self) -> Any:
        assert self._channel is not None, "no plugin registered"
        return api_pb2_grpc.DevicePluginStub(self._channel)

    async def admit(self, count: int, container: str = "c") -> api_pb2.ContainerAllocateResponse:
        """Allocate `count` devices to one container, as the device manager does."""
        free = sorted(
            device.ID
            for device in self.devices
            if device.health == allocating.HEALTHY and device.ID not in self.allocated
        )
        if len(free) < count:
            raise RuntimeError(f"only {len(free)} free devices")
        chosen = free[:count]
        if self.use_preferred and self.options.get_preferred_allocation_available:
            preference = await self._stub().GetPreferredAllocation(
                api_pb2.PreferredAllocationRequest(
                    container_requests=[
                        api_pb2.ContainerPreferredAllocationRequest(
                            available_deviceIDs=free, allocation_size=count
                        )
                    ]
                )
            )
            preferred = list(preference.container_responses[0].deviceIDs)
            self.preferred.append(preferred)
            if len(preferred) == count and set(preferred) <= set(free):
                chosen = preferred
        for device in chosen:  # reserved while Allocate runs, as the kubelet does
            self.allocated[device] = container
        try:
            response = await self._stub().Allocate(
                api_pb2.AllocateRequest(
                    container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=chosen)]
                )
            )
        except grpc.aio.AioRpcError:
            for device in chosen:
                del self.allocated[device]
            raise
        answer: api_pb2.ContainerAllocateResponse = response.container_responses[0]
        return answer

    async def allocate(self, device_ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        """Allocate exactly these IDs (a kubelet whose choice differs from the grant)."""
        response = await self._stub().Allocate(
            api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=device_ids)]
            )
        )
        answer: api_pb2.ContainerAllocateResponse = response.container_responses[0]
        return answer
