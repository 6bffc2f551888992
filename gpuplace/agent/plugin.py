"""The node agent's kubelet device plugin: a gRPC server on a unix socket in the kubelet's
device-plugins directory, registered with the kubelet, serving `gpuplace.io/gpu`.

It owns the plugin's life on the node, and nothing of the decisions (`gpuplace.agent.allocating`):

- `start` serves DevicePlugin on `<dir>/<socket_name>`, then calls the kubelet's
  Registration.Register on `<dir>/kubelet.sock` (retrying with backoff until it answers);
- `run` watches, every `poll_seconds`, that the kubelet's socket is still the one it
  registered with and that its own socket still exists. A kubelet restart removes every
  socket in the directory and recreates its own: the plugin then serves on a fresh socket
  and registers again (the kubelet keeps running containers' devices in its checkpoint);
- ListAndWatch streams the slot list, and again whenever `set_gpus` changes a GPU's
  health or the GPU set;
- GetPreferredAllocation and Allocate read this node's pods from a `PodView` (fed by an
  informer of pods with `spec.nodeName=<node>`), waiting up to `wait_seconds` for it to
  show the pod the kubelet is admitting (the sidecar writes the assignment before the
  Binding, so the kubelet cannot see a pod before its grant exists). Allocate calls are
  answered one at a time (the kubelet admits pods one at a time too);
- a share is answered only once the MPS daemon of its GPU is ready (a share admitted
  before its daemon runs would run unlimited): `mps_ready` is either one event for the
  node or `ready(uuid) -> bool` per GPU, whose changes the composition reports with
  `mps_changed()` (e.g. `supervisor.subscribe(server.mps_changed)`); Allocate waits up to
  `wait_seconds`, then refuses.

A refusal is a gRPC FAILED_PRECONDITION (UNAVAILABLE while MPS is not ready) with a
message: the kubelet fails that pod's admission (UnexpectedAdmissionError) and the
container never starts, so nothing ever runs with a GPU it was not granted. A refused
Allocate records nothing (every container of a call is answered, or none is), and bytes
that are no message of their method get INVALID_ARGUMENT before any of this runs
(`gpuplace.agent.decoding`). Each call waits at most `wait_seconds` in all, and one that
names more than `MAX_CONTAINERS` containers is refused INVALID_ARGUMENT unread.

The composition root builds it (`PodView`, `pod_informer`, `PluginServer`) and runs
`informer.run()` beside `server.run(stop)`; `/readyz` can read `server.registered`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpuplace.agent import allocating, decoding, handover
from gpuplace.agent.deviceplugin import api_pb2, api_pb2_grpc
from gpuplace.cluster import keys, kube, watching

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
SOCKET_NAME = "gpuplace.sock"
MAX_CONTAINERS = 16
"""Containers one Allocate or GetPreferredAllocation may name: the kubelet names one (a
call per container); more would only cost time (each is read against every pod)."""


# --- the pods of this node ---------------------------------------------------------


class PodView:
    """The pods bound to this node, as raw dicts by UID (a node holds ~100 pods at most);
    a `gpuplace.cluster.watching.Handler` for the pod informer. Waiters wake on every change."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self._changed = asyncio.Event()
        self.synced = False

    def _touch(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def replace(self, objects: list[dict[str, Any]]) -> None:
        self.pods = {_uid(pod): pod for pod in objects}
        self.synced = True
        self._touch()

    def upsert(self, obj: dict[str, Any]) -> None:
        self.pods[_uid(obj)] = obj
        self._touch()

    def delete(self, obj: dict[str, Any]) -> None:
        self.pods.pop(_uid(obj), None)
        self._touch()

    async def changed(self, timeout: float) -> None:
        """Return on the next change, or after `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), max(timeout, 0.0))


def _uid(pod: dict[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


def pod_informer(
    api: kube.Kube, node: str, view: PodView, metrics: watching.InformerMetrics | None = None
) -> watching.Informer[dict[str, Any]]:
    """The informer of this node's pods (list + watch pods, `spec.nodeName=<node>`)."""
    return watching.Informer(
        api,
        "pods",
        view,
        lambda pod: pod,
        field_selector=f"spec.nodeName={node}",
        metrics=metrics,
    )


# --- metrics ---------------------------------------------------------------------------


class PluginMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.allocate = Histogram(
            "gpuplace_agent_allocate_duration_seconds",
            "Allocate answers to the kubelet, by result (exact, mismatch, refused).",
            ["result"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0, 10.0),
            registry=registry,
        )
        self.ambiguous = Counter(
            "gpuplace_agent_allocate_ambiguous_total",
            "Allocate answers chosen among pods that would have got different answers.",
            registry=registry,
        )
        self.registrations = Counter(
            "gpuplace_agent_plugin_registrations_total",
            "Registrations with the kubelet, by result.",
            ["result"],
            registry=registry,
        )
        self.registered = Gauge(
            "gpuplace_agent_plugin_registered",
            "1 while the device plugin is registered with the current kubelet.",
            registry=registry,
        )
        self.devices = Gauge(
            "gpuplace_agent_plugin_devices",
            "Slots listed to the kubelet, by health.",
            ["health"],
            registry=registry,
        )


# --- the server ------------------------------------------------------------------------


class PluginServer(api_pb2_grpc.DevicePluginServicer):
    """The device plugin for `resource` on `node`; see the module docstring."""

    def __init__(
        self,
        *,
        node: str,
        gpus: Sequence[handover.NodeGpu],
        pods: PodView,
        options: handover.Options,
        mps_ready: asyncio.Event | Callable[[str], bool] | None = None,
        directory: str = DEVICE_PLUGIN_DIR,
        socket_name: str = SOCKET_NAME,
        resource: str = keys.RESOURCE_GPU,
        slots_per_gpu: int = 100,
        wait_seconds: float = 5.0,
        poll_seconds: float = 1.0,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.gpus: tuple[handover.NodeGpu, ...] = tuple(gpus)
        self.pods = pods
        self.options = options
        self.mps_ready = mps_ready if mps_ready is not None else asyncio.Event()
        """The node's MPS daemon is ready (an event), or the one of a GPU (by UUID)."""
        self._mps_wake = asyncio.Event()
        self.directory = Path(directory)
        self.socket_name = socket_name
        self.resource = resource
        self.slots_per_gpu = slots_per_gpu
        self.wait_seconds = wait_seconds
        self.poll_seconds = poll_seconds
        self.metrics = PluginMetrics(registry)
        self._clock = clock
        self.registered = asyncio.Event()
        """Set while registered with the kubelet whose socket is there now."""
        self.answered: dict[str, tuple[str, tuple[str, ...]]] = {}
        """Pod UID → (container, slot IDs) of the Allocate answers given."""
        self._server: Any = None
        self._kubelet: tuple[int, int] | None = None
        self._listing = asyncio.Event()
        self._lock = asyncio.Lock()
        self._stopping = False
        self._stop = asyncio.Event()
        """`run`'s stop event: ends registration retries too."""
        self._read: dict[str, tuple[dict[str, Any], allocating.Reading]] = {}
        self._read_gpus: tuple[handover.NodeGpu, ...] = ()
        self._slots: tuple[tuple[handover.NodeGpu, ...] | None, frozenset[str]] = (
            None,
            frozenset(),
        )
        self._count_devices()

    @property
    def socket_path(self) -> Path:
        return self.directory / self.socket_name

    # --- life ---------------------------------------------------------------------

    def mps_changed(self) -> None:
        """An MPS daemon became ready or stopped being ready: waiting shares look again."""
        self._mps_wake.set()
        self._mps_wake = asyncio.Event()

    def _mps_is_ready(self, uuid: str) -> bool:
        if isinstance(self.mps_ready, asyncio.Event):
            return self.mps_ready.is_set()
        return self.mps_ready(uuid)

    def set_gpus(self, gpus: Sequence[handover.NodeGpu]) -> None:
        """The node's GPUs changed (health, or the set): ListAndWatch sends the new list."""
        fresh = tuple(gpus)
        if fresh != self.gpus:
            self.gpus = fresh
            self._count_devices()
            self._listing.set()
            self._listing = asyncio.Event()

    async def start(self) -> None:
        """Serve on a fresh socket, then register with the kubelet (retried until it
        answers or `stop`)."""
        self._stopping = False
        await self._serve()
        await self._register()

    async def stop(self) -> None:
        self._stopping = True
        self.registered.clear()
        self.metrics.registered.set(0)
        self._listing.set()
        if self._server is not None:
            await self._server.stop(0.5)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def run(self, stop: asyncio.Event) -> None:
        """Start, keep registered across kubelet restarts until `stop` is set, then stop."""
        self._stop = stop
        try:
            await self.start()
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_seconds)
                if not stop.is_set() and self._kubelet_restarted():
                    log.info("kubelet restarted: serving again and re-registering")
                    self.registered.clear()
                    self.metrics.registered.set(0)
                    await self._serve()
                    await self._register()
        finally:
            await self.stop()

    def _kubelet_restarted(self) -> bool:
        return self._kubelet_identity() != self._kubelet or not self.socket_path.exists()

    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            found = os.stat(self.directory / KUBELET_SOCKET)
        except FileNotFoundError:
            return None
        return (found.st_ino, found.st_ctime_ns)

    async def _serve(self) -> None:
        if self._server is not None:
            await self._server.stop(0.5)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = grpc.aio.server(interceptors=[decoding.RefuseUndecodable()])
        api_pb2_grpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server
        log.info("device plugin serving", extra={"socket": str(self.socket_path)})

    async def _register(self) -> None:
        attempt = 0
        backoff = watching.Backoff(first=0.1, cap=5.0)
        while not self._stopping and not self._stop.is_set():
            identity = self._kubelet_identity()
            try:
                await self._register_once()
            except grpc.aio.AioRpcError as error:
                attempt += 1
                self.metrics.registrations.labels("failed").inc()
                log.warning(
                    "kubelet registration failed, retrying",
                    extra={"code": str(error.code()), "error": str(error.details())[:200]},
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), backoff.delay(attempt))
                continue
            self._kubelet = identity
            self.registered.set()
            self.metrics.registered.set(1)
            self.metrics.registrations.labels("ok").inc()
            log.info("registered with the kubelet", extra={"resource": self.resource})
            return

    async def _register_once(self) -> None:
        target = f"unix://{self.directory / KUBELET_SOCKET}"
        async with grpc.aio.insecure_channel(target) as channel:
            stub = api_pb2_grpc.RegistrationStub(channel)
            await stub.Register(
                api_pb2.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.socket_name,
                    resource_name=self.resource,
                    options=_OPTIONS,
                ),
                timeout=5.0,
            )

    def _count_devices(self) -> None:
        healthy = sum(1 for gpu in self.gpus if gpu.healthy) * self.slots_per_gpu
        self.metrics.devices.labels(allocating.HEALTHY).set(healthy)
        self.metrics.devices.labels(allocating.UNHEALTHY).set(
            len(self.gpus) * self.slots_per_gpu - healthy
        )

    # --- the DevicePlugin service -------------------------------------------------------

    async def GetDevicePluginOptions(  # noqa: N802 (the gRPC method's name)
        self, request: api_pb2.Empty, context: Any
    ) -> api_pb2.DevicePluginOptions:
        return _OPTIONS

    async def ListAndWatch(  # noqa: N802
        self, request: api_pb2.Empty, context: Any
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        while not self._stopping:
            changed = self._listing
            yield api_pb2.ListAndWatchResponse(
                devices=allocating.devices(self.gpus, self.slots_per_gpu)
            )
            await changed.wait()

    async def GetPreferredAllocation(  # noqa: N802
        self, request: api_pb2.PreferredAllocationRequest, context: Any
    ) -> api_pb2.PreferredAllocationResponse:
        response = api_pb2.PreferredAllocationResponse()
        if len(request.container_requests) > MAX_CONTAINERS:
            _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, _crowded(request))
            return response
        if not request.container_requests:
            return response  # nothing to prefer: no pod to wait for
        sizes = {int(container.allocation_size) for container in request.container_requests}
        deadline = self._clock() + self.wait_seconds  # one wait per call, however many asked
        while True:
            candidates, _ = self._readings()
            waiting = any(
                item.count in sizes and item.uid not in self.answered and not item.started
                for item in candidates
            )
            if waiting or self._clock() >= deadline:
                break
            await self.pods.changed(deadline - self._clock())
        for container in request.container_requests:
            chosen = allocating.prefer(
                self._slots_only(container), candidates, self.answered.keys()
            )
            response.container_responses.append(
                api_pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen)
            )
        return response

    async def Allocate(  # noqa: N802
        self, request: api_pb2.AllocateRequest, context: Any
    ) -> api_pb2.AllocateResponse:
        """Every container of the request answered, or none: a refusal records nothing."""
        started = self._clock()
        deadline = started + self.wait_seconds  # one wait per call, however many containers
        response = api_pb2.AllocateResponse()
        results: list[str] = []
        if len(request.container_requests) > MAX_CONTAINERS:
            self.metrics.allocate.labels("refused").observe(self._clock() - started)
            _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, _crowded(request))
            return response
        async with self._lock:
            taken: dict[str, tuple[str, tuple[str, ...]]] = {}
            waiting = False
            try:
                for container in request.container_requests:
                    answer, result = await self._allocate(
                        tuple(container.devices_ids), taken, deadline
                    )
                    response.container_responses.append(answer)
                    results.append(result)
            except handover.Refusal as refusal:
                why, waiting = str(refusal), isinstance(refusal, handover.MpsNotReady)
            else:
                why = ""
                self.answered.update(taken)
        if why:
            self.metrics.allocate.labels("refused").observe(self._clock() - started)
            code = grpc.StatusCode.UNAVAILABLE if waiting else grpc.StatusCode.FAILED_PRECONDITION
            _refuse(context, code, why)
            return api_pb2.AllocateResponse()
        elapsed = self._clock() - started
        for result in results:
            self.metrics.allocate.labels(result).observe(elapsed)
        return response

    async def PreStartContainer(  # noqa: N802
        self, request: api_pb2.PreStartContainerRequest, context: Any
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()

    # --- Allocate, one container ---------------------------------------------------------

    def _listed_slots(self) -> frozenset[str]:
        """The slot IDs ListAndWatch sends for the GPUs of now. O(GPUs × slots) on a change."""
        if self._slots[0] is not self.gpus:
            slots = frozenset(
                allocating.device_id(gpu.uuid, slot)
                for gpu in self.gpus
                for slot in range(self.slots_per_gpu)
            )
            self._slots = (self.gpus, slots)
        return self._slots[1]

    def _slots_only(
        self, container: api_pb2.ContainerPreferredAllocationRequest
    ) -> api_pb2.ContainerPreferredAllocationRequest:
        """`container` as `prefer` reads it: when it names more IDs than there are slots (no
        kubelet does), only the IDs of slots, so that the work stays O(slots)."""
        listed = self._listed_slots()
        available, must = container.available_deviceIDs, container.must_include_deviceIDs
        if max(len(available), len(must)) <= len(listed):
            return container
        return api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=[device for device in available if device in listed],
            must_include_deviceIDs=[device for device in must if device in listed],
            allocation_size=container.allocation_size,
        )

    def _readings(self) -> tuple[list[allocating.Candidate], list[allocating.Stranger]]:
        """The candidates and strangers among this node's pods, each pod read once per
        version of it (the informer hands a new dict for every change) and of the GPU list."""
        gpus = self.gpus
        cache = self._read if self._read_gpus is gpus else {}
        fresh: dict[str, tuple[dict[str, Any], allocating.Reading]] = {}
        candidates: list[allocating.Candidate] = []
        strangers: list[allocating.Stranger] = []
        for uid, pod in self.pods.pods.items():
            cached = cache.get(uid)
            item = (
                cached[1]
                if cached is not None and cached[0] is pod
                else allocating.read(pod, self.node, gpus)
            )
            fresh[uid] = (pod, item)
            if isinstance(item, allocating.Candidate):
                candidates.append(item)
            elif item is not None:
                strangers.append(item)
        self._read, self._read_gpus = fresh, gpus
        for uid in [uid for uid in self.answered if uid not in self.pods.pods]:
            del self.answered[uid]  # the pod is gone: forget its answer
        return candidates, strangers

    async def _allocate(
        self,
        device_ids: tuple[str, ...],
        taken: dict[str, tuple[str, tuple[str, ...]]],
        deadline: float,
    ) -> tuple[api_pb2.ContainerAllocateResponse, str]:
        """One container's answer; its pod goes into `taken` (the call's own record, kept
        only if every container of the call is answered)."""
        listed = self._listed_slots()
        unknown = [device for device in device_ids if device not in listed]
        if unknown or not device_ids:
            shown = repr(unknown[0][:80]) if unknown else "(none)"
            raise handover.Refusal(f"device {shown} is not a {self.resource} slot of this node")
        named = {device for _, ids in taken.values() for device in ids}
        if len(set(device_ids)) != len(device_ids) or named.intersection(device_ids):
            raise handover.Refusal("the same slot is named twice")
        match = None
        while match is None:
            settled = self._clock() >= deadline
            candidates, suspects = self._readings()
            match = allocating.choose(
                device_ids,
                candidates,
                suspects,
                self.answered.keys() | taken.keys(),
                allow_mismatch=settled,
            )
            if match is not None and match.tier is not allocating.Tier.EXACT and not settled:
                match = None  # an exact candidate may still arrive: wait for it first
            if match is None:
                if settled:
                    raise handover.Refusal(self._unmatched(len(device_ids), suspects))
                await self.pods.changed(deadline - self._clock())
        chosen = match.candidate
        while chosen.share and not self._mps_is_ready(chosen.uuids[0]):
            left = deadline - self._clock()
            if left <= 0:
                break
            waking = self.mps_ready if isinstance(self.mps_ready, asyncio.Event) else self._mps_wake
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waking.wait(), left)
        options = self.options
        if chosen.share and not self._mps_is_ready(chosen.uuids[0]):
            options = options.without_mps()
        answer = allocating.answer(chosen, self.gpus, options)
        if match.ambiguous:
            self.metrics.ambiguous.inc()
        if match.tier is not allocating.Tier.EXACT or match.ambiguous:
            log.warning(
                "allocate matched a pod by its grant, not by the kubelet's slots",
                extra={"pod": str(chosen), "tier": str(match.tier), "ambiguous": match.ambiguous},
            )
        taken[chosen.uid] = (chosen.container, device_ids)
        log.info(
            "allocated",
            extra={
                "pod": str(chosen),
                "container": chosen.container,
                "gpus": ",".join(chosen.uuids),
                "tier": str(match.tier),
            },
        )
        return answer, str(match.tier)

    def _unmatched(self, size: int, strangers: list[allocating.Stranger]) -> str:
        """Why nothing was chosen for `size` slots."""
        suspects = allocating.suspects(size, strangers)
        if suspects:
            named = ", ".join(str(stranger) for stranger in suspects[:3])
            return (
                f"{named} asks for {size} {self.resource} slot(s) without a gpuplace grant on "
                f"{self.node}; the kubelet does not say which pod it allocates for, so no pod "
                "of that size is answered while such a pod waits for admission"
            )
        return (
            f"no pod bound to {self.node} holds a gpuplace grant for {size} GPU(s) that has "
            "not started yet"
        )


def _refuse(context: Any, code: grpc.StatusCode, why: str) -> None:
    """Answer the call with `code` and one WARNING line. A status, not `context.abort`: the
    abort's traceback would keep the caller's frame (the request: up to 4 MiB) in a
    reference cycle until a full collection."""
    log.warning("request refused", extra={"code": code.name, "reason": why[:300]})
    context.set_code(code)
    context.set_details(why)


def _crowded(request: api_pb2.AllocateRequest | api_pb2.PreferredAllocationRequest) -> str:
    return (
        f"{len(request.container_requests)} containers in one call: the kubelet asks for one "
        f"container a call, and at most {MAX_CONTAINERS} are read"
    )


_OPTIONS = api_pb2.DevicePluginOptions(
    pre_start_required=False, get_preferred_allocation_available=True
)
