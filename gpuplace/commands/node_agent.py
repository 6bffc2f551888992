"""`gpuplace node-agent`: the node agent, one per opted-in GPU node (a DaemonSet; see
docs/node-agent.md). It discovers the node's GPUs and their health through NVML and keeps
them and a heartbeat on its Node (gpuplace.agent.publishing), answers the kubelet so that each
container gets exactly its grant: as its device plugin (gpuplace.agent.plugin), or with
--kubelet-plugin=dra as a DRA kubelet plugin that publishes the node's ResourceSlice
(gpuplace.agent.slices) and prepares claims through CDI (gpuplace.agent.kubeletplugin; docs/dra.md),
runs one MPS control daemon per GPU and restarts it when it dies (gpuplace.agent.mps), samples
what each pod uses of its GPUs (gpuplace.agent.usage_sampling), catches pods that hold more than
their grant (an Event, a metric, an audit line and, with --evict-over-grant, an eviction:
gpuplace.agent.enforcing), and serves /metrics, /healthz and /readyz.

Order at start: with DRA, the node's container runtime is checked first (one without CDI
would drop the claims' devices: the agent refuses to start); the node's pod informer, the
first discovery, then the MPS daemons of the node's GPUs, which must answer before a share
is handed out (a client that starts without its daemon runs with no limits), then the
kubelet plugin (registered with the kubelet) and, with DRA, the ResourceSlice, the periodic
discovery and heartbeat, and the usage sampler.

Every flag is also an environment variable `GPUPLACE_<FLAG>`. Exit codes: 0 after
SIGTERM/SIGINT, 2 for invalid settings, 1 when it cannot start (no API, no NVML, port in
use).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

import prometheus_client

from gpuplace import commands
from gpuplace.agent import (
    auditing,
    cgroups,
    discovery,
    enforcing,
    handover,
    kubeletplugin,
    mps,
    nvml,
    plugin,
    publishing,
    runtimes,
    slices,
    usage_sampling,
)
from gpuplace.cluster import connecting, kube, recording, watching
from gpuplace.placement.inventory import ClientContext
from gpuplace.runtime import jsonlines, logs
from gpuplace.wiring import serving, settings
from gpuplace.wiring.agent_settings import AgentSettings

log = logging.getLogger(__name__)

INHERITED_ENV = ("PATH", "LD_LIBRARY_PATH")
"""What the MPS daemons inherit from the agent: where the container toolkit put the
driver's binaries (nvidia-cuda-mps-server) and libraries."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "node-agent",
        help=commands.HELP["node-agent"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    settings.add_arguments(parser, AgentSettings)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = settings.build_or_explain(AgentSettings, args, "node-agent")
    if config is None:
        return 2
    logs.configure(config.log_level)
    registry = serving.process_registry()
    try:
        return asyncio.run(_serve(config, registry))
    except (OSError, nvml.NvmlError, kube.ApiError, StartRefused) as error:
        log.error("cannot start", extra={"error": str(error)})
        return 1


class StartRefused(Exception):
    """The agent must not run as configured on this node (the message says why)."""


def shareable(found: discovery.Discovery | None) -> list[str]:
    """The GPUs that get an MPS daemon: every GPU with a known UUID that is not in MIG
    mode (a share may be granted on any of them at any time, and its daemon must already
    answer then). Whole-GPU grants never reach a daemon: their containers get no pipe
    directory. O(GPUs)."""
    if found is None:
        return []
    return [gpu.uuid for gpu in found.gpus if gpu.uuid is not None and gpu.mig is not True]


def node_gpus(found: discovery.Discovery | None) -> list[handover.NodeGpu]:
    """The GPUs the kubelet plugins hand out: those with a known UUID (a GPU NVML cannot
    name cannot be granted by UUID), healthy or not as discovered. O(GPUs)."""
    if found is None:
        return []
    return [
        handover.NodeGpu(
            gpu.index,
            gpu.uuid,
            healthy=gpu.health.healthy,
            numa=gpu.numa,
            memory_mib=gpu.packable_mib if gpu.packable_mib is not None else gpu.memory_mib,
            reasons=gpu.health.reasons,
            context=gpu.context,
        )
        for gpu in found.gpus
        if gpu.uuid is not None
    ]


def packable(found: discovery.Discovery | None) -> dict[str, int]:
    """GPU UUID → the bytes the engine packs there, as last published. O(GPUs)."""
    if found is None:
        return {}
    return {
        gpu.uuid: gpu.packable_mib << 20
        for gpu in found.gpus
        if gpu.uuid is not None and gpu.packable_mib is not None
    }


def contexts(found: discovery.Discovery | None) -> dict[str, ClientContext]:
    """GPU UUID → its MPS client context, as last published. O(GPUs)."""
    if found is None:
        return {}
    return {gpu.uuid: gpu.context for gpu in found.gpus if gpu.uuid is not None}


@dataclass(slots=True)
class Dra:
    """The DRA side of an agent with --kubelet-plugin=dra."""

    plugin: kubeletplugin.KubeletPlugin
    slices: slices.SlicePublisher
    slice_informer: watching.Informer[dict[str, Any]]


@dataclass(slots=True)
class AgentProcess:
    """The parts of one `gpuplace node-agent` process, built and not yet started."""

    config: AgentSettings
    server: serving.Server
    api: kube.Kube
    nvml: nvml.Nvml
    publisher: publishing.Publisher
    supervisor: mps.Supervisor | None
    plugin: plugin.PluginServer | None
    """The device plugin; None with DRA."""
    informer: watching.Informer[dict[str, Any]]
    sampler: usage_sampling.Sampler
    recorder: recording.Recorder
    audit: auditing.AgentAudit
    dra: Dra | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def not_published_reason(self) -> str | None:
        """Not ready until the GPUs are published, and again while the heartbeat is stale
        (`Publisher.healthy`: no write for two heartbeat periods), so that a node whose
        agent cannot write shows as a pod not ready long before the sidecar closes the
        node. Never in /healthz: a restart would end every share's MPS server."""
        publisher = self.publisher
        error = f" ({publisher.last_error})" if publisher.last_error else ""
        age = publisher.heartbeat_age()
        if age is None:
            return "the node's GPUs are not published yet" + error
        if not publisher.healthy():
            return (
                f"the node's heartbeat was last written {age:.0f} s ago, over two "
                f"--heartbeat-seconds ({publisher.heartbeat_seconds:g} s)" + error
            )
        return None

    def not_serving_reason(self) -> str | None:
        if not self.informer.synced.is_set():
            return "the node's pods are not listed yet"
        if self.plugin is not None and not self.plugin.registered.is_set():
            return "the device plugin is not registered with the kubelet"
        if self.dra is not None:
            if not self.dra.slices.published.is_set():
                return "the node's ResourceSlice is not published yet"
            return self.dra.plugin.not_ready_reason()
        return None

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _discovered(self, found: discovery.Discovery) -> None:
        """A GPU appeared, went or changed health: the plugin lists the new GPUs, and the
        shareable ones get exactly one daemon each."""
        self._set_gpus(found)
        if self.supervisor is not None:
            self._spawn(self.supervisor.set_gpus(shareable(found)), "mps set_gpus")

    def _set_gpus(self, found: discovery.Discovery | None) -> None:
        if self.plugin is not None:
            self.plugin.set_gpus(node_gpus(found))
        if self.dra is not None:
            self.dra.plugin.set_gpus(node_gpus(found))
            self.dra.slices.set_gpus(slices.gpu_devices(found))

    def _mps_changed(self) -> None:
        """A daemon started, stopped, became ready or stopped answering: the plugin knows
        each GPU's pipe directory and looks again at the shares waiting for their daemon
        (it hands out a share only while `supervisor.ready(uuid)`)."""
        supervisor = self.supervisor
        if supervisor is None:
            return
        layout = supervisor.layout
        daemons = {
            uuid: handover.Mps(
                pipe_dir=str(layout.pipe_directory(uuid)), shm_dir=str(layout.shm_directory)
            )
            for uuid in supervisor.daemons
        }
        for served in (self.plugin, self.dra.plugin if self.dra is not None else None):
            if served is not None:
                options = served.options
                served.options = handover.Options(options.strategy, options.cdi_kind, daemons)
                served.mps_changed()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        publisher, supervisor = self.publisher, self.supervisor
        self._spawn(self.informer.run(), "pod informer")
        self._spawn(self.recorder.run(), "events")
        if self.dra is not None:
            self._spawn(self.dra.slice_informer.run(), "slice informer")
            self._spawn(self.dra.slices.run(), "slice publisher")
        try:
            await publisher.publish_once()
        except kube.ApiError as error:  # published by the loop below once the API answers
            log.warning("node GPUs not published yet", extra={"error": str(error)})
        self._set_gpus(publisher.discovery)
        publisher.on_change.append(self._discovered)
        if supervisor is not None:
            supervisor.subscribe(self._mps_changed)
            await supervisor.set_gpus(shareable(publisher.discovery))
            self._mps_changed()
            if not await supervisor.wait_ready(self.config.mps_start_timeout_seconds):
                log.warning(
                    "mps daemons not ready", extra={"reason": supervisor.not_ready_reason()}
                )
        stop_plugin = asyncio.Event()
        served = self.plugin if self.plugin is not None else self.dra.plugin if self.dra else None
        if served is not None:
            self._spawn(served.run(stop_plugin), KUBELET_PLUGIN_TASK)
        self._spawn(publisher.run(), "publishing")
        self._spawn(self.sampler.run(), "usage sampler")
        try:
            yield
        finally:
            stop_plugin.set()
            for task in list(self.tasks):
                if task.get_name() != KUBELET_PLUGIN_TASK:
                    task.cancel()
            for task in list(self.tasks):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if supervisor is not None:
                await supervisor.stop()
            await self.recorder.drain()
            await self.api.close()
            self.audit.close()
            close(self.nvml)


KUBELET_PLUGIN_TASK = "kubelet plugin"
"""Stopped by its own event, last: it removes its sockets (the kubelet then knows)."""


def close(reading: nvml.Nvml) -> None:
    """Shut NVML down (a replay holds nothing)."""
    if isinstance(reading, nvml.Real):
        reading.close()


def open_nvml(config: AgentSettings) -> nvml.Nvml:
    """The driver's NVML, or the captured reading `--nvml-replay` names."""
    if config.nvml_replay is not None:
        return nvml.Replay.load(config.nvml_replay, follow=True)
    return nvml.Real()


async def compose(
    config: AgentSettings,
    registry: prometheus_client.CollectorRegistry,
    *,
    base_env: dict[str, str] | None = None,
) -> AgentProcess:
    """The process as configured; run it with `process.server.run(stop)`. Raises
    `ConnectError` (no API), `NvmlError` (no driver), `OSError` (replay file)."""
    reading = open_nvml(config)
    try:
        client = await connecting.api_client(config.kubeconfig)
    except BaseException:
        close(reading)
        raise
    api = kube.Kube(client, timeout=config.kube_timeout_seconds)
    publisher = publishing.Publisher(
        api,
        config.node_name,
        reading,
        heartbeat_seconds=config.heartbeat_seconds,
        discover_seconds=config.discover_seconds,
        registry=registry,
        context=config.context(),
    )
    if base_env is None:
        base_env = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
    supervisor = mps.Supervisor(config.mps_config(base_env), registry) if config.mps else None
    informer_metrics = watching.InformerMetrics(registry)
    view = plugin.PodView()
    informer = plugin.pod_informer(api, config.node_name, view, informer_metrics)
    # No MPS until the daemons run: a share is refused rather than run unlimited.
    options = handover.Options(handover.Strategy(config.device_list_strategy), mps=None)
    server_of_plugin: plugin.PluginServer | None = None
    dra_side: Dra | None = None
    if config.kubelet_plugin == "dra":
        try:
            dra_side = await _dra(
                config,
                api,
                options,
                supervisor,
                informer_metrics=informer_metrics,
                registry=registry,
            )
        except BaseException:
            await api.close()
            close(reading)
            raise
    else:
        server_of_plugin = plugin.PluginServer(
            node=config.node_name,
            gpus=(),
            pods=view,
            options=options,
            # A share of a GPU is handed out only while that GPU's own daemon answers;
            # without MPS (--mps=false) never (an event nobody sets).
            mps_ready=supervisor.ready if supervisor is not None else asyncio.Event(),
            directory=str(config.device_plugin_dir),
            wait_seconds=config.allocate_wait_seconds,
            registry=registry,
        )
    proc = cgroups.Proc(config.proc_root)
    sampler = usage_sampling.Sampler(
        usage_sampling.Meter(
            reading,
            config.node_name,
            proc,
            own=config.pod_uid or proc.pod_uid("self"),
            servers=supervisor.server_pids if supervisor is not None else frozenset,
            claims=(lambda: list(dra_side.plugin.prepared.values())) if dra_side else tuple,
            contexts=lambda: contexts(publisher.discovery),
        ),
        lambda: list(view.pods.values()),
        seconds=config.usage_seconds,
        peak_seconds=config.usage_peak_seconds,
        registry=registry,
    )
    registry.register(
        usage_sampling.UsageCollector(
            config.node_name,
            sampler,
            usage_sampling.live_in(lambda: view.pods, config.node_name),
            packable=lambda: packable(publisher.discovery),
        )
    )
    recorder = recording.Recorder(api, registry=registry, reporting="gpuplace.io/node-agent")
    audit = auditing.AgentAudit(
        jsonlines.open_sink(config.audit_log, config.audit_log_max_bytes, config.audit_log_backups),
        config.node_name,
    )
    enforcer = enforcing.Enforcer(
        api,
        recorder,
        audit,
        config.node_name,
        contexts=lambda: contexts(publisher.discovery),
        tolerance_mib=config.over_grant_tolerance_mib,
        evict=config.evict_over_grant,
        registry=registry,
    )
    registry.register(enforcer)
    sampler.listeners.append(enforcer.on_sample)
    server = serving.Server(registry)
    process = AgentProcess(
        config,
        server,
        api,
        reading,
        publisher,
        supervisor,
        server_of_plugin,
        informer,
        sampler,
        recorder,
        audit,
        dra_side,
    )
    server.add_site("ops", serving.ops_app(server), config.metrics_address, config.metrics_port)
    server.add_context(process.running)
    server.add_readiness("publishing", process.not_published_reason)
    server.add_readiness(
        "DRA plugin" if dra_side is not None else "device plugin", process.not_serving_reason
    )
    if supervisor is not None:
        server.add_readiness("mps", supervisor.not_ready_reason)
    return process


async def _dra(
    config: AgentSettings,
    api: kube.Kube,
    options: handover.Options,
    supervisor: mps.Supervisor | None,
    *,
    informer_metrics: watching.InformerMetrics,
    registry: prometheus_client.CollectorRegistry,
) -> Dra:
    """The DRA side, once the node's runtime is known to pass CDI devices on. Raises
    `StartRefused` (a runtime without CDI) and `kube.ApiError` (the Node cannot be read)."""
    node = await api.get_node(config.node_name)
    reported = str(
        ((node.get("status") or {}).get("nodeInfo") or {}).get("containerRuntimeVersion") or ""
    )
    refusal = runtimes.cdi_refusal(reported)
    if refusal is not None:
        raise StartRefused(f"--kubelet-plugin=dra refused on node {config.node_name}: {refusal}")
    caveat = runtimes.caveat(reported)
    if caveat is not None:
        log.warning("check the runtime's CDI setting", extra={"runtime": reported, "why": caveat})
    publisher = slices.SlicePublisher(
        api,
        config.node_name,
        str((node.get("metadata") or {}).get("uid") or ""),
        registry=registry,
    )
    return Dra(
        plugin=kubeletplugin.KubeletPlugin(
            node=config.node_name,
            claims=api,
            options=options,
            # without MPS (--mps=false) a share is never ready, so never prepared
            mps_ready=supervisor.ready if supervisor is not None else lambda uuid: False,
            plugins_dir=str(config.kubelet_plugins_dir),
            registry_dir=str(config.kubelet_registry_dir),
            cdi_dir=str(config.cdi_dir),
            wait_seconds=config.allocate_wait_seconds,
            registry=registry,
        ),
        slices=publisher,
        slice_informer=slices.slice_informer(api, config.node_name, publisher, informer_metrics),
    )


async def _serve(config: AgentSettings, registry: prometheus_client.CollectorRegistry) -> int:
    try:
        process = await compose(config, registry)
    except connecting.ConnectError as error:
        log.error("cannot reach the Kubernetes API", extra={"error": str(error)})
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await process.server.run(stop)
    return 0
