"""`gpuplace demo`: end to end as a real process, and its parts in process (the same seed
gives the same placements; the played kube-scheduler's texts are kube-scheduler's)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from gpuplace.dev.demo import reporting, running, scenario, scheduling
from tests import c_helpers_built
from tests.webhook import helpers

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REFUSED = {
    "research/typo",
    "research/fifty",
    "research/huge-model",
    "research/half-of-two",
    "research/grab-gpus",
}
GANG = {f"platform/ddp-resnet-{i}" for i in range(4)}


def _table(stdout: str) -> dict[str, list[str]]:
    """POD → the table row's cells (split on runs of 2+ spaces)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("POD "))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells
    return rows


@pytest.fixture(scope="module")
def demo_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path, float]:
    cwd = tmp_path_factory.mktemp("demo")
    began = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "gpuplace.cli", "demo", "--seed", "3", "--width", "200"],
        cwd=cwd,
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(helpers.REPO)},
    )
    return completed, cwd, time.monotonic() - began


def test_demo_runs_end_to_end_and_exits_cleanly(
    demo_run: tuple[subprocess.CompletedProcess[str], Path, float],
) -> None:
    completed, cwd, elapsed = demo_run
    assert completed.returncode == 0, completed.stderr
    assert elapsed < 60
    assert "Traceback" not in completed.stdout + completed.stderr
    # the only stderr lines are the progress line's (no log warnings, no asyncio complaints),
    # and, on an install without a C compiler, the sidecar's notice of its C helpers
    others = [
        line
        for line in completed.stderr.splitlines()
        if not line.startswith("gpuplace demo") and not c_helpers_built.is_expected_notice(line)
    ]
    assert others == [], others
    assert "[47/47]" in completed.stderr
    assert "PLAYS kube-apiserver" in completed.stdout and "kube-scheduler" in completed.stdout
    plot = cwd / "gpuplace-demo.png"
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert f"written to {plot.resolve()}" in completed.stdout


def test_demo_table_shows_placed_refused_pending_and_the_gang(
    demo_run: tuple[subprocess.CompletedProcess[str], Path, float],
) -> None:
    completed, _, _ = demo_run
    rows = _table(completed.stdout)
    assert set(rows) == {submission.key for submission in scenario.submissions()}
    results = {pod: cells[2] for pod, cells in rows.items()}
    assert {pod for pod, result in results.items() if result == "refused"} == REFUSED
    assert all(results[pod] == "placed" for pod in GANG)
    assert results["platform/sweep-0"] == results["platform/sweep-1"] == "waiting"
    assert results["serving/t4-batch"] == "pending"
    assert sum(result == "placed" for result in results.values()) == 39
    # memory-only shares: placed, packed onto one GPU, shown as such, warned about
    evals = [rows[f"research/eval-{i}"] for i in (1, 2)]
    assert all(cells[2] == "placed" and cells[5] == "memory only 9Gi" for cells in evals)
    assert evals[0][3:5] == evals[1][3:5]
    assert evals[0][1] == "memory 9Gi"
    # the gang is planned as one: every member on its plan, together
    assert all("planned as one" in rows[pod][-1] for pod in GANG)
    # the refusals are the webhook's, as kubectl prints them
    out = completed.stdout
    assert "did you mean gpu-percent?" in out
    assert "the largest has 79Gi" in out  # 80 GiB less the 1 GiB margin (no node agent)
    assert (
        'admission webhook "validate.gpuplace.io" denied the request: gpuplace.io/assigned' in out
    )
    # the pending pod says why: kube-scheduler's event, the extender's, and explain
    assert "FailedScheduling (from gpuplace): 0/36 nodes are available:" in out
    assert "FailedGpuPlacement" in out and "$ gpuplace explain serving/t4-batch" in out
    # the audit log: one line per review (a mutate denial ends the review)
    audit = [line for line in out.splitlines() if re.match(r"  \d\d:\d\d:\d\d\.\d{3}  ", line)]
    assert len(audit) == 2 * 47 - 3
    assert "fully allocated (1 by memory-only shares)" in out
    warned = [line for line in audit if "research/eval-" in line and " mutate " in line]
    assert len(warned) == 2
    assert all("memory-only share: 9216 MiB of GPU memory and no compute" in w for w in warned)
    assert sum(" denied " in line for line in audit) == 5


