"""The Prometheus reader against a real Prometheus: both metric sets, exact peaks and
95th percentiles from backfilled history, live scrapes, and every way it can fail."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest
from aiohttp import web
from pydantic import ValidationError

from gpuplace.usage import names, prometheus, report
from gpuplace.usage.gpu_loads import GpuLoad, LoadReader, UsageUnavailable
from gpuplace.usage.readings import Usage
from tests.usage import harness, scenario
from tests.usage.conftest import Setup

GIB = scenario.GIB
MIB = scenario.MIB


async def read(prom: harness.Prometheus, metrics: prometheus.Metrics) -> Usage:
    # the backfilled history's samples are a minute apart: so is the step
    source = prometheus.Source(url=prom.url, metrics=metrics, step_seconds=60)
    async with prometheus.Reader(source) as reader:
        return await reader.read(3600, at=scenario.T_END)


async def test_agent_series_report(prom: harness.Prometheus) -> None:
    usage = await read(prom, "gpuplace")
    pods = {(use.pod, use.gpu): use for use in usage.pods}
    train = pods[("train", 0)]
    assert (train.memory_peak_bytes, train.memory_p95_bytes) == (21 * GIB, 20 * GIB)
    assert train.util_peak == pytest.approx(0.50) and train.util_p95 == pytest.approx(0.49)
    assert train.samples == 21 and not train.gpu_reading
    assert train.granted_memory_bytes == 40 * GIB and train.granted_share == 0.5
    spiky = pods[("spiky", 0)]  # a peak between two scrapes, from the agent's own series
    assert (spiky.memory_peak_bytes, spiky.memory_p95_bytes) == (9 * GIB, 2 * GIB)
    idle = pods[("idle", 1)]
    assert idle.memory_peak_bytes == 6 * GIB
    assert idle.memory_p95_bytes == pytest.approx(5.8 * GIB, abs=1)
    assert pods[("short", 0)].samples == 5
    gpus = {(gpu.node, gpu.gpu): gpu for gpu in usage.gpus}
    assert gpus[("h-a", 0)].memory_total_bytes == 80 * GIB
    assert gpus[("h-a", 1)].util_p95 == pytest.approx(0.20)

    result = report.build(usage, scenario.AGENT_ASKED)
    over = {(item.pod, item.what): item for item in result.over}
    assert set(over) == {
        ("idle", "memory"),
        ("idle", "compute"),
        ("ghost", "memory"),
        ("ghost", "compute"),
    }
    assert over[("idle", "memory")].line == 'gpuplace.io/gpu-memory: "8Gi"'
    assert over[("idle", "compute")].line == 'gpuplace.io/gpu-percent: "25"'
    assert over[("ghost", "memory")].value == "2Gi"  # asked from the granted series
    assert over[("ghost", "compute")].value == "5"
    assert any(text.startswith("default/short: 5 samples") for text in result.unjudged)
    nodes = {row.node: row for row in result.nodes}
    assert nodes["h-a"].asked_memory_bytes == 64 * GIB and nodes["h-a"].asked_percent == 150


async def test_a_pod_split_by_an_agent_restart_is_read_whole(prom: harness.Prometheus) -> None:
    """Two series of one pod from two agent instances (before and after a rollout): the
    p95 and the sample count are the union's, not the larger part's."""
    usage = await read(prom, "gpuplace")
    (rolled,) = [use for use in usage.pods if use.pod == "rolled"]
    assert (rolled.memory_peak_bytes, rolled.memory_p95_bytes) == (21 * GIB, 20 * GIB)
    assert rolled.util_p95 == pytest.approx(0.20) and rolled.samples == 21
    gpus = {(gpu.node, gpu.gpu): gpu for gpu in usage.gpus}
    assert gpus[("h-c", 0)].memory_p95_bytes == 20 * GIB and gpus[("h-c", 0)].samples == 21


async def test_dcgm_series_report(prom: harness.Prometheus) -> None:
    usage = await read(prom, "dcgm")
    pods = {use.pod: use for use in usage.pods if use.node == "d-a"}
    assert set(pods) == {"train-d", "infer-d", "solo-d"}
    assert all(use.gpu_reading for use in pods.values())
    assert pods["train-d"].memory_peak_bytes == 12240 * MIB  # MiB -> bytes
    assert pods["train-d"].memory_p95_bytes == 12140 * MIB
    assert pods["train-d"].util_p95 == pytest.approx(0.59)  # percent -> ratio
    assert pods["solo-d"].util_p95 == pytest.approx(0.19)  # SM_ACTIVE wins over GPU_UTIL
    gpus = {(gpu.node, gpu.gpu): gpu for gpu in usage.gpus}
    assert gpus[("d-a", 2)].memory_peak_bytes == 30000 * MIB
    assert gpus[("d-a", 2)].memory_total_bytes == 81920 * MIB
    assert gpus[("d-a", 2)].util_peak == pytest.approx(0.70)

    result = report.build(usage, scenario.DCGM_ASKED)
    rows = {row.pod: row for row in result.pods}
    assert rows["train-d"].shared and rows["infer-d"].shared
    assert not rows["solo-d"].shared and rows["solo-d"].gpu_reading
    assert rows["unlabelled-d"].memory_peak_bytes == 30000 * MIB  # from the GPU's series
    over = {(item.pod, item.what): item.value for item in result.over}
    assert over == {("solo-d", "memory"): "3Gi", ("solo-d", "compute"): "25"}
    assert any("train-d: its GPU is shared" in text for text in result.unjudged)
    gpu0 = next(row for row in result.gpus if (row.node, row.gpu) == ("d-a", 0))
    assert gpu0.pods == 2 and gpu0.asked_percent == 100


async def test_live_scrapes_exported_pod_and_loads(prom: harness.Prometheus) -> None:
    # scraped every second: so is the step
    source = prometheus.Source(url=prom.url, metrics="dcgm", step_seconds=1)
    async with prometheus.Reader(source) as reader:
        usage = await reader.read(30)
        loads = await reader.gpu_loads(30)
    live = [use for use in usage.pods if use.node == "live-0"]
    # the scrape's pod label (the exporter's own) moved dcgm's to exported_pod: read that
    assert [(use.namespace, use.pod, use.gpu) for use in live] == [("default", "live-pod", 0)]
    assert live[0].memory_peak_bytes == 5120 * MIB
    assert loads["live-0"] == {
        0: GpuLoad("live-0", 0, 0.25, 5120 * MIB),
        1: GpuLoad("live-0", 1, 0.0, 0),
    }
    source = prometheus.Source(url=prom.url, metrics="gpuplace", step_seconds=1)
    async with prometheus.Reader(source) as reader:
        load_reader: LoadReader = reader  # the sidecar's protocol, checked by mypy
        loads = await load_reader.gpu_loads(30)
        usage = await reader.read(30)
    assert loads == {"live-1": {0: GpuLoad("live-1", 0, 0.25, 3 * GIB)}}
    (agent,) = usage.pods
    assert (agent.pod, agent.util_peak, agent.granted_share) == ("live-agent", 0.125, 0.25)


async def test_refused_query_is_a_clear_error(prom: harness.Prometheus) -> None:
    async with prometheus.Client(prometheus.Source(url=prom.url)) as client:
        with pytest.raises(UsageUnavailable, match=r"refused the query \(bad_data: .*\): max_"):
            await client.vector("max_over_time(", 0.0)


async def test_down_not_prometheus_and_slow(setup: Setup, tmp_path: Path) -> None:
    port = harness.free_port()
    down = prometheus.Reader(prometheus.Source(url=f"http://127.0.0.1:{port}"))
    with pytest.raises(UsageUnavailable, match=f"at http://127.0.0.1:{port} cannot be reached"):
        await down.read(60)
    await down.close()
    exporter = setup.agent.url.removesuffix("/metrics")
    other = prometheus.Reader(prometheus.Source(url=exporter))
    with pytest.raises(UsageUnavailable, match="HTTP 404 with something other than Prometheus"):
        await other.gpu_loads(60)
    await other.close()

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response()

    async with harness.answering(slow) as url:
        source = prometheus.Source(url=url, timeout_seconds=0.3)
        async with prometheus.Reader(source) as reader:
            with pytest.raises(UsageUnavailable, match=r"did not answer within 0.3 s"):
                await reader.read(60)


async def test_token_file_is_sent_never_shown(tmp_path: Path) -> None:
    seen: list[str] = []

    async def refuse(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.Response(status=401, text="Unauthorized")

    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    async with harness.answering(refuse) as url:
        source = prometheus.Source(url=f"{url}/", token_file=token)
        async with prometheus.Client(source) as client:
            with pytest.raises(UsageUnavailable) as caught:
                await client.vector("up", 0.0)
        assert seen == ["Bearer s3cret-token"]
        assert "refused the credentials (HTTP 401)" in str(caught.value)
        assert "s3cret" not in str(caught.value)
        with_password = url.replace("http://", "http://user:hunter2@")
        async with prometheus.Client(prometheus.Source(url=with_password)) as client:
            with pytest.raises(UsageUnavailable) as caught:
                await client.vector("up", 0.0)
        assert seen[1].startswith("Basic ") and "hunter2" not in str(caught.value)
        with pytest.raises(ValidationError, match="either in its URL or as a token file"):
            prometheus.Source(url=with_password, token_file=token)
        both = prometheus.Source.model_construct(url=with_password, token_file=token)
        with pytest.raises(UsageUnavailable, match="either in its URL or as a token file"):
            prometheus.Client(both)
        missing = prometheus.Source(url=url, token_file=tmp_path / "no")
        async with prometheus.Client(missing) as client:
            with pytest.raises(UsageUnavailable, match="cannot read the token file"):
                await client.vector("up", 0.0)


async def test_server_failure_is_named() -> None:
    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=503, text="Service Unavailable\n")

    async with (
        harness.answering(broken) as url,
        prometheus.Client(prometheus.Source(url=url)) as client,
    ):
        with pytest.raises(UsageUnavailable, match=r"failed: HTTP 503 Service Unavailable$"):
            await client.vector("up", 0.0)


async def test_large_answer_in_many_chunks_is_read_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer of 50,000 series (3.7 MB) written in 64 KiB chunks with pauses between
    them, as a real Prometheus streams a large vector: every series comes back."""
    series = 50_000
    result = [
        {
            "metric": {"Hostname": f"node-{i // 8:05d}", "gpu": str(i % 8)},
            "value": [1.0, str(i % 97)],
        }
        for i in range(series)
    ]
    body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        data = body.encode()
        for start in range(0, len(data), 64 << 10):
            await response.write(data[start : start + (64 << 10)])
            await asyncio.sleep(0.002)
        await response.write_eof()
        return response

    async with harness.answering(chunked) as url:
        source = prometheus.Source(url=url, metrics="dcgm")
        async with prometheus.Reader(source) as reader:
            loads = await reader.gpu_loads(60)
    assert len(body) > 3_000_000
    assert sum(len(gpus) for gpus in loads.values()) == series
    assert loads["node-00010"][3].utilization == pytest.approx(((10 * 8 + 3) % 97) / 100)
    monkeypatch.setattr(prometheus, "MAX_BODY", 1 << 20)  # past the bound: refused, not cut
    async with (
        harness.answering(chunked) as url,
        prometheus.Client(prometheus.Source(url=url)) as client,
    ):
        with pytest.raises(UsageUnavailable, match="answered over 1048576 bytes"):
            await client.vector("up", 0.0)


