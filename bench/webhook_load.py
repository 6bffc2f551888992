"""Load generator for the admission webhook: keep-alive TLS clients on 127.0.0.1.

Starts `gpuplace serve` pinned to one core (`taskset -c --server-cpu`; the generator pins
itself to another core when there is one), then runs

1. a fixed-rate phase: reviews sent on an open-loop schedule (`--rate`/s); latency counts
   from the scheduled send time, so queueing behind a slow answer is included;
2. a saturation phase: `--connections` closed-loop clients sending as fast as answered.

The review mix is every captured AdmissionReview in ../shared/fixtures/admission (mutate
ones to /mutate, validate ones to /validate, round robin), or a synthetic mix of plain
and GPU pods when the fixtures are absent. Prints one JSON document: throughput, p50/p90/
p99/max latency and errors per phase. Bounded: by default ~30 s in all.

    .venv/bin/python -m bench.webhook_load            # starts its own server
    .venv/bin/python -m bench.webhook_load --url https://127.0.0.1:8443 --cafile ca.crt
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures" / "admission"


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of process `pid` so far (Linux /proc), else None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    started: float = 0.0
    ended: float = 0.0
    server_cpu_s: float | None = None

    def report(self, **extra: Any) -> dict[str, Any]:
        ordered = sorted(self.latencies)

        def quantile(q: float) -> float | None:
            if not ordered:
                return None
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

        elapsed = max(self.ended - self.started, 1e-9)
        report = {
            **extra,
            "duration_s": round(elapsed, 2),
            "answered": len(ordered),
            "errors": self.errors,
            "throughput_rps": round(len(ordered) / elapsed, 1),
            "p50_ms": quantile(0.50),
            "p90_ms": quantile(0.90),
            "p99_ms": quantile(0.99),
            "max_ms": round(ordered[-1] * 1000, 3) if ordered else None,
        }
        if self.server_cpu_s is not None and ordered:
            # What one dedicated core could answer, independent of other load on the machine.
            per_review = self.server_cpu_s / len(ordered)
            report["server_cpu_busy"] = round(self.server_cpu_s / elapsed, 3)
            report["server_cpu_us_per_review"] = round(per_review * 1e6, 1)
            report["one_core_capacity_rps"] = round(1 / per_review) if per_review else None
        return report


def _synthetic() -> list[tuple[str, dict[str, Any]]]:
    def review(annotations: dict[str, str], uid: str) -> dict[str, Any]:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": uid, "namespace": "default", "annotations": annotations},
            "spec": {
                "containers": [{"name": "main", "image": "busybox:1.36", "resources": {}}],
                "schedulerName": "default-scheduler",
            },
        }
        return {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "operation": "CREATE",
                "namespace": "default",
                "userInfo": {"username": "bench"},
                "object": pod,
            },
        }

    share = {"gpuplace.io/gpu-percent": "50", "gpuplace.io/gpu-memory": "20Gi"}
    return [
        ("/mutate", review({}, "plain")),
        ("/validate", review({}, "plain")),
        ("/mutate", review(share, "share")),
        ("/validate", review(share, "share")),
    ]


def bodies() -> tuple[str, list[bytes]]:
    """The request mix as ready-to-send HTTP/1.1 requests."""
    if FIXTURES.is_dir() and any(FIXTURES.glob("*.json")):
        source = "fixtures"
        reviews = []
        for path in sorted(FIXTURES.glob("*.json")):
            endpoint = "/mutate" if "-mutate-" in path.name else "/validate"
            reviews.append((endpoint, json.loads(path.read_text())["request"]))
    else:
        source = "synthetic"
        reviews = _synthetic()
    requests = []
    for endpoint, review in reviews:
        body = json.dumps(review).encode()
        head = (
            f"POST {endpoint}?timeout=5s HTTP/1.1\r\nHost: gpuplace-webhook\r\n"
            f"Content-Type: application/json\r\nAccept: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        requests.append(head + body)
    return source, requests


class Connection:
    """One keep-alive HTTPS connection speaking just enough HTTP/1.1."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int, context: ssl.SSLContext) -> Connection:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=context, server_hostname=host
        )
        return cls(reader, writer)

    async def send(self, request: bytes) -> bool:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return head.startswith(b"HTTP/1.1 200")

    def close(self) -> None:
        self.writer.close()


