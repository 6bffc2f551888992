"""`gpuplace serve` against hostile callers (issue 30): the composed process on the local
API with the shipped RBAC, probed from outside over its real sockets, as the issue's
probe did. Each test here failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.wiring import composing
from tests import c_helpers_built
from tests.gpuplace.test_serve_cluster import enforcing, settings, started
from tests.webhook import helpers


@pytest.fixture
def tls(tmp_path: Path) -> tuple[Path, Path]:
    return helpers.write_certificate(tmp_path / "tls")


@dataclass
class Running:
    """A started `gpuplace serve`, its local API and a client session."""

    api: localapi.FakeApi
    process: composing.Process
    session: aiohttp.ClientSession

    def url(self, site: str, path: str) -> str:
        scheme = "https" if site == "webhook" else "http"
        return f"{scheme}://127.0.0.1:{self.process.server.port(site)}{path}"

    async def post(self, verb: str, body: Any) -> tuple[int, Any]:
        async with self.session.post(self.url("extender", f"/{verb}"), json=body) as response:
            return response.status, await response.json(content_type=None)


@contextlib.asynccontextmanager
async def serving(
    tls: tuple[Path, Path], tmp_path: Path, nodes: dict[str, int], **values: Any
) -> AsyncIterator[Running]:
    """`gpuplace serve` composed with `values` on a local API holding `nodes` (name →
    GPUs), started and ready."""
    async with localapi.serve(enforcing()) as api_server:
        for name, gpus in nodes.items():
            api_server.api.create(objects.node(name, gpus=gpus))
        kubeconfig = api_server.kubeconfig(tmp_path / "kubeconfig", localapi.GPUPLACE)
        config = settings(tls, tmp_path, kubeconfig, **values)
        process = await composing.compose(config, CollectorRegistry())
        async with started(process) as session:
            yield Running(api_server.api, process, session)


async def bound_pod(running: Running, name: str, node: str, percent: int) -> dict[str, Any]:
    """A pod placed through the extender's own /bind, once the sidecar sees it bound."""
    pod = running.api.create(objects.pod(name, percent=percent))
    bind = {
        "PodName": name,
        "PodNamespace": "default",
        "PodUID": pod["metadata"]["uid"],
        "Node": node,
    }
    assert await running.post("bind", bind) == (200, {"Error": ""})
    sidecar = running.process.sidecar
    assert sidecar is not None
    uid = pod["metadata"]["uid"]
    for _ in range(100):
        record = sidecar.sync.pods.get(uid)
        if record is not None and record.bound:
            return pod
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} was not seen bound")


# --- point 3: one huge preempt call must not freeze the process ----------------------------


@pytest.mark.parametrize(
    ("victims", "values", "status"),
    [
        (100_000, {}, 413),  # the call: over --preempt-max-body-bytes
        (80_000, {"preempt_max_victims": 100_000}, 200),  # worked out, limits lifted
    ],
)
async def test_readyz_and_filter_answer_while_a_huge_preempt_is_in_flight(
    tls: tuple[Path, Path],
    tmp_path: Path,
    victims: int,
    values: dict[str, Any],
    status: int,
) -> None:
    """The issue's probe: /preempt with the pod and tens of thousands of victims on one
    node (its one GPU held, the others holding none) froze every verb and /readyz for
    ~67 s at 100,000 (a list scanned per victim). Now every /readyz and /filter sent
    while it is in flight answers within seconds (the body's decoding is the longest
    stretch)."""
    async with serving(tls, tmp_path, {"gpu-x": 1, "gpu-y": 1}, **values) as running:
        low = await bound_pod(running, "low", "gpu-x", 100)
        high = objects.pod("high", percent=70)
        high["metadata"]["uid"] = "high-uid"
        high["spec"]["priority"] = 1000
        others = (f"{i:08x}-0000-4000-8000-000000000000" for i in range(victims))  # UID-long
        offered = [low["metadata"]["uid"], *others]
        body = {
            "Pod": high,
            "NodeNameToVictims": None,
            "NodeNameToMetaVictims": {
                "gpu-x": {"Pods": [{"UID": uid} for uid in offered], "NumPDBViolations": 0}
            },
        }
        encoded = json.dumps(body).encode()  # here, not in the loop the server shares

        async def preempting() -> tuple[int, Any]:
            url = running.url("extender", "/preempt")
            headers = {"Content-Type": "application/json"}
            async with running.session.post(url, data=encoded, headers=headers) as response:
                return response.status, await response.json(content_type=None)

        preempt = asyncio.create_task(preempting())
        slowest, probes = 0.0, 0
        while not preempt.done() or probes < 2:
            started = time.perf_counter()
            async with running.session.get(running.url("ops", "/readyz")) as response:
                assert response.status == 200
            filter_args = {"Pod": high, "NodeNames": ["gpu-y"], "Nodes": None}
            assert (await running.post("filter", filter_args))[0] == 200
            slowest = max(slowest, time.perf_counter() - started)
            probes += 1
        answer_status, answer = await preempt
    assert answer_status == status
    if status == 200:
        assert set(answer["NodeNameToMetaVictims"]) == {"gpu-x"}
    # The body's decoding is one stretch by design (bounded by --preempt-max-body-bytes):
    # tenths of a second here, a second or two on a loaded 2-core machine; the freeze this
    # guards against lasted 40-67 s (a turn between the answer's steps: test_preempt.py).
    assert slowest < 3.0, f"/readyz + /filter took {slowest:.2f} s during the preempt"


