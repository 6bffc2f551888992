"""Scoring ahead: the evaluations of the request shapes the cluster runs most, kept
current in the background so that kube-scheduler's filter rarely waits for a node to
be scored.

A filter for a request shape the engine has not evaluated yet must score every
named node once (about 40 µs each in Python: 0.4 s on 10,000 nodes); later filters
for the same shape only re-score the nodes that changed (`choosing.Chooser.evaluate`).
The `Warmer` takes the `shapes` most common *scoring shapes* (a request without its
host memory, which decides fit but never a score) among the recent managed pods
(`LedgerSync.requests`, the same window the typical workload is built from), then up
to `pending_shapes` other shapes of pods waiting for a node (`LedgerSync.pending`,
most waiting first: a backlog's rare shapes, an unschedulable pod kube-scheduler
retries), and has each one's every node scored (`Chooser.prepare`), in that order, in
slices of about `slice_seconds` between which the event loop serves the verbs; a
slice starts only while no verb is in flight (`gpuplace.extender.activity`), looked at once a
request that arrived during the last slice has had the loop turns it needs to reach
its handler (`HANDOFF_TURNS`). It looks again
every `interval` seconds; a warm shape then costs O(nodes changed since).

It also makes the typical workload's refresh seamless: the `PolicyHolder` is told to
stage a rebuilt Chooser instead of swapping it in, the warmer fills the staged one for
the same shapes, then promotes it. Until then the previous policy keeps deciding.

A shape never seen before whose filter comes before the warmer got to it (a pod of a
new shape in an idle cluster: kube-scheduler calls filter milliseconds after the pod
is created) is still scored in full by that filter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as CounterMetric

from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender.activity import Activity
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement import choosing
from gpuplace.placement.requests import GpuRequest, Topology
from gpuplace.runtime import gc_tuning

log = logging.getLogger(__name__)

BATCH = 8
"""Nodes scored between two looks at the clock."""
COUNT_SLICE = 2000
"""Recent requests counted between two yields to the event loop."""
HANDOFF_TURNS = 4
"""Event-loop turns the warmer yields after a slice before it looks for a verb in
flight. A request whose bytes arrive during a slice reaches its handler (which marks
it in flight) only some turns later: four with aiohttp 3.14 on an open connection
(kube-scheduler keeps its connection to the extender alive), as
tests/extender/test_warming.py measures over a real socket. Looking after one turn,
the warmer ran three more slices (~1 ms each) ahead of that verb. Each extra turn
costs microseconds when nothing is waiting."""


class Warmer:
    """See the module docstring."""

    def __init__(
        self,
        sync: LedgerSync,
        holder: PolicyHolder,
        *,
        shapes: int = 64,
        pending_shapes: int = 16,
        interval: float = 0.2,
        recount_seconds: float = 10.0,
        slice_seconds: float = 0.001,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.perf_counter,
        activity: Activity | None = None,
        freeze_young_above: int | None = None,
    ) -> None:
        if shapes + pending_shapes > choosing.EVALUATIONS_KEPT:
            raise ValueError(
                f"{shapes} + {pending_shapes} shapes to score ahead: the engine keeps "
                f"{choosing.EVALUATIONS_KEPT} at most"
            )
        self.sync = sync
        self.holder = holder
        self.activity = activity
        """When given, slices start only while no verb is in flight."""
        self.freeze_young_above = freeze_young_above
        """Passed to `gpuplace.runtime.gc_tuning.collect_young` between slices."""
        self.shapes = shapes
        self.pending_shapes = pending_shapes
        self.interval = interval
        self.recount_seconds = recount_seconds
        self.slice_seconds = slice_seconds
        self._clock = clock
        self._counted_at = -1
        self._counted_when = -float("inf")
        self._typical: list[GpuRequest] = []
        self._ahead: list[GpuRequest] = []
        self.warm = asyncio.Event()
        """Set once every typical shape has been scored on every node (the first time)."""
        holder.staged = shapes > 0
        self.warm_shapes = Gauge(
            "gpuplace_warm_request_shapes",
            "Request shapes (without host memory) whose every node is scored ahead.",
            registry=registry,
        )
        self.scored = CounterMetric(
            "gpuplace_nodes_scored_ahead_total",
            "Node evaluations done ahead of kube-scheduler's calls.",
            registry=registry,
        )

    @property
    def counted(self) -> list[GpuRequest]:
        """The typical shapes as last counted (most common first)."""
        return list(self._typical)

    @property
    def ahead(self) -> list[GpuRequest]:
        """Every shape the last fill scored ahead: the typical ones, then those of
        waiting pods (`wanted`)."""
        return list(self._ahead)

    async def wanted(self) -> list[GpuRequest]:
        """The shapes to score ahead: the typical ones (`typical`), then up to
        `pending_shapes` others that pods wait for, most waiting pods first.
        O(window) when the typical ones are recounted, else O(waiting shapes)."""
        typical = await self.typical()
        if self.pending_shapes <= 0 or not self.sync.pending:
            return typical
        known = set(typical)
        extra = [
            shape
            for shape, _ in self.sync.pending.most_common(len(typical) + self.pending_shapes)
            if shape not in known
        ]
        return typical + extra[: self.pending_shapes]

    async def typical(self) -> list[GpuRequest]:
        """The `shapes` most common scoring shapes among the recent GPU requests, most
        common first. O(window) in slices, recounted at most every `recount_seconds` and
        only when the window changed."""
        now = time.monotonic()
        if self._counted_at == self.sync.requests_version or (
            now - self._counted_when < self.recount_seconds and self._typical
        ):
            return self._typical
        self._counted_at = self.sync.requests_version
        self._counted_when = now
        recent = list(self.sync.requests)
        counts: Counter[tuple[int, int, int, frozenset[str], int, Topology]] = Counter()
        # Counted by field tuple: `choosing.scoring_shape` per request (a dataclass
        # replace) costs ten times more; the shapes are rebuilt from the top tuples.
        for start in range(0, len(recent), COUNT_SLICE):
            counts.update(
                (r.milli, r.memory_mib, r.count, r.models, r.cpu_milli, r.topology)
                for r in recent[start : start + COUNT_SLICE]
                if r.count > 0
            )
            await asyncio.sleep(0)
        self._typical = [
            GpuRequest(milli, memory, count, models, cpu, 0, topology)
            for (milli, memory, count, models, cpu, topology), _ in counts.most_common(self.shapes)
        ]
        return self._typical

    async def fill(self, chooser: choosing.Chooser) -> int:
        """Score every node for every wanted shape on `chooser`, yielding to the event
        loop every `slice_seconds`. Returns the number of shapes now complete."""
        complete = 0
        began = [self._clock()]

        async def pause_when_due() -> None:
            if self._clock() - began[0] >= self.slice_seconds:
                gc_tuning.collect_young(self.freeze_young_above)
                for _ in range(HANDOFF_TURNS):
                    await asyncio.sleep(0)
                if self.activity is not None:
                    await self.activity.idle.wait()
                began[0] = self._clock()

        self._ahead = await self.wanted()
        for shape in self._ahead:
            if chooser.ledger is not self.sync.ledger:
                break
            missing = chooser.missing(shape)
            for start in range(0, len(missing), BATCH):
                self.scored.inc(chooser.prepare(shape, missing[start : start + BATCH]))
                await pause_when_due()
            complete += 1
            await pause_when_due()
        if chooser.ledger is self.sync.ledger:
            chooser.prepare_memory()
            self.holder.every_node.of(chooser)  # filter's set of every node's name, ahead
        gc_tuning.collect_young(self.freeze_young_above)
        return complete

    async def run(self) -> None:
        """Fill the deciding Chooser (or a staged one, then promote it) forever."""
        if self.shapes <= 0:
            return
        await self.sync.ready.wait()
        while True:
            self.holder.current()  # stages a rebuild when one is due
            staged = self.holder.staged_chooser()
            if staged is not None:
                began = time.monotonic()
                await self.fill(staged)
                self.holder.promote(staged)
                log.info(
                    "rebuilt policy scored ahead and promoted",
                    extra={"seconds": round(time.monotonic() - began, 2)},
                )
            complete = await self.fill(self.holder.current())
            self.warm_shapes.set(complete)
            self.warm.set()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
            # that races with the event, and the task would never stop
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self.holder.staged_event.wait()
