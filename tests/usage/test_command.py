"""`gpuplace usage` and `gpuplace explain --prometheus` end to end: the local API server
holds the pods and their grants, a real Prometheus their use."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpuplace import cli
from gpuplace.cluster import assignments
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.placement.ledger import Grant
from tests.extender.test_explain import place
from tests.usage import harness, scenario


@pytest.fixture
def cluster() -> Iterator[localapi.ThreadedServer]:
    with localapi.serve_in_thread() as server:

        def build() -> None:
            api = server.api
            for node in ("h-a", "h-b", "d-a"):
                api.create(objects.node(node, gpus=3))
            place(api, "train", "h-a", (0,), 50, memory="40Gi")
            place(api, "idle", "h-a", (1,), 100, memory="24Gi")
            place(api, "short", "h-b", (0,), 20, memory="10Gi")
            place(api, "train-d", "d-a", (0,), 50, memory="20Gi")
            place(api, "infer-d", "d-a", (0,), 50, memory="20Gi")
            place(api, "solo-d", "d-a", (1,), 100, memory="40Gi")
            place(api, "unlabelled-d", "d-a", (2,), 100, memory="40Gi")
            api.create(objects.pod("waiting", percent=30))

        server.call(build)
        yield server


def run(cluster: localapi.ThreadedServer, tmp_path: Path, prom_url: str, *args: str) -> int:
    config = cluster.server.kubeconfig(tmp_path / "kubeconfig")
    return cli.main(
        [
            *args,
            *("--prometheus", prom_url, "--at", str(scenario.T_END), "--step", "1m"),
            *("--kubeconfig", str(config)),
        ]
    )


def test_usage_table(
    cluster: localapi.ThreadedServer,
    prom: harness.Prometheus,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(cluster, tmp_path, prom.url, "usage", "--window", "1h") == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("Asked vs used over 3600 s (gpuplace metrics)")
    header = next(line for line in lines if line.startswith("POD"))
    assert header.split()[:4] == ["POD", "NODE", "GPU", "ASKED"]
    idle = next(line for line in lines if line.startswith("default/idle "))
    assert idle.split()[:8] == [
        "default/idle",
        "h-a",
        "1",
        "100%",
        "24.0Gi",
        "6.0Gi",
        "5.8Gi",
        "21%",
    ]
    assert (
        'default/idle  memory: peak 6.0Gi of 24.0Gi asked; write gpuplace.io/gpu-memory: "8Gi"'
        in out
    )
    assert (
        'default/idle  compute: p95 20% of 100% asked; write gpuplace.io/gpu-percent: "25"' in out
    )
    assert "default/short: 5 samples in the window, fewer than 20" in out
    assert "default/train  memory" not in out and "default/waiting" not in out
    node = next(line for line in lines if line.startswith("h-a ") and "150%" in line)
    assert node.split()[:5] == ["h-a", "2", "2", "150%", "64.0Gi"]


def test_usage_json_dcgm_and_namespace(
    cluster: localapi.ThreadedServer,
    prom: harness.Prometheus,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ("usage", "--metrics", "dcgm", "-o", "json", "--namespace", "default")
    assert run(cluster, tmp_path, prom.url, *args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["source"] == "dcgm"
    rows = {row["pod"]: row for row in data["pods"] if row["node"] == "d-a"}
    assert rows["train-d"]["shared"] and rows["infer-d"]["shared"]
    assert rows["unlabelled-d"]["memory_peak_bytes"] == 30000 * scenario.MIB
    lines = sorted(item["line"] for item in data["over"])
    assert lines == ['gpuplace.io/gpu-memory: "3Gi"', 'gpuplace.io/gpu-percent: "25"']
    assert {item["pod"] for item in data["over"]} == {"solo-d"}
    assert run(cluster, tmp_path, prom.url, "usage", "-o", "json", "-n", "elsewhere") == 0
    assert json.loads(capsys.readouterr().out)["pods"] == []


def test_explain_shows_asked_vs_used(
    cluster: localapi.ThreadedServer,
    prom: harness.Prometheus,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(cluster, tmp_path, prom.url, "explain", "default/idle") == 0
    out = capsys.readouterr().out
    assert "Running on node h-a with GPU 1" in out
    assert "Asked vs used over 3600 s (gpuplace metrics):" in out
    assert 'write gpuplace.io/gpu-memory: "8Gi"' in out
    assert run(cluster, tmp_path, prom.url, "explain", "default/train", "-o", "json") == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["usage"]["pods"]
    assert row["memory_peak_bytes"] == 21 * scenario.GIB and data["usage"]["over"] == []
    assert run(cluster, tmp_path, prom.url, "explain", "default/waiting") == 0
    assert "no gpuplace grant recorded on this pod" in capsys.readouterr().out


def test_prometheus_down_is_a_clear_error(
    cluster: localapi.ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    down = f"http://127.0.0.1:{harness.free_port()}"
    assert run(cluster, tmp_path, down, "usage") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpuplace usage: Prometheus at {down} cannot be reached")
    assert "Traceback" not in err
    assert run(cluster, tmp_path, down, "explain", "default/idle") == 2
    captured = capsys.readouterr()
    assert "Running on node h-a" in captured.out  # the explanation still comes
    assert "gpuplace explain: asked vs used: Prometheus at" in captured.err
    assert run(cluster, tmp_path, "ftp://nowhere", "usage") == 2
    assert "is not an http(s) URL" in capsys.readouterr().err


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["usage", "--prometheus", "http://x", "--window", "an hour"])
    assert exit_.value.code == 2
    assert "'an hour' is not a duration such as 1h" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["usage"], ["explain", "default/idle"]])
def test_a_bad_prometheus_url_is_refused_before_connecting(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No scheme: one line, exit 2, and the API is never reached (the kubeconfig named
    does not even exist)."""
    missing = str(tmp_path / "no-kubeconfig")
    args = [*command, "--prometheus", "prometheus.monitoring:9090", "--kubeconfig", missing]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err == (
        f"gpuplace {command[0]}: the Prometheus URL 'prometheus.monitoring:9090' is not an "
        "http(s) URL with a host (e.g. http://prometheus.monitoring:9090)\n"
    )


