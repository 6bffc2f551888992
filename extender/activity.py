"""Verbs in flight: lets background work (the warmer) give way to kube-scheduler.

The event loop runs one thing at a time. A bind awaits the API twice, and every await
resumes only after whatever else is ready has run; if the warmer's slices are among
it, each resumption waits up to a slice. So the warmer scores only while no verb is
in flight (`idle`), and a verb waits at most for the one slice it arrived during (the
warmer yields the loop turns a request needs to reach its handler before it looks:
`warming.HANDOFF_TURNS`).
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class Activity:
    """Counts the verbs being answered; `idle` is set while there are none. O(1)."""

    __slots__ = ("idle", "in_flight")

    def __init__(self) -> None:
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def __enter__(self) -> Activity:
        self.in_flight += 1
        self.idle.clear()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()
