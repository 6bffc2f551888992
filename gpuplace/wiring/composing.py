"""The `gpuplace serve` process composed from its settings, built and not yet started:
the ops and webhook sites and, unless `--inventory` is given, the scheduler sidecar.
Used by `gpuplace serve` and by the demo alike, so the demo runs the real process."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import prometheus_client

from gpuplace.usage.gpu_loads import LoadReader
from gpuplace.wiring import loads, serving, settings
from gpuplace.wiring.sidecar import Sidecar


@dataclass(slots=True)
class Process:
    """The parts of one `gpuplace serve` process, built and not yet started."""

    server: serving.Server
    sidecar: Sidecar | None
    """The scheduler sidecar (None when offline: `--inventory FILE`)."""


async def compose(
    config: settings.Settings,
    registry: prometheus_client.CollectorRegistry,
    *,
    rng: random.Random | None = None,
    load_reader: Callable[[], LoadReader] | None = None,
) -> Process:
    """The process as configured: ops and webhook sites (`serving.build`) and, unless
    `--inventory` is given, the sidecar (its informers and background work as a context,
    its sync as a readiness check, failing load reads (`--load-aware`) as a degradation,
    the extender as a site, its live inventory as the
    webhook's). Run it with `process.server.run(stop)`. Used by `gpuplace serve` and
    `gpuplace demo` alike. `load_reader` makes the sidecar's reader of measured GPU
    loads (`--load-aware`); by default the Prometheus reader that `--usage-prometheus`
    names (`gpuplace.wiring.loads.prometheus_reader`). Raises `ConnectError` (no API),
    `NoLoadReader` (`--load-aware` without one), `OSError`/`ssl.SSLError` (certificate),
    `gpuplace.wiring.webhook.InventoryFileError` only later, at start."""
    sidecar: Sidecar | None = None
    if load_reader is None and config.load_aware and config.usage_prometheus:
        load_reader = loads.prometheus_reader(config)
    if config.inventory is None:
        sidecar = await Sidecar.create(config, registry, rng=rng, load_reader=load_reader)
    try:
        server = serving.build(
            config,
            registry,
            capabilities=sidecar,
            queues=sidecar.directory if sidecar is not None else None,
        )
    except BaseException:
        if sidecar is not None:
            await sidecar.api.close()
        raise
    if sidecar is not None:
        server.add_context(sidecar.running)
        server.add_readiness("sidecar", sidecar.not_ready_reason)
        if sidecar.measured is not None:
            server.add_degradation("load-aware", sidecar.measured.poller.failing_reason)
        server.add_site("extender", sidecar.app, config.extender_address, config.extender_port)
    return Process(server, sidecar)
