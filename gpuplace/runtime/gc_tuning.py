"""The cyclic garbage collector's tuning, in one place: every call gpuplace's processes
make to `gc`, and why.

gpuplace keeps large object graphs alive for the life of a process (the sidecar's
ledger, ~1 KB of records per pod, the engine's per-node caches; the imported libraries)
and answers requests that must not wait. CPython's cyclic collector traverses every
tracked object of the generations it collects: a full pass over all of them, or a young
one grown large, costs tens to hundreds of milliseconds, paid by whichever verb or
review runs into it. So:

- `freeze()` (`gpuplace serve` once started, `serving.Server.freeze_gc`): collect once,
  then move everything alive out of the collector's sight (`gc.freeze`, O(1)): the
  ~70,000 objects of the imported libraries are never traversed again (~30 ms a pass).
- `paused()` (an informer's relist, `gpuplace.cluster.watching`): no automatic pass
  while a large list is built; its objects are not garbage, and collecting as they
  arrive traverses them again and again (a list of 100,000 pods several times slower).
- `collect_young(freeze_above)` (the warmer between its slices, `gpuplace.extender.warming`,
  and the sidecar's loop): the young generations collected while they are small.
- `keep_passes_short(...)` (the sidecar's loop, `gpuplace.wiring.sidecar`, `--gc-young-seconds`,
  `--gc-freeze-seconds`, `--gc-full-seconds`): after the first sync and then
  periodically, what lives is frozen and automatic full passes are off
  (`freeze_survivors`); a full unfrozen pass runs every `full_seconds`, between verbs.

Frozen objects are still freed by reference counting; only cyclic garbage waits for the
next full unfrozen pass. The dev tools' in-memory API (`gpuplace.dev.localapi`, when it runs
as its own process) freezes its set-up objects through `freeze()` for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Iterator

log = logging.getLogger(__name__)

FULL_PASS_NEVER = 1 << 30
"""gc threshold of the oldest generation once a process runs its own full passes."""

YOUNG_FREEZE = 5_000
"""Young objects above which `collect_young` freezes rather than collects (see there)."""


def freeze() -> None:
    """Collect everything once, then freeze what is alive (at a process's start). O(objects)."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside the block (restored as it was after). O(1)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def collect_young(freeze_above: int | None = None) -> None:
    """Collect the young generations now, while they are small (O(objects allocated
    since the last call that are still alive)).

    CPython (3.11) counts container allocations *minus deallocations* towards its
    automatic young collections. Scoring ahead replaces old outcomes with new ones,
    so the count barely moves while the young generation grows to hundreds of
    thousands of objects; the collection that finally comes then traverses all of
    them in the middle of a verb (40-270 ms at 10,000 nodes). The warmer calls this
    between its slices instead: the middle generation is collected when it is due by
    the collector's own threshold, else the youngest.

    With `freeze_above`, a young generation larger than that (a filter that scored
    every node for a new request shape leaves ~40,000 live objects, 15-40 ms to
    traverse) is frozen instead (`gc.freeze`, O(1); counting it is ~30 times cheaper
    than collecting it): the objects are long-lived evaluations, and whatever cyclic
    garbage is among them waits for the next full unfrozen pass. Only for callers
    that run such passes (`young_freeze_limit`)."""
    if freeze_above is not None and len(gc.get_objects(0)) > freeze_above:
        gc.freeze()
        return
    middle_due = gc.get_count()[1] >= gc.get_threshold()[1]
    gc.collect(1 if middle_due else 0)


def young_freeze_limit(freeze_seconds: float, full_seconds: float) -> int | None:
    """`collect_young`'s `freeze_above`: large young generations are frozen only when
    freezing is on and full unfrozen passes will come (None: always collected)."""
    if freeze_seconds > 0 and full_seconds > 0:
        return YOUNG_FREEZE
    return None


def freeze_survivors() -> int:
    """Collect the young cycles (short), freeze everything alive and turn automatic full
    passes off: the long-lived state as `keep_passes_short` leaves it after the first
    sync. Returns the number of frozen objects. O(young objects)."""
    gc.collect(1)  # short; older cyclic garbage waits for the first full pass
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_PASS_NEVER)
    return gc.get_freeze_count()


async def keep_passes_short(
    ready: asyncio.Event,
    *,
    young_seconds: float,
    freeze_seconds: float,
    full_seconds: float,
) -> None:
    """Keep the cyclic collector's passes short for a process holding a large ledger
    (module docstring), until cancelled.

    Once `ready` is set (the first sync is in), and then every `freeze_seconds`, young
    cycles are collected and everything alive is frozen, with automatic full passes off
    (they would run every few decisions, each over everything allocated since the last
    freeze; on 10,000 nodes 0.1-0.5 s in the middle of a verb). Cyclic garbage that
    outlived a freeze is reclaimed by a full unfreeze + collect every `full_seconds`,
    between verbs. Every `young_seconds` the young generations are collected
    (`collect_young`). A period of 0 turns its part off; with `freeze_seconds` 0 there
    are no full passes of ours either."""
    freezing = freeze_seconds > 0
    full_every = full_seconds if freezing else 0.0
    periods = [every for every in (young_seconds, freeze_seconds) if every]
    if not periods:
        return
    await ready.wait()
    if freezing:
        log.info("initial state frozen for the collector", extra={"objects": freeze_survivors()})
    loop = asyncio.get_running_loop()
    last_freeze = last_full = loop.time()
    while True:
        await asyncio.sleep(min(periods))
        now = loop.time()
        if full_every and now - last_full >= full_every:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            last_full = last_freeze = now
        elif freezing and now - last_freeze >= freeze_seconds:
            gc.collect(1)
            gc.freeze()
            last_freeze = now
        elif young_seconds:
            collect_young(young_freeze_limit(freeze_seconds, full_seconds))
