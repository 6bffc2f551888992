"""How late the process's event loop runs what is due: `gpuplace_event_loop_lag_seconds`.

Everything `gpuplace serve` answers — the extender's verbs inside kube-scheduler's cycle,
the webhook's reviews inside the API server's request — runs on one asyncio loop. A
request that arrives while the loop is busy (a batch of watch events, another verb, the
collector) or while the process waits for a CPU (a node whose cores others keep busy)
waits for its turn before any of its own work starts; the handlers' own timings
(`gpuplace_extender_request_duration_seconds`, the webhook's) cannot show that wait.

`LoopLag` measures it the way such a request meets it: a probe asks to wake every
`interval_seconds` and records how much later than asked it ran. The figure includes the
loop's own timer resolution (its selector waits in whole milliseconds: up to 1 ms on an
idle loop). The probe costs one wake-up per interval (20 a second by default).

    lag = LoopLag(registry)
    server.add_context(lag.running)     # gpuplace.wiring.serving: started with the process
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry, Histogram

from gpuplace.runtime import background

NAME = "gpuplace_event_loop_lag_seconds"
BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""From the timer's resolution (1 ms) to a stall no request should meet."""


class LoopLag:
    """The probe and its histogram, registered in `registry` at construction."""

    def __init__(self, registry: CollectorRegistry, interval_seconds: float = 0.05) -> None:
        if interval_seconds <= 0:
            raise ValueError("interval_seconds must be above 0")
        self.interval = interval_seconds
        self.histogram = Histogram(
            NAME,
            "How much later than due the event loop ran a probe that asks to wake at a "
            "fixed interval (0.05 s in gpuplace serve): what a request arriving then waits "
            "before its own work starts (the "
            "loop busy with other work, or the process waiting for a CPU). Includes up to "
            "1 ms of the loop's timer resolution.",
            buckets=BUCKETS,
            registry=registry,
        )

    async def probe(self) -> None:
        """Measure until cancelled. O(1) per wake-up."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self.histogram.observe(max(0.0, loop.time() - due))

    def running(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The probe as a task for as long as the context is open."""
        return background.running(self.probe(), "gpuplace-loop-lag")
