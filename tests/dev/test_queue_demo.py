"""`gpuplace demo --scene queues`: two teams' GpuQueues in one cohort on one 8-GPU node, on
the real queue controller (webhook, extender, gang and queue controllers of `gpuplace
serve --queues`). What the scene shows is read back from the API after each step; these
tests check it against docs/queues.md's rules and the invariants of issue 29: quota never
exceeded, no admitted pod without a GPU, a gang admitted whole (an elastic one with at
least gang-min), a reclaim evicting only what is needed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gpuplace.cluster import keys
from gpuplace.cluster.gang_marks import gated
from gpuplace.dev.demo import queue_reporting, queue_running, queue_scene
from gpuplace.dev.demo.queue_running import QueueOutcome, Seen
from tests import c_helpers_built
from tests.webhook import helpers

GPUS = 8
WIDTH = 120


@pytest.fixture(scope="module")
def scene() -> QueueOutcome:
    demo = queue_running.QueueDemo(seed=1, policy="default", progress=lambda _: None)
    return asyncio.run(demo.run())


def name(pod: dict[str, Any]) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


def live(pod: dict[str, Any]) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return phase not in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp")


def running(seen: Seen) -> dict[str, list[int]]:
    """Pods that hold GPUs after the step: name -> GPU indices (from their assignment)."""
    held = {}
    for pod in seen.pods:
        annotations = pod["metadata"].get("annotations") or {}
        if live(pod) and (pod.get("spec") or {}).get("nodeName"):
            held[name(pod)] = [int(i) for i in annotations[keys.ASSIGNED_GPUS].split(",")]
    return held


def waiting(seen: Seen) -> set[str]:
    return {name(pod) for pod in seen.pods if live(pod) and gated(pod, keys.QUEUE_GATE)}


def line(seen: Seen, queue: str) -> dict[str, str]:
    """The `gpus` line of the queue's status as the controller wrote it."""
    found = next(q for q in seen.queues if q["metadata"]["name"] == queue)
    return dict(found["status"]["resources"][0])


def reasons(seen: Seen, reason: str) -> list[tuple[str, str]]:
    """(pod, message) of the step's Events with `reason`."""
    return [
        (f"{e['involvedObject']['namespace']}/{e['involvedObject']['name']}", e["message"])
        for e in seen.events
        if e["reason"] == reason
    ]


def test_the_scene_plays_every_step_and_refuses_nothing(scene: QueueOutcome) -> None:
    assert [seen.step for seen in scene.steps] == queue_scene.steps()
    assert all(not admitted.refused for seen in scene.steps for admitted in seen.admitted)
    # every pod went through the real webhook, which put it behind the queue gate
    for seen in scene.steps:
        for admitted in seen.admitted:
            assert admitted.pod is not None
            assert gated(admitted.pod, keys.QUEUE_GATE), admitted.submission.key
    assert scene.node["metadata"]["name"] == queue_scene.NODE


def test_team_a_borrows_team_bs_idle_quota(scene: QueueOutcome) -> None:
    first, second = scene.steps[0], scene.steps[1]
    assert sorted(running(first)) == [f"team-a/sweep-{i}" for i in range(4)]
    assert line(first, "team-a") == {
        "name": "gpus",
        "model": "*",
        "used": "4",
        "borrowed": "0",
        "lent": "0",
    }
    assert sorted(running(second)) == [f"team-a/sweep-{i}" for i in range(6)]
    assert line(second, "team-a")["borrowed"] == "2"
    assert line(second, "team-b")["lent"] == "2"
    borrowing = [message for _, message in reasons(second, "QueueAdmitted")]
    assert len(borrowing) == 2 and all("borrowing from cohort research" in m for m in borrowing)


def test_team_bs_pod_reclaims_exactly_the_borrowed_pods_needed(scene: QueueOutcome) -> None:
    before, third = scene.steps[2], scene.steps[3]
    assert "team-b/train-0" in running(before)
    assert len(running(before)) == 7  # the node is full: 6 + one 2-GPU pod
    # two of team A's pods (the most recently admitted) and no more are preempted
    assert sorted(pod for pod, _ in reasons(third, "GpuPreempted")) == [
        "team-a/sweep-4",
        "team-a/sweep-5",
    ]
    [(claimant, message)] = reasons(third, "QueueReclaiming")
    # in eviction order, the most recently admitted first (sweep-5 came after sweep-4)
    assert claimant == "team-b/train-1" and "team-a/sweep-5, team-a/sweep-4" in message
    # they went, the Job replaced them, and the replacements wait in team A's queue
    held = running(third)
    assert "team-a/sweep-4" not in held and "team-a/sweep-5" not in held
    assert held["team-b/train-1"] == sorted(held["team-b/train-1"])
    assert waiting(third) == {"team-a/sweep-4-retry", "team-a/sweep-5-retry"}
    told = dict(reasons(third, "QueueWaiting"))
    assert "(cohort)" in told["team-a/sweep-4-retry"]
    assert line(third, "team-a")["borrowed"] == "0"
    assert line(third, "team-b")["used"] == "4"
    # the requeued pods are admitted once team A has quota again
    fifth = scene.steps[4]
    assert {"team-a/sweep-4-retry", "team-a/sweep-5-retry"} <= set(running(fifth))
    assert waiting(fifth) == set()


