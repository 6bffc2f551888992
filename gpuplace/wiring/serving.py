"""The `gpuplace serve` process: several aiohttp sites and shared background work in one
event loop.

`Server` is the frame; `build(settings, registry)` wires today's parts into it:

- the ops site (plain HTTP, `--metrics-port`): `/metrics`, `/healthz`, `/readyz`;
- the event loop's lag probe (`gpuplace.runtime.loop_lag`, `gpuplace_event_loop_lag_seconds`);
- the admission webhook (`gpuplace.wiring.webhook`): its site (TLS, `--webhook-port`:
  `/mutate`, `/validate`), the inventory source it checks requests against (the
  sidecar's, or `--inventory FILE`), its audit log.

Extending the process (the scheduler extender, cluster informers) needs no change here:

    server = serving.build(settings, registry, capabilities=live_source)
    server.add_context(informers.running)             # started before any site, stopped after
    server.add_readiness("informers", informers.not_synced_reason)
    server.add_site("extender", extender_app, settings.extender_address, settings.extender_port)
    await server.run(stop)

Every site listens through `gpuplace.runtime.connection_limits.Site`: a deadline on each request
head, a limit on idle connections, no inflated request bodies (`--http-head-timeout-seconds`,
`--http-idle-timeout-seconds`).

Contexts (zero-argument callables returning async context managers) are entered in the
order added before the sites start and exited in reverse after they stop; a context that
fails to enter aborts the start. `/readyz` is 200 only when every readiness check returns
None and the process is not shutting down. A part that works, but less than configured
(`add_degradation`: the load-aware tie-break whose Prometheus does not answer), is named
in `/readyz`'s body under `degraded` and never turns it 503: the pod still serves everything
it must. On `stop`, `/readyz` turns 503 for `--shutdown-delay-seconds` (so endpoints drop
this pod) before the listeners close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from gpuplace.runtime import connection_limits, gc_tuning, loop_lag
from gpuplace.webhook.inventory import CapabilitySource
from gpuplace.webhook.queueing import QueueSource
from gpuplace.wiring import webhook
from gpuplace.wiring.settings import Settings

log = logging.getLogger(__name__)

ContextFactory = Callable[[], AbstractAsyncContextManager[Any]]
ReadinessCheck = Callable[[], str | None]


@dataclass(slots=True)
class Site:
    name: str
    app: web.Application
    host: str
    port: int
    ssl_context: Any = None
    bound_port: int | None = None


@dataclass(slots=True)
class Server:
    """Sites, background contexts and readiness checks of one process."""

    registry: CollectorRegistry
    shutdown_delay_seconds: float = 0.0
    limits: connection_limits.Limits = field(default_factory=connection_limits.Limits)
    """What one connection to any site may hold on to (`gpuplace.runtime.connection_limits`)."""
    sites: list[Site] = field(default_factory=list)
    contexts: list[ContextFactory] = field(default_factory=list)
    readiness: dict[str, ReadinessCheck] = field(default_factory=dict)
    degradations: dict[str, ReadinessCheck] = field(default_factory=dict)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: bool = False
    freeze_gc: bool = False
    """After the start, move every object so far out of the cyclic GC's sight
    (`gpuplace.runtime.gc_tuning.freeze`): a full collection over the ~70,000 objects of the
    imported libraries takes ~30 ms, a tail latency every review behind it would pay.
    Set by `gpuplace serve`."""
    slow_heads: Counter = field(init=False)

    def __post_init__(self) -> None:
        self.slow_heads = Counter(
            "gpuplace_http_slow_heads_total",
            "Connections closed because a request head did not arrive in full in time "
            "(--http-head-timeout-seconds), by site.",
            ["site"],
            registry=self.registry,
        )

    def add_site(
        self, name: str, app: web.Application, host: str, port: int, *, ssl_context: Any = None
    ) -> Site:
        site = Site(name, app, host, port, ssl_context)
        self.sites.append(site)
        return site

    def add_context(self, factory: ContextFactory) -> None:
        self.contexts.append(factory)

    def add_readiness(self, name: str, check: ReadinessCheck) -> None:
        self.readiness[name] = check

    def add_degradation(self, name: str, check: ReadinessCheck) -> None:
        """`check` says (or None) what works less than configured: shown in /readyz's body,
        never a reason to be not ready."""
        self.degradations[name] = check

    def degraded(self) -> dict[str, str]:
        """What works less than configured, by check name; empty when nothing."""
        return {name: why for name, check in self.degradations.items() if (why := check())}

    def not_ready(self) -> dict[str, str]:
        """Why the process is not ready, by check name; empty when ready."""
        reasons = {name: reason for name, check in self.readiness.items() if (reason := check())}
        if self.stopping:
            reasons["process"] = "shutting down"
        return reasons

    def port(self, name: str) -> int:
        for site in self.sites:
            if site.name == name and site.bound_port is not None:
                return site.bound_port
        raise KeyError(f"site {name} is not listening")

    async def run(self, stop: asyncio.Event) -> None:
        """Start everything, serve until `stop` is set, then stop in reverse order."""
        async with contextlib.AsyncExitStack() as stack:
            for factory in self.contexts:
                await stack.enter_async_context(factory())
            for site in self.sites:
                runner = web.AppRunner(site.app, access_log=None, handle_signals=False)
                await runner.setup()
                stack.push_async_callback(runner.cleanup)
                listening = connection_limits.Site(
                    runner,
                    site.host,
                    site.port,
                    limits=self.limits,
                    on_slow_head=self.slow_heads.labels(site.name).inc,
                    ssl_context=site.ssl_context,
                )
                await listening.start()
                site.bound_port = _bound_port(runner, site.port)
                log.info(
                    "listening",
                    extra={
                        "site": site.name,
                        "host": site.host,
                        "port": site.bound_port,
                        "tls": site.ssl_context is not None,
                    },
                )
            if self.freeze_gc:
                gc_tuning.freeze()
            self.started.set()
            await stop.wait()
            self.stopping = True
            log.info("stopping", extra={"delay_seconds": self.shutdown_delay_seconds})
            if self.shutdown_delay_seconds:
                await asyncio.sleep(self.shutdown_delay_seconds)
        log.info("stopped")


def _bound_port(runner: web.AppRunner, wanted: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return wanted


def process_registry() -> CollectorRegistry:
    """A fresh registry with the process and platform collectors, for one process."""
    registry = CollectorRegistry()
    prometheus_client.ProcessCollector(registry=registry)
    prometheus_client.PlatformCollector(registry=registry)
    return registry


# --- the ops site ---------------------------------------------------------------------------

SERVER = web.AppKey("server", Server)


def ops_app(server: Server) -> web.Application:
    app = web.Application()
    app[SERVER] = server

    async def metrics(request: web.Request) -> web.Response:
        body = prometheus_client.generate_latest(request.app[SERVER].registry)
        return web.Response(
            body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST}
        )

    async def healthz(_: web.Request) -> web.Response:
        return _json(200, {"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        server = request.app[SERVER]
        reasons = server.not_ready()
        body: dict[str, Any] = (
            {"status": "not ready", "reasons": reasons} if reasons else {"status": "ready"}
        )
        degraded = server.degraded()
        if degraded:
            body["degraded"] = degraded
        return _json(503 if reasons else 200, body)

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def _json(status: int, body: dict[str, Any]) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


# --- the process ---------------------------------------------------------------------------


def build(
    settings: Settings,
    registry: CollectorRegistry,
    *,
    capabilities: CapabilitySource | None = None,
    queues: QueueSource | None = None,
) -> Server:
    """The process as configured: the ops site, the loop-lag probe and the webhook site
    with its inventory source (`gpuplace.wiring.webhook.add`).

    `capabilities` replaces the inventory source (a live, informer-backed one); without it
    `--inventory FILE` is used, and without that the webhook stays not ready. `queues`:
    the sidecar's GpuQueues and namespaces, which the webhook reads to queue GPU pods
    (None: queues are off). Raises
    `OSError`/`ssl.SSLError` when the certificate cannot be loaded (fail at start).
    """
    server = Server(
        registry,
        shutdown_delay_seconds=settings.shutdown_delay_seconds,
        limits=connection_limits.Limits(
            head_seconds=settings.http_head_timeout_seconds,
            idle_seconds=settings.http_idle_timeout_seconds,
        ),
    )
    server.add_site("ops", ops_app(server), settings.metrics_address, settings.metrics_port)
    server.add_context(loop_lag.LoopLag(registry).running)
    hook = webhook.build(settings, registry, capabilities=capabilities, queues=queues)
    for context in hook.contexts:
        server.add_context(context)
    server.add_readiness("inventory", hook.not_ready_reason)
    server.add_site(
        "webhook",
        hook.app,
        settings.webhook_address,
        settings.webhook_port,
        ssl_context=hook.certificates.context,
    )
    return server