async def _connections(
    host: str, port: int, context: ssl.SSLContext, count: int
) -> list[Connection]:
    return list(await asyncio.gather(*(Connection.open(host, port, context) for _ in range(count))))


def _cycle(requests: list[bytes], offset: int) -> Iterator[bytes]:
    index = offset
    while True:
        yield requests[index % len(requests)]
        index += 1


async def fixed_rate(
    connections: list[Connection], requests: list[bytes], rate: float, seconds: float
) -> Phase:
    phase = Phase("fixed_rate")
    total = int(rate * seconds)
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    next_index = 0

    async def worker(connection: Connection, offset: int) -> None:
        nonlocal next_index
        mix = _cycle(requests, offset)
        while next_index < total:
            index = next_index
            next_index += 1
            scheduled = start + index / rate
            delay = scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                ok = await connection.send(next(mix))
            except (OSError, asyncio.IncompleteReadError, ValueError):
                phase.errors += 1
                continue
            if ok:
                phase.latencies.append(loop.time() - scheduled)
            else:
                phase.errors += 1

    phase.started = time.perf_counter()
    await asyncio.gather(*(worker(c, i) for i, c in enumerate(connections)))
    phase.ended = time.perf_counter()
    return phase


async def saturation(connections: list[Connection], requests: list[bytes], seconds: float) -> Phase:
    phase = Phase("saturation")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds

    async def worker(connection: Connection, offset: int) -> None:
        mix = _cycle(requests, offset)
        while loop.time() < deadline:
            sent = loop.time()
            try:
                ok = await connection.send(next(mix))
            except (OSError, asyncio.IncompleteReadError, ValueError):
                phase.errors += 1
                continue
            if ok:
                phase.latencies.append(loop.time() - sent)
            else:
                phase.errors += 1

    phase.started = time.perf_counter()
    await asyncio.gather(*(worker(c, i) for i, c in enumerate(connections)))
    phase.ended = time.perf_counter()
    return phase


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


NOOP_SERVER = """
import ssl, sys
from aiohttp import web
ANSWER = (b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview",'
          b'"response":{"uid":"x","allowed":true}}')
async def answer(request):
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")
async def ready(request):
    return web.Response(text="ok")
app = web.Application(client_max_size=3 * 1024 * 1024)
app.router.add_post("/mutate", answer)
app.router.add_post("/validate", answer)
ops = web.Application()
ops.router.add_get("/readyz", ready)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[3], sys.argv[4])
async def main():
    runners = [web.AppRunner(app, access_log=None), web.AppRunner(ops, access_log=None)]
    for runner in runners:
        await runner.setup()
    await web.TCPSite(runners[0], "127.0.0.1", int(sys.argv[1]), ssl_context=context).start()
    await web.TCPSite(runners[1], "127.0.0.1", int(sys.argv[2])).start()
    await asyncio.Event().wait()
import asyncio
asyncio.run(main())
"""


