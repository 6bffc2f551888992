"""Scoring ahead (gpuplace.extender.warming): the most common request shapes get every node
scored in the background, in slices that let the event loop run, and a rebuilt policy
decides only once it is filled the same way."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from collections.abc import Iterable

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender.activity import Activity
from gpuplace.extender.warming import Warmer
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement import choosing
from gpuplace.placement.choosing import scoring_shape
from gpuplace.placement.ledger import Grant, Ledger, NodeState
from gpuplace.placement.requests import GpuRequest
from tests.cluster.test_syncing import node_record


def cluster(nodes: int = 40) -> LedgerSync:
    sync = LedgerSync()
    sync.replace_nodes([node_record(f"n{i}", gpus=4) for i in range(nodes)])
    return sync


def arrive(sync: LedgerSync, *requests: GpuRequest) -> None:
    for request in requests:
        sync.requests.append(request)
        sync.requests_version += 1


HALF = GpuRequest(500, count=1, cpu_milli=1000, host_memory_mib=2048)
QUARTER = GpuRequest(250, count=1, cpu_milli=1000, host_memory_mib=512)
WHOLE = GpuRequest(1000, count=1, cpu_milli=4000)


async def test_common_shapes_are_scored_on_every_node_most_common_first() -> None:
    sync = cluster()
    arrive(sync, HALF, HALF, QUARTER, QUARTER, QUARTER, WHOLE)
    registry = CollectorRegistry()
    holder = PolicyHolder(sync, "default")
    warmer = Warmer(sync, holder, shapes=2, registry=registry)
    typical = await warmer.typical()
    assert [shape.milli for shape in typical] == [250, 500]
    assert all(shape.host_memory_mib == 0 for shape in typical)
    chooser = holder.current()
    names = list(sync.ledger.inventory.names())
    assert chooser.unseen(HALF, names) == set(names)
    assert await warmer.fill(chooser) == 2
    assert chooser.unseen(HALF, names) == set() and chooser.unseen(QUARTER, names) == set()
    assert chooser.unseen(WHOLE, names) == set(names)  # not among the 2 most common
    assert registry.get_sample_value("gpuplace_nodes_scored_ahead_total") == 80
    assert await warmer.fill(chooser) == 2
    assert registry.get_sample_value("gpuplace_nodes_scored_ahead_total") == 80  # nothing new


async def test_filling_yields_to_the_event_loop() -> None:
    sync = cluster(400)
    arrive(sync, HALF)
    holder = PolicyHolder(sync, "default")
    warmer = Warmer(sync, holder, shapes=1, slice_seconds=0.0)
    ticks = 0

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_work())
    await warmer.fill(holder.current())
    task.cancel()
    assert ticks >= 400 // 8 - 1  # at least once per batch of nodes


async def test_filling_keeps_the_young_generations_collected() -> None:
    """Between slices the young generations are collected, so the collector never
    meets a young generation grown by allocation-for-deallocation churn."""
    sync = cluster(400)
    arrive(sync, HALF)
    holder = PolicyHolder(sync, "default")
    warmer = Warmer(sync, holder, shapes=1, slice_seconds=0.0)
    passes: list[int] = []

    def collected(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            passes.append(info["generation"])

    gc.callbacks.append(collected)
    try:
        await warmer.fill(holder.current())
    finally:
        gc.callbacks.remove(collected)
    assert len(passes) >= 400 // 8 - 1  # one per slice at least
    assert 1 in passes  # the middle generation when its threshold came


def sliced(nodes: int) -> tuple[Warmer, Activity, choosing.Chooser]:
    """A warmer for one shape (HALF) on `nodes` nodes, a slice per batch, that gives way
    to the returned activity."""
    sync = cluster(nodes)
    arrive(sync, HALF)
    holder = PolicyHolder(sync, "default")
    activity = Activity()
    warmer = Warmer(sync, holder, shapes=1, slice_seconds=0.0, activity=activity)
    return warmer, activity, holder.current()


async def test_slices_wait_while_a_verb_is_in_flight() -> None:
    warmer, activity, chooser = sliced(400)
    names = list(chooser.ledger.inventory.names())
    with activity:
        filling = asyncio.create_task(warmer.fill(chooser))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not filling.done()
        assert len(chooser.unseen(HALF, names)) == 400 - 8  # one batch, then it waited
    assert await filling == 1
    assert chooser.unseen(HALF, names) == set()


async def test_slices_wait_for_the_verb_a_verb_says_is_next() -> None:
    """After filter (prioritize follows) or prioritize (bind follows) the warmer waits
    for that verb, or until the expectation lapses when it does not come."""
    warmer, _, chooser = sliced(400)
    activity = Activity(expect_seconds=0.2)
    warmer.activity = activity
    names = list(chooser.ledger.inventory.names())
    with activity:
        filling = asyncio.create_task(warmer.fill(chooser))
        for _ in range(20):
            await asyncio.sleep(0)
        activity.expect_next()
    for _ in range(20):  # filter's answer sent; prioritize is expected
        await asyncio.sleep(0)
    assert not activity.idle.is_set()
    assert len(chooser.unseen(HALF, names)) == 400 - 8  # still the one batch
    with activity:  # prioritize came: the expectation is met
        activity.expect_next()  # and bind is expected next
    with activity:  # bind came, and expects nothing
        pass
    assert activity.idle.is_set()
    assert await filling == 1
    # Expected but never coming: the warmer waits only so long.
    with activity:
        activity.expect_next()
    began = time.monotonic()
    await asyncio.wait_for(activity.idle.wait(), 2)
    assert time.monotonic() - began >= 0.15


async def test_a_request_arriving_during_a_slice_is_served_before_the_next_slice() -> None:
    """Over a real socket: bytes that arrive while a slice runs reach their handler (which
    marks itself in flight) before the warmer starts another slice."""
    warmer, activity, chooser = sliced(400)
    slices: list[int] = []
    sending = threading.Event()
    served_after: list[int] = []

    class Batches:
        """Stands in for the warmer's counter, bumped once per batch (one slice here)."""

        def inc(self, amount: float = 1) -> None:
            slices.append(1)
            if len(slices) == 5:
                sending.set()  # the client sends now, while this slice holds the loop
                time.sleep(0.25)  # (time for the client thread to run on a loaded machine)

    warmer.scored = Batches()  # type: ignore[assignment]

    async def handle(request: web.Request) -> web.Response:
        with activity:
            served_after.append(len(slices))
            await request.read()
            return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/filter", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    replies: list[bytes] = []

    connected = threading.Event()

    def client() -> None:
        with socket.create_connection(("127.0.0.1", port)) as connection:
            connected.set()
            sending.wait(10)
            connection.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            replies.append(connection.recv(1024))

    thread = threading.Thread(target=client)
    thread.start()
    try:
        assert await asyncio.to_thread(connected.wait, 10)
        await asyncio.sleep(0.05)  # the server accepts the connection before the slices
        assert await warmer.fill(chooser) == 1
    finally:
        thread.join(10)
        await runner.cleanup()
    assert replies and replies[0].startswith(b"HTTP/1.1 200")
    # No slice ran between the bytes and the handler (looking after one turn: [8]).
    assert served_after == [5]


