"""`gpuplace simulate` end to end: bundled default, outputs, and errors a person reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuplace import cli
from gpuplace.replay import in_time

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuplace.cli", "simulate", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_bundled_default_prints_a_row_per_policy(tmp_path: Path) -> None:
    decisions = tmp_path / "decisions.jsonl"
    figures = tmp_path / "figures.json"
    plot = tmp_path / "plot.png"
    assert cli.main(["simulate", "--policy", "default", "--decisions", str(decisions)]) == 0
    lines = [json.loads(line) for line in decisions.read_text().splitlines()]
    assert [line["seq"] for line in lines] == list(range(len(lines)))
    keys = {
        "seq",
        "pod",
        "cpu_milli",
        "memory_mib",
        "num_gpu",
        "gpu_milli",
        "gpu_spec",
        "gpu_memory_mib",
        "memory_only",
        "node",
        "gpus",
    }
    assert all(set(line) == keys for line in lines)
    placed = [line for line in lines if line["node"] is not None]
    assert placed and all(len(line["gpus"]) == line["num_gpu"] for line in placed)
    assert any(line["node"] is None for line in lines)  # the list asks for 130%: some rejected
    code = cli.main(
        ["simulate", "--policy", "fgd,best-fit", "--json", str(figures), "--plot", str(plot)]
    )
    assert code == 0
    document = json.loads(figures.read_text())
    assert [r["policy"] for r in document["runs"]] == ["fgd", "best-fit"]
    assert 0 < document["runs"][0]["allocation_at_100"] <= 100
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decisions_replay_independently_without_oversubscription(tmp_path: Path) -> None:
    """An independent checker: re-apply every decision and check every GPU and node."""
    decisions = tmp_path / "d.jsonl"
    assert (
        cli.main(["simulate", "--seed", "3", "--via-extender", "--decisions", str(decisions)]) == 0
    )
    nodes: dict[str, dict[str, Any]] = {}
    with (REPO / "gpuplace" / "data" / "nodes.csv").open() as lines:
        next(lines)
        for line in lines:
            name, cpu, memory, gpus, model = line.strip().split(",")
            nodes[name] = {
                "cpu": int(cpu),
                "mem": int(memory),
                "gpus": [1000] * int(gpus),
                "model": model,
            }
    for line in map(json.loads, decisions.read_text().splitlines()):
        if line["node"] is None:
            continue
        node = nodes[line["node"]]
        node["cpu"] -= line["cpu_milli"]
        node["mem"] -= line["memory_mib"]
        if line["gpu_spec"]:
            assert node["model"] in line["gpu_spec"].split("|")
        for index in line["gpus"]:
            node["gpus"][index] -= line["gpu_milli"]
    for node in nodes.values():
        assert node["cpu"] >= 0 and node["mem"] >= 0
        assert all(left >= 0 for left in node["gpus"])


@pytest.mark.parametrize("extender", [False, True])
def test_memory_only_shares_replay_by_memory_and_keep_their_gpus(
    tmp_path: Path, extender: bool
) -> None:
    """--memory-only-shares: every share asks its fraction of a 16 GiB GPU and no compute;
    an independent check of the decisions: no GPU over its memory, a GPU holding
    memory-only shares holds nothing else, and they pack (fewer GPUs than pods)."""
    decisions = tmp_path / "d.jsonl"
    args = ["simulate", "--memory-only-shares", "16384", "--decisions", str(decisions)]
    assert cli.main([*args, *(["--via-extender"] if extender else [])]) == 0
    lines = [json.loads(line) for line in decisions.read_text().splitlines()]
    memory_only = [line for line in lines if line["memory_only"]]
    assert memory_only and all(
        line["num_gpu"] == 1 and line["gpu_memory_mib"] == -(-line["gpu_milli"] * 16384 // 1000)
        for line in memory_only
    )
    held: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for line in lines:
        if line["node"] is not None:
            for index in line["gpus"]:
                held.setdefault((line["node"], index), []).append(line)
    pooled = 0
    for holders in held.values():
        kinds = {line["memory_only"] for line in holders}
        assert len(kinds) == 1, "a memory-only share shared its GPU with a compute share"
        if kinds == {True}:
            pooled += 1
            assert sum(line["gpu_memory_mib"] for line in holders) <= 16384
        else:
            assert sum(line["gpu_milli"] for line in holders) <= 1000
    placed = sum(1 for line in memory_only if line["node"] is not None)
    assert 0 < pooled < placed


def test_memory_only_rows_of_a_pod_list(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(
        "sn,cpu_milli,memory_mib,gpu,model,gpu_memory_mib\nn0,64000,262144,2,T4,16384\n"
    )
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_memory_mib\n"
        "m0,1000,1024,1,0,8192\nm1,1000,1024,1,0,8192\ns0,1000,1024,1,500,0\n"
    )
    decisions = tmp_path / "d.jsonl"
    args = ["--nodes", str(nodes), "--pods", str(pods), "--decisions", str(decisions)]
    assert cli.main(["simulate", *args]) == 0
    lines = {line["pod"]: line for line in map(json.loads, decisions.read_text().splitlines())}
    assert lines["m0"]["memory_only"] and lines["m0"]["gpu_memory_mib"] == 8192
    assert lines["m0"]["gpus"] == lines["m1"]["gpus"] != lines["s0"]["gpus"]


def test_malformed_file_is_one_line_naming_file_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "pods.csv"
    bad.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,500\nq,1,x,1,500\n")
    result = run("--pods", str(bad))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"gpuplace simulate: {bad}:3:3: memory_mib must be an integer, got 'x'"
    )
    assert "Traceback" not in result.stderr
    missing = run("--nodes", str(tmp_path / "nope.csv"))
    assert missing.returncode == 1 and "No such file" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_priorities_run_each_policy_without_and_with_preemption(tmp_path: Path) -> None:
    figures = tmp_path / "figures.json"
    result = run("--policy", "best-fit", "--priorities", "0.1", "--json", str(figures))
    assert result.returncode == 0, result.stderr
    assert "direct+pre" in result.stdout and "sched-wrong" in result.stdout
    runs = json.loads(figures.read_text())["runs"]
    assert [r["preempt"] for r in runs] == [False, True]
    assert runs[0]["preemptions"] == 0 < runs[1]["preemptions"] <= runs[1]["victims"]
    assert runs[1]["high_rejected"] < runs[0]["high_rejected"]
    assert run("--priorities", "2").returncode == 2


def test_the_planner_and_the_dra_allocators_first_fit_replay_side_by_side(
    tmp_path: Path,
) -> None:
    """`--via-planner` decides as the sidecar's planner; dra-first-fit, kube-scheduler's
    own allocator, is decided directly in the same call; both modes are in the JSON."""
    figures = tmp_path / "figures.json"
    args = ["simulate", "--policy", "default,dra-first-fit", "--via-planner"]
    assert cli.main([*args, "--json", str(figures)]) == 0
    runs = json.loads(figures.read_text())["runs"]
    assert [(r["policy"], r["via_planner"]) for r in runs] == [
        ("default", True),
        ("dra-first-fit", False),
    ]
    assert runs[0]["allocation_at_100"] > runs[1]["allocation_at_100"]
    both = run("--via-planner", "--via-extender")
    assert both.returncode == 2 and "not both" in both.stderr


def test_unknown_policy_lists_the_choices() -> None:
    result = run("--policy", "fastest")
    assert result.returncode == 2
    assert "choose from default, fgd, best-fit, first-fit, random" in result.stderr


@pytest.mark.parametrize("flag", ["--help"])
def test_help_documents_the_options(flag: str) -> None:
    result = run(flag)
    for option in (
        "--nodes",
        "--pods",
        "--policy",
        "--seed",
        "--via-extender",
        "--via-planner",
        "--memory-only-shares",
        "--decisions",
        "--priorities",
        "--plot",
        "--json",
        "--queues",
        "--gpus",
        "--fair-sharing-half-life",
        "--hold-after",
    ):
        assert option in result.stdout


# --- --queues: the replay in time ------------------------------------------------------

TIMED_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    "creation_time,deletion_time,scheduled_time"
)
QUEUES = """
apiVersion: gpuplace.io/v1alpha1
kind: GpuQueue
metadata: {name: ls}
spec:
  namespaceSelector: {}
  cohort: trace
  resources: [{name: gpus, nominal: 2}]
