"""`gpuplace serve`: settings, the process frame, the ops site and the wiring of the
webhook, in process and as a real subprocess."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from gpuplace import cli
from gpuplace.cluster import keys
from gpuplace.runtime import logs
from gpuplace.wiring import serving, webhook
from gpuplace.wiring.settings import Settings, from_arguments
from tests.webhook import helpers

SHARE = {keys.GPU_PERCENT: "50", keys.GPU_MEMORY: "20Gi"}


@pytest.fixture
def tls(tmp_path: Path) -> tuple[Path, Path]:
    return helpers.write_certificate(tmp_path / "tls")


@pytest.fixture
def inventory_file(tmp_path: Path) -> Path:
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(helpers.node_list()))
    return path


def settings(tls: tuple[Path, Path], tmp_path: Path, **values: Any) -> Settings:
    base: dict[str, Any] = {
        "webhook_address": "127.0.0.1",
        "webhook_port": 0,
        "metrics_address": "127.0.0.1",
        "metrics_port": 0,
        "cert_file": tls[0],
        "key_file": tls[1],
        "audit_log": str(tmp_path / "audit.jsonl"),
    }
    base.update(values)
    return Settings(**base)


class Running:
    def __init__(self, server: serving.Server, stop: asyncio.Event, cafile: Path) -> None:
        self.server = server
        self.stop = stop
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=str(cafile)))
        )

    async def get(self, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.server.port('ops')}{path}"
        async with self.session.get(url) as response:
            return response.status, await response.text()

    async def review(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = f"https://127.0.0.1:{self.server.port('webhook')}{path}"
        async with self.session.post(url, json=body) as response:
            assert response.status == 200
            answer: dict[str, Any] = await response.json()
            return answer


@contextlib.asynccontextmanager
async def running(server: serving.Server, cafile: Path) -> AsyncIterator[Running]:
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(stop))
    started = asyncio.create_task(server.started.wait())
    done, _ = await asyncio.wait({task, started}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        started.cancel()
        task.result()  # raises the start failure
    handle = Running(server, stop, cafile)
    try:
        yield handle
    finally:
        await handle.session.close()
        stop.set()
        await asyncio.wait_for(task, timeout=10)


# --- settings ---------------------------------------------------------------------------------


def test_settings_defaults_follow_the_process_contract() -> None:
    defaults = Settings()
    assert (defaults.webhook_port, defaults.metrics_port) == (8443, 9090)
    assert (defaults.extender_address, defaults.extender_port) == ("127.0.0.1", 8888)
    assert defaults.cert_file == Path("/etc/gpuplace/tls/tls.crt")
    assert defaults.key_file == Path("/etc/gpuplace/tls/tls.key")
    assert defaults.sidecar_user == "system:serviceaccount:gpuplace:gpuplace"
    assert defaults.scheduler_name == "gpuplace"
    assert defaults.max_body_bytes == 3 * 1024 * 1024
    assert defaults.inventory is None and defaults.kubeconfig is None


def test_flags_beat_env_beat_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPLACE_WEBHOOK_PORT", "9443")
    monkeypatch.setenv("GPUPLACE_SIDECAR_USER", "system:serviceaccount:x:y")
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--sidecar-user", "flag-user", "--log-level", "debug"])
    config = from_arguments(args)
    assert config.webhook_port == 9443
    assert config.sidecar_user == "flag-user"
    assert config.log_level == "DEBUG"
    with pytest.raises(ValidationError):
        config.webhook_port = 1  # type: ignore[misc]


def test_every_setting_is_a_flag_with_its_env_var(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in text
        assert "GPUPLACE_" + name.upper() in text


def test_invalid_settings_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--webhook-port", "70000"]) == 2
    assert "--webhook-port" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (
            ["--usage-prometheus", "prometheus.monitoring:9090"],
            "--usage-prometheus: the Prometheus URL 'prometheus.monitoring:9090' is not an "
            "http(s) URL with a host (e.g. http://prometheus.monitoring:9090)",
        ),
        (
            ["--usage-prometheus", "http://u:p@prom:9090", "--usage-token-file", "/t"],
            "--usage-token-file: give Prometheus' credentials either in its URL or as a "
            "token file, not both",
        ),
    ],
)
def test_bad_usage_prometheus_exits_2_before_connecting(
    flags: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Prometheus URL the reader could never use is a bad setting (one line, exit 2),
    not a traceback once the sidecar has connected to the API."""
    assert cli.main(["serve", "--load-aware", "true", *flags]) == 2
    assert capsys.readouterr().err == f"gpuplace serve: {why}\n"