async def test_a_rebuilt_policy_decides_only_once_filled() -> None:
    now = [0.0]
    sync = cluster()
    arrive(sync, HALF)
    holder = PolicyHolder(sync, "default", refresh_seconds=10, clock=lambda: now[0])
    warmer = Warmer(sync, holder, shapes=4, interval=0.01)
    first = holder.current()
    version = holder.version
    arrive(sync, QUARTER, QUARTER)
    now[0] = 11.0
    assert holder.current() is first  # staged, not swapped
    staged = holder.staged_chooser()
    assert staged is not None and staged is not first
    assert holder.version == version
    sync.ready.set()
    task = asyncio.create_task(warmer.run())
    try:
        await asyncio.wait_for(warmer.warm.wait(), 5)
    finally:
        task.cancel()
    assert holder.current() is staged
    assert holder.version == version + 1
    assert holder.workload is not None and len(holder.workload.observed) == 2
    names = list(sync.ledger.inventory.names())
    assert staged.unseen(QUARTER, names) == set() and staged.unseen(HALF, names) == set()


def test_without_a_warmer_a_rebuild_swaps_at_once() -> None:
    now = [0.0]
    sync = cluster(2)
    arrive(sync, HALF)
    holder = PolicyHolder(sync, "default", refresh_seconds=10, clock=lambda: now[0])
    first = holder.current()
    arrive(sync, QUARTER)
    now[0] = 11.0
    assert holder.current() is not first
    assert holder.staged_chooser() is None


