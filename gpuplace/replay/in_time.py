"""`gpuplace simulate --queues FILE`: files in, the event-driven replay with and without
queues (`gpuplace.placement.queueing.timeline`), figures out as JSON.

Teams are the trace's `qos` classes (LS, BE, Burstable, Guaranteed); each team's pods go
to the GpuQueue named after it in lower case (`ls`, `be`, ...), read from FILE (the same
YAML as the GpuQueue objects, `gpuplace.cluster.gpuqueues`). Pods the production cluster
never started (no `scheduled_time`) are left out: their run time is unknown. Both runs
replay the same jobs on the same nodes with the same policy; this module owns only I/O.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from gpuplace.cluster import gpuqueues
from gpuplace.placement import fragmentation, policies, trace
from gpuplace.placement.inventory import Node
from gpuplace.placement.queueing import quotas, timeline


class ReplayError(ValueError):
    """Input the replay cannot use; the message says what and where."""


def read_queues(path: Path) -> list[quotas.QueueSpec]:
    try:
        documents = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]
    except yaml.YAMLError as error:
        raise ReplayError(f"{path}: not YAML: {error}") from None
    if not documents or not all(isinstance(doc, dict) for doc in documents):
        raise ReplayError(f"{path}: expected GpuQueue objects")
    try:
        return gpuqueues.parse_all(documents)
    except gpuqueues.QueueError as error:
        raise ReplayError(f"{path}: {error}") from None


def read_jobs(path: Path) -> list[trace.TimedPod]:
    with path.open(encoding="utf-8", newline="") as lines:
        return trace.parse_timed_pods(str(path), lines)


def jobs_of(pods: Sequence[trace.TimedPod]) -> list[timeline.Job]:
    """The GPU pods that ran in production, as replay jobs (arrival: creation time)."""
    return [
        timeline.Job(timed.pod.name, timed.qos, timed.pod.request(), timed.created, runtime)
        for timed in pods
        if timed.pod.num_gpu and (runtime := timed.runtime) is not None
    ]


def team_queues(jobs: Sequence[timeline.Job], queues: Sequence[quotas.QueueSpec]) -> dict[str, str]:
    """Each team's queue (its name in lower case); raises for a team without one."""
    names = {queue.name for queue in queues}
    teams = sorted({job.team for job in jobs})
    missing = [team for team in teams if team.lower() not in names]
    if missing:
        raise ReplayError(
            "no GpuQueue for the trace's qos "
            + ", ".join(f"{team} (name it {team.lower()!r})" for team in missing)
        )
    return {team: team.lower() for team in teams}


def nominal_gpus(queue: quotas.QueueSpec) -> int:
    """The queue's `gpus` quota over all its lines (milli-GPU)."""
    return sum(q.nominal for (resource, _), q in queue.quotas.items() if resource == quotas.GPUS)


def replay(
    nodes: Sequence[Node],
    pods: Sequence[trace.TimedPod],
    queues: Sequence[quotas.QueueSpec],
    *,
    policy_name: str,
    half_life: float | None = None,
    hold_after: float | None = None,
) -> dict[str, Any]:
    """Both runs and their figures, as one JSON-ready document. `half_life`: fair
    sharing over time; `hold_after`: capacity holds (`gpuplace serve`'s settings)."""
    jobs = jobs_of(pods)
    if not jobs:
        raise ReplayError("the pod list has no GPU pod that ran (scheduled_time set)")
    queue_of = team_queues(jobs, queues)
    by_name = {queue.name: queue for queue in queues}
    nominal = {team: float(nominal_gpus(by_name[name])) for team, name in queue_of.items()}
    weight = {team: by_name[name].weight for team, name in queue_of.items()}
    until = max(job.arrives for job in jobs)
    workload = fragmentation.Workload.from_requests(timed.pod.request() for timed in pods)
    runs: dict[str, Any] = {}
    for mode in ("no_queues", "queues"):
        started = time.perf_counter()
        policy = policies.make(policy_name, workload=workload)
        result = timeline.run(
            nodes,
            jobs,
            policy,
            queues=queues if mode == "queues" else None,
            queue_of=queue_of,
            half_life=half_life,
            hold_after=hold_after,
        )
        figures = timeline.figures(result, nominal, weight, until)
        runs[mode] = {
            **_clean(asdict(figures)),
            "wall_seconds": round(time.perf_counter() - started, 1),
        }
    return {
        "cluster": {"nodes": len(nodes), "gpus": sum(len(node.gpus) for node in nodes)},
        "jobs": len(jobs),
        "teams": {team: {"queue": name, "weight": weight[team]} for team, name in queue_of.items()},
        "until_seconds": until,
        "policy": policy_name,
        "fair_sharing_half_life_seconds": half_life,
        "hold_after_seconds": hold_after,
        **runs,
        "allocation_cost_points": _round(
            runs["no_queues"]["allocation"] - runs["queues"]["allocation"]
        ),
        "allocation_cost_points_contended": _round(
            runs["no_queues"]["allocation_contended"] - runs["queues"]["allocation_contended"]
        ),
    }


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 3)


def _clean(value: Any) -> Any:
    """Floats rounded, NaN as null (JSON has no NaN)."""
    if isinstance(value, float):
        return _round(value)
    if isinstance(value, Mapping):
        return {key: _clean(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(item) for item in value]
    return value


def dumps(document: Mapping[str, Any]) -> str:
    return json.dumps(document, indent=2) + "\n"
