"""filter's answers kept for its repeats, served again while nothing they depend on changed.

An extender cannot tell kube-scheduler which cluster events matter to it, so every pod
event (another pod created, bound, its status updated) puts each pod waiting for a node
back into the scheduling queue, and kube-scheduler asks filter again: up to 182 times
within seconds for one pending pod in a real cluster (issue 18). Such a repeat names
the same nodes for the same request, and mostly nothing on those nodes changed in
between; its answer, down to the byte, is then the one already sent.

filter's answer depends on the pod's request (all of it: share, GPU memory, count,
models, topology, CPU and host memory), the nodes named, and each named node's
inventory and ledger state; and on the pod itself only where it holds a grant (the
reservation path) or a gang's capacity hold is in force (`gpuplace.placement.fences`):
those two are never kept nor served from here. So an answer is kept per (request,
names) with the position in the ledger's change log it was made at, and served again
only while the ledger is the same object (a relist replaces or restores it), the log
has every change since (else `Ledger.changes` says start over), and none of the nodes
changed since is among those named: a grant reserved or released on it, the node
added, replaced (new inventory) or removed. Not the policy: which nodes fit and why
the others do not is the same under every policy (it only ranks the fitting GPU
sets), so a rebuilt typical workload leaves kept answers current.

The extender keeps only answers that no node passed (the pending pod kube-scheduler
retries): a pod some node fits goes on to bind (or, for a tie and a profile that
names it, to prioritize, whose answer its filter prepares ahead, which a kept answer
could not).

Costs: a lookup is O(1) for the key, plus comparing the names (nothing when they are
the every-node list `gpuplace.extender.node_names.EveryNode` already holds, O(names) in
C otherwise), plus O(changes since the answer was made or last served); the set of names
it is checked against is built once per kept answer, O(names), when first needed. A kept
answer holds its bytes (a reason per node: about 0.5-1 MB at 10,000 nodes), so `KEPT`
are kept at most.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster.syncing import LedgerSync
from gpuplace.placement.ledger import Ledger
from gpuplace.placement.requests import GpuRequest

KEPT = 16
"""Answers kept (the least recently used is dropped first)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """filter's answer as sent, and what the verb does beside sending it."""

    body: bytes
    outcome: str
    failure: str = ""
    """The FailedGpuPlacement message when no node passed ("" otherwise)."""


@dataclass(slots=True)
class _Kept:
    ledger: Ledger
    epoch: int
    cursor: int
    names: Sequence[str]
    every: bool
    """`names` were every node of the ledger's inventory when kept."""
    answer: Answer
    named: set[str] | None = None


Key = tuple[GpuRequest, int, str, str]


class Repeats:
    """Answers kept for repeated filters; see the module docstring."""

    def __init__(
        self,
        sync: LedgerSync,
        *,
        size: int = KEPT,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.sync = sync
        self.size = size
        self._kept: OrderedDict[Key, _Kept] = OrderedDict()
        self.lookups = Counter(
            "gpuplace_filter_repeats_total",
            "filter calls answered with the answer kept for the same request and nodes "
            "(hit), with no answer kept (miss), or with one a change of a named node made "
            "stale (stale).",
            ["result"],
            registry=registry,
        )

    @staticmethod
    def _key(request: GpuRequest, names: Sequence[str]) -> Key:
        if not names:
            return (request, 0, "", "")
        return (request, len(names), names[0], names[-1])

    def find(self, request: GpuRequest, names: Sequence[str]) -> Answer | None:
        """The answer kept for `request` and exactly `names`, if still current. O(1) +
        O(names) to compare them when they are not the same list + O(changes since)."""
        key = self._key(request, names)
        kept = self._kept.get(key)
        if kept is None or not (names is kept.names or names == kept.names):
            self.lookups.labels("miss").inc()
            return None
        if not self._current(kept):
            del self._kept[key]
            self.lookups.labels("stale").inc()
            return None
        self._kept.move_to_end(key)
        self.lookups.labels("hit").inc()
        return kept.answer

    def _current(self, kept: _Kept) -> bool:
        ledger = self.sync.ledger
        if ledger is not kept.ledger:
            return False
        epoch, cursor, changed = ledger.changes(kept.epoch, kept.cursor)
        if changed is None:
            return False
        if changed:
            if kept.every:
                return False
            named = kept.named
            if named is None:
                named = kept.named = set(kept.names)
            if not named.isdisjoint(changed):
                return False
        kept.epoch, kept.cursor = epoch, cursor
        return True

    def keep(
        self, request: GpuRequest, names: Sequence[str], answer: Answer, *, every: bool
    ) -> None:
        """Keep `answer`, made just now (no await since the ledger was read) for `request`
        and `names` (`every`: they are every node of the inventory). O(1)."""
        ledger = self.sync.ledger
        epoch, cursor, _ = ledger.changes(-1, 0)
        key = self._key(request, names)
        self._kept[key] = _Kept(ledger, epoch, cursor, names, every, answer)
        self._kept.move_to_end(key)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def clear(self) -> None:
        self._kept.clear()
