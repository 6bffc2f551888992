"""`gpuplace serve --load-aware` fed by a real Prometheus: Debian's server scrapes a
fixture exporter in dcgm-exporter's format (node gpu-1 busy, gpu-0 idle), the sidecar's
Prometheus reader (`--usage-prometheus`, `--usage-metrics=dcgm`) polls it, and
kube-scheduler's filter call over HTTP passes the idle one of two equal nodes alone, and
prioritize (a profile that still names it) ranks it first; and when that Prometheus goes
down, the sidecar says so (metric, log line, /readyz detail) and decides as the policy
alone would."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.usage import names
from gpuplace.wiring import composing
from tests.gpuplace.test_serve_cluster import enforcing, settings, started
from tests.usage import harness
from tests.webhook import helpers

UTIL = {"gpu-0": 10, "gpu-1": 90}
"""gpu-1, which the policy's line ranks first among equals, is the busy one."""


def dcgm_text() -> str:
    lines = [
        f"# HELP {names.DCGM_GPU_UTIL} GPU utilization (in %).",
        f"# TYPE {names.DCGM_GPU_UTIL} gauge",
    ]
    for node, util in UTIL.items():
        for gpu in range(4):
            lines.append(
                f'{names.DCGM_GPU_UTIL}{{gpu="{gpu}",UUID="GPU-{node}-{gpu}",device="nvidia{gpu}",'
                f'modelName="NVIDIA A100-SXM4-80GB",Hostname="{node}"}} {util}'
            )
    return "\n".join(lines) + "\n"


@pytest.fixture
def tls(tmp_path: Path) -> tuple[Path, Path]:
    return helpers.write_certificate(tmp_path / "tls")


@dataclass
class Running:
    """The real Prometheus, the local API with two equal nodes, `gpuplace serve
    --load-aware` reading that Prometheus, and an HTTP session to it."""

    prom: harness.Prometheus
    api: localapi.FakeApi
    process: composing.Process
    session: aiohttp.ClientSession

    def url(self, site: str, path: str) -> str:
        return f"http://127.0.0.1:{self.process.server.port(site)}{path}"

    async def poll(self, done: Callable[[int, dict[str, Any], str], bool], what: str) -> Any:
        """/readyz (status, body) and /metrics until `done(status, body, metrics)`."""
        deadline = time.monotonic() + 30
        while True:
            async with self.session.get(self.url("ops", "/readyz")) as response:
                code, ready = response.status, await response.json()
            async with self.session.get(self.url("ops", "/metrics")) as response:
                text = await response.text()
            if done(code, ready, text):
                return code, ready, text
            assert time.monotonic() < deadline, (what, code, ready, load_reads(text))
            await asyncio.sleep(0.1)

    async def verb(self, verb: str, pod: dict[str, Any]) -> Any:
        body = {"Pod": pod, "NodeNames": list(UTIL), "Nodes": None}
        async with self.session.post(self.url("extender", f"/{verb}"), json=body) as response:
            return await response.json()


@contextlib.asynccontextmanager
async def load_aware(
    tls: tuple[Path, Path], tmp_path: Path, **values: Any
) -> AsyncIterator[Running]:
    """`Running`, after the sidecar's first successful read of the loads."""
    with contextlib.ExitStack() as stack:
        exporter = stack.enter_context(harness.serve_metrics(dcgm_text))
        prom = await asyncio.to_thread(
            stack.enter_context,
            harness.run_prometheus(
                tmp_path / "prom", {"dcgm": {"static": {"targets": [exporter.target]}}}
            ),
        )
        await asyncio.to_thread(prom.wait_for, f"count_over_time({names.DCGM_GPU_UTIL}[1m])", 2)
        async with localapi.serve(enforcing()) as api_server:
            for node in UTIL:
                api_server.api.create(objects.node(node, gpus=4))
            kubeconfig = api_server.kubeconfig(tmp_path / "kubeconfig", localapi.GPUPLACE)
            config = settings(
                tls,
                tmp_path,
                kubeconfig,
                load_aware=True,
                usage_prometheus=prom.url,
                usage_metrics="dcgm",
                usage_step_seconds=1,  # its scrape interval
                load_window_seconds=60,
                load_refresh_seconds=0.3,
                **values,
            )
            process = await composing.compose(config, CollectorRegistry())
            async with started(process) as session:
                running = Running(prom, api_server.api, process, session)
                await running.poll(
                    lambda code, ready, text: load_reads(text).get("ok", 0) >= 1,
                    "a load read that succeeds",
                )
                yield running


def load_reads(text: str) -> dict[str | None, float]:
    return {
        sample.labels.get("outcome"): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gpuplace_load_reads_total"
    }


async def test_the_less_loaded_of_two_equal_nodes_wins_filter_and_prioritize(
    tls: tuple[Path, Path], tmp_path: Path
) -> None:
    async with load_aware(tls, tmp_path) as running:
        pod = running.api.create(objects.pod("small", percent=25))
        passed = (await running.verb("filter", pod))["NodeNames"]
        scores = {item["Host"]: item["Score"] for item in await running.verb("prioritize", pod)}
    assert passed == ["gpu-0"], passed  # the shipped profile: filter's choice is the bind
    assert scores.get("gpu-0") == 10 and scores.get("gpu-1", 0) < 10, scores


async def test_a_prometheus_gone_down_is_said_loudly_and_decisions_fall_back_to_the_policy(
    tls: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 46: the shipped NetworkPolicy (or an outage) keeps the sidecar from its
    Prometheus. The real server answers first, then stops: the sidecar counts the failed
    reads, logs one ERROR that says where to look, names the outage in /readyz under
    `degraded` while staying ready (200: the webhook and the extender work on), and once
    the last loads are older than --load-max-age-seconds filter passes the policy's own
    choice, the busy node, as without --load-aware."""
    caplog.set_level(logging.INFO, logger="gpuplace.extender.load_polling")
    async with load_aware(tls, tmp_path, load_max_age_seconds=1.5) as running:
        running.prom.process.terminate()
        await asyncio.to_thread(running.prom.process.wait, 15)
        code, ready, text = await running.poll(
            lambda code, ready, text: "policy's alone" in str(ready.get("degraded")),
            "the outage named in /readyz, the loads too old",
        )
        passed = (
            await running.verb("filter", running.api.create(objects.pod("small", percent=25)))
        )["NodeNames"]
        url = running.prom.url
    assert code == 200 and ready["status"] == "ready", ready
    why = ready["degraded"]["load-aware"]
    assert why.startswith("measured GPU loads unreadable for "), why
    assert f"(Prometheus at {url} cannot be reached: " in why, why  # the reader's own words
    assert load_reads(text).get("unavailable", 0) >= 1, load_reads(text)
    errors = [
        r for r in caplog.records if r.levelno == logging.ERROR and "measured GPU loads" in r.msg
    ]
    assert len(errors) == 1, [r.msg for r in caplog.records]  # once per outage, not per read
    assert "NetworkPolicy" in errors[0].msg
    assert passed == ["gpu-1"], passed  # the policy's line, load no longer known
