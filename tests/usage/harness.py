"""A real Prometheus for the usage tests: Debian's `prometheus` binary, scraping fixture
exporters served by aiohttp on 127.0.0.1 (dcgm-exporter's text format and the node
agent's), with history backfilled by `promtool tsdb create-blocks-from openmetrics` so
that peaks and 95th percentiles are exactly known."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web


def require_prometheus() -> tuple[str, str]:
    """The `prometheus` and `promtool` binaries; skip (fail where CI is set) without them."""
    server, tool = shutil.which("prometheus"), shutil.which("promtool")
    if server and tool:
        return server, tool
    reason = (
        "Debian's prometheus package (prometheus, promtool) is not installed: "
        "`apt-get install prometheus`, or run ./dev test as root, which installs it"
    )
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Exporter:
    """An aiohttp app on its own thread and loop, serving `body()` at /metrics."""

    url: str
    loop: asyncio.AbstractEventLoop

    @property
    def target(self) -> str:
        return urllib.parse.urlsplit(self.url).netloc


@contextmanager
def serve_metrics(
    body: Callable[[], str], content_type: str = "text/plain; version=0.0.4; charset=utf-8"
) -> Iterator[Exporter]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    port = free_port()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=body().encode(), headers={"Content-Type": content_type})

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the fixture exporter did not start")
    try:
        yield Exporter(f"http://127.0.0.1:{port}/metrics", loop)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


@asynccontextmanager
async def answering(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A server on 127.0.0.1 (this loop) answering /api/v1/query with `handler`: a stand-in
    for a Prometheus that fails in one way. Yields its base URL."""
    app = web.Application()
    app.router.add_get("/api/v1/query", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


# -- OpenMetrics history for promtool --------------------------------------------------------

Series = tuple[str, dict[str, str], Sequence[tuple[float, float]]]
"""(metric name, labels, [(POSIX time, value)])"""


def openmetrics(series: Sequence[Series]) -> str:
    """OpenMetrics text of `series`, each family's samples together, each series in time
    order, ending in `# EOF` (what promtool reads)."""
    families: dict[str, list[Series]] = {}
    for item in series:
        families.setdefault(item[0], []).append(item)
    lines = []
    for name, items in families.items():
        lines.append(f"# TYPE {name} gauge")
        for _, labels, samples in items:
            text = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
            lines.extend(
                f"{name}{{{text}}} {float(value)!r} {at:.3f}" for at, value in sorted(samples)
            )
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def query(self, promql: str) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=5) as answer:
            data: dict[str, Any] = json.load(answer)
        result: list[dict[str, Any]] = data["data"]["result"]
        return result

    def wait_for(self, promql: str, at_least: float, timeout: float = 60.0) -> None:
        """Until `promql` gives at least `at_least` for some series (e.g. a sample count)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(promql)
            if result and max(float(item["value"][1]) for item in result) >= at_least:
                return
            time.sleep(0.5)
        raise AssertionError(f"Prometheus never had {promql} >= {at_least}: {self.log_tail()}")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextmanager
def run_prometheus(
    workdir: Path, jobs: dict[str, dict[str, Any]], history: Sequence[Series] = ()
) -> Iterator[Prometheus]:
    """Prometheus with `jobs` (name -> static_configs entry, plus `honor_labels` when given)
    scraped every second, its TSDB seeded with `history`."""
    server, tool = require_prometheus()
    data = workdir / "data"
    data.mkdir(parents=True)
    if history:
        source = workdir / "history.om"
        source.write_text(openmetrics(history))
        subprocess.run(
            [tool, "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
            check=True,
            capture_output=True,
            timeout=120,
        )
    scrape_configs = []
    for name, job in jobs.items():
        config = {"job_name": name, "static_configs": [job["static"]]}
        if "honor_labels" in job:
            config["honor_labels"] = job["honor_labels"]
        scrape_configs.append(config)
    config_file = workdir / "prometheus.yml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": scrape_configs,
            }
        )
    )
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                server,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=30d",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"prometheus exited {process.returncode}: {prom.log_tail()}")
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus never got ready: {prom.log_tail()}")
            time.sleep(0.2)
        yield prom
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
