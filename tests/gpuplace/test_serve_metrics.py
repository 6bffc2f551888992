"""The dashboard's sidecar metrics read from a composed `gpuplace serve` over its real
/metrics endpoint (127.0.0.1), against the local API under the shipped RBAC:
`gpuplace_pending_pods{reason}` follows the pods' lives (created, gated, found no node by
kube-scheduler, bound) and `gpuplace_fragmentation_milligpus{measure}` /
`gpuplace_ledger_free_milligpus` follow the binds. Then a real Prometheus (Debian's
package, which ./dev test installs) scrapes that endpoint and runs every query of the
Grafana dashboard: all are accepted, and those of the sidecar's rows return series."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpuplace.cluster import keys
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.placement.fragmentation_totals import ClusterMeasure
from gpuplace.wiring import composing
from tests.deploy import test_grafana_dashboard as grafana
from tests.gpuplace.test_serve_cluster import enforcing, member, started, two_nodes_led_here
from tests.webhook import helpers


@pytest.fixture
def tls(tmp_path: Path) -> tuple[Path, Path]:
    return helpers.write_certificate(tmp_path / "tls")


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(process: composing.Process, session: aiohttp.ClientSession) -> Samples:
    url = f"http://127.0.0.1:{process.server.port('ops')}/metrics"
    async with session.get(url) as response:
        assert response.status == 200
        text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def pending(samples: Samples) -> dict[str, float]:
    return {
        dict(labels)["reason"]: value
        for (name, labels), value in samples.items()
        if name == "gpuplace_pending_pods"
    }


def fragmentation(samples: Samples) -> dict[str, float]:
    return {
        dict(labels)["measure"]: value
        for (name, labels), value in samples.items()
        if name == "gpuplace_fragmentation_milligpus"
    }


async def until_scraped(
    process: composing.Process, session: aiohttp.ClientSession, want: dict[str, float]
) -> Samples:
    deadline = time.monotonic() + 10
    while True:
        samples = await scrape(process, session)
        if all(pending(samples).get(reason) == count for reason, count in want.items()):
            return samples
        assert time.monotonic() < deadline, f"pending pods {pending(samples)}, want {want}"
        await asyncio.sleep(0.05)


async def test_pending_pods_by_reason_and_fragmentation_over_metrics(
    tls: tuple[Path, Path], tmp_path: Path
) -> None:
    async with localapi.serve(enforcing()) as api_server:
        api = api_server.api
        process = await two_nodes_led_here(api_server, tls, tmp_path)
        sidecar = process.sidecar
        assert sidecar is not None
        async with started(process) as session:
            samples = await scrape(process, session)
            assert pending(samples) == dict.fromkeys(
                ["gated", "unreadable", "reserved", "unschedulable", "waiting"], 0.0
            )
            # two 4-GPU nodes, nothing granted: all idle, and no GPU is fragment
            assert samples[("gpuplace_ledger_free_milligpus", ())] == 8000
            assert fragmentation(samples) == {"fgd": 0.0, "stranded": 0.0}

            api.create(objects.pod("half", percent=50))
            api.create(objects.pod("nowhere", percent=50))
            api.create(objects.pod("bad", annotations={keys.GPU_MEMORY: "lots"}))
            for i in range(2):  # a gang of 3 with 2 members: gated, holding nothing
                api.create(member(f"w{i}", "train", 3))
            await until_scraped(
                process, session, {"waiting": 2, "gated": 2, "unreadable": 1, "unschedulable": 0}
            )
            # kube-scheduler's failed try, as it writes it
            condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
            api.patch(
                "pods", "nowhere", {"status": {"conditions": [condition]}}, "default",
                subresource="status",
            )  # fmt: skip
            await until_scraped(process, session, {"waiting": 1, "unschedulable": 1})

            # kube-scheduler's part for "half": filter, then bind through the extender
            extender = f"http://127.0.0.1:{process.server.port('extender')}"
            pod = next(p for p in api.objects("pods") if p["metadata"]["name"] == "half")
            body = {"Pod": pod, "NodeNames": ["gpu-0", "gpu-1"], "Nodes": None}
            async with session.post(f"{extender}/filter", json=body) as response:
                node = (await response.json())["NodeNames"][0]
            bind = {
                "PodName": "half",
                "PodNamespace": "default",
                "PodUID": pod["metadata"]["uid"],
                "Node": node,
            }
            async with session.post(f"{extender}/bind", json=bind) as response:
                assert (await response.json())["Error"] == ""
            samples = await until_scraped(
                process,
                session,
                {"waiting": 0, "unschedulable": 1, "gated": 2, "unreadable": 1, "reserved": 0},
            )
            # half a GPU granted: 7500 idle, and the half left on its GPU is fragment for
            # the whole GPUs of the typical workload (500 × their popularity)
            assert samples[("gpuplace_ledger_free_milligpus", ())] == 7500
            assert samples[("gpuplace_ledger_allocated_milligpus", ())] == 500
            workload = sidecar.holder.measured()
            whole = sum(p for task, p in workload.types if task.milli == 1000)
            assert fragmentation(samples)["fgd"] == pytest.approx(500 * whole)
            fresh = ClusterMeasure().totals(sidecar.sync.ledger, workload)
            assert fragmentation(samples) == {"fgd": fresh.fgd, "stranded": fresh.stranded}


async def bind_through_the_extender(
    process: composing.Process, session: aiohttp.ClientSession, pod: dict[str, Any]
) -> None:
    """kube-scheduler's part for `pod`: filter, then bind on the first node passed."""
    extender = f"http://127.0.0.1:{process.server.port('extender')}"
    body = {"Pod": pod, "NodeNames": ["gpu-0", "gpu-1"], "Nodes": None}
    async with session.post(f"{extender}/filter", json=body) as response:
        node = (await response.json())["NodeNames"][0]
    bind = {
        "PodName": pod["metadata"]["name"],
        "PodNamespace": pod["metadata"]["namespace"],
        "PodUID": pod["metadata"]["uid"],
        "Node": node,
    }
    async with session.post(f"{extender}/bind", json=bind) as response:
        assert (await response.json())["Error"] == ""