@contextlib.contextmanager
def own_server(
    cpu: int | None, *, noop: bool = False
) -> Iterator[tuple[str, int, Path, dict[str, Any]]]:
    """`gpuplace serve` (or, with `noop`, an aiohttp TLS server answering a constant: the
    floor set by aiohttp, TLS and this machine) in a subprocess with a throwaway
    certificate and inventory."""
    sys.path.insert(0, str(REPO))
    from tests.webhook import helpers  # the same throwaway cert and inventory as the tests

    with tempfile.TemporaryDirectory(prefix="gpuplace-bench-") as scratch:
        directory = Path(scratch)
        cert_file, key_file = helpers.write_certificate(directory)
        inventory = directory / "nodes.json"
        inventory.write_text(json.dumps(helpers.node_list()))
        port, metrics_port = _free_port(), _free_port()
        command = [
            sys.executable, "-m", "gpuplace.cli", "serve",
            "--webhook-address", "127.0.0.1", "--webhook-port", str(port),
            "--metrics-address", "127.0.0.1", "--metrics-port", str(metrics_port),
            "--cert-file", str(cert_file), "--key-file", str(key_file),
            "--inventory", str(inventory), "--audit-log", str(directory / "audit.jsonl"),
            "--log-level", "WARNING",
        ]  # fmt: skip
        if noop:
            command = [sys.executable, "-c", NOOP_SERVER, str(port), str(metrics_port),
                       str(cert_file), str(key_file)]  # fmt: skip
        pinned = cpu is not None and shutil.which("taskset") is not None
        if pinned:
            command = ["taskset", "-c", str(cpu), *command]
        server = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", metrics_port), 1) as sock:
                        sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
                        if b" 200 " in sock.recv(200):
                            break
                except OSError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("gpuplace serve did not start")
                time.sleep(0.1)
            info: dict[str, Any] = {
                "started": "no-op aiohttp TLS server" if noop else "gpuplace serve",
                "pid": server.pid,
                "pinned_cpu": cpu if pinned else None,
                "audit_log": None if noop else "file",
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
            yield "127.0.0.1", port, cert_file, info
            if not noop:
                server.terminate()
                server.wait(10)
                audit_lines = sum(1 for _ in (directory / "audit.jsonl").open())
                info["audit_lines"] = audit_lines
        finally:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()


def _spent(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


async def measure(
    host: str,
    port: int,
    cafile: Path | None,
    requests: list[bytes],
    args: argparse.Namespace,
    *,
    pid: int | None,
) -> dict[str, Any]:
    context = ssl.create_default_context(cafile=str(cafile) if cafile else None)
    if cafile is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    connections = await _connections(host, port, context, args.connections)
    await saturation(connections, requests, args.warmup)  # warm-up, not reported
    report: dict[str, Any] = {}
    before = cpu_seconds(pid)
    fixed = await fixed_rate(connections, requests, args.rate, args.seconds)
    fixed.server_cpu_s = _spent(before, cpu_seconds(pid))
    report["fixed_rate"] = fixed.report(target_rps=args.rate, connections=len(connections))
    before = cpu_seconds(pid)
    saturated = await saturation(connections, requests, args.seconds)
    saturated.server_cpu_s = _spent(before, cpu_seconds(pid))
    report["saturation"] = saturated.report(connections=len(connections))
    for connection in connections:
        connection.close()
    return report


async def run(args: argparse.Namespace) -> dict[str, Any]:
    source, requests = bodies()
    report: dict[str, Any] = {"mix": {"source": source, "reviews": len(requests)}}
    if args.client_cpu is not None and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {args.client_cpu})
            report["client_cpu"] = args.client_cpu
    if args.url:
        parts = urlsplit(args.url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 443
        cafile = Path(args.cafile) if args.cafile else None
        report["server"] = {"url": args.url}
        report.update(await measure(host, port, cafile, requests, args, pid=None))
        return report
    with own_server(args.server_cpu) as (host, port, cafile, info):
        report["server"] = info
        report.update(await measure(host, port, cafile, requests, args, pid=info["pid"]))
    if args.baseline:
        with own_server(args.server_cpu, noop=True) as (host, port, cafile, info):
            baseline = {"server": info}
            baseline.update(await measure(host, port, cafile, requests, args, pid=info["pid"]))
        report["baseline"] = baseline
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an already running webhook (default: start one)")
    parser.add_argument("--cafile", help="CA of --url's certificate (default: no verification)")
    parser.add_argument("--rate", type=float, default=500.0, help="fixed-rate reviews/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds")
    parser.add_argument("--connections", type=int, default=16, help="keep-alive connections")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    parser.add_argument("--server-cpu", type=int, default=cpus[0], help="core for the server")
    parser.add_argument(
        "--client-cpu",
        type=int,
        default=cpus[-1] if len(cpus) > 1 else None,
        help="core for this generator",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also measure a no-op aiohttp TLS server on the same core (the floor)",
    )
    args = parser.parse_args(argv)
    if (args.seconds * 2 + args.warmup) * (2 if args.baseline else 1) > 50:
        parser.error("--seconds and --warmup must keep the run under a minute")
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
