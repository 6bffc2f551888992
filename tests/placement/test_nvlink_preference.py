"""`gpu-topology: preferred` (the default for several GPUs) favours a GPU set inside one
NVLink domain on any node, as docs/annotations.md says, whatever the policy would have
picked otherwise; `none` leaves the choice to the policy. Caught on the real cluster
(tests/realcluster/test_placement.py): four whole GPUs `preferred` went to a PCIe node
while an NVLink domain of four was free, because only `required` weighed nodes."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.placement import choosing, fit, policies
from gpuplace.placement.fragmentation import TaskType, Workload
from gpuplace.placement.ledger import Grant, Ledger
from gpuplace.placement.requests import Topology

from .clusters import ledger, node, whole

WORKLOAD = Workload([(TaskType(1000, 250, 1, frozenset()), 1.0)])
POLICIES = ("default", "fgd", "best-fit", "first-fit", "random")


def chosen(book: Ledger, count: int, topology: Topology, name: str) -> choosing.Choice | None:
    policy = policies.make(name, workload=WORKLOAD, rng=random.Random(1))
    request = whole(count, topology=topology)
    return choosing.Chooser(book, policy).choose(request, random.Random(1))


def test_preferred_takes_a_free_nvlink_domain_over_a_roomier_pcie_node() -> None:
    # the PCIe node first in line: first-fit (and a policy that spreads) would take it
    book = ledger(node("pcie", 8), node("nvlink", 8, nvlink=(0, 0, 0, 0, 1, 1, 1, 1)))
    book.reserve(Grant("first", "nvlink", (0, 1, 2, 3), 1000, 0))
    for name in POLICIES:
        found = chosen(book, 4, Topology.PREFERRED, name)
        assert found is not None and (found.node, found.gpus) == ("nvlink", (4, 5, 6, 7)), name
    plain = chosen(book, 4, Topology.ANY, "first-fit")
    assert plain is not None and (plain.node, plain.gpus) == ("pcie", (0, 1, 2, 3))


def test_the_extender_gives_the_nvlink_node_alone_the_top_score() -> None:
    book = ledger(node("pcie", 8), node("nvlink", 8, nvlink=(0,) * 8))
    policy = policies.make("best-fit")
    evaluation = choosing.evaluate(book, whole(2, topology=Topology.PREFERRED), policy)
    assert choosing.extender_scores(evaluation) == {"pcie": 0, "nvlink": 10}


@st.composite
def clusters(draw: st.DrawFn) -> Ledger:
    nodes = []
    for i in range(draw(st.integers(1, 5))):
        gpus = draw(st.sampled_from([2, 4, 8]))
        domains = draw(
            st.sampled_from([None, (0,) * gpus, tuple(index * 2 // gpus for index in range(gpus))])
        )
        nodes.append(node(f"n{i}", gpus, nvlink=domains))
    book = ledger(*nodes)
    for j in range(draw(st.integers(0, 6))):
        state = book.state(f"n{draw(st.integers(0, len(nodes) - 1))}")
        assert state is not None
        free = [g.index for g in state.node.gpus if state.free_milli[g.index] == 1000]
        if free:
            book.reserve(Grant(f"bg{j}", state.node.name, (draw(st.sampled_from(free)),), 1000, 0))
    return book


@settings(max_examples=200, deadline=None)
@given(book=clusters(), count=st.integers(2, 4), name=st.sampled_from(POLICIES))
def test_preferred_lands_in_one_domain_whenever_some_node_has_one_free(
    book: Ledger, count: int, name: str
) -> None:
    request = whole(count, topology=Topology.PREFERRED)
    possible = any(
        choosing.linked(state, gpus)
        for state in book.states()
        for gpus in fit.gpu_sets(state, request)
    )
    found = chosen(book, count, Topology.PREFERRED, name)
    if found is not None:
        state = book.state(found.node)
        assert state is not None
        assert choosing.linked(state, found.gpus) is possible
