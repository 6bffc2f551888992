"""The admission webhook's builder: its TLS site, its inventory source, its audit log.

`build(settings, registry, ...)` makes what `gpuplace.wiring.serving.build` adds to the
process: the webhook's aiohttp app (`/mutate`, `/validate`: `gpuplace.webhook.app`) on its own TLS
site (`--webhook-address`, `--webhook-port`; the certificate and key reloaded when they
change, `--tls-reload-seconds`), the audit log it writes (stdout or a rotated file,
closed when the process stops), and the inventory it checks requests against: the
sidecar's live one when given (`capabilities`), else the offline `--inventory FILE`
(`FileInventory`, reread when it changes), else none (the webhook stays not ready).
`queues` is the sidecar's directory of GpuQueues and namespaces, which the webhook reads
to queue GPU pods (None: queues are off).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from gpuplace.cluster import nodes
from gpuplace.placement.inventory import Capabilities, Inventory
from gpuplace.runtime import background, jsonlines
from gpuplace.webhook import app as webhook_app
from gpuplace.webhook.auditing import AuditLog, Sink
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import CapabilitySource, FixedCapabilities, Paths, paths_of
from gpuplace.webhook.metrics import WebhookMetrics
from gpuplace.webhook.queueing import QueueSource
from gpuplace.webhook.tls import CertificateReloader
from gpuplace.wiring.settings import Settings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Webhook:
    """The webhook's parts, built and not started: what `gpuplace.wiring.serving.build`
    adds to the process."""

    app: web.Application
    certificates: CertificateReloader
    """Its serving certificate (`certificates.context` is the site's TLS context)."""
    source: CapabilitySource
    """The inventory its reviews are checked against."""
    contexts: list[Callable[[], AbstractAsyncContextManager[Any]]]
    """To enter while the process runs: the inventory file's watch, the audit log's close."""

    def not_ready_reason(self) -> str | None:
        return None if self.source.capabilities() is not None else "GPU inventory not known yet"


def build(
    settings: Settings,
    registry: CollectorRegistry,
    *,
    capabilities: CapabilitySource | None = None,
    queues: QueueSource | None = None,
) -> Webhook:
    """The webhook of the module docstring. Raises `OSError`/`ssl.SSLError` when the
    certificate cannot be loaded (fail at start)."""
    contexts: list[Callable[[], AbstractAsyncContextManager[Any]]] = []
    source: CapabilitySource
    if capabilities is not None:
        source = capabilities
    elif settings.inventory is not None:
        inventory_file = FileInventory(settings.inventory, settings.inventory_reload_seconds)
        contexts.append(inventory_file.watching)
        source = inventory_file
    else:
        log.warning("no inventory source: GPU pods are refused until one is configured")
        source = FixedCapabilities(None)
    metrics = WebhookMetrics(registry)
    certificates = CertificateReloader(
        settings.cert_file,
        settings.key_file,
        interval_seconds=settings.tls_reload_seconds,
        metrics=metrics,
    )
    audit = AuditLog(audit_sink(settings))

    @contextlib.asynccontextmanager
    async def closing_audit() -> AsyncIterator[None]:
        try:
            yield
        finally:
            audit.close()

    contexts.append(closing_audit)
    app = webhook_app.create_app(
        webhook_config(settings), source, audit, metrics, certificates=certificates, queues=queues
    )
    return Webhook(app, certificates, source, contexts)


def audit_sink(settings: Settings) -> Sink:
    """Where audit lines go: stdout (`-`) or a file rotated at `--audit-log-max-bytes`."""
    return jsonlines.open_sink(
        settings.audit_log, settings.audit_log_max_bytes, settings.audit_log_backups
    )


def webhook_config(settings: Settings) -> WebhookConfig:
    return WebhookConfig(
        scheduler_name=settings.scheduler_name,
        sidecar_user=settings.sidecar_user,
        max_body_bytes=settings.max_body_bytes,
        read_timeout_seconds=settings.read_timeout_seconds,
        node_agent=settings.node_agent,
        # the planner runs in this process's sidecar: none with an offline inventory
        place_gate=settings.plan_pin != "off" and settings.inventory is None,
        dra_claims=settings.dra_claims,
        dra_scheduler_name=settings.dra_scheduler_name,
    )


# --- the offline inventory ------------------------------------------------------------------


class InventoryFileError(ValueError):
    """`--inventory FILE` cannot be read as nodes; the message names the file and the cause."""


def read_inventory(path: Path) -> Inventory:
    """Nodes from a `kubectl get nodes -o json` file (a NodeList/List, or a bare list)."""
    try:
        document = json.loads(path.read_bytes())
    except (OSError, ValueError) as error:
        raise InventoryFileError(f"--inventory {path}: {error}") from None
    items = document.get("items") if isinstance(document, dict) else document
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise InventoryFileError(
            f"--inventory {path}: expected the output of `kubectl get nodes -o json` "
            '({"items": [Node, ...]})'
        )
    try:
        return nodes.inventory(items)
    except (nodes.NodeError, ValueError) as error:
        raise InventoryFileError(f"--inventory {path}: {error}") from None


class FileInventory:
    """The inventory from a file, read at start and again whenever the file changes.

    `capabilities()` is O(1): computed once per (re)load. A file that stops parsing keeps
    the last good inventory (logged); the first read must succeed.
    """

    def __init__(self, path: Path, interval_seconds: float = 10.0) -> None:
        self.path = path
        self.interval_seconds = interval_seconds
        self._inventory: Inventory | None = None
        self._capabilities: Capabilities | None = None
        self._paths: Paths | None = None
        self._signature: tuple[int, int, int] | None = None

    def inventory(self) -> Inventory | None:
        return self._inventory

    def capabilities(self) -> Capabilities | None:
        return self._capabilities

    def paths(self) -> Paths | None:
        return self._paths

    def _stat(self) -> tuple[int, int, int]:
        status = self.path.stat()
        return status.st_ino, status.st_size, status.st_mtime_ns

    def load(self) -> None:
        """Read the file now; raises `InventoryFileError`."""
        try:
            signature = self._stat()
        except OSError as error:
            raise InventoryFileError(f"--inventory {self.path}: {error}") from None
        inventory = read_inventory(self.path)
        self._inventory = inventory
        self._capabilities = inventory.capabilities()
        self._paths = paths_of(inventory)
        self._signature = signature
        log.info(
            "inventory loaded",
            extra={"path": str(self.path), "nodes": len(inventory), "gpus": inventory.gpu_count()},
        )

    def reload_if_changed(self) -> bool:
        try:
            if self._stat() == self._signature:
                return False
            self.load()
        except (OSError, InventoryFileError) as error:
            log.warning(
                "inventory reload failed; keeping the previous one", extra={"error": str(error)}
            )
            return False
        return True

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        if self._capabilities is None:
            self.load()

        async def poll() -> None:
            while True:
                await asyncio.sleep(self.interval_seconds)
                self.reload_if_changed()

        async with background.running(poll(), "gpuplace-inventory-file"):
            yield
