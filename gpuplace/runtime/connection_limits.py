"""What a connection to any site of a gpuplace process may hold on to: the listening side
of `gpuplace.wiring.serving`, for the ops, webhook and extender sites alike.

aiohttp bounds the size of a request head (8,190-byte lines, 128 headers) but not the
time it takes to arrive: a connection that sent part of a head, or nothing, and then
went quiet stayed open until aiohttp's keep-alive timeout (an hour in 3.14), one file
descriptor and a buffer each. Here (`Site`, `Limits`):

- a request head (request line and headers) must arrive in full within `head_seconds`
  of its first byte, and a new connection must send a whole head within `head_seconds`
  of opening; otherwise the connection is closed, with no answer (no request was made),
  one DEBUG line and `gpuplace_http_slow_heads_total{site}`. A TLS handshake has the
  same deadline. (A head sent behind another request before that one's answer, HTTP
  pipelining, which neither kube-scheduler nor the API server does, waits for
  `idle_seconds` instead);
- a connection idle between two requests is closed after `idle_seconds`, longer than
  the 90 s Go's HTTP clients keep an idle connection (kube-scheduler's and the API
  server's): the client, not us, closes it first, so no request races our close;
- a request aiohttp cannot parse (not HTTP, a bad header) gets its 400 with one DEBUG
  line, not aiohttp's ERROR and traceback: any caller can send one;
- request bodies are never inflated on the way in (aiohttp's `auto_decompress` off):
  a compressed body reaches the app as the bytes sent, which refuses it (HTTP 415);
  kube-scheduler and the API server never compress what they send.

How long a *body* may take is each app's: it answers 408 (`gpuplace.webhook.app`,
`gpuplace.extender.app`).

The head deadline reads two attributes of aiohttp's request handler: `_request_count`
(heads parsed on the connection) and `_waiter` (set while it waits for the next head);
aiohttp is pinned (`constraints.txt`) and `tests/gpuplace/test_serve_hostile.py` fails
should either change.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_request import BaseRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Limits:
    head_seconds: float = 10.0
    """A request head must arrive in full within this long of its first byte."""
    idle_seconds: float = 120.0
    """A connection idle between requests is closed after this long."""


class _Handler(web.RequestHandler):
    """aiohttp's request handler, with a deadline on every request head, and one DEBUG
    line (not an ERROR) for a request that is not HTTP."""

    def __init__(
        self,
        manager: web.Server,
        *,
        head_seconds: float,
        on_slow_head: Callable[[], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._head_seconds = head_seconds
        self._on_slow_head = on_slow_head
        self._head_deadline: asyncio.TimerHandle | None = None
        self._callers_fault = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()  # the first head, from the connection's start

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._awaiting_head():
            self._disarm()  # a whole head arrived (or the connection is closing)
        elif self._head_deadline is None:
            self._arm()  # the first bytes of a head

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not take; for one that is not HTTP
        (4xx: the caller's fault, any caller can send one) without aiohttp's ERROR line
        and traceback: one DEBUG line."""
        self._callers_fault = status < 500
        try:
            return super().handle_error(request, status, exc, message)
        finally:
            self._callers_fault = False

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        if self._callers_fault:
            why = str(kwargs.get("exc_info"))[:200]
            log.debug("not an HTTP request: answered 4xx", extra={"why": why})
            return
        super().log_exception(*args, **kwargs)

    def _awaiting_head(self) -> bool:
        """Whether the handler waits for a request's head: the connection's first (none
        parsed yet: over TLS the first bytes may come before the handler starts
        waiting), or the next one (it waits for it, none in hand or in flight)."""
        if self._request_count == 0:
            return True
        waiter: asyncio.Future[None] | None = self._waiter
        return waiter is not None and not waiter.done()

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._head_deadline = loop.call_later(self._head_seconds, self._head_due)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_due(self) -> None:
        self._head_deadline = None
        if self._awaiting_head():
            log.debug("request head not received in time: connection closed")
            self._on_slow_head()
            self.force_close()


class Site(web.BaseSite):
    """A TCP site (as aiohttp's `TCPSite`) whose connections keep to `limits`."""

    __slots__ = ("_host", "_limits", "_on_slow_head", "_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        limits: Limits,
        on_slow_head: Callable[[], None],
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host = host
        self._port = port
        self._limits = limits
        self._on_slow_head = on_slow_head

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        limits = self._limits

        def connection() -> web.RequestHandler:
            return _Handler(
                server,
                loop=loop,
                head_seconds=limits.head_seconds,
                on_slow_head=self._on_slow_head,
                keepalive_timeout=limits.idle_seconds,
                auto_decompress=False,
                access_log=None,
            )

        self._server = await loop.create_server(
            connection,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            ssl_handshake_timeout=limits.head_seconds if self._ssl_context else None,
        )
