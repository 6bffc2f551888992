"""The scheduler sidecar, composed from one builder per feature: informers → ledger →
extender verbs, the background work that keeps the API right (node status, Events,
expired reservations), and the features `gpuplace serve` turns on.

What it holds itself is what every feature shares: the ledger (`LedgerSync`) fed by the
one informer of nodes and the one of managed pods (`gpuplace.cluster.mirroring`, whose
`pods.Reader` is the process's one reading of a pod), the placement policy in force
(`gpuplace.extender.workloads.PolicyHolder`), the fences of a starving gang or queued
workload, the Event recorder, the reaper of expired reservations, the node status
advertiser, and the leader gate of the controllers (`gpuplace.wiring.leading`: they
decide only while this pod's kube-scheduler holds its leader-election Lease,
`--scheduler-lease`, so that one replica's ledger decides at a time). The features,
each built by its own module of this room:

- the extender (`gpuplace.wiring.extender`: filter, prioritize, bind, preempt, scoring
  ahead; its app is `app`);
- the load-aware tie-break (`gpuplace.wiring.loads`, `--load-aware`);
- the link to the node agents (`gpuplace.wiring.node_agents`: silent agents close nodes);
- with `gangs`, the gang controller (`gpuplace.wiring.gangs`);
- with `queues`, the GpuQueues and the queue controller (`gpuplace.wiring.queues`; the
  webhook of the same process reads the same `directory`);
- with `plan_pin`, the planner (`gpuplace.wiring.planning`: plan, then pin; the webhook of
  the same process gates the pods it plans: those on the device-plugin path);
- with `dra_claims` (other than `off`), the informer of ResourceClaims beside the pod
  informer (grants through claims and through the extender: one ledger) and the DRA claim
  controller (`gpuplace.wiring.claims`: the claims of pods the webhook sent to DRA nodes).

For `gpuplace serve` (see gpuplace.wiring.composing):

    sidecar = await Sidecar.create(settings, registry)   # settings: the process's Settings
    server.add_context(sidecar.running)                  # informers etc. start/stop
    server.add_readiness("sidecar", sidecar.not_ready_reason)
    server.add_site("extender", sidecar.app, settings.extender_address,
                    settings.extender_port)
    # the webhook may use `sidecar` as its CapabilitySource (live inventory)

or, in a single aiohttp app: `app.cleanup_ctx.append(sidecar.cleanup_ctx)`. It reads its
flags from `gpuplace.wiring.settings.SidecarSettings` (the process's `Settings` extends
them, and is what `gpuplace serve` passes here); `SidecarSettings.gangs`, `queues` and
`plan_pin` are off (a bare sidecar, as the extender tests build it), `gpuplace serve`
turns them on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypedDict

from aiohttp import web
from prometheus_client import CollectorRegistry

from gpuplace.cluster import advertising, connecting, kube, metering, mirroring, reaping, recording
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender import workloads
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import Fences
from gpuplace.placement.inventory import Capabilities
from gpuplace.runtime import gc_tuning
from gpuplace.usage.gpu_loads import LoadReader
from gpuplace.webhook.inventory import Paths, paths_of
from gpuplace.wiring import (
    claims,
    extender,
    gangs,
    leading,
    loads,
    node_agents,
    planning,
    queues,
)
from gpuplace.wiring.settings import SidecarSettings

log = logging.getLogger(__name__)

DRAIN_SECONDS = 2.0
"""How long a stopping sidecar writes the Events still queued; an API that does not take
them in that time costs those Events, never the stop."""


class Controlled(TypedDict):
    """What the sidecar hands every controller's builder alike."""

    fences: Fences
    recorder: recording.Recorder | None
    registry: CollectorRegistry
    active: Callable[[], bool] | None
    blocked: Callable[[], str | None] | None


