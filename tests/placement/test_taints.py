"""Taints, tolerations and cordons as kube-scheduler judges them (TaintToleration and
NodeUnschedulable, `Toleration.ToleratesTaint` of k8s.io/component-helpers), and the gang
planner never placing a member where they would keep it off."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.placement import gangs, policies
from gpuplace.placement.inventory import Inventory, Node
from gpuplace.placement.ledger import Ledger
from gpuplace.placement.requests import GpuRequest
from gpuplace.placement.taints import (
    UNSCHEDULABLE,
    Taint,
    Toleration,
    tolerated,
    untolerated,
)

from .clusters import node, share, whole

GPU = Taint("nvidia.com/gpu", "present", "NoSchedule")


@pytest.mark.parametrize(
    ("toleration", "taint", "expected"),
    [
        (Toleration("nvidia.com/gpu", "Equal", "present", "NoSchedule"), GPU, True),
        (Toleration("nvidia.com/gpu", "", "present", "NoSchedule"), GPU, True),  # "" = Equal
        (Toleration("nvidia.com/gpu", "Equal", "absent", "NoSchedule"), GPU, False),
        (Toleration("nvidia.com/gpu", "Exists", "", "NoSchedule"), GPU, True),
        (Toleration("nvidia.com/gpu", "Exists"), GPU, True),  # empty effect: every effect
        (Toleration("nvidia.com/gpu", "Exists", "", "NoExecute"), GPU, False),
        (Toleration("other", "Exists"), GPU, False),
        (Toleration("", "Exists"), GPU, True),  # empty key with Exists: every taint
        (Toleration("", "Exists", "", "NoExecute"), GPU, False),
        (Toleration("nvidia.com/gpu", "Gt", "1", "NoSchedule"), GPU, False),  # alpha, gate off
        (Toleration("nvidia.com/gpu", "Equal", "", ""), Taint("nvidia.com/gpu", ""), True),
    ],
)
def test_a_toleration_tolerates_as_kube_scheduler_reads_it(
    toleration: Toleration, taint: Taint, expected: bool
) -> None:
    assert toleration.tolerates(taint) is expected


def test_only_no_schedule_and_no_execute_keep_a_pod_off() -> None:
    prefer = Taint("busy", "yes", "PreferNoSchedule")
    execute = Taint("broken", "", "NoExecute")
    assert untolerated([prefer], []) is None
    assert untolerated([prefer, execute], []) == execute
    assert untolerated([execute], [Toleration("broken", "Exists")]) is None


def test_a_cordoned_node_admits_only_pods_tolerating_the_cordon() -> None:
    assert untolerated([], [], unschedulable=True) == UNSCHEDULABLE
    cordon = Toleration("node.kubernetes.io/unschedulable", "Exists", "", "NoSchedule")
    assert untolerated([], [cordon], unschedulable=True) is None
    cordoned = replace(node("a", 2), unschedulable=True)
    assert not cordoned.admits([]) and cordoned.admits([cordon])
    assert cordoned.admits([Toleration("", "Exists")])


TAINTS = st.builds(
    Taint,
    st.sampled_from(["a", "b", "nvidia.com/gpu"]),
    st.sampled_from(["", "x", "y"]),
    st.sampled_from(["NoSchedule", "NoExecute", "PreferNoSchedule"]),
)
TOLERATIONS = st.builds(
    Toleration,
    st.sampled_from(["", "a", "b", "nvidia.com/gpu", "node.kubernetes.io/unschedulable"]),
    st.sampled_from(["Equal", "Exists", "", "Lt"]),
    st.sampled_from(["", "x", "y"]),
    st.sampled_from(["", "NoSchedule", "NoExecute", "PreferNoSchedule"]),
)


@settings(max_examples=300, deadline=None)
@given(
    taints=st.lists(TAINTS, max_size=4),
    tolerations=st.lists(TOLERATIONS, max_size=4),
    more=TOLERATIONS,
    extra=TAINTS,
    cordoned=st.booleans(),
)
def test_admission_is_monotone_in_tolerations_and_taints(
    taints: list[Taint],
    tolerations: list[Toleration],
    more: Toleration,
    extra: Taint,
    cordoned: bool,
) -> None:
    base = replace(node("n", 1), taints=tuple(taints), unschedulable=cordoned)
    admitted = base.admits(tolerations)
    # a pod that is let on stays let on with one more toleration ...
    if admitted:
        assert base.admits([*tolerations, more])
    # ... and a node that keeps it off keeps it off with one more taint or the cordon
    else:
        assert not replace(base, taints=(*base.taints, extra)).admits(tolerations)
        assert not replace(base, unschedulable=True).admits(tolerations)
    # the toleration of everything lets every pod on; no taint and no cordon, too
    assert base.admits([*tolerations, Toleration("", "Exists")])
    assert replace(base, taints=(), unschedulable=False).admits(tolerations)
    # exactly the filtering taints count
    filtering = [t for t in taints if t.effect in ("NoSchedule", "NoExecute")]
    expected = all(tolerated(t, tolerations) for t in filtering) and (
        not cordoned or tolerated(UNSCHEDULABLE, tolerations)
    )
    assert admitted is expected


@st.composite
def tainted_clusters(draw: st.DrawFn) -> Ledger:
    nodes: list[Node] = []
    for i in range(draw(st.integers(1, 6))):
        plain = node(f"n{i}", draw(st.sampled_from([1, 2, 4, 8])))
        nodes.append(
            replace(
                plain,
                taints=tuple(draw(st.lists(TAINTS, max_size=2))),
                unschedulable=draw(st.booleans()),
            )
        )
    return Ledger(Inventory(nodes))


REQUESTS = st.sampled_from([whole(1), whole(2), share(250, 4096), share(500)])


@settings(max_examples=200, deadline=None)
@given(
    book=tainted_clusters(),
    request=REQUESTS,
    size=st.integers(1, 8),
    tolerations=st.lists(TOLERATIONS, max_size=3),
)
def test_gang_plans_and_fences_only_use_nodes_that_admit_the_members(
    book: Ledger, request: GpuRequest, size: int, tolerations: list[Toleration]
) -> None:
    held = tuple(tolerations)
    members = [gangs.Member(f"m{i}", request, tolerations=held) for i in range(size)]
    admitting = {n.name for n in book.inventory if n.admits(held)}
    result = gangs.plan(book, policies.make("best-fit"), members)
    if isinstance(result, gangs.Plan):
        assert {choice.node for choice in result.choices.values()} <= admitting
    else:
        # the same gang on the admitting nodes alone: no better
        only = Ledger(Inventory(n for n in book.inventory if n.name in admitting))
        assert not isinstance(gangs.plan(only, policies.make("best-fit"), members), gangs.Plan)
    assert set(gangs.fence(book, members)) <= admitting


def test_a_gang_kept_off_every_node_says_by_what() -> None:
    book = Ledger(
        Inventory(
            [
                replace(node("a", 4), unschedulable=True),
                replace(node("b", 4), taints=(GPU,)),
                node("c", 1),
            ]
        )
    )
    result = gangs.plan(
        book, policies.make("best-fit"), [gangs.Member(f"m{i}", whole(1)) for i in range(2)]
    )
    assert isinstance(result, gangs.Shortfall)
    kept_off = {"node cordoned": 1, "taint not tolerated": 1}
    assert result.reasons == {**kept_off, "not enough whole GPUs free": 1}
    assert result.reason == (
        "the gang cannot fit on the nodes that admit its members (cordoned or tainted ones "
        "left out): even idle they would hold only 1 of 2; 1 fit now; 1 more need 1 whole "
        "GPU; 3 nodes: 1 node cordoned, 1 taint not tolerated, 1 not enough whole GPUs free"
    )
    tolerant = [
        gangs.Member(f"m{i}", whole(1), tolerations=(Toleration("nvidia.com/gpu", "Exists"),))
        for i in range(2)
    ]
    planned = gangs.plan(book, policies.make("best-fit"), tolerant)
    assert isinstance(planned, gangs.Plan) and planned.nodes == ("b",)