---
apiVersion: gpuplace.io/v1alpha1
kind: GpuQueue
metadata: {name: be}
spec:
  namespaceSelector: {}
  cohort: trace
  resources: [{name: gpus, nominal: 2}]
"""


def timed_trace(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Four GPUs; team LS floods them at 0 for 100 s, team BE comes at 10: with queues BE
    gets its two GPUs back at once, without it waits for LS. The figures run to the last
    arrival (200)."""
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,64000,262144,4,A100\n")
    rows = [f"ls{i},1000,1024,1,1000,,LS,Running,0,100,0" for i in range(6)]
    rows += [f"be{i},1000,1024,1,1000,,BE,Running,10,60,10" for i in range(2)]
    rows.append("never,1000,1024,1,1000,,BE,Pending,5,50,")
    rows.append("late,1000,1024,1,1000,,LS,Running,200,210,200")  # the figures end here
    pods = tmp_path / "pods.csv"
    pods.write_text("\n".join([TIMED_HEADER, *rows]) + "\n")
    queues = tmp_path / "queues.yaml"
    queues.write_text(QUEUES)
    return nodes, pods, queues


def test_queues_replay_prints_both_runs_as_json(tmp_path: Path) -> None:
    nodes, pods, queues = timed_trace(tmp_path)
    out = tmp_path / "figures.json"
    args = ["--queues", str(queues), "--nodes", str(nodes), "--pods", str(pods), "--json", str(out)]
    result = run(*args)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document == json.loads(out.read_text())
    assert document["jobs"] == 9  # the pod that never started in production is left out
    assert document["teams"] == {
        "BE": {"queue": "be", "weight": 1.0},
        "LS": {"queue": "ls", "weight": 1.0},
    }
    teams = {run: {t["team"]: t for t in document[run]["teams"]} for run in ("no_queues", "queues")}
    assert teams["queues"]["BE"]["wait_p50_s"] == 0 and teams["no_queues"]["BE"]["wait_p50_s"] == 90
    assert document["queues"]["preemptions"] == 2
    assert document["queues"]["jain"] > document["no_queues"]["jain"]
    assert isinstance(document["allocation_cost_points"], float)


