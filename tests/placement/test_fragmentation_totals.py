"""ClusterMeasure: the running cluster totals equal a fresh pass over every node, whatever
the ledger went through between two reads; a read with nothing changed looks at no node."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpuplace.placement import fragmentation_totals
from gpuplace.placement.fragmentation import MIN_CPU_MILLI, TaskType, Workload
from gpuplace.placement.fragmentation_totals import ClusterMeasure, Totals
from gpuplace.placement.inventory import Gpu, Inventory, Node
from gpuplace.placement.ledger import Grant, Ledger, LedgerError, NodeState

HALVES = Workload(((TaskType(MIN_CPU_MILLI, 500, 1, frozenset()), 1.0),))
WHOLES = Workload(((TaskType(MIN_CPU_MILLI, 1000, 2, frozenset()), 1.0),))


def node(name: str, gpus: int = 4, *, closed: str = "") -> Node:
    return Node(name, 8000, 64000, tuple(Gpu(i, "A100", 40960) for i in range(gpus)), closed=closed)


def from_scratch(ledger: Ledger, workload: Workload) -> Totals:
    free = fgd = stranded = 0
    for state in ledger.states():
        lefts = tuple(sorted(state.free_milli))
        free += sum(left for left in state.free_milli if left > 0)
        fgd += round(
            workload.amount(state.node.model, state.cpu, lefts) * fragmentation_totals.SCALE
        )
        stranded += round(
            workload.stranded(state.node.model, state.cpu, lefts) * fragmentation_totals.SCALE
        )
    return Totals(free, fgd / fragmentation_totals.SCALE, stranded / fragmentation_totals.SCALE)


def test_a_half_used_gpu_is_fragment_for_whole_gpus_and_not_for_halves() -> None:
    ledger = Ledger(Inventory([node("n0", 2)]))
    ledger.reserve(Grant("p", "n0", (0,), 500, 1000))
    assert ClusterMeasure().totals(ledger, HALVES) == Totals(1500, 0.0, 0.0)
    # a pod of two whole GPUs fits on none of them: all 1500 idle milli-GPU are fragment
    assert ClusterMeasure().totals(ledger, WHOLES) == Totals(1500, 1500.0, 1500.0)


ACTIONS = ["reserve", "reserve", "release", "close", "open", "drop", "add", "restore"]
OPS = st.lists(
    st.tuples(
        st.sampled_from([*ACTIONS, "workload", "read"]),
        st.integers(0, 3),
        st.integers(0, 3),
        st.sampled_from([250, 500, 1000]),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@example(  # a relist after a node came back with fewer GPUs than a grant names (it raised)
    [("reserve", 0, 2, 250), ("drop", 0, 0, 250), ("add", 0, 0, 250), ("restore", 0, 0, 250)]
)
@given(OPS)
def test_running_totals_equal_a_fresh_pass(ops: list[tuple[str, int, int, int]]) -> None:
    ledger = Ledger(Inventory([node(f"n{i}") for i in range(3)]))
    running = ClusterMeasure()
    workload = HALVES
    for step, (op, which, gpu, milli) in enumerate(ops):
        name = f"n{which}"
        if op == "reserve" and name in ledger.inventory:
            with contextlib.suppress(LedgerError):
                ledger.reserve(Grant(f"p{step}", name, (gpu,), milli, 100, 100))
        elif op == "release":
            grants = list(ledger)
            if grants:
                ledger.release(grants[which % len(grants)].pod_uid)
        elif op in ("close", "open") and name in ledger.inventory:
            ledger.put_node(
                replace(ledger.inventory[name], closed="agent silent" * (op == "close"))
            )
        elif op == "drop":
            ledger.remove_node(name)
        elif op == "add" and name not in ledger.inventory:
            ledger.put_node(node(name, gpus=2 + gpu))
        elif op == "restore":  # a relist: the change log starts over
            ledger.restore(list(ledger))
        elif op == "workload":
            workload = WHOLES if workload is HALVES else HALVES
        else:
            assert running.totals(ledger, workload) == from_scratch(ledger, workload)
    assert running.totals(ledger, workload) == from_scratch(ledger, workload)


def test_a_read_with_nothing_changed_measures_no_node(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = Ledger(Inventory([node(f"n{i}") for i in range(50)]))
    running = ClusterMeasure()
    first = running.totals(ledger, HALVES)
    measured: list[str] = []
    original = fragmentation_totals.measure

    def counting(state: NodeState, workload: Workload) -> tuple[int, int, int]:
        measured.append(state.node.name)
        return original(state, workload)

    monkeypatch.setattr(fragmentation_totals, "measure", counting)
    assert running.totals(ledger, HALVES) == first
    assert measured == []
    ledger.reserve(Grant("p", "n7", (0,), 250, 100))
    running.totals(ledger, HALVES)
    assert measured == ["n7"]