def test_the_elastic_gang_starts_with_what_fits_and_grows(scene: QueueOutcome) -> None:
    small, grown = scene.steps[5], scene.steps[6]
    members = {f"team-a/ddp-{i}" for i in range(4)}
    started = members & set(running(small))
    assert len(started) == 2  # gang-min: the queue's quota has room for two
    assert waiting(small) == members - started
    counts = {
        name(pod): str((pod["metadata"].get("annotations") or {}).get(keys.GANG_COUNT))
        for pod in grown.pods
        if name(pod) in members
    }
    assert members <= set(running(grown))
    assert waiting(grown) == set()
    assert sorted(counts.values()) == ["2", "2", "4", "4"]
    assert {counts[pod] for pod in started} == {"2"}
    grew = reasons(grown, "QueueAdmitted")
    assert len(grew) == 2 and all("the elastic gang grows" in message for _, message in grew)


@pytest.mark.parametrize("number", range(1, 8))
def test_after_every_step_quota_holds_and_every_admitted_pod_has_its_gpu(
    scene: QueueOutcome, number: int
) -> None:
    seen = scene.steps[number - 1]
    held = running(seen)
    # no GPU twice (whole GPUs only in this scene), none beyond the node's
    taken = Counter(index for indices in held.values() for index in indices)
    assert all(count == 1 for count in taken.values()), taken
    assert set(taken) <= set(range(GPUS))
    # admitted (ungated) and alive means bound with its GPUs: none waits for a place
    for pod in seen.pods:
        if live(pod) and not gated(pod, keys.QUEUE_GATE):
            assert name(pod) in held, f"{name(pod)} admitted but not placed"
    assert not [line for line in seen.played if "not placed" in line]
    # quota: each queue within its nominal plus what the other lends, the cohort within 8
    use = Counter(pod.split("/")[0] for pod in held for _ in held[pod])
    for team, other in (("team-a", "team-b"), ("team-b", "team-a")):
        idle = max(queue_scene.NOMINAL - use[other], 0)
        assert use[team] <= queue_scene.NOMINAL + idle
        assert line(seen, team)["used"] == str(use[team])
        borrowed = max(use[team] - queue_scene.NOMINAL, 0)
        assert line(seen, team)["borrowed"] == str(borrowed)
    assert sum(use.values()) <= 2 * queue_scene.NOMINAL


def test_the_report_tells_each_step(scene: QueueOutcome) -> None:
    text = queue_reporting.report(scene, WIDTH)
    for number, seen in enumerate(scene.steps, 1):
        assert f"Step {number}: {seen.step.title}" in text
    assert "PLAYS kube-apiserver" in text and "real `gpuplace serve --queues`" in text
    assert "QueueReclaiming" in text and "GpuPreempted" in text
    assert "(played) Job controller: team-a/sweep-4-retry replaces team-a/sweep-4" in text
    assert "gang team-a/ddp: 4 of 4 members run" in text
    assert "  GPUQUEUE  COHORT    NOMINAL  USED  BORROWED  LENT" in text
    assert max(len(line) for line in text.splitlines()) <= WIDTH


def test_gpu_map_splits_to_the_width() -> None:
    pods = [
        {
            "metadata": {
                "namespace": "team-a",
                "name": f"pod-with-name-{i}",
                "annotations": {
                    keys.ASSIGNED_NODE: queue_scene.NODE,
                    keys.ASSIGNED_GPUS: str(i),
                },
            },
            "status": {"phase": "Running"},
        }
        for i in range(GPUS)
    ]
    lines = queue_reporting.gpu_map(pods, GPUS, width=100)
    assert len(lines) == 4  # two halves of GPU indices and holders
    assert all(len(text) <= 100 for text in lines)
    assert lines[0].split()[1:] == ["0", "1", "2", "3"]
    assert "A pod-with-name-7" in lines[3]


def test_demo_scene_queues_from_the_command_line(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "gpuplace.cli", "demo", "--scene", "queues", "--width", "120"],
        cwd=tmp_path,
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(helpers.REPO)},
    )
    assert completed.returncode == 0, completed.stderr
    others = [
        line
        for line in completed.stderr.splitlines()
        if not line.startswith("gpuplace demo") and not c_helpers_built.is_expected_notice(line)
    ]
    assert others == [], others
    assert "[7/7]" in completed.stderr
    out = completed.stdout
    assert out.startswith("gpuplace demo, the queues scene")
    assert "Step 7: team B's train-0 finishes" in out
    assert "Queues scene done in" in out
    assert "POD " not in out  # the pods scene is not played
    assert list(tmp_path.iterdir()) == []  # and no plot written
