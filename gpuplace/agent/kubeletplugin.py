"""The node agent as a DRA kubelet plugin (driver `gpu.gpuplace.io`): two gRPC servers on
unix sockets, the prepared claims' files, and nothing of the decisions
(`gpuplace.agent.preparing`).

- `<plugins dir>/gpu.gpuplace.io/dra.sock` serves `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`
  (NodePrepareResources, NodeUnprepareResources) and the optional
  `v1alpha1.DRAResourceHealth/NodeWatchResources`;
- `<plugins_registry dir>/gpu.gpuplace.io-reg.sock` serves `pluginregistration.Registration`:
  the kubelet's plugin watcher finds the socket, asks GetInfo (type `DRAPlugin`, the driver
  name, the DRA socket, versions `v1.DRAPlugin`) and reports with NotifyRegistrationStatus
  (`registered` is set on success). The kubelet keeps the sockets across its own restarts
  and registers them again; `run` serves again on fresh sockets if one disappears.

NodePrepareResources, per claim (the kubelet names namespace, name, UID; one call at a time):
a claim already prepared is answered as before from the checkpoint (its CDI spec written
back if it is gone), with no API call, so the kubelet's retries and an agent restarted
while the API is away are served alike; otherwise the claim is read
(`get_resource_claim`), `preparing.prepare` decides, the CDI spec is written, then the
checkpoint, then the answer is given. A share waits up to `wait_seconds` for its GPU's MPS
daemon (a share handed out before its daemon runs would run unlimited), then is refused.
A refusal is the claim's `error` in the answer: the kubelet retries, the pod waits with
the message in its Events, and nothing runs. NodeUnprepareResources removes the claim's
spec (by its UID, recorded or not) and its checkpoint entry: the kubelet calls it once the
claim's last pod on the node is gone. Bytes that are no message of their method get
INVALID_ARGUMENT before any of this (`gpuplace.agent.decoding`), and a call naming more than
`MAX_CLAIMS` claims is refused unread.

The health stream sends every device's health (NVML's, as discovered) at once, again on
every change and every `health_seconds`; the kubelet shows it in the pod's
`status.containerStatuses[].allocatedResourcesStatus`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpuplace.agent import claim_files, decoding, handover, preparing
from gpuplace.agent.draplugin import (
    dra_pb2,
    dra_pb2_grpc,
    health_pb2,
    health_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)
from gpuplace.cluster import dra, kube

log = logging.getLogger(__name__)

PLUGINS_DIR = "/var/lib/kubelet/plugins"
REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
CDI_DIR = "/var/run/cdi"
PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin",)
DRA_SOCKET = "dra.sock"
REGISTRATION_SOCKET = f"{dra.DRIVER}-reg.sock"
MAX_CLAIMS = 64
"""Claims one call may name: a pod has at most 32 claims (and its extended-resource one);
more would only cost time."""


class ClaimReader(Protocol):
    """What the plugin needs of `gpuplace.cluster.kube.Kube`."""

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


class DraMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.prepare = Histogram(
            "gpuplace_agent_dra_prepare_duration_seconds",
            "NodePrepareResources answers per claim, by result (prepared, known, refused).",
            ["result"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 1.0, 5.0, 10.0),
            registry=registry,
        )
        self.unprepare = Counter(
            "gpuplace_agent_dra_unprepare_total",
            "NodeUnprepareResources answers per claim, by result (ok, error).",
            ["result"],
            registry=registry,
        )
        self.prepared = Gauge(
            "gpuplace_agent_dra_prepared_claims",
            "Claims prepared on this node and not yet unprepared.",
            registry=registry,
        )
        self.registered = Gauge(
            "gpuplace_agent_dra_registered",
            "1 once the kubelet reported the DRA plugin registered.",
            registry=registry,
        )


def _error(why: str) -> dra_pb2.NodePrepareResourceResponse:
    log.warning("claim not prepared", extra={"reason": why[:300]})
    return dra_pb2.NodePrepareResourceResponse(error=why)


def _answer(prepared: preparing.Prepared) -> dra_pb2.NodePrepareResourceResponse:
    answer = dra_pb2.NodePrepareResourceResponse()
    for item in prepared.devices:
        device = dra_pb2.Device(
            request_names=[item.request.split("/", 1)[0]],
            pool_name=item.pool,
            device_name=item.device,
            cdi_device_ids=list(item.cdi_ids),
        )
        if item.share_id is not None:
            device.share_id = item.share_id
        answer.devices.append(device)
    return answer


class Registration(registration_pb2_grpc.RegistrationServicer):
    """The plugin watcher's side: who we are, and the kubelet's verdict."""

    def __init__(self, endpoint: str, registered: asyncio.Event, metrics: DraMetrics) -> None:
        self.endpoint = endpoint
        self.registered = registered
        self.metrics = metrics
        self.last_error = ""

    async def GetInfo(  # noqa: N802 (the gRPC method's name)
        self, request: registration_pb2.InfoRequest, context: Any
    ) -> registration_pb2.PluginInfo:
        return registration_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=dra.DRIVER,
            endpoint=self.endpoint,
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    async def NotifyRegistrationStatus(  # noqa: N802
        self, request: registration_pb2.RegistrationStatus, context: Any
    ) -> registration_pb2.RegistrationStatusResponse:
        if request.plugin_registered:
            self.registered.set()
            self.metrics.registered.set(1)
            self.last_error = ""
            log.info("registered with the kubelet", extra={"driver": dra.DRIVER})
        else:
            self.registered.clear()
            self.metrics.registered.set(0)
            self.last_error = request.error[:300]
            log.error(
                "the kubelet refused the DRA plugin's registration",
                extra={"driver": dra.DRIVER, "error": self.last_error},
            )
        return registration_pb2.RegistrationStatusResponse()


class KubeletPlugin(dra_pb2_grpc.DRAPluginServicer, health_pb2_grpc.DRAResourceHealthServicer):
    """The DRA plugin of `node`; see the module docstring."""

    def __init__(
        self,
        *,
        node: str,
        claims: ClaimReader,
        options: handover.Options,
        mps_ready: Callable[[str], bool],
        plugins_dir: str = PLUGINS_DIR,
        registry_dir: str = REGISTRY_DIR,
        cdi_dir: str = CDI_DIR,
        wait_seconds: float = 5.0,
        poll_seconds: float = 1.0,
        health_seconds: float = 10.0,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self.claims = claims
        self.options = options
        self.mps_ready = mps_ready
        self.gpus: tuple[handover.NodeGpu, ...] = ()
        self.plugin_dir = Path(plugins_dir) / dra.DRIVER
        self.registry_dir = Path(registry_dir)
        self.files = claim_files.ClaimFiles(self.plugin_dir, Path(cdi_dir))
        self.wait_seconds = wait_seconds
        self.poll_seconds = poll_seconds
        self.health_seconds = health_seconds
        self.metrics = DraMetrics(registry)
        self._clock = clock
        self._wall = wall
        self.registered = asyncio.Event()
        """Set once the kubelet reported this plugin registered."""
        self.registration = Registration(str(self.dra_socket), self.registered, self.metrics)
        self.prepared: dict[str, preparing.Prepared] = {}
        """Claim UID → what was prepared for it (the checkpoint's content)."""
        self.loaded = False
        self._lock = asyncio.Lock()
        self._servers: list[Any] = []
        self._stopping = False
        self._mps_wake = asyncio.Event()
        self._health = asyncio.Event()

    @property
    def dra_socket(self) -> Path:
        return self.plugin_dir / DRA_SOCKET

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / REGISTRATION_SOCKET

    # --- what the agent knows -----------------------------------------------------------

    def set_gpus(self, gpus: Sequence[handover.NodeGpu]) -> None:
        fresh = tuple(gpus)
        if fresh != self.gpus:
            self.gpus = fresh
            self._health.set()
            self._health = asyncio.Event()

    def mps_changed(self) -> None:
        """An MPS daemon became ready or stopped being ready: waiting shares look again."""
        self._mps_wake.set()
        self._mps_wake = asyncio.Event()

    def _ready_options(self) -> handover.Options:
        """The options with only the MPS daemons that answer now."""
        mps = self.options.mps
        if isinstance(mps, Mapping):
            mps = {uuid: daemon for uuid, daemon in mps.items() if self.mps_ready(uuid)}
        return handover.Options(self.options.strategy, self.options.cdi_kind, mps)

    # --- life -----------------------------------------------------------------------------

    async def load(self) -> None:
        """Read the checkpoint, write back the specs that are gone, remove our specs that
        no prepared claim holds."""
        self.prepared = await asyncio.to_thread(self.files.load)
        for uid, prepared in self.prepared.items():
            if not await asyncio.to_thread(self.files.has_spec, uid):
                log.info("CDI spec written back", extra={"claim": str(prepared.claim)})
                await asyncio.to_thread(self.files.write_spec, prepared)
        for uid in await asyncio.to_thread(self.files.orphans, self.prepared):
            log.info("CDI spec of no prepared claim removed", extra={"uid": uid})
            await asyncio.to_thread(self.files.remove_spec, uid)
        self.metrics.prepared.set(len(self.prepared))
        self.loaded = True

    async def start(self) -> None:
        """Load the claims, serve DRAPlugin, then the registration socket (the kubelet dials
        the DRA socket as soon as it registers us)."""
        self._stopping = False
        if not self.loaded:
            await self.load()
        await self._serve()

    async def _serve(self) -> None:
        await self._close_servers()
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.dra_socket, self.registration_socket):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        server = grpc.aio.server(interceptors=[decoding.RefuseUndecodable()])
        dra_pb2_grpc.add_DRAPluginServicer_to_server(self, server)
        health_pb2_grpc.add_DRAResourceHealthServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.dra_socket}")
        await server.start()
        self._servers.append(server)
        registrar = grpc.aio.server(interceptors=[decoding.RefuseUndecodable()])
        registration_pb2_grpc.add_RegistrationServicer_to_server(self.registration, registrar)
        registrar.add_insecure_port(f"unix://{self.registration_socket}")
        await registrar.start()
        self._servers.append(registrar)
        log.info(
            "DRA plugin serving",
            extra={"socket": str(self.dra_socket), "registration": str(self.registration_socket)},
        )

    async def _close_servers(self) -> None:
        servers, self._servers = self._servers, []
        for server in reversed(servers):
            await server.stop(0.5)

    async def stop(self) -> None:
        self._stopping = True
        self._health.set()
        self.registered.clear()
        self.metrics.registered.set(0)
        await self._close_servers()
        for path in (self.registration_socket, self.dra_socket):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    async def run(self, stop: asyncio.Event) -> None:
        """Start, serve again when a socket disappears, until `stop` is set; then stop."""
        try:
            await self.start()
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_seconds)
                gone = not (self.dra_socket.exists() and self.registration_socket.exists())
                if not stop.is_set() and gone:
                    log.info("a DRA plugin socket disappeared: serving again")
                    self.registered.clear()
                    self.metrics.registered.set(0)
                    await self._serve()
        finally:
            await self.stop()

    # --- DRAPlugin ----------------------------------------------------------------------

    async def NodePrepareResources(  # noqa: N802 (the gRPC method's name)
        self, request: dra_pb2.NodePrepareResourcesRequest, context: Any
    ) -> dra_pb2.NodePrepareResourcesResponse:
        response = dra_pb2.NodePrepareResourcesResponse()
        if len(request.claims) > MAX_CLAIMS:
            _refuse(context, _crowded(len(request.claims)))
            return response
        deadline = self._clock() + self.wait_seconds  # one wait per call
        async with self._lock:
            for claim in request.claims:
                if claim.uid in response.claims:
                    continue
                started = self._clock()
                answer, result = await self._prepare(claim, deadline)
                self.metrics.prepare.labels(result).observe(self._clock() - started)
                response.claims[claim.uid].CopyFrom(answer)
        return response

    async def _prepare(
        self, claim: dra_pb2.Claim, deadline: float
    ) -> tuple[dra_pb2.NodePrepareResourceResponse, str]:
        try:
            ref = preparing.checked_ref(claim.namespace, claim.name, claim.uid)
        except handover.Refusal as refusal:
            return _error(str(refusal)), "refused"
        known = self.prepared.get(ref.uid)
        if known is not None:
            if known.claim != ref:
                return _error(f"{ref}: UID {ref.uid} is {known.claim}'s, prepared here"), "refused"
            try:
                if not await asyncio.to_thread(self.files.has_spec, ref.uid):
                    await asyncio.to_thread(self.files.write_spec, known)
            except OSError as error:
                return _error(f"{ref}: its CDI spec cannot be written: {error}"), "refused"
            return _answer(known), "known"
        try:
            body = await self.claims.get_resource_claim(ref.namespace, ref.name)
        except kube.ApiError as error:
            return _error(f"{ref}: cannot be read: {error}"), "refused"
        while True:
            try:
                prepared = preparing.prepare(ref, body, self.node, self.gpus, self._ready_options())
                break
            except handover.MpsNotReady as refusal:
                left = deadline - self._clock()
                if left <= 0:
                    return _error(str(refusal)), "refused"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._mps_wake.wait(), left)
            except handover.Refusal as refusal:
                return _error(str(refusal)), "refused"
        try:
            await asyncio.to_thread(self.files.write_spec, prepared)
            self.prepared[ref.uid] = prepared
            await asyncio.to_thread(self.files.save, list(self.prepared.values()))
        except OSError as error:
            self.prepared.pop(ref.uid, None)
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self.files.remove_spec, ref.uid)
            return _error(f"{ref}: its CDI spec or checkpoint cannot be written: {error}"), (
                "refused"
            )
        self.metrics.prepared.set(len(self.prepared))
        log.info(
            "claim prepared",
            extra={
                "claim": str(ref),
                "gpus": ",".join(item.uuid for item in prepared.devices),
                "milli": ",".join(str(item.milli) for item in prepared.devices),
                "memory_mib": ",".join(str(item.memory_mib) for item in prepared.devices),
            },
        )
        return _answer(prepared), "prepared"

    async def NodeUnprepareResources(  # noqa: N802
        self, request: dra_pb2.NodeUnprepareResourcesRequest, context: Any
    ) -> dra_pb2.NodeUnprepareResourcesResponse:
        response = dra_pb2.NodeUnprepareResourcesResponse()
        if len(request.claims) > MAX_CLAIMS:
            _refuse(context, _crowded(len(request.claims)))
            return response
        async with self._lock:
            for claim in request.claims:
                if claim.uid in response.claims:
                    continue
                response.claims[claim.uid].CopyFrom(await self._unprepare(claim))
        return response

    async def _unprepare(self, claim: dra_pb2.Claim) -> dra_pb2.NodeUnprepareResourceResponse:
        if preparing.uid_of_spec(preparing.spec_file(claim.uid)) is None:
            self.metrics.unprepare.labels("error").inc()
            return dra_pb2.NodeUnprepareResourceResponse(
                error=f"{claim.uid[:64]!r} is not a claim UID"
            )
        known = self.prepared.pop(claim.uid, None)
        try:
            await asyncio.to_thread(self.files.remove_spec, claim.uid)
            if known is not None:
                await asyncio.to_thread(self.files.save, list(self.prepared.values()))
        except OSError as error:
            if known is not None:
                self.prepared[claim.uid] = known
            self.metrics.unprepare.labels("error").inc()
            return dra_pb2.NodeUnprepareResourceResponse(error=f"cannot unprepare: {error}")
        self.metrics.unprepare.labels("ok").inc()
        self.metrics.prepared.set(len(self.prepared))
        log.info(
            "claim unprepared",
            extra={"claim": str(known.claim) if known else claim.uid, "known": known is not None},
        )
        return dra_pb2.NodeUnprepareResourceResponse()

    # --- DRAResourceHealth ----------------------------------------------------------------

    def health(self) -> health_pb2.NodeWatchResourcesResponse:
        """Every device's health now."""
        now = int(self._wall())
        timeout = int(3 * self.health_seconds) + 1
        return health_pb2.NodeWatchResourcesResponse(
            devices=[
                health_pb2.DeviceHealth(
                    device=health_pb2.DeviceIdentifier(
                        pool_name=dra.pool_name(self.node), device_name=dra.device_name(gpu.index)
                    ),
                    health=health_pb2.HEALTHY if gpu.healthy else health_pb2.UNHEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=timeout,
                    message="; ".join(gpu.reasons)[:1024],
                )
                for gpu in self.gpus
            ]
        )

    async def NodeWatchResources(  # noqa: N802
        self, request: health_pb2.NodeWatchResourcesRequest, context: Any
    ) -> AsyncIterator[health_pb2.NodeWatchResourcesResponse]:
        while not self._stopping:
            changed = self._health
            yield self.health()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), self.health_seconds)

    # --- readiness ----------------------------------------------------------------------

    def not_ready_reason(self) -> str | None:
        if not self.registered.is_set():
            refused = self.registration.last_error
            return "the DRA plugin is not registered with the kubelet" + (
                f" (it refused: {refused})" if refused else ""
            )
        return None


def _refuse(context: Any, why: str) -> None:
    log.warning("request refused", extra={"code": "INVALID_ARGUMENT", "reason": why})
    context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
    context.set_details(why)


def _crowded(count: int) -> str:
    return f"{count} claims in one call: at most {MAX_CLAIMS} are read"