# --- point 4: partial requests time out, and a dropped client is no ERROR -------------------

HEAD_SECONDS = 0.5
"""--http-head-timeout-seconds in these tests."""
BODY_SECONDS = 0.5
"""--extender-read-timeout-seconds and --read-timeout-seconds (the webhook's) here."""
LIMITS = {
    "http_head_timeout_seconds": HEAD_SECONDS,
    "extender_read_timeout_seconds": BODY_SECONDS,
    "read_timeout_seconds": BODY_SECONDS,
}
FILTER_HEAD = b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


async def connected(
    running: Running, site: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    port = running.process.server.port(site)
    if site != "webhook":
        return await asyncio.open_connection("127.0.0.1", port)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return await asyncio.open_connection("127.0.0.1", port, ssl=context)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> tuple[float, bytes]:
    """How long until the server closed the connection, and what it sent before."""
    started = time.perf_counter()
    received = await asyncio.wait_for(reader.read(), seconds)
    return time.perf_counter() - started, received


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Warning and error lines, but the sidecar's start-up notice of a C helper not in
    use (an install without a C compiler)."""
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.WARNING and not c_helpers_built.is_expected_notice(r.getMessage())
    ]


@pytest.mark.parametrize("site", ["extender", "webhook", "ops"])
@pytest.mark.parametrize(
    "sent",
    [
        b"",  # a connection that sends nothing
        b"POST /filter HTTP/1.1\r\nHost: x\r\n",  # unfinished headers
        b"POST /fil",  # an unfinished request line
    ],
    ids=["nothing", "partial-headers", "partial-line"],
)
async def test_an_unfinished_request_head_closes_the_connection(
    tls: tuple[Path, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    site: str,
    sent: bytes,
) -> None:
    """Issue 30, point 4: these stayed open 150 s and more (aiohttp's keep-alive: an
    hour). Every site closes them after --http-head-timeout-seconds, answering nothing,
    and counts them."""
    async with serving(tls, tmp_path, {"gpu-x": 1}, **LIMITS) as running:
        with caplog.at_level(logging.DEBUG):
            reader, writer = await connected(running, site)
            writer.write(sent)
            took, answer = await closed_within(reader, HEAD_SECONDS * 8)
            writer.close()
        registry = running.process.server.registry
        counted = registry.get_sample_value("gpuplace_http_slow_heads_total", {"site": site})
    assert answer == b""
    assert HEAD_SECONDS * 0.8 <= took < HEAD_SECONDS * 6
    assert counted == 1.0
    assert errors(caplog) == []


async def test_a_slowloris_head_is_cut_off_at_the_deadline(
    tls: tuple[Path, Path], tmp_path: Path
) -> None:
    """One header byte every tenth of the deadline: the head's deadline runs from its
    first byte, not from the last."""
    async with serving(tls, tmp_path, {"gpu-x": 1}, **LIMITS) as running:
        reader, writer = await connected(running, "extender")
        started = time.perf_counter()
        with contextlib.suppress(ConnectionError):
            for byte in FILTER_HEAD * 4:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(HEAD_SECONDS / 10)
                if reader.at_eof() or time.perf_counter() - started > HEAD_SECONDS * 8:
                    break
        _, answer = await closed_within(reader, HEAD_SECONDS * 8)
        writer.close()
    assert answer == b""
    assert time.perf_counter() - started < HEAD_SECONDS * 6


@pytest.mark.parametrize(
    ("site", "head"),
    [
        ("extender", FILTER_HEAD),
        ("webhook", b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"),
    ],
)
async def test_a_body_shorter_than_its_length_gets_408(
    tls: tuple[Path, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    site: str,
    head: bytes,
) -> None:
    """A Content-Length larger than the body sent: 408 after the body's deadline, and
    the connection closed."""
    async with serving(tls, tmp_path, {"gpu-x": 1}, **LIMITS) as running:
        with caplog.at_level(logging.DEBUG):
            reader, writer = await connected(running, site)
            writer.write(head + b"Content-Length: 1000\r\n\r\n{}")
            took, answer = await closed_within(reader, BODY_SECONDS * 30)
            writer.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"within" in answer
    assert took < BODY_SECONDS * 25  # the 408, then aiohttp's lingering close (10 s)
    assert errors(caplog) == []


@pytest.mark.parametrize("site", ["extender", "webhook"])
async def test_a_client_dropping_mid_body_logs_no_error(
    tls: tuple[Path, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    site: str,
) -> None:
    """The issue's other half of point 4: each dropped connection logged an ERROR with
    a traceback. Now at most a DEBUG line, and the next caller is served as usual."""
    path = b"/filter" if site == "extender" else b"/mutate"
    async with serving(tls, tmp_path, {"gpu-x": 1}, **LIMITS) as running:
        with caplog.at_level(logging.DEBUG):
            for _ in range(3):
                _, writer = await connected(running, site)
                writer.write(
                    b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{"
                )
                await writer.drain()
                await asyncio.sleep(0.1)
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
            await asyncio.sleep(0.3)
            status, _ = await running.post(
                "filter", {"Pod": objects.pod("p"), "NodeNames": ["gpu-x"], "Nodes": None}
            )
    assert status == 200
    assert errors(caplog) == []
    assert not [r for r in caplog.records if r.exc_info and r.levelno >= logging.INFO]


@pytest.mark.parametrize("site", ["extender", "webhook", "ops"])
@pytest.mark.parametrize(
    "sent",
    [
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n",  # TLS to a plain port
        b"POST /filter HTTP/1.1\r\n\r\n",  # no Host
        b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"POST /filter HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 9000 + b"\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 200 + b"\r\n",
    ],
    ids=["tls-bytes", "no-host", "negative-length", "long-header", "many-headers"],
)
async def test_a_request_that_is_not_http_gets_400_and_no_error_line(
    tls: tuple[Path, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    site: str,
    sent: bytes,
) -> None:
    """aiohttp answers what it cannot parse with 400 and logged each at ERROR with a
    traceback: any caller could fill the process log. Now one DEBUG line each."""
    async with serving(tls, tmp_path, {"gpu-x": 1}, **LIMITS) as running:
        with caplog.at_level(logging.DEBUG):
            reader, writer = await connected(running, site)
            writer.write(sent)
            _, answer = await closed_within(reader, 5)
            writer.close()
    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0], answer
    assert errors(caplog) == []


async def test_an_idle_connection_is_kept_for_the_idle_timeout_only(
    tls: tuple[Path, Path], tmp_path: Path
) -> None:
    """Between two requests a connection may idle (kube-scheduler reuses it), longer than
    a head may take, up to --http-idle-timeout-seconds."""
    values = {**LIMITS, "http_idle_timeout_seconds": HEAD_SECONDS * 4}
    async with serving(tls, tmp_path, {"gpu-x": 1}, **values) as running:
        reader, writer = await connected(running, "ops")
        for _ in range(2):
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 ")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            await asyncio.sleep(HEAD_SECONDS * 2)  # idle beyond a head's deadline
        took, answer = await closed_within(reader, HEAD_SECONDS * 12)
        writer.close()
    assert answer == b""
    assert took < HEAD_SECONDS * 8


# --- point 6: a compressed body is refused, never inflated ---------------------------------


def gzip_bomb(inflated: int = 1 << 30) -> bytes:
    """~1 MiB of gzip that inflates to `inflated` bytes of JSON-ish whitespace, made a
    chunk at a time (never the whole inflated body here)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip format
    chunk = b" " * (1 << 20)
    parts = [packer.compress(chunk) for _ in range(inflated // len(chunk))]
    return b"".join([*parts, packer.flush()])


BOMB = gzip_bomb()


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.parametrize(("site", "path"), [("extender", "/filter"), ("webhook", "/mutate")])
async def test_a_gzip_bomb_is_refused_without_inflating_it(
    tls: tuple[Path, Path], tmp_path: Path, site: str, path: str
) -> None:
    """Issue 30, point 6: 1 MiB inflating to 1 GiB got 413 on /filter, but only after the
    process grew 188 MiB (eight at once: 450-580 MiB). kube-scheduler and the API server
    never compress what they send, so a compressed body is refused unread: 415, eight
    at once, with the process (server and this client alike) growing < 64 MiB."""
    assert len(BOMB) < 2 << 20
    async with serving(tls, tmp_path, {"gpu-x": 1}) as running:
        url = running.url(site, path)
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}

        async def bomb() -> tuple[int, Any]:
            async with running.session.post(url, data=BOMB, headers=headers, ssl=False) as r:
                return r.status, await r.json(content_type=None)

        before = rss_mib()
        answers = await asyncio.gather(*(bomb() for _ in range(8)))
        grown = rss_mib() - before
    for status, answer in answers:
        assert status == 415, answer
        assert "Content-Encoding 'gzip' is not accepted" in str(answer)
    assert grown < 64, f"the process grew {grown:.0f} MiB"
