"""Measured GPU load for the opt-in load tie-break (`--load-aware`, `gpuplace.placement.load_ties`):
the latest loads read (`LoadBoard`) and the background task that reads them
(`LoadPoller`) from a `gpuplace.usage.gpu_loads.LoadReader` (Prometheus).

The board hands the engine its loads only while they are younger than `max_age`; older
ones, or none yet, are no loads at all, and every decision is then exactly the policy's.
So a Prometheus that stops answering costs the tie-break, after `max_age`, and nothing
else: filter, prioritize and bind go on as without `--load-aware`.

A failed read is counted (`gpuplace_load_reads_total{outcome}`) and logged once per
outage at ERROR with the reader's own message (which names no credential), and its
recovery at INFO; the age of the loads in use is a gauge (`gpuplace_load_age_seconds`,
+Inf before the first read); while reads fail, `LoadPoller.failing_reason` says since when
and why (the sidecar shows it in /readyz under `degraded`, which stays 200).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuplace.placement import load_ties
from gpuplace.usage.gpu_loads import GpuLoads, LoadReader, UsageUnavailable

log = logging.getLogger(__name__)


class LoadBoard:
    """The latest loads read, and whether they may still break ties. O(1) to read."""

    def __init__(self, max_age: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age = max_age
        self.clock = clock
        """The clock the loads' age is measured on."""
        self._latest: load_ties.Loads | None = None

    def store(self, measured: GpuLoads) -> None:
        """Keep `measured` (read just now) as the latest. O(GPUs measured)."""
        utilization = {
            node: {index: load.utilization for index, load in gpus.items()}
            for node, gpus in measured.items()
        }
        self._latest = load_ties.Loads.measured(utilization, self.clock())

    def current(self) -> load_ties.Loads | None:
        """The loads to break ties with now: the latest, unless older than `max_age`
        (then None: no tie-break). The same object until the next `store`, so a
        decision made with it can tell whether it is still current. O(1)."""
        latest = self._latest
        if latest is None or not latest.fresh(self.clock(), self.max_age):
            return None
        return latest

    def age(self) -> float:
        """Seconds since the latest loads were read; +Inf before the first. O(1)."""
        latest = self._latest
        return math.inf if latest is None else max(self.clock() - latest.measured_at, 0.0)


class LoadPoller:
    """Reads every GPU's load over the last `window_seconds` every `refresh_seconds`
    into `board`, for as long as `run` runs. A read that takes longer than
    `refresh_seconds` counts as unavailable."""

    def __init__(
        self,
        reader: LoadReader,
        board: LoadBoard,
        *,
        window_seconds: float,
        refresh_seconds: float,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.reader = reader
        self.board = board
        self.window_seconds = window_seconds
        self.refresh_seconds = refresh_seconds
        self._failing = False
        self._why = ""
        self._failing_since = 0.0
        self.reads = Counter(
            "gpuplace_load_reads_total",
            "Reads of measured GPU load for the load-aware tie-break, by outcome (ok, "
            "unavailable: the source did not answer, error: the reader failed otherwise).",
            ["outcome"],
            registry=registry,
        )
        self.age = Gauge(
            "gpuplace_load_age_seconds",
            "Age of the latest measured GPU loads (+Inf before the first read); older than "
            "--load-max-age-seconds, they break no ties.",
            registry=registry,
        )
        self.age.set_function(board.age)

    async def read_once(self) -> str:
        """One read into the board; its outcome (ok, unavailable, error)."""
        try:
            measured = await asyncio.wait_for(
                self.reader.gpu_loads(self.window_seconds), self.refresh_seconds
            )
        except TimeoutError:
            return self._failed("unavailable", f"no answer within {self.refresh_seconds:g} s")
        except UsageUnavailable as error:
            return self._failed("unavailable", str(error))
        except Exception as error:  # a reader's bug must not end the polling
            # Its type only: an unexpected error's text may carry what a reader was
            # given (an address with credentials), which is never logged.
            return self._failed("error", f"the reader raised {type(error).__name__}")
        self.board.store(measured)
        self.reads.labels("ok").inc()
        if self._failing:
            self._failing = False
            log.info("measured GPU loads read again", extra={"nodes": len(measured)})
        return "ok"

    def _failed(self, outcome: str, why: str) -> str:
        self.reads.labels(outcome).inc()
        self._why = why[:300]
        if not self._failing:
            self._failing = True
            self._failing_since = self.board.clock()
            log.error(
                "cannot read measured GPU loads: the load-aware tie-break stops once the "
                "last loads are too old (is --usage-prometheus reachable from this pod? the "
                "shipped NetworkPolicy lets it reach only the API server and DNS until "
                "widened: docs/deploy.md, NetworkPolicy)",
                extra={"why": self._why, "max_age_seconds": self.board.max_age},
            )
        return outcome

    def failing_reason(self) -> str | None:
        """None while the last read succeeded (or none was made yet); else since when
        reads fail, why, and whether the tie-break still has loads to use. O(1)."""
        if not self._failing:
            return None
        since = max(self.board.clock() - self._failing_since, 0.0)
        state = (
            "the tie-break still uses the last loads read"
            if self.board.current() is not None
            else f"no loads younger than {self.board.max_age:g} s: decisions are the policy's alone"
        )
        return f"measured GPU loads unreadable for {since:.0f} s ({self._why}); {state}"

    async def run(self) -> None:
        while True:
            await self.read_once()
            await asyncio.sleep(self.refresh_seconds)
