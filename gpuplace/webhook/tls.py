"""The webhook's TLS: one server `SSLContext` (TLS ≥ 1.2) whose certificate is reloaded
when the cert or key file changes.

Kubernetes updates a mounted Secret by swapping a symlink, so the files are compared by
(inode, size, mtime) of what they point to. A reload builds a fresh context from the files
and, only when the pair loads, makes it current: the listening context's SNI callback
(called for every ClientHello, with or without SNI) hands each new handshake to the
current context. Loading into the live context instead would leave it half-updated (new
certificate, old key) when a rotation is caught between its two file writes. A pair that
does not load is logged and retried at the next poll; the old one stays in use meanwhile.
Connections already open keep their session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from datetime import UTC
from pathlib import Path

from cryptography import x509

from gpuplace.runtime import background
from gpuplace.webhook.metrics import WebhookMetrics

log = logging.getLogger(__name__)

Signature = tuple[tuple[int, int, int], tuple[int, int, int]]


def _signature(cert_file: Path, key_file: Path) -> Signature:
    def one(path: Path) -> tuple[int, int, int]:
        status = os.stat(path)
        return status.st_ino, status.st_size, status.st_mtime_ns

    return one(cert_file), one(key_file)


def not_after(cert_file: Path) -> float:
    """notAfter of the first certificate in `cert_file`, Unix time."""
    certificate = x509.load_pem_x509_certificate(cert_file.read_bytes())
    return certificate.not_valid_after_utc.astimezone(UTC).timestamp()


def _server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    context.load_cert_chain(cert_file, key_file)
    return context


class CertificateReloader:
    """Owns the server SSLContext; `watch` (an aiohttp cleanup context) polls the files."""

    def __init__(
        self,
        cert_file: Path,
        key_file: Path,
        *,
        interval_seconds: float = 10.0,
        metrics: WebhookMetrics | None = None,
    ) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.interval_seconds = interval_seconds
        self._metrics = metrics
        self._signature = _signature(cert_file, key_file)
        self.context = _server_context(cert_file, key_file)
        """The context to listen with; it stays the same object across reloads."""
        self._current = self.context
        self.context.sni_callback = self._choose
        self._set_expiry()
        self.reloads = 0

    def _choose(self, connection: ssl.SSLObject, _name: str | None, _: ssl.SSLContext) -> None:
        if self._current is not self.context:
            connection.context = self._current

    def _set_expiry(self) -> None:
        if self._metrics is None:
            return
        try:
            self._metrics.certificate_expiry.set(not_after(self.cert_file))
        except (OSError, ValueError):
            log.warning("certificate expiry unreadable", extra={"cert_file": str(self.cert_file)})

    def reload_if_changed(self) -> bool:
        """Load the files again when they changed; True when a new pair is in use."""
        try:
            signature = _signature(self.cert_file, self.key_file)
        except OSError as error:
            log.warning("certificate files unreadable", extra={"error": str(error)})
            return False
        if signature == self._signature:
            return False
        try:
            fresh = _server_context(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError, ValueError) as error:
            log.warning(
                "certificate reload failed; keeping the previous one", extra={"error": str(error)}
            )
            if self._metrics is not None:
                self._metrics.certificate_reloads.labels("failed").inc()
            return False
        self._current = fresh
        self._signature = signature
        self.reloads += 1
        self._set_expiry()
        if self._metrics is not None:
            self._metrics.certificate_reloads.labels("ok").inc()
        log.info("certificate reloaded", extra={"cert_file": str(self.cert_file)})
        return True

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_seconds)
            self.reload_if_changed()

    def watching(self) -> contextlib.AbstractAsyncContextManager[None]:
        return background.running(self._poll(), "gpuplace-tls-reload")
