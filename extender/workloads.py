"""The scoring policy in force, and the typical workload it scores against.

fgd and default measure fragmentation against the *typical workload*: the mix of
GPU requests the cluster usually sees. It is built from the requests of the managed
pods that arrived most recently (`LedgerSync.requests`: the last `window` pods, seeded
at start with every managed pod the first list returns), and rebuilt at most every
`refresh_seconds`, only when that window changed. Rebuilding swaps in a new policy and
a new `Chooser`, so cached node evaluations of the old one are dropped.

With no managed pod yet (a new cluster), `FALLBACK` stands in: one whole GPU (half of
the weight), half a GPU and a quarter of a GPU (a quarter each), any model, the
minimum CPU. Against it a node is "fragmented" by idle shares smaller than a quarter
GPU and by partly used GPUs, so the policy packs shares onto already-used GPUs and
keeps whole GPUs whole, which is what a binpacker should do before it knows better.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from cluster.syncing import LedgerSync
from placement import choosing, policies
from placement.fragmentation import MIN_CPU_MILLI, TaskType, Workload

log = logging.getLogger(__name__)

FALLBACK = Workload(
    (
        (TaskType(MIN_CPU_MILLI, 1000, 1, frozenset()), 0.5),
        (TaskType(MIN_CPU_MILLI, 500, 1, frozenset()), 0.25),
        (TaskType(MIN_CPU_MILLI, 250, 1, frozenset()), 0.25),
    )
)
NEEDS_WORKLOAD = frozenset({"fgd", "default"})


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
    ) -> None:
        if name not in policies.NAMES:
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(policies.NAMES)}")
        self.sync = sync
        self.name = name
        self.refresh_seconds = refresh_seconds
        self._rng = rng or random.Random()
        self._clock = clock
        self._built_from = -1
        self._built_at = -float("inf")
        self.version = 0
        """Grows with every rebuild; cached evaluations key on it."""
        self.workload: Workload | None = None
        self.chooser = self._build()

    def _build(self) -> choosing.Chooser:
        workload = None
        if self.name in NEEDS_WORKLOAD:
            requests = list(self.sync.requests)
            workload = Workload.from_requests(requests) if requests else FALLBACK
            if not workload.types:
                workload = FALLBACK
        self.workload = workload
        self._built_from = self.sync.requests_version
        # A fallback is replaced as soon as real requests exist, not a refresh later.
        self._built_at = -float("inf") if workload is FALLBACK else self._clock()
        self.version += 1
        policy = policies.make(self.name, workload=workload, rng=self._rng)
        return choosing.Chooser(self.sync.ledger, policy)

    def current(self) -> choosing.Chooser:
        """The Chooser to decide with, rebuilt first when the workload is due for it. O(1),
        O(window) on a rebuild."""
        if (
            self.name in NEEDS_WORKLOAD
            and self.sync.requests_version != self._built_from
            and self._clock() - self._built_at >= self.refresh_seconds
        ) or self.chooser.ledger is not self.sync.ledger:
            self.chooser = self._build()
            log.info(
                "typical workload rebuilt",
                extra={
                    "policy": self.name,
                    "types": len(self.workload.types) if self.workload else 0,
                    "pods": len(self.sync.requests),
                },
            )
        return self.chooser