def test_a_zero_refresh_rebuilds_whenever_a_pod_arrived_and_only_then() -> None:
    """`--workload-refresh-seconds 0` (the demo): no clock involved, the window alone."""
    sync = cluster(2)
    arrive(sync, HALF)
    holder = PolicyHolder(sync, "default", refresh_seconds=0, clock=lambda: 0.0)
    first = holder.current()
    assert holder.current() is first
    arrive(sync, QUARTER)
    second = holder.current()
    assert second is not first
    assert holder.current() is second
    assert holder.workload is not None and len(holder.workload.observed) == 2


async def test_filling_brings_the_host_memory_index_up_to_date(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A filter for a request with host memory finds the index of free memory built
    (a pass over every node, ~8 ms at 10,000 nodes) and current."""
    sync = cluster()
    arrive(sync, HALF)
    holder = PolicyHolder(sync, "default")
    chooser = holder.current()
    await Warmer(sync, holder, shapes=1).fill(chooser)
    sync.ledger.reserve(Grant("p", "n3", (0,), 500, 0, host_memory_mib=2048))

    def every_node(self: Ledger) -> Iterable[NodeState]:
        raise AssertionError("evaluate rebuilt the memory index from every node")

    monkeypatch.setattr(Ledger, "states", every_node)
    evaluation = chooser.evaluate(HALF)
    assert len(evaluation.choices) == 40


async def test_shapes_pods_wait_for_are_scored_ahead_after_the_common_ones() -> None:
    """A rare shape is not among the common ones, but once pods of it wait for a node
    the warmer scores it too (most waiting first, at most `pending_shapes`)."""
    sync = cluster()
    arrive(sync, HALF, HALF, QUARTER)
    rare = GpuRequest(300, count=1, cpu_milli=500, host_memory_mib=128)
    rarer = GpuRequest(1000, count=2, cpu_milli=500)
    sync.pending.update({scoring_shape(rare): 3, scoring_shape(rarer): 1, HALF_SHAPE: 5})
    holder = PolicyHolder(sync, "default")
    chooser = holder.current()
    names = list(sync.ledger.inventory.names())
    warmer = Warmer(sync, holder, shapes=2, pending_shapes=1)
    assert await warmer.wanted() == [HALF_SHAPE, scoring_shape(QUARTER), scoring_shape(rare)]
    assert await warmer.fill(chooser) == 3
    assert warmer.ahead == [HALF_SHAPE, scoring_shape(QUARTER), scoring_shape(rare)]
    assert chooser.unseen(rare, names) == set()
    assert chooser.unseen(rarer, names) == set(names)  # beyond pending_shapes
    assert await Warmer(sync, holder, shapes=2, pending_shapes=0).wanted() == warmer.counted


HALF_SHAPE = scoring_shape(HALF)


def test_more_shapes_than_the_engine_keeps_are_refused() -> None:
    sync = cluster(2)
    with pytest.raises(ValueError, match="keeps"):
        Warmer(sync, PolicyHolder(sync, "default"), shapes=100, pending_shapes=40)
