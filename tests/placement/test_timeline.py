"""The event-driven replay: jobs arrive, wait, run their time and leave; with queues a team
that lent its quota gets it back at once (reclaim), the preempted jobs start over later;
the figures integrate shares against entitlements over contended time."""

from __future__ import annotations

import math

import pytest

from gpuplace.placement import policies, trace
from gpuplace.placement.queueing import timeline
from gpuplace.placement.queueing.quotas import ANY_MODEL, GPUS, Preemption, QueueSpec, Quota
from gpuplace.placement.requests import GpuRequest

from .clusters import node, share, whole

NODES = [node("n1", 2), node("n2", 2)]


def job(
    uid: str, team: str, arrives: float, runtime: float, request: GpuRequest | None = None
) -> timeline.Job:
    return timeline.Job(uid, team, request or whole(1), arrives, runtime)


def queues(nominal: float = 2.0) -> list[QueueSpec]:
    return [
        QueueSpec(name, {(GPUS, ANY_MODEL): Quota(round(nominal * 1000))}, cohort="lab")
        for name in ("a", "b")
    ]


FLOOD = [job(f"a{i}", "A", 0, 100) for i in range(6)] + [
    job(f"b{i}", "B", 10, 50) for i in range(2)
]
TEAMS = {"A": "a", "B": "b"}
NOMINAL = {"A": 2000.0, "B": 2000.0}
WEIGHT = {"A": 1.0, "B": 1.0}


def test_without_queues_jobs_take_free_gpus_in_arrival_order_and_wait_otherwise() -> None:
    result = timeline.run(NODES, FLOOD, policies.make("best-fit"))
    records = result.jobs
    assert all(record.done and record.starts == 1 for record in records.values())
    # a0-a3 start at once; a4, a5, b0 and b1 wait for them to leave at 100
    assert [records[f"a{i}"].waited for i in range(6)] == [0, 0, 0, 0, 100, 100]
    assert records["b0"].waited == records["b1"].waited == 90
    assert result.preemptions == 0


def test_with_queues_a_team_gets_back_its_lent_quota_at_once() -> None:
    result = timeline.run(NODES, FLOOD, policies.make("best-fit"), queues=queues(), queue_of=TEAMS)
    records = result.jobs
    assert records["b0"].waited == records["b1"].waited == 0
    assert result.preemptions == 2  # two of a's borrowed jobs, the most recent
    assert sum(records[f"a{i}"].preempted for i in range(6)) == 2
    assert all(record.done for record in records.values())
    assert result.lost_gpu_seconds == pytest.approx(2 * 10)


def test_the_figures_show_the_fairer_split() -> None:
    until = 400.0
    plain = timeline.figures(
        timeline.run(NODES, FLOOD, policies.make("best-fit")), NOMINAL, WEIGHT, until
    )
    fair = timeline.figures(
        timeline.run(NODES, FLOOD, policies.make("best-fit"), queues=queues(), queue_of=TEAMS),
        NOMINAL,
        WEIGHT,
        until,
    )
    by_team = {row.team: row for row in fair.teams}
    assert by_team["B"].share_vs_entitlement == pytest.approx(1.0)
    assert {row.team: row.share_vs_entitlement for row in plain.teams}["B"] == 0.0
    assert fair.jain > plain.jain
    assert 0 < fair.contended_fraction <= 1 and plain.allocation == pytest.approx(
        fair.allocation, abs=15
    )
    assert by_team["B"].wait_p50_s == 0 and by_team["A"].preempted == 2


def test_jobs_no_node_could_ever_hold_are_left_out() -> None:
    jobs = [job("big", "A", 0, 10, whole(3)), job("ok", "A", 0, 10, share(500))]
    result = timeline.run(NODES, jobs, policies.make("best-fit"))
    assert result.never == ["big"] and set(result.jobs) == {"ok"}
    figures = timeline.figures(result, NOMINAL, WEIGHT, 5.0)
    assert figures.never_fit == 1
    assert math.isnan(figures.jain)  # never contended


# --- the trace's times and a smaller cluster --------------------------------------------

HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    "creation_time,deletion_time,scheduled_time"
)
TIMED = f"""{HEADER}
p0,1000,1024,1,500,,LS,Running,10,100,12
p1,1000,1024,2,1000,,BE,Pending,20,50,
"""


def test_timed_pods_carry_qos_times_and_their_run_time() -> None:
    pods = trace.parse_timed_pods("pods.csv", TIMED.splitlines())
    assert [(p.pod.name, p.qos, p.created, p.scheduled, p.deleted) for p in pods] == [
        ("p0", "LS", 10, 12, 100),
        ("p1", "BE", 20, None, 50),
    ]
    assert [p.runtime for p in pods] == [88, None]  # p1 never started


def test_a_deletion_before_the_creation_is_refused_where_it_is() -> None:
    bad = TIMED.replace(
        "p0,1000,1024,1,500,,LS,Running,10,100,12", "p0,1000,1024,1,500,,LS,Running,10,5,12"
    )
    with pytest.raises(
        trace.TraceError, match=r"pods.csv:2:10: deletion_time before creation_time"
    ):
        trace.parse_timed_pods("pods.csv", bad.splitlines())
    with pytest.raises(trace.TraceError, match="missing column 'qos'"):
        trace.parse_timed_pods("pods.csv", ["name,cpu_milli,memory_mib,num_gpu,gpu_milli"])


def test_a_scaled_cluster_keeps_the_mix_of_node_kinds() -> None:
    nodes = [node(f"g{i}", 8, model="G2") for i in range(12)] + [
        node(f"t{i}", 2, model="T4") for i in range(8)
    ]
    small = trace.scaled(nodes, 28)
    kinds = [(n.model, len(n.gpus)) for n in small]
    assert kinds.count(("G2", 8)) == 3 and kinds.count(("T4", 2)) == 2  # 24 + 4 GPUs
    assert [n.name for n in small] == ["g0", "g1", "g2", "t0", "t1"]  # the first of each kind
    with pytest.raises(ValueError, match="no node kind"):
        trace.scaled(nodes, 1)


def test_a_capacity_hold_drains_a_node_for_a_starving_two_gpu_job() -> None:
    """b's 2-GPU job waits behind a stream of a's 1-GPU jobs, each taking the GPU that
    frees; with holds a node is kept for it after 10 s and it starts once that drains."""
    specs = [
        QueueSpec("a", {(GPUS, ANY_MODEL): Quota(1000)}, cohort="lab"),
        QueueSpec("b", {(GPUS, ANY_MODEL): Quota(3000)}, cohort="lab", reclaim=Preemption.NEVER),
    ]
    stream = [job(f"a{i}", "A", 0, 30 + 10 * i) for i in range(4)]
    stream += [job(f"s{i}", "A", 1 + i, 40) for i in range(12)]
    jobs = [*stream, job("big", "B", 2, 10, whole(2))]
    waits = {}
    for hold_after in (None, 10.0):
        result = timeline.run(
            NODES,
            jobs,
            policies.make("best-fit"),
            queues=specs,
            queue_of=TEAMS,
            hold_after=hold_after,
        )
        assert all(record.done for record in result.jobs.values())
        assert result.preemptions == 0
        waits[hold_after] = result.jobs["big"].waited
        if hold_after is not None:
            assert result.holds == 1
    assert waits[10.0] < waits[None], waits
