"""How fragmented the whole cluster is, kept current from the ledger's change log.

`ClusterMeasure.totals` sums, over every node of a ledger, the idle milli-GPU open to new
grants and the node's fragmentation against a typical workload, by both measures of
`gpuplace.placement.fragmentation`: FGD's (`Workload.amount`: idle milli-GPU that the workload's
types, weighed by popularity, could not use) and gpuplace's stranded one
(`Workload.stranded`: idle milli-GPU beyond what repeated pods of each type could use,
CPU counted). It is for metrics: the sums are what a dashboard plots, and the node
values behind them are never read for a decision.

Each node's values are kept with the node's `version`; a call looks only at the nodes
the ledger logged as changed since the call before (`Ledger.changes`), so a scrape costs
O(changed nodes × GPUs log GPUs) on memo hits. Every node is measured again, O(nodes ×
GPUs log GPUs) plus the workload's memo misses (O(types × GPUs) each), when the workload
or the ledger is another one than last time (a rebuilt typical workload: at most once a
refresh; a relist) or the change log overran. Sums are kept in integer micro-units of a
milli-GPU, so adding and taking away node values never drifts.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuplace.placement.fragmentation import Workload
from gpuplace.placement.ledger import Ledger, NodeState

SCALE = 1_000_000
"""Node values are kept as integers in millionths of a milli-GPU."""


@dataclass(frozen=True, slots=True)
class Totals:
    """Over the whole cluster, in milli-GPU (1000 = one GPU)."""

    free: int
    """Idle compute open to new grants (closed nodes and unhealthy GPUs offer none)."""
    fgd: float
    """FGD's fragmentation of that idle compute against the typical workload."""
    stranded: float
    """gpuplace's stranded measure of it (CPU counted)."""


class ClusterMeasure:
    """Running `Totals` of a ledger against a workload; see the module docstring."""

    __slots__ = ("_cursor", "_epoch", "_ledger", "_nodes", "_sums", "_workload")

    def __init__(self) -> None:
        self._ledger: Ledger | None = None
        self._workload: Workload | None = None
        self._epoch = -1
        self._cursor = 0
        self._nodes: dict[str, tuple[int, int, int, int]] = {}
        """Per node: (version, free, fgd, stranded), the last two scaled by `SCALE`."""
        self._sums = [0, 0, 0]

    def totals(self, ledger: Ledger, workload: Workload) -> Totals:
        """The totals now. O(nodes changed since the last call × GPUs log GPUs) on memo
        hits; O(nodes × …) for another ledger or workload (see the module docstring)."""
        epoch, cursor, changed = ledger.changes(self._epoch, self._cursor)
        if ledger is not self._ledger or workload is not self._workload or changed is None:
            self._ledger, self._workload = ledger, workload
            self._nodes.clear()
            self._sums = [0, 0, 0]
            names: list[str] | set[str] = [state.node.name for state in ledger.states()]
        else:
            names = set(changed)
        self._epoch, self._cursor = epoch, cursor
        for name in names:
            self._update(name, ledger.state(name), workload)
        free, fgd, stranded = self._sums
        return Totals(free, fgd / SCALE, stranded / SCALE)

    def _update(self, name: str, state: NodeState | None, workload: Workload) -> None:
        old = self._nodes.get(name)
        if old is not None and state is not None and old[0] == state.version:
            return
        if old is not None:
            self._add(old, -1)
            del self._nodes[name]
        if state is None:
            return
        new = (state.version, *measure(state, workload))
        self._nodes[name] = new
        self._add(new, 1)

    def _add(self, values: tuple[int, int, int, int], sign: int) -> None:
        sums = self._sums
        sums[0] += sign * values[1]
        sums[1] += sign * values[2]
        sums[2] += sign * values[3]


def measure(state: NodeState, workload: Workload) -> tuple[int, int, int]:
    """One node's (free milli-GPU, FGD fragmentation × SCALE, stranded × SCALE).
    O(GPUs log GPUs) when the workload's memos know the node's state."""
    lefts = tuple(sorted(state.free_milli))
    model = state.node.model
    return (
        state.free_total(),
        round(workload.amount(model, state.cpu, lefts) * SCALE),
        round(workload.stranded(model, state.cpu, lefts) * SCALE),
    )
