"""One real Prometheus for the usage tests (per session): it scrapes the two fixture
exporters every second and holds the backfilled history of `tests.usage.scenario`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuplace.usage import names
from tests.usage import harness, scenario


@dataclass
class Setup:
    prometheus: harness.Prometheus
    dcgm: harness.Exporter
    agent: harness.Exporter


@pytest.fixture(scope="session")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    harness.require_prometheus()
    workdir: Path = tmp_path_factory.mktemp("prometheus")
    with (
        harness.serve_metrics(scenario.dcgm_text) as dcgm,
        harness.serve_metrics(scenario.agent_text) as agent,
    ):
        jobs: dict[str, dict[str, Any]] = {
            # the scrape's own pod/namespace target labels (as a kubernetes_sd relabel
            # would add): Prometheus renames dcgm-exporter's to exported_pod/_namespace
            "dcgm": {
                "static": {
                    "targets": [dcgm.target],
                    "labels": {"pod": "dcgm-exporter-x7k2p", "namespace": "gpu-operator"},
                }
            },
            "agent": {"static": {"targets": [agent.target]}},
        }
        with harness.run_prometheus(workdir, jobs, scenario.history()) as prometheus:
            prometheus.wait_for(f"count_over_time({names.DCGM_FB_USED}[1m])", 3)
            prometheus.wait_for(f"count_over_time({names.POD_MEMORY_USED}[1m])", 3)
            yield Setup(prometheus, dcgm, agent)


@pytest.fixture
def prom(setup: Setup) -> harness.Prometheus:
    return setup.prometheus
