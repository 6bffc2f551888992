"""Verbs in flight: lets background work (the warmer) give way to kube-scheduler.

The event loop runs one thing at a time. A bind awaits the API twice, and every await
resumes only after whatever else is ready has run; if the warmer's slices are among
it, each resumption waits up to a slice. So the warmer scores only while no verb is
in flight (`idle`), and a verb waits at most for the one slice it arrived during (the
warmer yields the loop turns a request needs to reach its handler before it looks:
`warming.HANDOFF_TURNS`).

A pod's verbs come one after another: prioritize right after kube-scheduler has read
filter's answer (and run its own score plugins), bind right after prioritize's. A verb
that knows the next one is coming says so (`expect_next`); `idle` then stays clear
until that verb arrives, or `EXPECT_SECONDS` pass if it does not, so the warmer neither
takes the CPU kube-scheduler is reading the answer with nor makes the next verb wait
for a slice. Between pods (after bind) the warmer runs as before.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

EXPECT_SECONDS = 0.01
"""How long `expect_next` keeps background work off when the next verb does not come:
long enough for kube-scheduler to read an answer of 10,000 nodes and write the next
request (~2-5 ms), short enough that the warmer loses little when it never comes."""


class Activity:
    """Counts the verbs being answered; `idle` is set while there are none and none is
    expected. O(1)."""

    __slots__ = ("_expecting", "expect_seconds", "idle", "in_flight")

    def __init__(self, expect_seconds: float = EXPECT_SECONDS) -> None:
        self.in_flight = 0
        self.expect_seconds = expect_seconds
        self.idle = asyncio.Event()
        self.idle.set()
        self._expecting: asyncio.TimerHandle | None = None

    def __enter__(self) -> Activity:
        self.in_flight += 1
        self.idle.clear()
        self._stop_expecting()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._expecting is None:
            self.idle.set()

    def expect_next(self) -> None:
        """Another verb for the same pod follows this one (called while it is in
        flight): keep `idle` clear until a verb arrives or `expect_seconds` pass."""
        self._stop_expecting()
        self._expecting = asyncio.get_running_loop().call_later(
            self.expect_seconds, self._not_coming
        )

    def _not_coming(self) -> None:
        self._expecting = None
        if self.in_flight == 0:
            self.idle.set()

    def _stop_expecting(self) -> None:
        if self._expecting is not None:
            self._expecting.cancel()
            self._expecting = None