@pytest.mark.parametrize(
    ("change", "message", "code"),
    [
        ("no queue for be", "no GpuQueue for the trace's qos BE (name it 'be')", 1),
        ("weight 0", "GpuQueue ls: weight must be above 0", 1),
        ("no pods", "--queues: it needs --pods (an openb pod list)", 2),
        ("with priorities", "--queues: not with --priorities", 2),
        ("gpus 0", "--gpus takes a number of GPUs above 0", 2),
        ("half-life 0", "--fair-sharing-half-life takes seconds above 0", 2),
        ("hold after -1", "--hold-after takes seconds above 0", 2),
        ("plain pods", "missing column 'qos'", 1),
    ],
)
def test_queues_replay_refuses_what_it_cannot_use(
    tmp_path: Path, change: str, message: str, code: int
) -> None:
    nodes, pods, queues = timed_trace(tmp_path)
    args = ["--queues", str(queues), "--nodes", str(nodes), "--pods", str(pods)]
    if change == "no queue for be":
        queues.write_text(QUEUES.split("---", maxsplit=1)[0])
    elif change == "weight 0":
        queues.write_text(
            QUEUES.replace("  cohort: trace\n", "  cohort: trace\n  weight: '0'\n", 1)
        )
    elif change == "no pods":
        args = ["--queues", str(queues)]
    elif change == "with priorities":
        args += ["--priorities", "0.5"]
    elif change == "gpus 0":
        args += ["--gpus", "0"]
    elif change == "half-life 0":
        args += ["--fair-sharing-half-life", "0"]
    elif change == "hold after -1":
        args += ["--hold-after=-1"]
    elif change == "plain pods":
        pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,1000\n")
    result = run(*args)
    assert result.returncode == code
    assert message in result.stderr


def test_the_queue_settings_reach_the_replay_and_its_json(tmp_path: Path) -> None:
    nodes, pods, queues = timed_trace(tmp_path)
    args = ["--queues", str(queues), "--nodes", str(nodes), "--pods", str(pods)]
    result = run(*args, "--fair-sharing-half-life", "3600", "--hold-after", "60")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["fair_sharing_half_life_seconds"] == 3600
    assert document["hold_after_seconds"] == 60
    assert document["queues"]["holds"] == 0  # 1-GPU pods only: nothing to hold for
    plain = json.loads(run(*args).stdout)
    assert plain["fair_sharing_half_life_seconds"] is None


@pytest.mark.parametrize("name", ["queues-openb.yaml", "queues-openb-over-time.yaml"])
def test_the_bench_queue_files_are_read_as_the_replay_reads_them(name: str) -> None:
    from gpuplace.placement.queueing import quotas

    found = in_time.read_queues(Path(__file__).parents[2] / "bench" / name)
    assert sorted(q.name for q in found) == ["be", "burstable", "guaranteed", "ls"]
    fair = {q.fair_sharing for q in found}
    assert fair == ({quotas.Preemption.ANY} if "over-time" in name else {quotas.Preemption.NEVER})


def test_gpus_without_queues_is_refused() -> None:
    result = run("--gpus", "8")
    assert result.returncode == 2
    assert "--gpus goes with --queues" in result.stderr