def test_finished_job_pod_does_not_hide_the_over_asker(
    cluster: localapi.ThreadedServer,
    prom: harness.Prometheus,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A Job's pod that ran on solo-d's GPU and finished a day before the window (the API
    keeps it, Succeeded) and one reserved there but not bound: with dcgm, solo-d is still
    the GPU's only holder, judged and named."""

    def more() -> None:
        api = cluster.server.api
        place(api, "job-done", "d-a", (1,), 100, memory="40Gi")
        finished = assignments.rfc3339(datetime.fromtimestamp(scenario.T_END - 86400, tz=UTC))
        status = {
            "phase": "Succeeded",
            "containerStatuses": [
                {"name": "main", "state": {"terminated": {"exitCode": 0, "finishedAt": finished}}}
            ],
        }
        api.patch("pods", "job-done", {"status": status}, "default", subresource="status")
        api.create(objects.pod("reserved", percent=100))
        grant = Grant(
            api.get("pods", "reserved", "default")["metadata"]["uid"], "d-a", (1,), 1000, 0
        )
        notes = assignments.annotations_for(grant, None, datetime(2026, 1, 1, tzinfo=UTC))
        api.patch("pods", "reserved", {"metadata": {"annotations": notes}}, "default")

    cluster.call(more)
    assert run(cluster, tmp_path, prom.url, "usage", "--metrics", "dcgm", "-o", "json") == 0
    data = json.loads(capsys.readouterr().out)
    assert {(item["pod"], item["line"]) for item in data["over"]} == {
        ("solo-d", 'gpuplace.io/gpu-memory: "3Gi"'),
        ("solo-d", 'gpuplace.io/gpu-percent: "25"'),
    }
    assert sorted(data["outside"]) == [
        "default/job-done: ended before the window",
        "default/reserved: not bound to its node",
    ]
    gpu1 = next(row for row in data["gpus"] if (row["node"], row["gpu"]) == ("d-a", 1))
    assert (gpu1["pods"], gpu1["asked_percent"]) == (1, 100)
