"""Elastic gangs' arithmetic: how many members to start, to add, to give back.

A gang with `gang-min` below `gang-size` may run with any count from `gang-min` to
`gang-size`. It starts with every member when all fit, else with the largest count that
fits (never below `gang-min`); once running it grows by the largest count of its missing
members that fits; under pressure it gives back its extra members (beyond `gang-min`),
the most recently started first, before any whole workload is preempted
(`gpuplace.placement.queueing.reclaiming`).

"Fits" is the caller's test (quota and a real place, `gpuplace.placement.queueing.admitting`).
Counts are searched by bisection, which assumes that if k members fit so do fewer: true
of quota, and of placement on the engine's packing rules for equal members; for members
of different shapes it may miss a larger count that fits (the next round tries again).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def largest(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest k in [`low`, `high`] with `fits(k)`, by bisection (see the module
    docstring); None when not even `low` fits (or the range is empty). O(log(high - low))
    calls of `fits`."""
    if low > high or not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def start(fits: Callable[[int], bool], minimum: int, size: int) -> int | None:
    """Members to start a gang of `size` with: all when they fit, else the most that fit
    from `minimum` up; None when not even `minimum` fit. A gang that is not elastic
    (`minimum` 0 or `size`) starts whole or not at all. O(log size) calls of `fits`."""
    if size <= 0:
        raise ValueError("a gang has at least one member")
    if fits(size):
        return size
    if not 0 < minimum < size:
        return None
    return largest(fits, minimum, size - 1)


def grow(fits: Callable[[int], bool], missing: int) -> int:
    """How many of `missing` members to add now: the most that fit (0: none).
    O(log missing) calls of `fits`."""
    if missing <= 0:
        return 0
    return largest(fits, 1, missing) or 0


def extras(started: Sequence[T], minimum: int) -> list[T]:
    """The members a running elastic gang gives back first under pressure, in that order:
    those beyond `minimum`, the most recently started (last in `started`) first. O(n)."""
    if minimum <= 0 or minimum >= len(started):
        return []
    return list(reversed(started[minimum:]))
