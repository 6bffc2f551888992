"""Identical shares pack through the extender (issue 18): filter → prioritize → bind as
kube-scheduler drives them, one pod at a time, on a fresh cluster whose typical workload
is still its first GPU pod's shape."""

from __future__ import annotations

import asyncio

from gpuplace.cluster import keys
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from tests.extender.conftest import Harness, harness

REFRESH = 60.0


class Clock:
    """The sidecar's workload clock, moved on by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _place(h: Harness, name: str, percent: int) -> tuple[str, str]:
    """Create a pod asking `percent` of one GPU with 10Gi and schedule it: its (node, GPU)."""
    pod = h.api.create(objects.pod(name, percent=percent, memory="10Gi"))
    uid = pod["metadata"]["uid"]
    await h.synced(lambda: any(r.uid == uid for r in h.sidecar.sync.pods.values()))
    node = await h.schedule(pod)
    notes = h.pod("default", name)["metadata"]["annotations"]
    return node, notes[keys.ASSIGNED_GPUS]


async def test_quarter_shares_fill_gpus_before_opening_new_ones(
    server: localapi.Server,
) -> None:
    """The cluster's first GPU pod asked half a GPU (and finished): the typical workload
    is that one shape until the refresh. 16 quarter shares then fill 4 GPUs, not 8;
    after the refresh 8 more fill 2 more."""
    api = server.api
    for index in range(3):
        api.create(objects.node(f"a100-{index}", gpus=8))
    clock = Clock()
    async with harness(server, clock=clock, workload_refresh_seconds=REFRESH) as h:
        await asyncio.wait_for(h.sidecar.sync.ready.wait(), 5)
        await _place(h, "first", 50)
        first_uid = h.pod("default", "first")["metadata"]["uid"]
        api.delete("pods", "first", "default")
        await h.synced(lambda: h.sidecar.sync.ledger.get(first_uid) is None)

        placed = [await _place(h, f"quarter-{i}", 25) for i in range(16)]
        assert len(set(placed)) == 4, sorted(placed)

        clock.now += REFRESH + 1
        placed += [await _place(h, f"later-{i}", 25) for i in range(8)]
        assert len(set(placed)) == 6, sorted(placed)
        for gpu in set(placed):
            assert placed.count(gpu) == 4
