"""`gpuplace.runtime.loop_lag`: the probe records how late the loop ran it — a loop held by
blocking work shows that work's length — and stops with its context."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from gpuplace.runtime import loop_lag


def observed(registry: CollectorRegistry) -> tuple[float, float]:
    """(count, sum) of the lag histogram."""
    count = registry.get_sample_value(loop_lag.NAME + "_count") or 0.0
    total = registry.get_sample_value(loop_lag.NAME + "_sum") or 0.0
    return count, total


def above(registry: CollectorRegistry, seconds: float) -> float:
    """Observations above `seconds` (a bucket edge)."""
    count, _ = observed(registry)
    within = registry.get_sample_value(loop_lag.NAME + "_bucket", {"le": str(seconds)})
    return count - (within or 0.0)


async def test_a_loop_held_by_blocking_work_shows_that_work_as_lag() -> None:
    registry = CollectorRegistry()
    lag = loop_lag.LoopLag(registry, interval_seconds=0.01)
    async with lag.running():
        await asyncio.sleep(0.05)  # the probe runs
        time.sleep(0.12)  # the loop held: the probe due meanwhile runs ~0.11 s late
        await asyncio.sleep(0.05)
    count, total = observed(registry)
    assert count >= 3
    assert above(registry, 0.1) >= 1  # the stall, in the bucket above 0.1 s
    assert total >= 0.1


async def test_the_probe_stops_with_its_context() -> None:
    registry = CollectorRegistry()
    async with loop_lag.LoopLag(registry, interval_seconds=0.01).running():
        await asyncio.sleep(0.05)
    assert not [task for task in asyncio.all_tasks() if task.get_name() == "gpuplace-loop-lag"]
    count, _ = observed(registry)
    await asyncio.sleep(0.05)
    assert observed(registry)[0] == count  # nothing measured after the context closed


def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="above 0"):
        loop_lag.LoopLag(CollectorRegistry(), interval_seconds=0)
