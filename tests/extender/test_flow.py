"""filter → prioritize → bind through the real HTTP app, against the fake API server."""

from __future__ import annotations

import asyncio

from cluster import keys
from placement.ledger import GrantState
from tests import fakeapi
from tests.extender.conftest import harness
from tests.fakeapi import objects


async def test_schedules_binds_and_annotates(server: fakeapi.Server) -> None:
    api = server.api
    for index in range(3):
        api.create(objects.node(f"gpu-{index}", gpus=2, uuids=index == 0))
    async with harness(server) as h:
        await asyncio.wait_for(h.sidecar.sync.ready.wait(), 5)
        pod = api.create(objects.pod("train", percent=50, memory="20Gi"))
        node = await h.schedule(pod)
        bound = h.pod("default", "train")
        assert bound["spec"]["nodeName"] == node
        notes = bound["metadata"]["annotations"]
        assert notes[keys.ASSIGNED_NODE] == node
        assert notes[keys.ASSIGNED_MILLI] == "500"
        assert notes[keys.ASSIGNED_MEMORY] == "20480"
        grant = h.sidecar.sync.ledger.get(pod["metadata"]["uid"])
        assert grant is not None
        assert grant.state is GrantState.CONFIRMED
        assert grant.gpus == (int(notes[keys.ASSIGNED_GPUS]),)
        await h.synced(
            lambda: any(e["reason"] == "GpusAssigned" for e in api.objects("events", "default"))
        )
        # a second half-GPU pod packs onto the same GPU (binpacking), not a fresh one
        second = api.create(objects.pod("train-2", percent=50, memory="20Gi"))
        assert await h.schedule(second) == node
        notes2 = h.pod("default", "train-2")["metadata"]["annotations"]
        assert notes2[keys.ASSIGNED_GPUS] == notes[keys.ASSIGNED_GPUS]
