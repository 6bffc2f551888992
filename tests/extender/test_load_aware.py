"""The load-aware tie-break through the sidecar (`--load-aware`): filter → prioritize →
bind over HTTP as kube-scheduler drives them, with GPU loads read by the sidecar's own
poller from a reader defined here (the Prometheus one is `usage`'s); and the poller's
failure path: Prometheus down costs the tie-break, after the max age, and nothing else."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpuplace.cluster import keys
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.extender import load_polling
from gpuplace.placement import policies
from gpuplace.usage.gpu_loads import GpuLoad, GpuLoads, UsageUnavailable
from gpuplace.wiring.loads import NoLoadReader
from gpuplace.wiring.sidecar import Sidecar
from tests.extender.conftest import Harness, harness, settings

NODES = ("gpu-a", "gpu-b")
LINE = policies.Ranked()
"""The default policy's line of nodes (no rank given): its exact ties go to the first."""
FIRST, SECOND = sorted(NODES, key=lambda name: LINE.place(name) or 0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


class DictReader:
    """A `LoadReader` over a dict of utilisations (node -> GPU -> 0-1), or failing with
    `UsageUnavailable` while `down`; counts its reads."""

    def __init__(self, utilization: dict[str, dict[int, float]]) -> None:
        self.utilization = utilization
        self.down = False
        self.reads = 0
        self.windows: list[float] = []
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True

    async def gpu_loads(self, window_seconds: float) -> GpuLoads:
        self.reads += 1
        self.windows.append(window_seconds)
        if self.down:
            raise UsageUnavailable("prometheus at http://prometheus:9090 answered 503")
        return {
            node: {gpu: GpuLoad(node, gpu, value, 1 << 30) for gpu, value in gpus.items()}
            for node, gpus in self.utilization.items()
        }


class BrokenReader:
    """A reader with a bug: it raises what no reader should."""

    async def gpu_loads(self, window_seconds: float) -> GpuLoads:
        raise RuntimeError("token=s3cr3t leaked into an error")


BUSY_FIRST = {FIRST: {0: 0.95, 1: 0.9}, SECOND: {0: 0.6, 1: 0.05}}
"""The node first in line is busy; on the other, GPU 1 is idle and GPU 0 half busy."""


async def _ready(h: Harness) -> None:
    await asyncio.wait_for(h.sidecar.sync.ready.wait(), 5)


async def _loaded(h: Harness) -> tuple[load_polling.LoadBoard, load_polling.LoadPoller]:
    """The sidecar's board and poller, once synced and the first loads are read."""
    await _ready(h)
    assert h.sidecar.measured is not None
    board, poller = h.sidecar.measured.board, h.sidecar.measured.poller
    assert board is not None and poller is not None
    await h.synced(lambda: board.current() is not None)
    return board, poller


async def _scores(h: Harness, pod: dict[str, Any]) -> dict[str, int]:
    """prioritize's scores for every node (a profile that still names it), once filter
    passed exactly the node they give 10 (the shipped profile's choice)."""
    names = sorted(h.sidecar.sync.nodes)
    passed = (await h.filter(pod, names))["NodeNames"]
    scores = await h.prioritize(pod, names)
    assert passed == [name for name in names if scores[name] == 10]
    return scores


async def _pod(h: Harness, name: str) -> dict[str, Any]:
    """A half-GPU pod, once the sidecar knows it."""
    pod = h.api.create(objects.pod(name, percent=50, memory="10Gi"))
    uid = pod["metadata"]["uid"]
    await h.synced(lambda: any(r.uid == uid for r in h.sidecar.sync.pods.values()))
    return pod


async def _place(h: Harness, name: str) -> tuple[str, str, dict[str, int]]:
    """Schedule a half-GPU pod: its node, its GPUs and prioritize's scores."""
    pod = await _pod(h, name)
    scores = await _scores(h, pod)
    node = await h.schedule(pod)
    return node, h.pod("default", name)["metadata"]["annotations"][keys.ASSIGNED_GPUS], scores


def _cluster(server: localapi.Server) -> None:
    for name in NODES:
        server.api.create(objects.node(name, gpus=2))


async def test_of_two_equal_nodes_the_less_loaded_wins_and_its_idle_gpu(
    server: localapi.Server,
) -> None:
    _cluster(server)
    reader = DictReader(BUSY_FIRST)
    async with harness(
        server, load_aware=True, load_window_seconds=120.0, load_reader=lambda: reader
    ) as h:
        await _loaded(h)
        node, gpus, scores = await _place(h, "p")
        assert (node, gpus) == (SECOND, "1")
        assert scores == {SECOND: 10, FIRST: 0}
        assert reader.windows[0] == 120.0
        assert not reader.closed
    assert reader.closed  # the sidecar closes its reader when it stops


async def test_new_loads_between_two_filters_are_not_missed(
    server: localapi.Server,
) -> None:
    """filter reads the loads in force when it answers: new loads read after one filter
    move the next filter (and prioritize, for a profile that names it) to the node now
    idle; an answer prepared ahead is never involved (one node passed)."""
    _cluster(server)
    reader = DictReader(BUSY_FIRST)
    async with harness(
        server,
        load_aware=True,
        load_refresh_seconds=3600.0,
        load_reader=lambda: reader,
        workload_refresh_seconds=3600.0,
        warm_shapes=0,  # no policy rebuilt and promoted between the calls
    ) as h:
        _, poller = await _loaded(h)
        pod = await _pod(h, "p")
        names = sorted(h.sidecar.sync.nodes)
        assert (await h.filter(pod, names))["NodeNames"] == [SECOND]
        assert not h.sidecar.service.ahead
        reader.utilization = {FIRST: {0: 0.0, 1: 0.0}, SECOND: {0: 1.0, 1: 1.0}}
        assert await poller.read_once() == "ok"
        assert (await h.filter(pod, names))["NodeNames"] == [FIRST]
        assert await h.prioritize(pod, names) == {FIRST: 10, SECOND: 0}
        assert await h.schedule(pod) == FIRST


async def test_without_load_aware_the_answers_are_todays(server: localapi.Server) -> None:
    """Off (the default), the same loads change nothing: the first node in line, GPU 0."""
    _cluster(server)
    async with harness(server) as h:
        await _ready(h)
        assert h.sidecar.measured is None
        node, gpus, scores = await _place(h, "p")
        assert (node, gpus) == (FIRST, "0")
        assert scores == {FIRST: 10, SECOND: 0}


async def test_a_better_score_wins_however_busy(server: localapi.Server) -> None:
    """The default policy packs a second half share onto the half-used GPU: its node
    scores higher than an empty one, and the load never overturns that."""
    _cluster(server)
    reader = DictReader({FIRST: {0: 0.0, 1: 0.0}, SECOND: {0: 0.0, 1: 0.0}})
    async with harness(server, load_aware=True, load_reader=lambda: reader) as h:
        _, poller = await _loaded(h)
        first, gpus, _ = await _place(h, "one")
        assert (first, gpus) == (FIRST, "0")
        other = SECOND
        reader.utilization = {first: {0: 1.0, 1: 1.0}, other: {0: 0.0, 1: 0.0}}
        assert await poller.read_once() == "ok"
        node, gpus, scores = await _place(h, "two")
        assert (node, gpus) == (first, "0")
        assert scores[first] == 10


async def test_old_loads_break_no_ties_and_prometheus_down_is_logged_once(
    server: localapi.Server, caplog: pytest.LogCaptureFixture
) -> None:
    _cluster(server)
    reader = DictReader(BUSY_FIRST)
    clock = Clock()
    async with harness(
        server,
        load_aware=True,
        load_refresh_seconds=3600.0,
        load_max_age_seconds=60.0,
        load_reader=lambda: reader,
        load_clock=clock,
    ) as h:
        board, poller = await _loaded(h)
        registry = h.sidecar.registry
        assert registry.get_sample_value("gpuplace_load_age_seconds") == 0.0

        reader.down = True
        with caplog.at_level(logging.INFO, logger="gpuplace.extender.load_polling"):
            assert await poller.read_once() == "unavailable"
            clock.now += 30.0
            assert await poller.read_once() == "unavailable"
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1
        assert "503" in errors[0].__dict__["why"]
        failures = registry.get_sample_value(
            "gpuplace_load_reads_total", {"outcome": "unavailable"}
        )
        assert failures == 2.0
        assert registry.get_sample_value("gpuplace_load_age_seconds") == 30.0
        why = poller.failing_reason()
        assert why is not None and why.startswith("measured GPU loads unreadable for 30 s (")
        assert "503" in why and why.endswith("the tie-break still uses the last loads read")

        # Still within the max age: the last loads still break ties.
        pod = await _pod(h, "p")
        assert await _scores(h, pod) == {SECOND: 10, FIRST: 0}

        clock.now += 31.0  # 61 s old: too old, the policy alone decides
        assert board.current() is None
        why = poller.failing_reason()
        assert why is not None and why.endswith(
            "no loads younger than 60 s: decisions are the policy's alone"
        )
        assert await _scores(h, pod) == {FIRST: 10, SECOND: 0}
        assert await h.schedule(pod) == FIRST
        assert h.pod("default", "p")["metadata"]["annotations"][keys.ASSIGNED_GPUS] == "0"

        reader.down = False
        with caplog.at_level(logging.INFO, logger="gpuplace.extender.load_polling"):
            assert await poller.read_once() == "ok"
        assert any(r.getMessage() == "measured GPU loads read again" for r in caplog.records)
        assert board.current() is not None
        assert poller.failing_reason() is None


async def test_a_reader_that_breaks_is_counted_and_its_text_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    board = load_polling.LoadBoard(60.0)
    poller = load_polling.LoadPoller(
        BrokenReader(), board, window_seconds=300.0, refresh_seconds=1.0, registry=registry
    )
    with caplog.at_level(logging.ERROR, logger="gpuplace.extender.load_polling"):
        assert await poller.read_once() == "error"
    assert registry.get_sample_value("gpuplace_load_reads_total", {"outcome": "error"}) == 1.0
    assert board.current() is None
    assert registry.get_sample_value("gpuplace_load_age_seconds") == float("inf")
    text = " ".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "RuntimeError" in text and "s3cr3t" not in text


async def test_a_read_that_hangs_times_out() -> None:
    class Hanging:
        async def gpu_loads(self, window_seconds: float) -> GpuLoads:
            await asyncio.sleep(3600)
            return {}

    registry = CollectorRegistry()
    poller = load_polling.LoadPoller(
        Hanging(),
        load_polling.LoadBoard(60.0),
        window_seconds=300.0,
        refresh_seconds=0.05,
        registry=registry,
    )
    assert await poller.read_once() == "unavailable"


async def test_the_poller_keeps_reading_through_failures() -> None:
    reader = DictReader({"n": {0: 0.5}})
    reader.down = True
    board = load_polling.LoadBoard(60.0)
    poller = load_polling.LoadPoller(reader, board, window_seconds=300.0, refresh_seconds=0.01)
    task = asyncio.create_task(poller.run())
    try:
        deadline = asyncio.get_running_loop().time() + 5
        while reader.reads < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        reader.down = False
        while board.current() is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert reader.reads >= 3
    view = board.current()
    assert view is not None and view.level("n", 0) == 50


def test_load_aware_without_a_reader_refuses_to_start() -> None:
    api: Any = object()
    with pytest.raises(NoLoadReader, match="--load-aware"):
        Sidecar(settings(load_aware=True), CollectorRegistry(), api)