def test_load_aware_without_a_load_reader_exits_2() -> None:
    """Until a reader of GPU loads is configured, --load-aware refuses to start rather
    than run without the tie-break it asked for (before any API connection)."""
    assert cli.main(["serve", "--load-aware", "true"]) == 2


def test_unloadable_certificate_exits_1(tmp_path: Path) -> None:
    missing = tmp_path / "missing.crt"
    assert cli.main(["serve", "--cert-file", str(missing), "--key-file", str(missing)]) == 1


# --- logs -------------------------------------------------------------------------------------


def test_json_log_lines_carry_extra_fields() -> None:
    stream = io.StringIO()
    handler = logs.configure("INFO", stream)
    try:
        logger = logging.getLogger("gpuplace.test")
        logger.info("review answered", extra={"uid": "u1", "latency": 0.5})
        try:
            raise ValueError("bad")
        except ValueError:
            logger.exception("failed")
        logger.debug("hidden")
        first, second = (json.loads(line) for line in stream.getvalue().splitlines())
        assert first["message"] == "review answered" and first["uid"] == "u1"
        assert first["level"] == "INFO" and first["logger"] == "gpuplace.test"
        assert "ValueError: bad" in second["exception"]
        assert logs.configure("INFO", stream) is not handler
        assert sum(h.get_name() == "gpuplace-json" for h in logging.getLogger().handlers) == 1
    finally:
        logging.getLogger().removeHandler(logs.configure("WARNING", io.StringIO()))


# --- in process -------------------------------------------------------------------------------


async def test_serves_webhook_and_ops(
    tls: tuple[Path, Path], tmp_path: Path, inventory_file: Path
) -> None:
    config = settings(tls, tmp_path, inventory=inventory_file)
    server = serving.build(config, CollectorRegistry())
    async with running(server, tls[0]) as process:
        assert await process.get("/healthz") == (200, '{"status": "ok"}')
        assert await process.get("/readyz") == (200, '{"status": "ready"}')
        answer = await process.review("/mutate", helpers.review(helpers.pod(SHARE), uid="a"))
        assert answer["response"]["allowed"] and answer["response"]["patch"]
        denied = await process.review(
            "/validate",
            helpers.review(helpers.pod({keys.GPU_PERCENT: "5", keys.GPU_MEMORY: "1Ti"})),
        )
        # GPU Feature Discovery's 80 GiB less the margin of nodes without the agent
        assert "the largest has 79Gi" in denied["response"]["status"]["message"]
        status, metrics = await process.get("/metrics")
        assert status == 200
        assert 'gpuplace_admission_reviews_total{endpoint="mutate",result="allowed"} 1.0' in (
            metrics
        )
        assert "gpuplace_webhook_certificate_expiry_timestamp_seconds" in metrics
        assert "gpuplace_event_loop_lag_seconds_bucket" in metrics  # the probe runs
        # the webhook is not served on the plain port, nor the ops endpoints on the TLS one
        status, _ = await process.get("/mutate")
        assert status == 404
    lines = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [line["uid"] for line in lines][:1] == ["a"]
    assert len(lines) == 2


async def test_not_ready_without_inventory_and_gpu_pods_refused(
    tls: tuple[Path, Path], tmp_path: Path
) -> None:
    server = serving.build(settings(tls, tmp_path), CollectorRegistry())
    async with running(server, tls[0]) as process:
        status, body = await process.get("/readyz")
        assert status == 503
        assert json.loads(body)["reasons"] == {"inventory": "GPU inventory not known yet"}
        answer = await process.review("/validate", helpers.review(helpers.pod(SHARE)))
        assert answer["response"]["status"]["code"] == 503
        plain = await process.review("/validate", helpers.review(helpers.pod()))
        assert plain["response"]["allowed"]


async def test_shutdown_turns_not_ready_before_closing(
    tls: tuple[Path, Path], tmp_path: Path, inventory_file: Path
) -> None:
    config = settings(tls, tmp_path, inventory=inventory_file, shutdown_delay_seconds=0.5)
    server = serving.build(config, CollectorRegistry())
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(stop))
    await asyncio.wait_for(server.started.wait(), 10)
    port = server.port("ops")
    async with aiohttp.ClientSession() as session:
        stop.set()
        await asyncio.sleep(0.1)
        async with session.get(f"http://127.0.0.1:{port}/readyz") as response:
            assert response.status == 503
            assert (await response.json())["reasons"] == {"process": "shutting down"}
        await asyncio.wait_for(task, 5)
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"http://127.0.0.1:{port}/healthz")


