"""deploy/grafana/gpuplace.json loads in Grafana and asks only for what gpuplace exports.

- It is valid against Grafana's published dashboard JSON schema (vendored beside this
  file: grafana/README.md says from where) and has the shape the docs promise: the
  `${datasource}` Prometheus variable on every panel and query, the node and namespace
  variables, the five rows, unique panel ids, panels that do not overlap.
- Every query is PromQL once Grafana's variables are put in: parsed by promql-parser
  (PyPI) and by Prometheus' own `promtool check rules`, where Debian's prometheus package
  is installed (`./dev test` installs it).
- Every metric a query or a variable names is one gpuplace exports: the names are read
  from the real registries of a composed `gpuplace serve` (webhook, sidecar) and
  `gpuplace node-agent` (the agent's own collectors), with the sample suffixes
  prometheus_client gives each type (`_total`, `_bucket`/`_sum`/`_count`), and the GPU
  use names of `gpuplace/usage/names.py` that the node agent exports, and the queue
  controller's (`gpuplace serve --queues`), read from `gpuplace.queues.metrics.QueueMetrics`
  on a fresh registry. A misspelt or missing metric fails (the negative cases below show
  that it does).
- The Queues row asks only for the queue controller's metrics, and for each that it
  registers.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry

from gpuplace.agent import nvml
from gpuplace.commands import node_agent
from gpuplace.dev import localapi
from gpuplace.queues.metrics import QueueMetrics
from gpuplace.usage import names as usage_names
from gpuplace.wiring import composing
from gpuplace.wiring.agent_settings import AgentSettings
from gpuplace.wiring.settings import Settings
from tests.agent.kubelet import gpu_fixture
from tests.deploy import rendering
from tests.webhook import helpers

DASHBOARD = rendering.DEPLOY / "grafana" / "gpuplace.json"
SCHEMA = Path(__file__).resolve().parent / "grafana" / "dashboard.schema.json"
ROWS = ["Allocation", "Fragmentation", "Asked vs used", "Pending GPU pods", "Queues", "Health"]
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
DURATIONS = frozenset({"__rate_interval", "__interval", "__range"})
"""Grafana's built-in variables that stand for a duration in a query."""
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
LABEL_VALUES = re.compile(r"^label_values\((\w+),\s*(\w+)\)$")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
"""The sample names prometheus_client writes for a family of each type (the family's
name has no `_total`)."""

Dashboard = dict[str, Any]


def load() -> Dashboard:
    dashboard: Dashboard = json.loads(DASHBOARD.read_text())
    return dashboard


# --- what gpuplace exports ------------------------------------------------------------


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name `registry` can write: each family's name with its type's suffixes
    (a labelled family with no child yet has no sample, and still exports its name)."""
    return {
        family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]
    }


async def _composed_names() -> set[str]:
    """The sample names of a composed `gpuplace serve` (webhook, sidecar, gang
    controller) and `gpuplace node-agent`, built against the local API and never run."""
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        cert, key = helpers.write_certificate(tmp / "tls")
        async with localapi.serve(localapi.FakeApi()) as api_server:
            settings = Settings(
                webhook_address="127.0.0.1",
                webhook_port=0,
                extender_port=0,
                metrics_address="127.0.0.1",
                metrics_port=0,
                cert_file=cert,
                key_file=key,
                audit_log=str(tmp / "audit.jsonl"),
                kubeconfig=api_server.kubeconfig(tmp / "gpuplace.kubeconfig", localapi.GPUPLACE),
            )
            served = CollectorRegistry()
            process = await composing.compose(settings, served)
            reading = nvml.Replay.load(gpu_fixture("nvml-idle.json")).reading
            (tmp / "nvml.json").write_text(json.dumps(reading))
            agent_settings = AgentSettings(
                node_name="gpu-0",
                kubeconfig=api_server.kubeconfig(tmp / "agent.kubeconfig", localapi.NODE_AGENT),
                nvml_replay=tmp / "nvml.json",
                device_plugin_dir=tmp / "dp",
                mps_root=tmp / "mps",
                metrics_address="127.0.0.1",
                metrics_port=0,
            )
            agents = CollectorRegistry()
            agent = await node_agent.compose(agent_settings, agents, base_env={})
            try:
                return sample_names(served) | sample_names(agents)
            finally:
                assert process.sidecar is not None
                await process.sidecar.api.close()
                await agent.api.close()
                node_agent.close(agent.nvml)


def queue_names() -> set[str]:
    """The sample names the queue controller registers (it runs only with `--queues`, off
    in the composed `serve` above)."""
    registry = CollectorRegistry()
    QueueMetrics(registry)
    return sample_names(registry)


@functools.cache
def exported() -> frozenset[str]:
    """What gpuplace exports: the composed processes' registries, the queue controller's
    and the node agent's GPU use metrics named in gpuplace/usage/names.py."""
    usage = {
        value
        for name, value in vars(usage_names).items()
        if name.isupper() and isinstance(value, str) and value.startswith("gpuplace_")
    }
    assert usage, "gpuplace/usage/names.py names the node agent's GPU use metrics"
    return frozenset(asyncio.run(_composed_names()) | queue_names() | usage)