def require_prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        reason = "Debian's prometheus package is not installed (./dev test as root installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


@contextlib.contextmanager
def prometheus(binary: str, target: str, tmp: Path) -> Iterator[str]:
    """A Prometheus scraping `target` (host:port) every second; yields its base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = tmp / "prometheus.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {"job_name": "gpuplace", "static_configs": [{"targets": [target]}]}
                ],
            }
        )
    )
    log = (tmp / "prometheus.log").open("w")
    server = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)
        log.close()


async def query(session: aiohttp.ClientSession, base: str, expr: str) -> list[Any]:
    async with session.get(f"{base}/api/v1/query", params={"query": expr}) as response:
        body = await response.json()
    assert body["status"] == "success", (expr, body)
    result: list[Any] = body["data"]["result"]
    return result


async def test_every_dashboard_query_runs_on_a_prometheus_scraping_the_sidecar(
    tls: tuple[Path, Path], tmp_path: Path
) -> None:
    binary = require_prometheus()
    async with localapi.serve(enforcing()) as api_server:
        api = api_server.api
        process = await two_nodes_led_here(api_server, tls, tmp_path)
        async with started(process) as session:
            api.create(objects.pod("half", percent=50))
            api.create(objects.pod("waits", percent=75))
            for i in range(2):
                api.create(member(f"w{i}", "train", 3))
            await until_scraped(process, session, {"waiting": 2, "gated": 2})
            pod = next(p for p in api.objects("pods") if p["metadata"]["name"] == "half")
            await bind_through_the_extender(process, session, pod)
            target = f"127.0.0.1:{process.server.port('ops')}"
            with prometheus(binary, target, tmp_path) as base:
                deadline = time.monotonic() + 30
                while len(await query_or_none(session, base, "gpuplace_pending_pods")) < 5:
                    assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
                    await asyncio.sleep(0.2)
                await asyncio.sleep(2.5)  # a few more scrapes: rates have two samples
                empty = []
                for each in grafana.queries(grafana.load(), duration="1m"):
                    found = await query(session, base, each.expr)
                    if not found and each.row in SIDECAR_ROWS:
                        empty.append(f"{each.where}: {each.expr}")
                assert empty == []


SIDECAR_ROWS = frozenset({"Allocation", "Fragmentation", "Pending GPU pods"})
"""The rows whose every query has series as soon as a sidecar is scraped (asked vs used
needs node agents on GPUs; the health rows' rates need traffic)."""


async def query_or_none(session: aiohttp.ClientSession, base: str, expr: str) -> list[Any]:
    """`query`, or [] while Prometheus is not up yet."""
    try:
        return await query(session, base, expr)
    except (aiohttp.ClientError, AssertionError):
        return []
