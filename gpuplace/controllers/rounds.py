"""The leader-gated round loop the gang and queue controllers run in.

A controller decides in rounds, never per event. `Rounds.run(step, follow)` first waits
for what the controller reads to be listed (`ready`: informers' events), then, until
cancelled:

1. **lead or follow**: while this replica decides (`active()`, None: always; the sidecar
   passes its `gpuplace.controllers.leader.LeaseFollower`), `leading` reads 1 and
   `await step()` runs a round; otherwise it reads 0 and `follow()` does what a follower
   does (drop what only a leader may hold, tell the waiting pods when gpuplace cannot
   tell who leads). Every round that returns counts (`rounds`, which tests wait on); one
   that raises `kube.ApiError` is logged and tried again at the next (never raised);
2. **wait** until something wakes it (`wake`, `poke`: the controller's listeners on its
   pods, the ledger, its queues), an alarm it set for this round (`alarm`: a timeout or a
   retry that falls due), or `poll_seconds`, whichever comes first;
3. **settle** `settle_seconds` more, so that a burst of events makes one round, and if
   the last round that decided (`decided()`) did so less than `min_round_seconds` ago,
   the rest of that.

The throttling is one rule for both controllers, with their own figures
(`gpuplace.gangs.controller.GangSettings`, `gpuplace.queues.controller.QueueSettings`):
the gang controller settles 0.05 s and spaces nothing (a gang round that finds nothing
changed costs O(gang pods): each gang's plan is tried once per change), the queue
controller settles 0.2 s and spaces deciding rounds 1 s apart (a round over 1,000 nodes
costs 1-2 s of the event loop the extender shares). Alarms are the gang controller's
(gang timeouts, preemption retries); they are set anew by each round, so a follower
never wakes for a leader's alarm. No I/O of its own; the clock is the controller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from prometheus_client import Gauge

from gpuplace.cluster import kube

log = logging.getLogger(__name__)


class Rounds:
    """See the module docstring. `name` ("gang", "queue") words the log lines;
    `clock` (POSIX seconds) is the one `alarm` times are read against."""

    def __init__(
        self,
        name: str,
        *,
        leading: Gauge,
        active: Callable[[], bool] | None = None,
        poll_seconds: float,
        settle_seconds: float,
        min_round_seconds: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self.leading = leading
        self.active = active
        self.poll_seconds = poll_seconds
        self.settle_seconds = settle_seconds
        self.min_round_seconds = min_round_seconds
        self.clock = clock
        self.rounds = 0
        """Completed rounds, deciding or following."""
        self.decided_at = float("-inf")
        """`time.monotonic()` when the last round that decided made its decision
        (`decided`)."""
        self._wake = asyncio.Event()
        self._next = float("inf")

    def wake(self) -> None:
        """Run a round soon."""
        self._wake.set()

    def poke(self, *_: object) -> None:
        """`wake`, as a listener of any change (its arguments are not read)."""
        self._wake.set()

    def alarm(self, at: float, now: float) -> None:
        """Wake up at `at` (`clock` seconds) at the latest; only a future time counts."""
        if at > now:
            self._next = min(self._next, at)

    def decided(self) -> None:
        """The round under way has decided (ran the engine): the next one waits for
        `min_round_seconds` from now."""
        self.decided_at = time.monotonic()

    def leads(self) -> bool:
        """Whether this replica decides now (`active`, None: always)."""
        return self.active is None or self.active()

    async def run(
        self,
        step: Callable[[], Awaitable[None]],
        follow: Callable[[], None],
        *,
        ready: Iterable[asyncio.Event] = (),
    ) -> None:
        """Wait for `ready`, then run rounds until cancelled (module docstring)."""
        for event in ready:
            await event.wait()
        while True:
            self._next = float("inf")
            try:
                leading = self.leads()
                self.leading.set(1 if leading else 0)
                if leading:
                    await step()
                else:
                    follow()
                self.rounds += 1
            except kube.ApiError as error:
                log.warning(
                    f"{self.name} round failed, retrying",
                    extra={"status": error.status, "reason": error.reason},
                )
            delay = min(self.poll_seconds, max(self._next - self.clock(), 0.0))
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
            # that races with the event, and the task would never stop
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.settle_seconds)
            rest = self.decided_at + self.min_round_seconds - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)
