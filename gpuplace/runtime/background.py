"""A coroutine run as a task for as long as an async context is open: the shape of every
poller and probe a process keeps beside its sites (certificate and inventory reloads,
the event-loop lag probe), started when the context is entered and cancelled, and
awaited, when it is left."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def running(work: Coroutine[Any, Any, None], name: str) -> AsyncIterator[None]:
    """`work` as the task `name` while the context is open; cancelled on exit."""
    task = asyncio.create_task(work, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
