"""The dashboard's asked-vs-used panels (deploy/grafana/gpuplace.json) run by a real
Prometheus over the node agent's series, scraped twice (two jobs, as a second scrape
config or a PodMonitor beside a ServiceMonitor would): each figure counts once, as in
`gpuplace usage`, and no ratio is +Inf or NaN for a pod granted no memory (a compute
share that asks none) or no SM share (a memory-only share)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from gpuplace.usage import names
from tests.usage import harness

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "gpuplace.json"
GIB = 1 << 30
PODS = {
    # pod: (memory used, memory granted, SM used, share granted)
    "full": (4 * GIB, 8 * GIB, 0.25, 0.5),
    "compute-only": (1 * GIB, 0, 0.1, 0.25),
    "memory-only": (2 * GIB, 4 * GIB, 0.05, 0.0),
}


def agent_text() -> str:
    registry = CollectorRegistry()
    gpu = {"node": "n1", "gpu": "0", "uuid": "GPU-n1-0"}
    metrics = (
        names.POD_MEMORY_USED,
        names.POD_MEMORY_GRANTED,
        names.POD_SM_UTILIZATION,
        names.POD_SHARE_GRANTED,
    )
    gauges = [Gauge(name, name, names.POD_LABELS, registry=registry) for name in metrics]
    for pod, values in PODS.items():
        labels = {**gpu, "namespace": "team", "pod": pod}
        for gauge, value in zip(gauges, values, strict=True):
            gauge.labels(**labels).set(value)
    for name, value in (
        (names.GPU_MEMORY_USED, 7.0 * GIB),
        (names.GPU_MEMORY_TOTAL, 80.0 * GIB),
        (names.GPU_UTILIZATION, 0.4),
    ):
        Gauge(name, name, names.GPU_LABELS, registry=registry).labels(**gpu).set(value)
    return generate_latest(registry).decode()


@pytest.fixture(scope="module")
def twice(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Prometheus]:
    harness.require_prometheus()
    with harness.serve_metrics(agent_text) as agent:
        job = {"static": {"targets": [agent.target]}, "honor_labels": True}
        workdir = tmp_path_factory.mktemp("dashboard")
        with harness.run_prometheus(workdir, {"agent": job, "agent-again": job}) as prom:
            prom.wait_for(f"count(count by (job) ({names.POD_MEMORY_USED}))", 2)
            yield prom


def queries(title: str) -> dict[str, str]:
    """legendFormat -> expr of the panel titled `title`, Grafana's variables put in."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for item in items:
            yield item
            yield from panels(item.get("panels", []))

    dashboard = json.loads(DASHBOARD.read_text())
    (panel,) = [item for item in panels(dashboard["panels"]) if item.get("title") == title]
    return {
        target["legendFormat"]: target["expr"].replace("$namespace", ".*").replace("$node", ".*")
        for target in panel["targets"]
    }


def values(prom: harness.Prometheus, expr: str, by: str) -> dict[str, float]:
    return {item["metric"].get(by, ""): float(item["value"][1]) for item in prom.query(expr)}


def test_asked_vs_used_panels_count_each_series_once(twice: harness.Prometheus) -> None:
    memory = queries("GPU memory: granted vs used, by namespace")
    assert [values(twice, expr, "namespace") for expr in memory.values()] == [
        {"team": 12.0 * GIB},
        {"team": 7.0 * GIB},
    ]
    compute = queries("Compute: granted vs used, by namespace (GPUs)")
    found = [values(twice, expr, "namespace")["team"] for expr in compute.values()]
    assert found == pytest.approx([0.75, 0.4])
    node = queries("GPU memory used, by node")
    assert [values(twice, expr, "node") for expr in node.values()] == [{"n1": 7 / 80}]
    util = queries("GPU utilization, by node")
    assert [values(twice, expr, "node") for expr in util.values()] == [{"n1": 0.4}]


def test_ratios_leave_out_what_was_not_granted(twice: harness.Prometheus) -> None:
    least = queries("Pods using the least of their grant")
    memory, sm = (values(twice, expr, "pod") for expr in least.values())
    assert memory == {"full": 0.5, "memory-only": 0.5}  # compute-only asked no memory
    assert sm == pytest.approx({"full": 0.5, "compute-only": 0.4})  # memory-only: no SM share
    assert all(math.isfinite(value) for value in (*memory.values(), *sm.values()))
