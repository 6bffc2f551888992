"""Closed nodes (node agent silent) and unhealthy GPUs take no new grant, under every
policy and through the Chooser's caches, while the grants already on them stay."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.placement import choosing, fit, gangs, policies
from gpuplace.placement.fragmentation import TaskType, Workload
from gpuplace.placement.inventory import Node
from gpuplace.placement.ledger import Grant
from gpuplace.placement.requests import GpuRequest

from .clusters import ledger, node, share, whole

WORKLOAD = Workload([(TaskType(1000, 500, 1, frozenset()), 1.0)])

requests = st.one_of(
    st.builds(share, st.integers(1, 1000), st.sampled_from([0, 8192, 40_960])),
    st.builds(whole, st.integers(1, 4)),
    st.builds(
        lambda mib: GpuRequest(milli=0, memory_mib=mib, count=1, cpu_milli=1, host_memory_mib=1),
        st.sampled_from([1024, 20_480]),
    ),
)


def with_health(base: Node, sick: set[int], closed: bool) -> Node:
    gpus = tuple(replace(gpu, healthy=gpu.index not in sick) for gpu in base.gpus)
    return replace(base, gpus=gpus, closed="node agent silent since then" if closed else "")


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.sets(st.integers(0, 3)), st.booleans()), min_size=1, max_size=4),
    st.lists(requests, min_size=1, max_size=12),
    st.sampled_from(policies.NAMES),
)
def test_no_grant_lands_on_a_closed_node_or_an_unhealthy_gpu(
    states: list[tuple[set[int], bool]], asked: list[GpuRequest], name: str
) -> None:
    book = ledger(*(node(f"n{i}", 4) for i in range(len(states))))
    # grants made while everything was healthy stay when health changes
    before = Grant("running", "n0", (0,), 500, 1024)
    book.reserve(before)
    for i, (sick, closed) in enumerate(states):
        book.put_node(with_health(book.inventory[f"n{i}"], sick, closed))
    assert book.get("running") == before
    chooser = choosing.Chooser(book, policies.make(name, workload=WORKLOAD, rng=random.Random(1)))
    for uid, request in enumerate(asked):
        evaluation = chooser.evaluate(request)
        for where, misfit in evaluation.misfits.items():
            sick, closed = states[int(where[1:])]
            if closed:
                assert misfit.kind is fit.MisfitKind.AGENT_SILENT
        choice = chooser.choose(request, random.Random(uid))
        if choice is None:
            continue
        sick, closed = states[int(choice.node[1:])]
        assert not closed, (choice, request)
        assert not set(choice.gpus) & sick, (choice, request)
        book.reserve(choosing.grant_for(f"p{uid}", choice, request))
    for i in range(len(states)):
        state = book.state(f"n{i}")
        assert state is not None
        copies, _ = gangs.capacity(state, share(100))
        if states[i][1] or states[i][0] == {0, 1, 2, 3}:
            assert copies == 0