@pytest.mark.parametrize(
    "url", ["prometheus.monitoring:9090", "ftp://prom", "http://", "/api", "", "http:///x"]
)
def test_a_url_without_http_scheme_and_host_is_refused(url: str) -> None:
    with pytest.raises(ValidationError, match=r"is not an http\(s\) URL with a host"):
        prometheus.Source(url=url)
    secret = prometheus.Source.model_construct(url="ftp://user:hunter2@prom")
    with pytest.raises(UsageUnavailable, match=r"is not an http\(s\) URL") as caught:
        prometheus.Client(secret)
    assert "hunter2" not in str(caught.value)
    assert prometheus.Source(url="https://prom.example/prefix/").url.endswith("/prefix/")


def many_gpus_text() -> str:
    """The node agent's GPU series of 500 nodes of 8 GPUs: 4,000 series a metric."""
    lines = []
    for name, value in ((names.GPU_UTILIZATION, "0.5"), (names.GPU_MEMORY_USED, "1073741824")):
        lines.append(f"# TYPE {name} gauge")
        lines.extend(
            f'{name}{{node="n{node:03d}",gpu="{gpu}",uuid="GPU-{node}-{gpu}"}} {value}'
            for node in range(500)
            for gpu in range(8)
        )
    return "\n".join(lines) + "\n"