class Sidecar:
    """Everything the sidecar runs; see the module docstring."""

    def __init__(
        self,
        settings: SidecarSettings,
        registry: CollectorRegistry,
        api: kube.Kube,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        load_reader: Callable[[], LoadReader] | None = None,
        load_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` times the typical workload's refresh (tests move it on);
        `load_reader` makes the reader of GPU loads (needed with `load_aware`), whose
        age `load_clock` measures. Raises `loads.NoLoadReader`."""
        self.settings = settings
        self.registry = registry
        self.api = api
        self.sync = LedgerSync(
            window=settings.workload_window,
            agent_silence=settings.agent_silence_seconds,
            require_agent=settings.require_node_agent,
        )
        self.mirror = mirroring.Mirror(
            api,
            self.sync,
            registry=registry,
            page_size=settings.list_page_size,
            watch_seconds=settings.watch_timeout_seconds,
            with_claims=settings.dra_claims != "off",
        )
        self.holder = workloads.PolicyHolder(
            self.sync,
            settings.policy,
            refresh_seconds=settings.workload_refresh_seconds,
            rng=rng,
            clock=clock,
            ties=settings.load_aware,
        )
        self.measured = loads.build(settings, registry, load_reader, load_clock)
        """Measured GPU loads and their poller (None without `load_aware`)."""
        self.fences = Fences()
        """Capacity holds of a starving gang or queued workload (written by the
        controllers, read by filter)."""
        self.recorder = recording.Recorder(api, registry=registry) if settings.pod_events else None
        self.extender = extender.build(
            settings,
            registry,
            api,
            self.sync,
            self.holder,
            fences=self.fences,
            recorder=self.recorder,
            loads=self.measured.board if self.measured is not None else None,
            reader=self.mirror.reader,
        )
        self.app = self.extender.app
        """The extender's aiohttp app (/filter, /prioritize, /bind, /preempt), for its own
        site."""
        self.decider = self.extender.decider
        self.service = self.extender.service
        self.warmer = self.extender.warmer
        self.preempter = self.extender.preempter
        self.reaper = reaping.Reaper(
            api,
            self.sync,
            ttl=settings.reservation_timeout_seconds,
            interval=settings.reap_interval_seconds,
            recorder=self.recorder,
            registry=registry,
        )
        self.silence_taints = node_agents.silence_taints(settings, api, registry)
        """Silent DRA nodes' device taints (None without `--dra-silence-taints`)."""
        self.advertiser: advertising.Advertiser | None = None
        if settings.advertise_resources:
            self.advertiser = advertising.Advertiser(
                api, registry=registry, min_interval=settings.node_status_min_interval_seconds
            )
            self.sync.node_listeners.append(self.advertiser.observe)
        self._capabilities: Capabilities | None = None
        self._paths: Paths | None = None
        self.sync.node_listeners.append(self._nodes_changed)
        registry.register(metering.LedgerCollector(self.sync, self.holder.measured))
        registry.register(api.refusals)  # gpuplace_api_refusals_total
        self.leader = (
            leading.follower(api, settings.scheduler_lease)
            if settings.gangs
            or settings.queues
            or settings.dra_claims != "off"
            or settings.plan_pin != "off"
            else None
        )
        """Whether this replica's kube-scheduler leads (None: always treated as leading,
        or no controller runs): the gang, queue, claim and plan controllers decide only
        then."""
        blocked = self.leader.blocked_reason if self.leader is not None else None
        controlled = Controlled(
            fences=self.fences,
            recorder=self.recorder,
            registry=registry,
            active=self.leader,
            blocked=blocked,
        )
        self.gangs = (
            gangs.build(
                api, self.sync, self._policy, settings=gangs.settings_from(settings), **controlled
            )
            if settings.gangs
            else None
        )
        """The gang controller (None with `gangs` off)."""
        self.queues = (
            queues.build(
                api,
                self.sync,
                self._policy,
                settings=queues.settings_from(settings),
                page_size=settings.list_page_size,
                watch_seconds=settings.watch_timeout_seconds,
                **controlled,
            )
            if settings.queues
            else None
        )
        """The GpuQueues and the queue controller (None with `queues` off)."""
        self.planning = (
            planning.build(
                api,
                self.sync,
                self._policy,
                settings=planning.settings_from(settings),
                **controlled,
            )
            if settings.plan_pin != "off"
            else None
        )
        """The planner: plan, then pin (None with `plan_pin` off)."""
        self.claims = (
            claims.build(
                api,
                self.sync,
                self._policy,
                recorder=self.recorder,
                registry=registry,
                settings=claims.settings_from(settings),
                fences=self.fences,
                active=controlled["active"],
                blocked=controlled["blocked"],
            )
            if settings.dra_claims != "off"
            else None
        )
        """The DRA claim controller (None with `dra_claims` off)."""
        self.directory = self.queues.directory if self.queues is not None else None
        """The GpuQueues and namespaces (None with `queues` off): the queue controller's,
        and the webhook's `QueueSource` in the same process."""

    @classmethod
    async def create(
        cls, settings: SidecarSettings, registry: CollectorRegistry, **kwargs: Any
    ) -> Sidecar:
        """Connect to the API (kubeconfig, else in-cluster) and build the sidecar.
        Raises `gpuplace.cluster.connecting.ConnectError`, `loads.NoLoadReader` (before
        connecting)."""
        loads.check(settings, kwargs.get("load_reader"))
        client = await connecting.api_client(settings.kubeconfig)
        return cls(
            settings, registry, kube.Kube(client, timeout=settings.kube_timeout_seconds), **kwargs
        )

    def _policy(self) -> Policy:
        """The placement policy in force (the controllers plan with it)."""
        return self.holder.current().policy

    # --- readiness and the webhook's inventory ---------------------------------------

    def not_ready_reason(self) -> str | None:
        """None once nodes and managed pods are synced and the API refuses none of the
        calls the sidecar cannot work without (`gpuplace.cluster.refusals.BLOCKING`; for
        /readyz)."""
        refused = self.api.refusals.not_ready_reason()
        if refused is not None:
            return f"the API refuses calls gpuplace needs (check its RBAC): {refused}"
        if self.directory is not None:
            queued = self.directory.not_ready_reason()
            if queued is not None:
                return queued
        return self.mirror.not_ready_reason()

    def _nodes_changed(self, _: object) -> None:
        self._capabilities = None
        self._paths = None

    def capabilities(self) -> Capabilities | None:
        """The largest requests any managed node could hold; None until nodes synced.
        (The webhook's CapabilitySource.) O(1), O(GPUs) after a node change."""
        if not self.mirror.nodes.synced.is_set():
            return None
        if self._capabilities is None:
            self._capabilities = self.sync.ledger.inventory.capabilities()
        return self._capabilities

    def paths(self) -> Paths | None:
        """The same per path (device plugin, DRA: `gpuplace.webhook.inventory.Paths`); the
        webhook's choice of a pod's path reads it. O(1), O(GPUs) after a node change."""
        if not self.mirror.nodes.synced.is_set():
            return None
        if self._paths is None:
            self._paths = paths_of(self.sync.ledger.inventory)
        return self._paths

    # --- running -----------------------------------------------------------------------

    def _background(self) -> list[Coroutine[Any, Any, None]]:
        work: list[Coroutine[Any, Any, None]] = [self.mirror.run(), self.reaper.run()]
        work.extend(node_agents.work(self.settings, self.sync, self.silence_taints))
        work.extend(self.extender.work(self.settings))
        if self.settings.gc_freeze_seconds > 0 or self.settings.gc_young_seconds > 0:
            work.append(
                gc_tuning.keep_passes_short(
                    self.sync.ready,
                    young_seconds=self.settings.gc_young_seconds,
                    freeze_seconds=self.settings.gc_freeze_seconds,
                    full_seconds=self.settings.gc_full_seconds,
                )
            )
        if self.measured is not None:
            work.append(self.measured.poller.run())
        if self.advertiser is not None:
            work.append(self.advertiser.run())
        if self.recorder is not None:
            work.append(self.recorder.run())
        if self.leader is not None:
            work.append(self.leader.run())
        if self.gangs is not None:
            work.extend(self.gangs.work())
        if self.queues is not None:
            work.extend(self.queues.work())
        if self.planning is not None:
            work.extend(self.planning.work())
        if self.claims is not None:
            work.append(self.claims.run())
        return work

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Sidecar]:
        """Run the informers and background work for the duration of the block; on exit
        stop them and close the API client. The loops handle API failures themselves
        (backoff, retry); a task that still dies is logged."""
        extender.warn_without_c_helpers()
        tasks = [asyncio.create_task(work, name="gpuplace-sidecar") for work in self._background()]
        for task in tasks:
            task.add_done_callback(_report)
        try:
            yield self
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.recorder is not None:
                try:
                    await asyncio.wait_for(self.recorder.drain(), DRAIN_SECONDS)
                except (kube.ApiError, TimeoutError):
                    log.warning(
                        "stopped with Events unwritten",
                        extra={"events": self.recorder.queued, "seconds": DRAIN_SECONDS},
                    )
            if self.measured is not None:
                await self.measured.close()
            await self.api.close()

    async def cleanup_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """The same, as an aiohttp cleanup context; stores itself under `SIDECAR`."""
        async with self.running():
            app[SIDECAR] = self
            yield


SIDECAR = web.AppKey("gpuplace.wiring.sidecar", Sidecar)


def _report(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        log.error("sidecar background task died", exc_info=error)
