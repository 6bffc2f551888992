from __future__ import annotations

import io
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from gpuplace.cluster import nodes
from gpuplace.placement.inventory import Capabilities
from gpuplace.webhook import app as webhook_app
from gpuplace.webhook.auditing import AuditLog, StreamSink
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import FixedCapabilities
from gpuplace.webhook.metrics import WebhookMetrics
from gpuplace.webhook.tls import CertificateReloader
from tests.webhook import helpers


@pytest.fixture(scope="session")
def capabilities() -> Capabilities:
    return nodes.inventory(helpers.node_list()["items"]).capabilities()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return helpers.write_certificate(tmp_path_factory.mktemp("tls"))


@dataclass
class Webhook:
    """A running webhook over TLS on 127.0.0.1 and what it writes."""

    server: TestServer
    session: aiohttp.ClientSession
    source: FixedCapabilities
    registry: CollectorRegistry
    audit: io.StringIO
    certificates: CertificateReloader
    audit_log: AuditLog

    @property
    def port(self) -> int:
        assert self.server.port is not None
        return self.server.port

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def post(
        self, path: str, body: bytes | dict[str, Any], **kwargs: Any
    ) -> tuple[int, dict[str, Any]]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.url + path, data=data, **kwargs) as response:
            assert response.content_type == "application/json"
            payload: dict[str, Any] = await response.json()
            return response.status, payload

    def audit_lines(self) -> list[dict[str, Any]]:
        self.audit_log.flush()
        return [json.loads(line) for line in self.audit.getvalue().splitlines()]

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


MakeWebhook = Callable[..., Awaitable[Webhook]]


@pytest.fixture
async def make_webhook(
    aiohttp_server: Any, tls_files: tuple[Path, Path], capabilities: Capabilities
) -> AsyncIterator[MakeWebhook]:
    sessions: list[aiohttp.ClientSession] = []
    logs: list[AuditLog] = []

    async def make(
        config: WebhookConfig | None = None,
        *,
        known: bool = True,
        reload_seconds: float = 30.0,
        tls: tuple[Path, Path] | None = None,
    ) -> Webhook:
        cert_file, key_file = tls or tls_files
        registry = CollectorRegistry()
        metrics = WebhookMetrics(registry)
        certificates = CertificateReloader(
            cert_file, key_file, interval_seconds=reload_seconds, metrics=metrics
        )
        source = FixedCapabilities(capabilities if known else None)
        stream = io.StringIO()
        audit = AuditLog(StreamSink(stream))
        logs.append(audit)
        app = webhook_app.create_app(
            config or WebhookConfig(), source, audit, metrics, certificates=certificates
        )
        server = await aiohttp_server(app, ssl=certificates.context)
        client_context = ssl.create_default_context(cafile=str(cert_file))
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_context))
        sessions.append(session)
        return Webhook(server, session, source, registry, stream, certificates, audit)

    yield make
    for session in sessions:
        await session.close()
    for audit in logs:
        audit.close()


@pytest.fixture
async def webhook(make_webhook: MakeWebhook) -> Webhook:
    return await make_webhook()
