"""`gpuplace serve`: the admission webhook (TLS) and the ops endpoints in one process.

Every flag is also an environment variable `GPUPLACE_<FLAG>` (see `gpuplace.settings`).
Exit codes: 0 after SIGTERM/SIGINT, 2 for invalid settings, 1 when it cannot start
(certificate, inventory file or port unusable).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import ssl
import sys
from typing import Any

import prometheus_client
from pydantic import ValidationError

from gpuplace import logs, serving, settings

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the admission webhook and the ops endpoints",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    settings.add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = settings.from_arguments(args)
    except ValidationError as error:
        for item in error.errors(include_url=False):
            name = ".".join(str(part) for part in item["loc"])
            print(f"gpuplace serve: {settings.flag(name)}: {item['msg']}", file=sys.stderr)
        return 2
    logs.configure(config.log_level)
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.ProcessCollector(registry=registry)
    prometheus_client.PlatformCollector(registry=registry)
    try:
        server = serving.build(config, registry)
    except (OSError, ssl.SSLError) as error:
        log.error("cannot load the serving certificate", extra={"error": str(error)})
        return 1
    server.freeze_gc = True
    try:
        asyncio.run(_serve(server))
    except (OSError, serving.InventoryFileError) as error:
        log.error("cannot start", extra={"error": str(error)})
        return 1
    return 0


async def _serve(server: serving.Server) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await server.run(stop)