# --- the dashboard's queries ------------------------------------------------------------


def panels(dashboard: Dashboard) -> Iterator[dict[str, Any]]:
    """Every panel that is not a row, also those inside a collapsed row."""
    for _, panel in placed(dashboard):
        yield panel


def placed(dashboard: Dashboard) -> Iterator[tuple[str, dict[str, Any]]]:
    """(title of its row, panel) of every panel that is not a row: the row it is in
    (collapsed) or under."""
    row = ""
    for panel in dashboard.get("panels", []):
        if panel["type"] == "row":
            row = panel.get("title", "")
            for inner in panel.get("panels", []):
                yield row, inner
        else:
            yield row, panel


def variables(dashboard: Dashboard) -> dict[str, dict[str, Any]]:
    return {variable["name"]: variable for variable in dashboard["templating"]["list"]}


def promql(expr: str, known: set[str], duration: str = "5m") -> str:
    """`expr` with Grafana's variables put in as Grafana would: `duration` for the
    built-in intervals, a regex for the dashboard's own (they stand inside `=~"..."`).
    A variable the dashboard does not define fails."""

    def put(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in DURATIONS:
            return duration
        assert name in known, f"{expr!r} uses ${name}, which the dashboard does not define"
        return ".*"

    return VARIABLE.sub(put, expr)


@dataclass(frozen=True)
class Query:
    row: str
    where: str
    expr: str
    """PromQL, variables put in."""


def queries(dashboard: Dashboard, duration: str = "5m") -> list[Query]:
    """Every panel target's query (see `promql`)."""
    known = set(variables(dashboard))
    return [
        Query(row, f"panel {panel['id']} {panel.get('title', '')!r} {target['refId']}",
              promql(target["expr"], known, duration))
        for row, panel in placed(dashboard)
        for target in panel.get("targets", [])
    ]  # fmt: skip


def metrics_of(expr: str) -> set[str]:
    """The metric names `expr` selects (promql-parser's AST). Raises on bad PromQL."""
    found: set[str] = set()

    def visit(node: promql_parser.Expr) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"{expr!r}: a selector without a metric name"
            found.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def problems(dashboard: Dashboard, names: frozenset[str]) -> list[str]:
    """Each query or variable that names a metric not in `names`, or is not PromQL."""
    found: list[str] = []
    for query in queries(dashboard):
        where = query.where
        try:
            selected = metrics_of(query.expr)
        except (ValueError, RuntimeError, SyntaxError) as error:
            found.append(f"{where}: not PromQL ({error}): {query.expr}")
            continue
        found.extend(f"{where}: {name} is not exported" for name in sorted(selected - names))
    for name, variable in variables(dashboard).items():
        if variable["type"] != "query":
            continue
        match = LABEL_VALUES.match(variable["query"])
        if match is None:
            found.append(f"variable {name}: not label_values(metric, label)")
        elif match.group(1) not in names:
            found.append(f"variable {name}: {match.group(1)} is not exported")
    return found


# --- the tests --------------------------------------------------------------------------


def test_the_dashboard_is_valid_against_grafanas_schema() -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(load())


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["panels"][1]["gridPos"].update(w=25),  # wider than the grid
        lambda d: d["templating"]["list"][1].update(definition="x"),  # not in the schema
        lambda d: d["panels"][0].pop("collapsed"),  # a row must say it
        lambda d: d.pop("annotations"),
    ],
)
def test_the_schema_refuses_what_grafana_would_not_load(break_it: Any) -> None:
    schema = json.loads(SCHEMA.read_text())
    broken = copy.deepcopy(load())
    break_it(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(broken)


def test_the_dashboard_has_the_promised_rows_variables_and_datasource() -> None:
    dashboard = load()
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    assert rows == ROWS
    declared = variables(dashboard)
    assert declared["datasource"]["type"] == "datasource"
    assert declared["datasource"]["query"] == "prometheus"
    assert {"node", "namespace", "queue"} <= set(declared)
    for name in ("node", "namespace", "queue"):
        assert declared[name]["datasource"] == DATASOURCE
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        assert all(target["datasource"] == DATASOURCE for target in panel["targets"])
        assert panel.get("description"), f"{panel['title']}: say what it shows"


def test_no_two_panels_overlap() -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in load()["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


def test_every_query_names_only_metrics_gpuplace_exports() -> None:
    names = exported()
    # the names the dashboard is about, as the registries give them
    assert {
        "gpuplace_ledger_allocated_milligpus",
        "gpuplace_fragmentation_milligpus",
        "gpuplace_pending_pods",
        "gpuplace_api_refusals_total",
        "gpuplace_admission_duration_seconds_bucket",
        "gpuplace_mps_daemon_ready",
    } <= names
    assert problems(load(), names) == []


def test_the_queue_row_asks_only_for_what_the_queue_controller_registers() -> None:
    """Every query of the Queues row names metrics, each one the controller registers; the
    row shows what issue 29 asks for (used vs nominal, borrowed and lent, waiting, the fair
    share, admission and reclaim rates), and the `queue` variable reads a queue metric."""
    registered = queue_names()
    row = [query for query in queries(load()) if query.row == "Queues"]
    assert row
    shown: set[str] = set()
    for query in row:
        selected = metrics_of(query.expr)
        assert selected, query.where
        assert selected <= registered, f"{query.where}: {sorted(selected - registered)}"
        shown |= selected
    assert {
        "gpuplace_queue_used",
        "gpuplace_queue_nominal",
        "gpuplace_queue_borrowed",
        "gpuplace_queue_lent",
        "gpuplace_queue_waiting_workloads",
        "gpuplace_queue_weighted_share",
        "gpuplace_queue_admissions_total",
        "gpuplace_queue_reclaims_total",
    } <= shown
    match = LABEL_VALUES.match(variables(load())["queue"]["query"])
    assert match is not None
    assert match.groups() == ("gpuplace_queue_nominal", "queue")
    assert match.group(1) in registered


@pytest.mark.parametrize(
    ("expr", "unknown"),
    [
        ("max(gpuplace_ledger_alocated_milligpus)", "gpuplace_ledger_alocated_milligpus"),
        ("sum(rate(gpuplace_admission_reviews[5m]))", "gpuplace_admission_reviews"),
        (
            "histogram_quantile(0.9, sum by (le) (rate(gpuplace_ledger_nodes_bucket[5m])))",
            "gpuplace_ledger_nodes_bucket",
        ),
        ("sum(gpuplace_pod_gpu_memory_used)", "gpuplace_pod_gpu_memory_used"),
        ("max(gpuplace_queue_borrowed_gpus)", "gpuplace_queue_borrowed_gpus"),
    ],
)
def test_a_panel_naming_a_metric_gpuplace_does_not_export_fails(expr: str, unknown: str) -> None:
    broken = copy.deepcopy(load())
    next(panels(broken))["targets"][0]["expr"] = expr
    assert [p for p in problems(broken, exported()) if unknown in p]


def test_a_query_that_is_not_promql_or_uses_an_undefined_variable_fails() -> None:
    broken = copy.deepcopy(load())
    next(panels(broken))["targets"][0]["expr"] = "max(gpuplace_pending_pods"
    assert [p for p in problems(broken, exported()) if "not PromQL" in p]
    next(panels(broken))["targets"][0]["expr"] = 'max(gpuplace_pending_pods{node=~"$nod"})'
    with pytest.raises(AssertionError, match=r"\$nod"):
        problems(broken, exported())
    variable = variables(broken)["node"]
    variable["query"] = "label_values(gpuplace_gpu_memory_totl_bytes, node)"
    broken["panels"] = []
    assert problems(broken, exported()) == [
        "variable node: gpuplace_gpu_memory_totl_bytes is not exported"
    ]


def test_prometheus_own_parser_accepts_every_query(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package, which ./dev test installs) absent")
    rules = [
        {"record": f"dashboard:query_{i}", "expr": query.expr}
        for i, query in enumerate(queries(load()))
    ]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules)} rules found" in done.stdout
    # and it does refuse what is not PromQL
    bad = {"record": "dashboard:bad", "expr": "sum(rate(gpuplace_pending_pods[5m])"}
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [bad]}]}))
    refused = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert refused.returncode != 0


def test_the_kustomization_ships_the_dashboard_to_grafanas_sidecar() -> None:
    """`kubectl apply -k deploy/grafana`: one ConfigMap with the sidecar's label, holding
    the dashboard byte for byte."""
    objects = rendering.render("grafana")
    config_map = rendering.one(objects, "ConfigMap", "gpuplace-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "gpuplace"
    assert config_map["data"] == {"gpuplace.json": DASHBOARD.read_text()}
    assert len(objects) == 1
