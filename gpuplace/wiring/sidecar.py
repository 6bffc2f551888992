"""The scheduler sidecar, composed: informers → ledger → extender verbs, plus the
background work that keeps the API right (node status, Events, expired reservations)
and, with `gangs`, the gang controller (`gpuplace.gangs`, built by `gpuplace.gangs.wiring`:
its own gang-pod informer, planning on the shared ledger, ungating members together),
and with `queues` the GpuQueue and namespace informers (`gpuplace.cluster.queue_directory`,
which the webhook of the same process reads: `directory`) and the queue controller
(`gpuplace.queues`, built by `gpuplace.queues.wiring`). Both controllers decide only while
this pod's kube-scheduler holds its leader-election Lease (`--scheduler-lease`, one
`gpuplace.controllers.leader.LeaseFollower` for both), so that one replica's ledger decides at
a time.

For `gpuplace serve` (see gpuplace.wiring.serving):

    sidecar = await Sidecar.create(settings, registry)   # settings: the process's Settings
    server.add_context(sidecar.running)                  # informers etc. start/stop
    server.add_readiness("sidecar", sidecar.not_ready_reason)
    server.add_site("extender", sidecar.app, settings.extender_address,
                    settings.extender_port)
    # the webhook may use `sidecar` as its CapabilitySource (live inventory)

or, in a single aiohttp app: `app.cleanup_ctx.append(sidecar.cleanup_ctx)`.

`SidecarSettings` holds the sidecar's own flags (env `GPUPLACE_*`); the process's one
settings object, `gpuplace.wiring.settings.Settings`, extends it, and that object itself is
what `gpuplace serve` passes here.
`SidecarSettings.gangs` is off (a bare sidecar, as the extender tests build it);
`gpuplace serve`'s settings turn it on by default (`--gangs false` turns it off).

With `--load-aware`, the sidecar is given a factory of a `gpuplace.usage.gpu_loads.LoadReader`
(`load_reader=`; `gpuplace serve` passes it through `gpuplace.wiring.composing.compose`): a
background task reads GPU loads with it every `--load-refresh-seconds`
(`gpuplace.extender.load_polling`), and the policy's exact ties are broken by them
(`gpuplace.placement.load_ties`). Without a factory, `--load-aware` refuses to start
(`NoLoadReader`). A reader with an `aclose()` or `close()` is closed when the sidecar stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CollectorRegistry
from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuplace.cluster import (
    advertising,
    connecting,
    kube,
    metering,
    mirroring,
    nodes,
    queue_directory,
    reaping,
    recording,
    watching,
)
from gpuplace.cluster.queue_directory import QueueDirectory
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import leader as gang_leader
from gpuplace.extender import app as extender_app
from gpuplace.extender import (
    binding,
    c_helpers,
    deciding,
    load_polling,
    preempt_verb,
    repeating,
    warming,
    workloads,
)
from gpuplace.extender.activity import Activity
from gpuplace.gangs import wiring as gang_wiring
from gpuplace.gangs.controller import GangSettings
from gpuplace.placement import choosing, policies
from gpuplace.placement.fences import Fences
from gpuplace.placement.inventory import Capabilities
from gpuplace.queues import wiring as queue_wiring
from gpuplace.queues.controller import QueueSettings
from gpuplace.runtime import gc_tuning
from gpuplace.usage import prometheus
from gpuplace.usage.gpu_loads import LoadReader

log = logging.getLogger(__name__)

DRAIN_SECONDS = 2.0
"""How long a stopping sidecar writes the Events still queued; an API that does not take
them in that time costs those Events, never the stop."""


LEASE_PATTERN = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class SidecarSettings(BaseSettings):
    """The sidecar's flags; each is also an env var GPUPLACE_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="GPUPLACE_", frozen=True, extra="ignore")

    kubeconfig: Path | None = Field(
        None, description="kubeconfig for the API (default: in-cluster service account)"
    )
    policy: Literal["default", "fgd", "best-fit", "first-fit", "random"] = Field(
        "default", description=f"placement policy, one of {', '.join(policies.NAMES)}"
    )
    workload_window: int = Field(
        10_000, ge=1, description="recent managed pods whose requests form the typical workload"
    )
    workload_refresh_seconds: float = Field(
        60.0,
        ge=0,
        description="rebuild the typical workload at most this often (0: whenever a pod "
        "arrived; every node is then scored anew for each new pod)",
    )
    reservation_timeout_seconds: float = Field(
        300.0,
        gt=0,
        description="a reservation whose pod is not bound within this time is released",
    )
    reap_interval_seconds: float = Field(
        10.0, gt=0, description="how often expired reservations are looked for"
    )
    filter_reasons: Literal["kind", "detail"] = Field(
        "kind",
        description="per-node filter reasons: the misfit kind (aggregates well in "
        "kube-scheduler's event) or each node's detail",
    )
    sync_wait_seconds: float = Field(
        5.0, gt=0, description="how long a verb waits for the informers' first sync"
    )
    kube_timeout_seconds: float = Field(
        4.0, gt=0, description="timeout of one API request (keep below the extender httpTimeout)"
    )
    watch_timeout_seconds: int = Field(
        300, ge=10, description="server-side timeout of one watch request"
    )
    list_page_size: int = Field(500, ge=1, description="objects per list page")
    advertise_resources: bool = Field(
        True, description="write gpu-percent/gpu-memory on managed nodes' status"
    )
    node_status_min_interval_seconds: float = Field(
        30.0, ge=0, description="at most one node status patch per node this often"
    )
    pod_events: bool = Field(True, description="write Events on pods (placement failures...)")
    extender_max_body_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="larger extender requests get HTTP 413"
    )
    extender_max_nodes: int = Field(
        20_000,
        ge=1,
        description="filter and prioritize requests naming more nodes than this get HTTP 413",
    )
    extender_read_timeout_seconds: float = Field(
        10.0, gt=0, description="an extender request body not received within this gets HTTP 408"
    )
    warm_shapes: int = Field(
        64,
        ge=0,
        le=choosing.EVALUATIONS_KEPT // 2,
        description="score every node ahead for this many of the most common request "
        "shapes, and fill a rebuilt policy before it decides (0 = off: a shape's first "
        "filter scores every node)",
    )
    warm_pending_shapes: int = Field(
        16,
        ge=0,
        le=choosing.EVALUATIONS_KEPT // 4,
        description="also score ahead this many other request shapes of pods waiting for "
        "a node, most waiting first (a backlog's rare shapes; needs --warm-shapes > 0)",
    )
    warm_interval_seconds: float = Field(
        0.2,
        gt=0,
        description="bring the shapes scored ahead up to date this often (a filter re-scores "
        "the nodes changed since itself)",
    )
    filter_answers_kept: int = Field(
        repeating.KEPT,
        ge=0,
        description="keep this many filter answers that no node passed, and send one again "
        "when kube-scheduler repeats that filter (same request, same nodes) and none of "
        "those nodes changed since (0 = off: every filter decides anew)",
    )
    gc_young_seconds: float = Field(
        0.1,
        ge=0,
        description="collect the young generations this often, while they are small "
        "(0 = only when CPython decides)",
    )
    gc_freeze_seconds: float = Field(
        10.0,
        ge=0,
        description="freeze long-lived objects for the collector this often (0 = never)",
    )
    gc_full_seconds: float = Field(
        3600.0, ge=0, description="a full unfrozen collection this often (0 = never)"
    )
    gangs: bool = Field(
        False,
        description="run the gang controller: plan complete gangs all at once, reserve "
        "their GPUs and remove their scheduling gates together",
    )
    scheduler_lease: str = Field(
        f"{gang_leader.LEASE_NAMESPACE}/{gang_leader.LEASE_NAME}",
        pattern=LEASE_PATTERN,
        description="kube-scheduler's leader-election Lease (NAMESPACE/NAME): the gang "
        "controller plans only while this pod's kube-scheduler holds it; empty = always "
        "(a single replica)",
    )
    queues: bool = Field(
        False,
        description="run the queue controller: GPU pods whose namespace or annotation names "
        "a GpuQueue wait behind its gate until the queue's quota and a free GPU cover them "
        "(needs the GpuQueue CRD; the webhook reads the queues from this sidecar)",
    )
    queue_window: int = Field(
        100,
        ge=1,
        description="waiting workloads per queue one admission round looks at (the most "
        "urgent; the rest wait their turn)",
    )
    queue_min_round_seconds: float = Field(
        1.0,
        ge=0,
        description="admission rounds that decide are at least this far apart (a round at "
        "1,000 nodes costs 1-2 s on the event loop the extender shares)",
    )
    queue_fair_sharing_half_life_seconds: float = Field(
        0.0,
        ge=0,
        description="fair sharing over time: each GpuQueue's share is remembered, decayed "
        "with this half-life, and added to its share while it borrows, so a queue held "
        "below the others for long goes first and may preempt past their share (0: off; "
        "docs/queues.md)",
    )
    queue_hold_after_seconds: float = Field(
        0.0,
        ge=0,
        description="capacity holds for queues: a queued workload of several GPUs that "
        "has waited this long, of the queue furthest below its fair share, gets nodes "
        "kept for it (no new pod there) while they drain (0: off; docs/queues.md)",
    )
    gang_starve_after_seconds: float = Field(
        120.0,
        gt=0,
        description="a complete gang at the head of the queue that has not fit for this "
        "long gets a capacity hold: its nodes are not offered to other pods",
    )
    preempt_beyond_offered: bool = Field(
        True,
        description="preempt: where no selection of kube-scheduler's victims on a node frees "
        "one GPU set, also consider the node's other pods of lower priority than the "
        "preemptor (kube-scheduler picks on node totals; false: drop such nodes)",
    )
    preempt_max_nodes: int = Field(
        1000,
        ge=1,
        description="preempt: candidate nodes one call considers, in kube-scheduler's order "
        "(it sends at most max(100, a tenth of the nodes) by default); the others are left out",
    )
    preempt_max_victims: int = Field(
        1000,
        ge=1,
        description="preempt: a node offered with more victims than this is left out (a "
        "node holds at most its kubelet's max-pods, 110 by default)",
    )
    preempt_max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="larger preempt requests get HTTP 413 (~90,000 victims; decoding one "
        "holds the event loop, ~25 ms per MiB)",
    )
    agent_silence_seconds: float = Field(
        nodes.DEFAULT_AGENT_SILENCE,
        ge=0,
        description="no new GPU pods go on a node whose node agent has not renewed its "
        "heartbeat for this long (pods already there keep their GPUs; 0 = never close a "
        "node for silence); nodes no agent ever reported on are not affected unless "
        "--require-node-agent",
    )
    require_node_agent: bool = Field(
        False,
        description="place GPU pods only on nodes whose node agent reports (else nodes "
        "without one are placed on from GPU Feature Discovery labels alone)",
    )
    load_aware: bool = Field(
        False,
        description="among nodes and GPUs the policy scores exactly alike, prefer those "
        "whose measured load (GPU utilisation, from Prometheus) is lower; never changes "
        "which nodes fit nor admits more than was granted",
    )
    load_window_seconds: float = Field(
        300.0, gt=0, description="with --load-aware: GPU load is averaged over this window"
    )
    load_refresh_seconds: float = Field(
        30.0,
        gt=0,
        description="with --load-aware: read GPU loads this often (a read taking longer fails)",
    )
    load_max_age_seconds: float = Field(
        120.0,
        gt=0,
        description="with --load-aware: loads older than this (reads failing) break no "
        "ties; decisions are then the policy's alone",
    )
    usage_prometheus: str | None = Field(
        None,
        description="Prometheus base URL to read measured GPU use from (needed by "
        "--load-aware), e.g. http://prometheus.monitoring:9090",
    )
    usage_metrics: Literal["gpuplace", "dcgm"] = Field(
        "gpuplace",
        description="which series --usage-prometheus holds: the node agent's (gpuplace) or "
        "NVIDIA dcgm-exporter's (dcgm)",
    )
    usage_token_file: Path | None = Field(
        None,
        description="file with a bearer token for --usage-prometheus (read at each query, "
        "never logged)",
    )
    usage_step_seconds: float = Field(
        prometheus.STEP_SECONDS,
        ge=0.001,
        le=3600,
        description="the scrape interval of the --usage-prometheus series: loads are "
        "averaged over the de-duplicated series at this step",
    )

    @field_validator("usage_prometheus")
    @classmethod
    def _prometheus_url(cls, value: str | None) -> str | None:
        """An http(s) URL with a host, checked before anything connects (empty: none)."""
        return prometheus.check_url(value) if value else None

    @field_validator("usage_token_file")
    @classmethod
    def _one_credential(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return prometheus.check_credentials(info.data.get("usage_prometheus"), value)


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
        age `load_clock` measures. Raises `NoLoadReader`."""
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
        )
        self.holder = workloads.PolicyHolder(
            self.sync,
            settings.policy,
            refresh_seconds=settings.workload_refresh_seconds,
            rng=rng,
            clock=clock,
            ties=settings.load_aware,
        )
        self.loads: load_polling.LoadBoard | None = None
        """Measured GPU loads for the tie-break (None without `load_aware`)."""
        self.load_poller: load_polling.LoadPoller | None = None
        if settings.load_aware:
            if load_reader is None:
                raise NoLoadReader(NO_LOAD_READER)
            self.loads = load_polling.LoadBoard(settings.load_max_age_seconds, clock=load_clock)
            self.load_poller = load_polling.LoadPoller(
                load_reader(),
                self.loads,
                window_seconds=settings.load_window_seconds,
                refresh_seconds=settings.load_refresh_seconds,
                registry=registry,
            )
        self.activity = Activity()
        """Extender verbs in flight: the warmer gives way to them."""
        self.warmer = warming.Warmer(
            self.sync,
            self.holder,
            shapes=settings.warm_shapes,
            pending_shapes=settings.warm_pending_shapes,
            interval=settings.warm_interval_seconds,
            registry=registry,
            activity=self.activity,
            freeze_young_above=gc_tuning.young_freeze_limit(
                settings.gc_freeze_seconds, settings.gc_full_seconds
            ),
        )
        """Scores the most common request shapes ahead (see gpuplace.extender.warming)."""
        self.fences = Fences()
        """Capacity holds of a starving gang (written by the gang controller, read by filter)."""
        self.decider = deciding.Decider(
            self.sync,
            self.holder,
            mode=settings.filter_reasons,
            registry=registry,
            fences=self.fences,
            loads=self.loads,
            reader=self.mirror.reader,
        )
        self.recorder = recording.Recorder(api, registry=registry) if settings.pod_events else None
        self.binder = binding.Binder(
            api,
            self.sync,
            self.decider,
            recorder=self.recorder,
            hold_seconds=settings.reservation_timeout_seconds,
        )
        self.reaper = reaping.Reaper(
            api,
            self.sync,
            ttl=settings.reservation_timeout_seconds,
            interval=settings.reap_interval_seconds,
            recorder=self.recorder,
            registry=registry,
        )
        self.advertiser: advertising.Advertiser | None = None
        if settings.advertise_resources:
            self.advertiser = advertising.Advertiser(
                api, registry=registry, min_interval=settings.node_status_min_interval_seconds
            )
            self.sync.node_listeners.append(self.advertiser.observe)
        self._capabilities: Capabilities | None = None
        self.sync.node_listeners.append(self._nodes_changed)
        registry.register(metering.LedgerCollector(self.sync, self.holder.measured))
        registry.register(api.refusals)  # gpuplace_api_refusals_total
        self.preempter = preempt_verb.Preempter(
            self.sync,
            self.decider.request,
            recorder=self.recorder,
            beyond_offered=settings.preempt_beyond_offered,
            max_nodes=settings.preempt_max_nodes,
            max_victims=settings.preempt_max_victims,
            hold_seconds=settings.reservation_timeout_seconds,
            registry=registry,
        )
        """The preempt verb; it holds a preemptor's GPUs once kube-scheduler acts."""
        self.sync.pod_listeners.append(self.preempter.observe)
        self.service = extender_app.Service(
            sync=self.sync,
            decider=self.decider,
            binder=self.binder,
            recorder=self.recorder,
            metrics=extender_app.Metrics(registry),
            ready_timeout=settings.sync_wait_seconds,
            max_body_bytes=settings.extender_max_body_bytes,
            preempt_max_body_bytes=settings.preempt_max_body_bytes,
            read_timeout=settings.extender_read_timeout_seconds,
            max_nodes=settings.extender_max_nodes,
            activity=self.activity,
            repeats=(
                repeating.Repeats(self.sync, size=settings.filter_answers_kept, registry=registry)
                if settings.filter_answers_kept
                else None
            ),
            preempter=self.preempter,
        )
        self.app = extender_app.create_app(self.service)
        """The extender's aiohttp app (/filter, /prioritize, /bind, /preempt), for its own site."""
        self.leader: gang_leader.LeaseFollower | None = None
        """Whether this replica's kube-scheduler leads (None: always treated as leading,
        or neither controller runs): the gang and queue controllers decide only then."""
        if settings.scheduler_lease and (settings.gangs or settings.queues):
            namespace, _, name = settings.scheduler_lease.partition("/")
            self.leader = gang_leader.LeaseFollower(api, namespace=namespace, name=name)
        blocked = self.leader.blocked_reason if self.leader is not None else None
        self.gangs: gang_wiring.Gangs | None = None
        """The gang controller and its informer (None with `gangs` off)."""
        if settings.gangs:
            self.gangs = gang_wiring.build(
                api,
                self.sync,
                lambda: self.holder.current().policy,
                fences=self.fences,
                recorder=self.recorder,
                registry=registry,
                settings=GangSettings(
                    starve_after_seconds=settings.gang_starve_after_seconds,
                    hold_seconds=settings.reservation_timeout_seconds,
                ),
                active=self.leader,
                blocked=blocked,
            )
        self.directory: QueueDirectory | None = None
        """The GpuQueues and namespaces (None with `queues` off): the queue controller's,
        and the webhook's `QueueSource` in the same process."""
        self.queues: queue_wiring.Queues | None = None
        """The queue controller and its informer (None with `queues` off)."""
        self._queue_informers: list[watching.Informer[Any]] = []
        if settings.queues:
            self.directory = QueueDirectory()
            self._queue_informers = list(
                queue_directory.informers(
                    api,
                    self.directory,
                    page_size=settings.list_page_size,
                    watch_seconds=settings.watch_timeout_seconds,
                )
            )
            self.queues = queue_wiring.build(
                api,
                self.sync,
                self.directory,
                lambda: self.holder.current().policy,
                fences=self.fences,
                recorder=self.recorder,
                registry=registry,
                settings=QueueSettings(
                    window=settings.queue_window,
                    min_round_seconds=settings.queue_min_round_seconds,
                    hold_seconds=settings.reservation_timeout_seconds,
                    half_life_seconds=settings.queue_fair_sharing_half_life_seconds,
                    hold_after_seconds=settings.queue_hold_after_seconds,
                ),
                active=self.leader,
                blocked=blocked,
            )

    @classmethod
    async def create(
        cls, settings: SidecarSettings, registry: CollectorRegistry, **kwargs: Any
    ) -> Sidecar:
        """Connect to the API (kubeconfig, else in-cluster) and build the sidecar.
        Raises `gpuplace.cluster.connecting.ConnectError`, `NoLoadReader` (before connecting)."""
        if settings.load_aware and kwargs.get("load_reader") is None:
            raise NoLoadReader(NO_LOAD_READER)
        client = await connecting.api_client(settings.kubeconfig)
        return cls(
            settings, registry, kube.Kube(client, timeout=settings.kube_timeout_seconds), **kwargs
        )

    # --- readiness and the webhook's inventory ---------------------------------------

    def not_ready_reason(self) -> str | None:
        """None once nodes and managed pods are synced and the API refuses none of the
        calls the sidecar cannot work without (`gpuplace.cluster.refusals.BLOCKING`; for
        /readyz)."""
        refused = self.api.refusals.not_ready_reason()
        if refused is not None:
            return f"the API refuses calls gpuplace needs (check its RBAC): {refused}"
        if self.directory is not None:
            queues = self.directory.not_ready_reason()
            if queues is not None:
                return queues
        return self.mirror.not_ready_reason()

    def _nodes_changed(self, _: object) -> None:
        self._capabilities = None

    def capabilities(self) -> Capabilities | None:
        """The largest requests any managed node could hold; None until nodes synced.
        (The webhook's CapabilitySource.) O(1), O(GPUs) after a node change."""
        if not self.mirror.nodes.synced.is_set():
            return None
        if self._capabilities is None:
            self._capabilities = self.sync.ledger.inventory.capabilities()
        return self._capabilities

    # --- running -----------------------------------------------------------------------

    async def _watch_agents(self) -> None:
        """Close nodes whose agent fell silent (`LedgerSync.check_agents`), within a
        quarter of the bound (at most every 5 s). O(nodes) per pass, no API call."""
        period = min(AGENT_CHECK_SECONDS, self.settings.agent_silence_seconds / 4)
        while True:
            await asyncio.sleep(period)
            self.sync.check_agents()

    def _background(self) -> list[Coroutine[Any, Any, None]]:
        work: list[Coroutine[Any, Any, None]] = [self.mirror.run(), self.reaper.run()]
        if self.settings.agent_silence_seconds > 0:
            work.append(self._watch_agents())
        if self.settings.warm_shapes > 0:
            work.append(self.warmer.run())
        if self.settings.gc_freeze_seconds > 0 or self.settings.gc_young_seconds > 0:
            work.append(
                gc_tuning.keep_passes_short(
                    self.sync.ready,
                    young_seconds=self.settings.gc_young_seconds,
                    freeze_seconds=self.settings.gc_freeze_seconds,
                    full_seconds=self.settings.gc_full_seconds,
                )
            )
        if self.load_poller is not None:
            work.append(self.load_poller.run())
        if self.advertiser is not None:
            work.append(self.advertiser.run())
        if self.recorder is not None:
            work.append(self.recorder.run())
        if self.leader is not None:
            work.append(self.leader.run())
        if self.gangs is not None:
            work.extend(self.gangs.work())
        work.extend(informer.run() for informer in self._queue_informers)
        if self.queues is not None:
            work.extend(self.queues.work())
        return work

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Sidecar]:
        """Run the informers and background work for the duration of the block; on exit
        stop them and close the API client. The loops handle API failures themselves
        (backoff, retry); a task that still dies is logged."""
        for used, helper, without in (
            (
                c_helpers.NAME_SET is not None,
                "gpuplace.extender._node_names",
                "filter parses every node name, ~3 ms",
            ),
            (
                c_helpers.RANKED_JSON is not None,
                "gpuplace.extender._priorities",
                "prioritize's answers are made in Python, ~1.5 ms",
            ),
        ):
            if not used:
                log.warning(
                    "%s (C) is not in use: %s more per pod at 10,000 nodes; install with a "
                    "C compiler to build it, and leave %s unset",
                    helper,
                    without,
                    c_helpers.SWITCH,
                )
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
            if self.load_poller is not None:
                await _close(self.load_poller.reader)
            await self.api.close()

    async def cleanup_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """The same, as an aiohttp cleanup context; stores itself under `SIDECAR`."""
        async with self.running():
            app[SIDECAR] = self
            yield


class NoLoadReader(ValueError):
    """`--load-aware` without a source of measured GPU loads."""


NO_LOAD_READER = (
    "--load-aware needs a source of measured GPU loads: set --usage-prometheus to a "
    "Prometheus that scrapes the node agents (or dcgm-exporter, with --usage-metrics=dcgm)"
)


AGENT_CHECK_SECONDS = 5.0
"""How often node agents' heartbeats are compared with the clock, at most."""

SIDECAR = web.AppKey("gpuplace.wiring.sidecar", Sidecar)


async def _close(reader: object) -> None:
    """Close a load reader that can be closed (an `aclose()` or `close()`, awaited when
    it returns an awaitable: an HTTP session to Prometheus); the protocol asks for none."""
    close = getattr(reader, "aclose", None) or getattr(reader, "close", None)
    if not callable(close):
        return
    try:
        result = close()
        if inspect.isawaitable(result):
            await result
    except Exception as error:  # stopping anyway: only logged, by type (its text may
        # carry what the reader was given)
        log.warning("closing the reader of GPU loads failed", extra={"error": type(error).__name__})


def _report(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        log.error("sidecar background task died", exc_info=error)
