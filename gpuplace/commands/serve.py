"""`gpuplace serve`: the admission webhook (TLS), the scheduler extender sidecar
(loopback HTTP, backed by the cluster's API, with the gang controller) and the ops
endpoints, in one process. With --inventory FILE it runs offline: the webhook and ops
endpoints only.

Every flag is also an environment variable `GPUPLACE_<FLAG>` (see `gpuplace.settings`).
Exit codes: 0 after SIGTERM/SIGINT, 2 for invalid settings, 1 when it cannot start
(certificate, inventory file or port unusable).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import prometheus_client

from cluster.connecting import ConnectError
from gpuplace import logs, serving, settings
from gpuplace.sidecar import NoLoadReader, Sidecar
from usage import prometheus
from usage.loads import LoadReader

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the admission webhook, the scheduler extender and the ops endpoints",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    settings.add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = settings.build_or_explain(settings.Settings, args, "serve")
    if config is None:
        return 2
    logs.configure(config.log_level)
    registry = serving.process_registry()
    try:
        return asyncio.run(_serve(config, registry))
    except (OSError, serving.InventoryFileError) as error:
        log.error("cannot start", extra={"error": str(error)})
        return 1


@dataclass(slots=True)
class Process:
    """The parts of one `gpuplace serve` process, built and not yet started."""

    server: serving.Server
    sidecar: Sidecar | None
    """The scheduler sidecar (None when offline: `--inventory FILE`)."""


def prometheus_reader(config: settings.Settings) -> Callable[[], LoadReader]:
    """The factory of the reader of measured GPU loads that `--usage-prometheus`,
    `--usage-metrics` and `--usage-token-file` name."""
    assert config.usage_prometheus is not None
    source = prometheus.Source(
        url=config.usage_prometheus,
        metrics=config.usage_metrics,
        token_file=config.usage_token_file,
        step_seconds=config.usage_step_seconds,
    )
    return lambda: prometheus.Reader(source)


async def compose(
    config: settings.Settings,
    registry: prometheus_client.CollectorRegistry,
    *,
    rng: random.Random | None = None,
    load_reader: Callable[[], LoadReader] | None = None,
) -> Process:
    """The process as configured: ops and webhook sites (`serving.build`) and, unless
    `--inventory` is given, the sidecar (its informers and background work as a context,
    its sync as a readiness check, the extender as a site, its live inventory as the
    webhook's). Run it with `process.server.run(stop)`. Used by `gpuplace serve` and
    `gpuplace demo` alike. `load_reader` makes the sidecar's reader of measured GPU
    loads (`--load-aware`); by default the Prometheus reader that `--usage-prometheus`
    names. Raises `ConnectError` (no API), `NoLoadReader`
    (`--load-aware` without one), `OSError`/`ssl.SSLError` (certificate),
    `serving.InventoryFileError` only later, at start."""
    sidecar: Sidecar | None = None
    if load_reader is None and config.load_aware and config.usage_prometheus:
        load_reader = prometheus_reader(config)
    if config.inventory is None:
        sidecar = await Sidecar.create(config, registry, rng=rng, load_reader=load_reader)
    try:
        server = serving.build(config, registry, capabilities=sidecar)
    except BaseException:
        if sidecar is not None:
            await sidecar.api.close()
        raise
    if sidecar is not None:
        server.add_context(sidecar.running)
        server.add_readiness("sidecar", sidecar.not_ready_reason)
        server.add_site("extender", sidecar.app, config.extender_address, config.extender_port)
    return Process(server, sidecar)


async def _serve(config: settings.Settings, registry: prometheus_client.CollectorRegistry) -> int:
    try:
        process = await compose(config, registry)
    except ConnectError as error:
        log.error("cannot reach the Kubernetes API", extra={"error": str(error)})
        return 1
    except NoLoadReader as error:
        log.error("cannot start", extra={"error": str(error)})
        return 2
    except (OSError, ssl.SSLError) as error:
        log.error("cannot load the serving certificate", extra={"error": str(error)})
        return 1
    server = process.server
    server.freeze_gc = True
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await server.run(stop)
    return 0
