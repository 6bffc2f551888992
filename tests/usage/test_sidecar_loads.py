"""`gpuplace serve --load-aware` fed by a real Prometheus: Debian's server scrapes a
fixture exporter in dcgm-exporter's format (node gpu-1 busy, gpu-0 idle), the sidecar's
Prometheus reader (`--usage-prometheus`, `--usage-metrics=dcgm`) polls it, and
kube-scheduler's filter call over HTTP passes the idle one of two equal nodes alone, and
prioritize (a profile that still names it) ranks it first."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

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


async def test_the_less_loaded_of_two_equal_nodes_wins_filter_and_prioritize(
    tls: tuple[Path, Path], tmp_path: Path
) -> None:
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
            api = api_server.api
            for node in UTIL:
                api.create(objects.node(node, gpus=4))
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
            )
            process = await composing.compose(config, CollectorRegistry())
            async with started(process) as session:
                metrics = f"http://127.0.0.1:{process.server.port('ops')}/metrics"
                deadline = time.monotonic() + 20
                while True:
                    async with session.get(metrics) as response:
                        text = await response.text()
                    reads = {
                        sample.labels.get("outcome"): sample.value
                        for family in text_string_to_metric_families(text)
                        for sample in family.samples
                        if sample.name == "gpuplace_load_reads_total"
                    }
                    if reads.get("ok", 0) >= 1:
                        break
                    assert time.monotonic() < deadline, f"no load read succeeded: {reads}"
                    await asyncio.sleep(0.1)
                pod = api.create(objects.pod("small", percent=25))
                body = {"Pod": pod, "NodeNames": list(UTIL), "Nodes": None}
                extender = f"http://127.0.0.1:{process.server.port('extender')}"
                async with session.post(f"{extender}/filter", json=body) as response:
                    passed = (await response.json())["NodeNames"]
                async with session.post(f"{extender}/prioritize", json=body) as response:
                    scores = {item["Host"]: item["Score"] for item in await response.json()}
    assert passed == ["gpu-0"], passed  # the shipped profile: filter's choice is the bind
    assert scores.get("gpu-0") == 10 and scores.get("gpu-1", 0) < 10, scores