def test_demo_placements_never_oversubscribe_a_gpu(
    demo_run: tuple[subprocess.CompletedProcess[str], Path, float],
) -> None:
    """An independent check of the table: per GPU, shares add up to at most 100%, a
    whole GPU is nobody else's and memory-only shares share only with each other."""
    rows = _table(demo_run[0].stdout)
    percent: dict[tuple[str, int], Decimal] = defaultdict(Decimal)
    holders: dict[tuple[str, int], list[str]] = defaultdict(list)
    for pod, cells in rows.items():
        if cells[2] != "placed":
            continue
        node, gpus, share = cells[3], cells[4], cells[5]
        indices: list[int] = []
        for part in gpus.split(","):
            low, _, high = part.partition("-")
            indices += range(int(low), int(high or low) + 1)
        whole = "whole" in share
        if whole and "×" in share:
            assert int(share.split("×")[0]) == len(indices)
        memory_only = share.startswith("memory only")
        amount = Decimal(100 if whole else 0 if memory_only else share.split("%")[0])
        kind = "WHOLE:" if whole else "MEM:" if memory_only else ""
        for index in indices:
            percent[(node, index)] += amount
            holders[(node, index)].append(kind + pod)
    for gpu, total in percent.items():
        assert total <= 100, (gpu, holders[gpu])
        if any(holder.startswith("WHOLE:") for holder in holders[gpu]):
            assert len(holders[gpu]) == 1, (gpu, holders[gpu])
        if any(holder.startswith("MEM:") for holder in holders[gpu]):
            # memory-only shares keep their GPU to themselves
            assert all(holder.startswith("MEM:") for holder in holders[gpu]), holders[gpu]


def test_demo_help_explains_what_it_does() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "gpuplace.cli", "demo", "--help"],
        capture_output=True,
        check=False,
        text=True,
        timeout=30,
        cwd=helpers.REPO,
    )
    assert completed.returncode == 0
    text = " ".join(completed.stdout.split())
    for words in (
        "no cluster needed",
        "plays kube-apiserver and kube-scheduler",
        "--seed",
        "--plot",
        "--scene {pods,queues,all}",
        "an elastic gang that starts with the members that fit and grows as GPUs free",
    ):
        assert words in text


# --- in process ----------------------------------------------------------------------------


@contextlib.contextmanager
def contended() -> Iterator[None]:
    """A thread that competes for the GIL while the block runs: the event loop gets about
    half the time and waits for its turns, as on a loaded machine."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, name="test-contention")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # shorter waits for the GIL: the run stays a few seconds
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


@pytest.mark.parametrize("policy", ["default", "random"])
async def test_the_same_seed_gives_the_same_placements_on_a_loaded_machine(policy: str) -> None:
    def placements(outcome: running.Outcome) -> list[tuple[str, ...]]:
        return [
            (row.pod, row.result, row.node, row.gpus, row.share) for row in reporting.rows(outcome)
        ]

    first = await running.Demo(seed=11, policy=policy, progress=lambda _: None).run()
    with contended():
        second = await running.Demo(seed=11, policy=policy, progress=lambda _: None).run()
    assert placements(first) == placements(second)
    assert first.timings["total_seconds"] < 15
    # nothing it started is left running
    await asyncio.sleep(0)
    assert [task for task in asyncio.all_tasks() if task is not asyncio.current_task()] == []


def test_failed_scheduling_text_is_kube_schedulers() -> None:
    reasons = {
        "a": [scheduling.AFFINITY],
        "b": [scheduling.AFFINITY],
        "c": ["Insufficient cpu", "Insufficient gpuplace.io/gpu-percent"],
        "d": ["gpuplace: not enough whole GPUs free"],
    }
    assert scheduling.failed_message(4, reasons) == (
        "0/4 nodes are available: 1 Insufficient cpu, 1 Insufficient gpuplace.io/gpu-percent, "
        "1 gpuplace: not enough whole GPUs free, "
        "2 node(s) didn't match Pod's node affinity/selector."
    )


def test_node_resources_fit_counts_requests_against_allocatable() -> None:
    allocatable = {"cpu": "4", "memory": "8Gi", "pods": "2", "gpuplace.io/gpu-percent": "200"}
    used = {"pods": Decimal(1), "cpu": Decimal("3.5"), "gpuplace.io/gpu-percent": Decimal(150)}
    wanted = {"cpu": Decimal("0.5"), "gpuplace.io/gpu-percent": Decimal(50)}
    assert scheduling._fit_reasons(wanted, allocatable, used) == []
    more = {"cpu": Decimal("0.6"), "gpuplace.io/gpu-percent": Decimal(51), "x.io/y": Decimal(1)}
    assert scheduling._fit_reasons(more, allocatable, used) == [
        "Insufficient cpu",
        "Insufficient gpuplace.io/gpu-percent",
        "Insufficient x.io/y",
    ]
    full = {"pods": Decimal(2)}
    assert scheduling._fit_reasons({}, allocatable, full) == [scheduling.TOO_MANY_PODS]