async def test_inventory_file_is_reloaded(
    tls: tuple[Path, Path], tmp_path: Path, inventory_file: Path
) -> None:
    config = settings(tls, tmp_path, inventory=inventory_file, inventory_reload_seconds=0.05)
    server = serving.build(config, CollectorRegistry())
    # more than the A100s have, within what an H200's 141 GiB packs (less the 1 GiB margin
    # of nodes without the node agent)
    big = helpers.pod({keys.GPU_COUNT: "1", keys.GPU_MEMORY: "139Gi"})
    async with running(server, tls[0]) as process:
        answer = await process.review("/mutate", helpers.review(big))
        patch = json.loads(base64.b64decode(answer["response"]["patch"]))
        mutated = helpers.review(jsonpatch.apply_patch(big, patch))
        before = await process.review("/validate", mutated)
        assert "the largest has 79Gi" in before["response"]["status"]["message"]
        # a broken file keeps the last good inventory
        inventory_file.write_text("{not json")
        await asyncio.sleep(0.2)
        assert (await process.get("/readyz"))[0] == 200
        nodes = helpers.node_list()
        nodes["items"].append(helpers.node("h200", gpus=8, model="NVIDIA-H200", memory_mib=144384))
        inventory_file.write_text(json.dumps(nodes))
        for _ in range(100):
            await asyncio.sleep(0.05)
            after = await process.review("/validate", mutated)
            if after["response"]["allowed"]:
                break
        assert after["response"]["allowed"], after


async def test_bad_inventory_file_fails_the_start(tls: tuple[Path, Path], tmp_path: Path) -> None:
    bad = tmp_path / "nodes.json"
    bad.write_text(json.dumps({"items": [helpers.node("x", gpus=2, model="")]}))
    server = serving.build(settings(tls, tmp_path, inventory=bad), CollectorRegistry())
    with pytest.raises(webhook.InventoryFileError, match=r"nvidia\.com/gpu\.product"):
        async with running(server, tls[0]):
            pass


async def test_lead_can_add_sites_contexts_and_checks(
    tls: tuple[Path, Path], tmp_path: Path, inventory_file: Path
) -> None:
    from aiohttp import web

    from gpuplace.webhook.inventory import FixedCapabilities

    source = FixedCapabilities(None)
    server = serving.build(settings(tls, tmp_path), CollectorRegistry(), capabilities=source)
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def informers() -> AsyncIterator[None]:
        events.append("start")
        yield
        events.append("stop")

    extra = web.Application()

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hi")

    extra.router.add_get("/filter", hello)
    server.add_context(informers)
    server.add_readiness("informers", lambda: None if events else "not synced")
    server.add_site("extender", extra, "127.0.0.1", 0)
    async with running(server, tls[0]) as process:
        assert events == ["start"]
        async with process.session.get(
            f"http://127.0.0.1:{server.port('extender')}/filter"
        ) as response:
            assert await response.text() == "hi"
        assert (await process.get("/readyz"))[0] == 503
        source.set(webhook.read_inventory(inventory_file).capabilities())
        assert (await process.get("/readyz"))[0] == 200
    assert events == ["start", "stop"]


# --- as a process ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_gpuplace_serve_process(
    tls: tuple[Path, Path], tmp_path: Path, inventory_file: Path
) -> None:
    webhook_port, metrics_port = _free_port(), _free_port()
    env = {
        **os.environ,
        "GPUPLACE_METRICS_ADDRESS": "127.0.0.1",
        "GPUPLACE_METRICS_PORT": str(metrics_port),
    }
    command = [
        sys.executable,
        "-m",
        "gpuplace.cli",
        "serve",
        "--webhook-address",
        "127.0.0.1",
        "--webhook-port",
        str(webhook_port),
        "--cert-file",
        str(tls[0]),
        "--key-file",
        str(tls[1]),
        "--inventory",
        str(inventory_file),
        "--audit-log",
        "-",
    ]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=helpers.REPO
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", metrics_port), timeout=1) as sock:
                    sock.sendall(b"GET /readyz HTTP/1.0\r\n\r\n")
                    reply = sock.recv(1000)
                if reply.split(b"\r\n", 1)[0].endswith(b" 200 OK"):
                    break
            except OSError:
                pass
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "gpuplace serve did not become ready"
            time.sleep(0.1)
        context = ssl.create_default_context(cafile=str(tls[0]))
        body = json.dumps(helpers.review(helpers.pod(SHARE), uid="proc")).encode()
        with (
            socket.create_connection(("127.0.0.1", webhook_port)) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as sock,
        ):
            sock.sendall(
                b"POST /mutate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200")
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr.decode()
    (audit,) = [json.loads(line) for line in stdout.decode().splitlines()]
    assert audit["uid"] == "proc" and audit["decision"] == "allowed"
    messages = [json.loads(line)["message"] for line in stderr.decode().splitlines()]
    assert "inventory loaded" in messages and "listening" in messages and "stopped" in messages
