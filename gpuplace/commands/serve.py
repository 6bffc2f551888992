"""`gpuplace serve`: the admission webhook (TLS), the scheduler extender sidecar
(loopback HTTP, backed by the cluster's API, with the gang controller) and the ops
endpoints, in one process. With --inventory FILE it runs offline: the webhook and ops
endpoints only.

Every flag is also an environment variable `GPUPLACE_<FLAG>` (see `gpuplace.wiring.settings`).
Exit codes: 0 after SIGTERM/SIGINT, 2 for invalid settings, 1 when it cannot start
(certificate, inventory file or port unusable).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import ssl
from typing import Any

import prometheus_client

from gpuplace import commands
from gpuplace.cluster.connecting import ConnectError
from gpuplace.runtime import logs
from gpuplace.wiring import composing, serving, settings, webhook
from gpuplace.wiring.loads import NoLoadReader

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help=commands.HELP["serve"],
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
    except (OSError, webhook.InventoryFileError) as error:
        log.error("cannot start", extra={"error": str(error)})
        return 1


async def _serve(config: settings.Settings, registry: prometheus_client.CollectorRegistry) -> int:
    try:
        process = await composing.compose(config, registry)
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
