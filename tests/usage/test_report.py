"""The asked-vs-used report's rules as properties: a suggestion is never below what was
used, a pod using at least the threshold of its grant is never named, totals add up."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.cluster import assignments, dra_claims
from gpuplace.commands import usage as usage_command
from gpuplace.dev.localapi import objects
from gpuplace.placement.ledger import Grant
from gpuplace.usage import report
from gpuplace.usage.readings import GpuUse, PodGpuUse, Usage

GIB = report.GIB
MIB = report.MIB

rules = st.builds(
    report.Rule,
    threshold=st.floats(0.05, 1.0),
    headroom=st.floats(1.0, 3.0),
    min_samples=st.integers(1, 30),
    percent_step=st.sampled_from([1, 5, 10]),
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Usage, list[report.Asked]]:
    count = draw(st.integers(0, 12))
    asked: list[report.Asked] = []
    uses: list[PodGpuUse] = []
    gpus: dict[tuple[str, int], GpuUse] = {}
    for index in range(count):
        node = draw(st.sampled_from(["n0", "n1", "n2"]))
        many = draw(st.integers(1, 3))
        held = tuple(sorted(draw(st.sets(st.integers(0, 7), min_size=many, max_size=many))))
        milli = 1000 if many > 1 else draw(st.sampled_from([0, 50, 200, 500, 1000]))
        memory = draw(st.integers(0, 81920)) if milli else draw(st.integers(1, 81920))
        item = report.Asked("ns", f"p{index}", node, held, milli, memory)
        asked.append(item)
        for gpu in held:
            if draw(st.integers(0, 9)):  # now and then a GPU nobody measured
                peak = draw(st.integers(0, 90 * GIB))
                util = draw(st.floats(0, 1))
                uses.append(
                    PodGpuUse(
                        namespace="ns",
                        pod=item.pod,
                        node=node,
                        gpu=gpu,
                        memory_peak_bytes=peak,
                        memory_p95_bytes=draw(st.integers(0, peak)),
                        util_peak=util,
                        util_p95=draw(st.floats(0, util)),
                        samples=draw(st.integers(0, 40)),
                    )
                )
            gpus[(node, gpu)] = GpuUse(node, gpu, 0, 0, 80 * GIB, None, None, 10)
    usage = Usage("gpuplace", 3600.0, 0.0, tuple(uses), tuple(gpus.values()))
    return usage, asked


@given(st.integers(0, 1 << 42), rules)
def test_memory_suggestion_never_below_peak(peak: int, rule: report.Rule) -> None:
    suggested = report.suggest_memory(peak, rule)
    assert suggested >= peak and suggested >= GIB and suggested % GIB == 0
    assert suggested - GIB < max(peak * rule.headroom, GIB)  # rounded up, not further


@given(st.floats(0, 1), rules)
def test_percent_suggestion_never_below_p95(p95: float, rule: report.Rule) -> None:
    percent = report.suggest_percent(p95, rule)
    assert percent >= min(p95 * 100, 100) and 1 <= percent <= 100
    assert percent % rule.percent_step == 0 or percent == 100


@settings(max_examples=300)
@given(cases(), rules)
def test_report_rules_and_totals(case: tuple[Usage, list[report.Asked]], rule: report.Rule) -> None:
    usage, asked = case
    result = report.build(usage, asked, rule)
    grants = {item.pod: item for item in asked}
    rows: dict[str, list[report.PodRow]] = {}
    for row in result.pods:
        rows.setdefault(row.pod, []).append(row)
    for item in result.over:
        mine = rows[item.pod]
        assert min(row.samples for row in mine) >= rule.min_samples
        assert item.suggested < item.asked
        if item.what == "memory":
            peak = max(row.memory_peak_bytes or 0 for row in mine)
            assert item.used == peak and item.suggested >= peak
            assert peak < rule.threshold * grants[item.pod].memory_mib * MIB
            assert item.value == f"{item.suggested // GIB}Gi"
        else:
            p95 = mine[0].util_p95
            assert p95 is not None and p95 < rule.threshold * grants[item.pod].milli / 1000
            assert item.suggested >= p95 * 100 and len(mine) == 1
    named = {(item.pod, item.what) for item in result.over}
    for pod, mine in rows.items():
        grant = grants[pod]
        peak = max(row.memory_peak_bytes or 0 for row in mine)
        if grant.memory_mib and peak >= rule.threshold * grant.memory_mib * MIB:
            assert (pod, "memory") not in named
        p95 = mine[0].util_p95
        if p95 is not None and p95 >= rule.threshold * grant.milli / 1000:
            assert (pod, "compute") not in named
    # totals add up: pods -> GPUs -> nodes
    assert sum(row.asked_memory_bytes for row in result.gpus) == sum(
        row.asked_memory_bytes or 0 for row in result.pods
    )
    assert sum(row.pods for row in result.gpus) == len(result.pods)
    for node in result.nodes:
        of_node = [row for row in result.gpus if row.node == node.node]
        assert node.gpus == len(of_node)
        assert node.asked_percent == sum(row.asked_percent for row in of_node)
        assert node.asked_memory_bytes == sum(row.asked_memory_bytes for row in of_node)
        assert node.memory_total_bytes == sum(row.memory_total_bytes or 0 for row in of_node)
    assert {row.node for row in result.nodes} == {row.node for row in result.gpus}


def test_rule_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="headroom must be at least 1"):
        report.Rule(headroom=0.9)
    with pytest.raises(ValueError, match="threshold"):
        report.Rule(threshold=0)


def test_shared_dcgm_reading_is_never_judged() -> None:
    reading = PodGpuUse("ns", "a", "n", 0, GIB, GIB, 0.01, 0.01, 40, gpu_reading=True)
    usage = Usage("dcgm", 3600.0, 0.0, (reading,), ())
    asked = [
        report.Asked("ns", "a", "n", (0,), 500, 40 * 1024),
        report.Asked("ns", "b", "n", (0,), 500, 40 * 1024),
    ]
    result = report.build(usage, asked)
    assert result.over == []
    assert [row.shared for row in result.pods] == [True, True]


def test_deleted_whole_gpu_pod_from_series_asked_no_memory() -> None:
    """A pod the API no longer lists, known from the agent's granted series only: for a
    whole GPU the agent exports the GPU's total as its granted memory, which the pod never
    asked for, so no memory suggestion (compute is still judged); a share's memory is its
    own and is judged."""
    whole = PodGpuUse(
        "ns", "gone", "n", 0, 2 * GIB, 2 * GIB, 0.1, 0.1, 40, 80 * GIB, granted_share=1.0
    )
    share = PodGpuUse("ns", "half", "n", 1, GIB, GIB, 0.4, 0.4, 40, 40 * GIB, granted_share=0.5)
    usage = Usage("gpuplace", 3600.0, 0.0, (whole, share), ())
    result = report.build(usage, [])
    assert {(item.pod, item.what, item.value) for item in result.over} == {
        ("gone", "compute", "15"),
        ("half", "memory", "2Gi"),
    }
    rows = {row.pod: row for row in result.pods}
    assert rows["gone"].asked_percent == 100 and rows["gone"].asked_memory_bytes is None
    assert rows["half"].asked_memory_bytes == 40 * GIB


def _pod(
    name: str, gpu: int, percent: int, *, phase: str = "Running", bound: bool = True
) -> dict[str, Any]:
    """A managed pod as the API holds it once the sidecar granted it `percent` of GPU
    `gpu` on node n (24 GiB), started an hour before the window (`AT - 2 h`)."""
    pod = objects.pod(name, percent=percent, memory="24Gi")
    pod["metadata"]["uid"] = f"uid-{name}"
    grant = Grant(f"uid-{name}", "n", (gpu,), percent * 10, 24 * 1024)
    pod["metadata"]["annotations"].update(
        assignments.annotations_for(grant, None, datetime(2026, 1, 1, tzinfo=UTC))
    )
    if bound:
        pod["spec"]["nodeName"] = "n"
        pod["status"] = {"phase": phase, "startTime": _rfc3339(AT - 7200)}
    else:
        pod["status"] = {"phase": "Pending"}
    return pod


def _rfc3339(moment: float) -> str:
    return assignments.rfc3339(datetime.fromtimestamp(moment, tz=UTC))


def _finished(pod: dict[str, Any], at: float) -> dict[str, Any]:
    pod["status"]["phase"] = "Succeeded"
    pod["status"]["containerStatuses"] = [
        {"name": "main", "state": {"terminated": {"exitCode": 0, "finishedAt": _rfc3339(at)}}}
    ]
    return pod


AT = 1_790_000_000.0


def test_finished_and_unbound_pods_do_not_hold_a_dcgm_gpu() -> None:
    """A Job's pod that finished before the window and a pod reserved but not yet bound,
    both granted GPU 0 beside a running over-asker: with dcgm's whole-GPU readings the
    running one is still judged and named, and GPU 0's asked sums are its alone. A pod
    that finished inside the window did hold the GPU: it counts, marked ended."""
    reading = PodGpuUse("default", "runner", "n", 0, GIB, GIB, 0.05, 0.05, 300, gpu_reading=True)
    gpu_use = GpuUse("n", 0, GIB, GIB, 80 * GIB, 0.05, 0.05, 300)
    usage = Usage("dcgm", 3600.0, AT, (reading,), (gpu_use,))
    pods = [
        _pod("runner", 0, 50),
        _finished(_pod("done", 0, 50), AT - 3 * 3600),
        _pod("waiting", 0, 50, bound=False),
    ]
    asked = [item for item in map(report.asked_of, pods) if item is not None]
    result = report.build(usage, asked)
    assert {(item.pod, item.what) for item in result.over} == {
        ("runner", "memory"),
        ("runner", "compute"),
    }
    assert [row.pod for row in result.pods] == ["runner"]
    (gpu,) = result.gpus
    assert (gpu.pods, gpu.asked_percent, gpu.asked_memory_bytes) == (1, 50, 24 * GIB)
    assert sorted(result.outside) == [
        "default/done: ended before the window",
        "default/waiting: not bound to its node",
    ]
    assert report.pod_section(result, "default", "done")[1:] == [
        "  held no GPU during the window: ended before the window."
    ]

    pods[1] = _finished(_pod("done", 0, 50), AT - 600)  # inside the window: a holder
    asked = [item for item in map(report.asked_of, pods) if item is not None]
    result = report.build(usage, asked)
    assert result.over == []
    rows = {row.pod: row for row in result.pods}
    assert rows["done"].ended and rows["done"].shared and not rows["runner"].ended
    assert "default/done" in report.render(result) and "ended in the window" in report.render(
        result
    )


def test_a_pod_exactly_at_the_compute_threshold_is_not_named() -> None:
    """Found by the property above: threshold × (milli / 1000) rounds to a hair above
    threshold × milli / 1000, which named a pod using exactly the threshold of its share."""
    use = PodGpuUse("ns", "p0", "n0", 0, 0, 0, 0.0025, 0.0025, 10)
    gpu = GpuUse("n0", 0, 0, 0, 80 * GIB, None, None, 10)
    usage = Usage("gpuplace", 3600.0, 0.0, (use,), (gpu,))
    asked = [report.Asked("ns", "p0", "n0", (0,), 50, 0)]
    rule = report.Rule(threshold=0.05, headroom=1.0, min_samples=1, percent_step=1)
    assert report.build(usage, asked, rule).over == []


def test_a_dra_pods_grant_is_its_claims_not_a_plans_annotations() -> None:
    """A pod on the DRA path that a queue planned on GPU 1 (its assignment annotations)
    while kube-scheduler's allocator gave its claim GPU 0 at 30 %: `gpuplace usage` takes
    its grant from the node agent's series (the prepared claim), not from the annotations."""
    planned = _pod("dra", 1, 50)
    planned["spec"]["resourceClaims"] = [
        {"name": dra_claims.ENTRY, "resourceClaimName": "dra-gpu-0a1b2c3d"}
    ]
    plain = _pod("plain", 1, 20)
    assert [item.pod for item in usage_command.asked([planned, plain])] == ["plain"]
    series = PodGpuUse(
        "default", "dra", "n", 0, GIB, GIB, 0.2, 0.2, 300, 8 * GIB, granted_share=0.3
    )
    result = report.build(Usage("gpuplace", 3600.0, AT, (series,), ()), [])
    (row,) = result.pods
    assert (row.pod, row.gpu, row.asked_percent, row.asked_memory_bytes) == ("dra", 0, 30, 8 * GIB)
