"""The scoring policy in force, and the typical workload it scores against.

fgd and default measure fragmentation against the *typical workload*: the mix of
GPU requests the cluster usually sees. It is built from the requests of the managed
pods that arrived most recently (`LedgerSync.requests`: the last `window` pods, seeded
at start with every managed pod the first list returns), with gpuplace's prior
(`gpuplace.placement.fragmentation.PRIOR`: whole GPUs weigh at least a quarter, and more while
few pods were seen), and rebuilt at most every `refresh_seconds`, only when that
window changed. Rebuilding swaps in a new policy and a new `Chooser`, so cached node
evaluations of the old one are dropped (with a warmer, the new one is filled first).

Between rebuilds the workload still follows arrivals where it matters at once and
costs nothing elsewhere: the default policy scores each request against the workload
with the request's own shape counted as one more pod (`Workload.observing`; while
the workload was seen through fewer than 100 pods), a variant per shape, so a new
shape changes only its own scores, which its first filter computes anyway. A change
in the mix's proportions changes every node's score for every shape: that waits for
the refresh.

With no managed pod yet (a new cluster), `FALLBACK` stands in: one whole GPU (half of
the weight), half a GPU and a quarter of a GPU (a quarter each), any model, the
minimum CPU. Against it a node is "fragmented" by idle shares smaller than a quarter
GPU and by partly used GPUs, so the policy packs shares onto already-used GPUs and
keeps whole GPUs whole, which is what a binpacker should do before it knows better.

The sidecar's fragmentation metric is measured against the deciding policy's workload,
or, under a policy that scores against none, one built alike (`PolicyHolder.measured`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender import node_names
from gpuplace.placement import choosing, policies
from gpuplace.placement.fragmentation import MIN_CPU_MILLI, PRIOR, TaskType, Workload
from gpuplace.placement.requests import GpuRequest

log = logging.getLogger(__name__)

FALLBACK = Workload(
    (
        (TaskType(MIN_CPU_MILLI, 1000, 1, frozenset()), 0.5),
        (TaskType(MIN_CPU_MILLI, 500, 1, frozenset()), 0.25),
        (TaskType(MIN_CPU_MILLI, 250, 1, frozenset()), 0.25),
    )
)
NEEDS_WORKLOAD = frozenset({"fgd", "default"})


def typical(requests: list[GpuRequest]) -> Workload:
    """The typical workload of `requests` (most recent last), with the prior; `FALLBACK`
    where they give none. O(requests + types log types)."""
    workload = Workload.from_requests(requests, prior=PRIOR) if requests else FALLBACK
    return workload if workload.types else FALLBACK


class PolicyHolder:
    """The current policy and its Chooser over the sync's ledger; see the module docstring."""

    def __init__(
        self,
        sync: LedgerSync,
        name: str = "default",
        *,
        refresh_seconds: float = 60.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        ties: bool = False,
    ) -> None:
        """`ties`: Choosers keep the GPU sets tied with each choice (`Choice.tied`), for
        the load tie-break."""
        if name not in policies.NAMES:
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(policies.NAMES)}")
        self.sync = sync
        self.name = name
        self.refresh_seconds = refresh_seconds
        self._rng = rng or random.Random()
        self._clock = clock
        self._ties = ties
        self._built_from = -1
        self._built_at = -float("inf")
        self.version = 0
        """Grows whenever the deciding Chooser changes; cached evaluations key on it."""
        self.staged = False
        """Keep a rebuilt Chooser aside until `promote` (set when a warmer runs)."""
        self.staging: choosing.Chooser | None = None
        self.staged_event = asyncio.Event()
        """Set when a rebuilt Chooser is staged (the warmer waits on it)."""
        self._measured: Workload | None = None
        self._measured_from = -1
        self._measured_at = -float("inf")
        self.every_node = node_names.EveryNodeSets()
        """Each Chooser's every node as a set filter's arguments are compared with."""
        self.chooser = self._build()

    def _build(self) -> choosing.Chooser:
        workload = typical(list(self.sync.requests)) if self.name in NEEDS_WORKLOAD else None
        self._built_from = self.sync.requests_version
        # A fallback is replaced as soon as real requests exist, not a refresh later.
        self._built_at = -float("inf") if workload is FALLBACK else self._clock()
        policy = policies.make(self.name, workload=workload, rng=self._rng)
        return choosing.Chooser(self.sync.ledger, policy, ties=self._ties)

    @property
    def workload(self) -> Workload | None:
        """The typical workload the deciding Chooser's policy scores against."""
        workload = getattr(self.chooser.policy, "workload", None)
        return workload if isinstance(workload, Workload) else None

    def measured(self) -> Workload:
        """The typical workload the cluster's fragmentation is measured against (for
        metrics; never a decision): the deciding policy's, or for a policy that scores
        against none (best-fit, first-fit, random), one built alike from the same requests and
        rebuilt on the same rule. O(1); O(window) on a rebuild."""
        workload = self.workload
        if workload is not None:
            return workload
        stale = (
            self._measured is FALLBACK or self._clock() - self._measured_at >= self.refresh_seconds
        )
        if self._measured is None or (self.sync.requests_version != self._measured_from and stale):
            self._measured = typical(list(self.sync.requests))
            self._measured_from = self.sync.requests_version
            self._measured_at = self._clock()
        return self._measured

    def current(self) -> choosing.Chooser:
        """The Chooser to decide with. O(1); O(window) on a rebuild.

        When the workload is due for a rebuild, the new Chooser replaces the current one
        at once, unless `staged` is set: then it is kept as `staging` (see `staged_chooser`)
        and the current one keeps deciding until `promote` — so that a warmer can fill
        the new Chooser's caches first, and no verb pays for scoring every node anew. A
        replaced ledger (a relist) always swaps at once: the old Chooser reads the old one.
        """
        if self.chooser.ledger is not self.sync.ledger:
            self.staging = None
            self.staged_event.clear()
            self._swap(self._build())
        elif self._due() and self.staging is None:
            built = self._build()
            if self.staged:
                self.staging = built
                self.staged_event.set()
            else:
                self._swap(built)
        return self.chooser

    def _due(self) -> bool:
        return (
            self.name in NEEDS_WORKLOAD
            and self.sync.requests_version != self._built_from
            and self._clock() - self._built_at >= self.refresh_seconds
        )

    def staged_chooser(self) -> choosing.Chooser | None:
        """A rebuilt Chooser waiting for `promote` (only with `staged`), else None."""
        if self.staging is not None and self.staging.ledger is not self.sync.ledger:
            self.staging = None
            self.staged_event.clear()
        return self.staging

    def promote(self, chooser: choosing.Chooser) -> None:
        """Decide with `chooser` (the staged one) from now on. O(1)."""
        if chooser is self.staging:
            self.staging = None
            self.staged_event.clear()
            self._swap(chooser)

    def _swap(self, chooser: choosing.Chooser) -> None:
        self.chooser = chooser
        self.version += 1
        log.info(
            "typical workload rebuilt",
            extra={
                "policy": self.name,
                "types": len(self.workload.types) if self.workload else 0,
                "pods": len(self.sync.requests),
            },
        )