async def test_real_prometheus_answer_of_thousands_of_series(tmp_path: Path) -> None:
    """A real Prometheus' answers for 4,000 GPUs (about 0.5 MB each, which it streams in
    several chunks): every GPU is read, by the sidecar's loads and by `read` alike."""
    with contextlib.ExitStack() as stack:
        agent = stack.enter_context(harness.serve_metrics(many_gpus_text))
        job = {"static": {"targets": [agent.target]}, "honor_labels": True}
        prom = await asyncio.to_thread(
            stack.enter_context, harness.run_prometheus(tmp_path, {"agent": job})
        )
        await asyncio.to_thread(prom.wait_for, f"count({names.GPU_UTILIZATION})", 4000)
        await asyncio.to_thread(prom.wait_for, f"count_over_time({names.GPU_UTILIZATION}[1m])", 3)
        source = prometheus.Source(url=prom.url, step_seconds=1)
        async with prometheus.Reader(source) as reader:
            loads = await reader.gpu_loads(30)
            usage = await reader.read(30)
    assert sum(len(gpus) for gpus in loads.values()) == 4000
    assert loads["n499"][7] == GpuLoad("n499", 7, 0.5, GIB)
    assert len(usage.gpus) == 4000 and usage.gpus[0].memory_peak_bytes == GIB
