"""filter → prioritize → bind through the real HTTP app, against the fake API server."""

from __future__ import annotations

import asyncio

from gpuplace.cluster import keys
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.placement.fences import Fence
from gpuplace.placement.ledger import GrantState
from tests.extender.conftest import harness


async def test_schedules_binds_and_annotates(server: localapi.Server) -> None:
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


async def test_fenced_nodes_are_not_offered_to_other_pods(server: localapi.Server) -> None:
    """A starving gang's capacity hold: filter keeps other pods off its nodes (a
    resolvable reason), and offers them to the gang's own members."""

    api = server.api
    for index in range(3):
        api.create(objects.node(f"gpu-{index}", gpus=2))
    async with harness(server) as h:
        await asyncio.wait_for(h.sidecar.sync.ready.wait(), 5)
        member = api.create(objects.pod("member", percent=50))
        other = api.create(objects.pod("other", percent=50))
        h.sidecar.fences.hold(
            Fence(
                owner=("default", "big"),
                nodes=frozenset({"gpu-0", "gpu-1"}),
                members=frozenset({member["metadata"]["uid"]}),
                since=0.0,
            )
        )
        names = ["gpu-0", "gpu-1", "gpu-2"]
        fenced = await h.filter(other, ["gpu-0", "gpu-1"])
        assert fenced["NodeNames"] == []
        assert set(fenced["FailedNodes"]) == {"gpu-0", "gpu-1"}
        assert "held for gang default/big" in fenced["FailedNodes"]["gpu-0"]
        assert not fenced["FailedAndUnresolvableNodes"]
        # A node passed: kube-scheduler reads no failed node, and the answer lists none.
        verdict = await h.filter(other, names)
        assert verdict["NodeNames"] == ["gpu-2"]
        assert not verdict["FailedNodes"] and not verdict["FailedAndUnresolvableNodes"]
        offered = await h.filter(member, names)  # the policy's best of all three
        assert len(offered["NodeNames"]) == 1 and not offered["FailedNodes"]
        assert await h.schedule(other) == "gpu-2"
        h.sidecar.fences.release()
        later = api.create(objects.pod("later", percent=50))
        verdict = await h.filter(later, names)  # packed beside "other" now nothing holds
        assert verdict["NodeNames"] == ["gpu-2"] and not verdict["FailedNodes"]


async def test_memory_only_pods_are_filtered_scored_bound_and_packed(
    server: localapi.Server,
) -> None:
    """`gpu-memory` alone: placed by per-GPU memory, never on a GPU with a compute share,
    packed onto one GPU until its memory is gone; a misfit says how much memory is free."""

    api = server.api
    for index in range(2):
        api.create(objects.node(f"gpu-{index}", gpus=2, uuids=True))
    async with harness(server) as h:
        await asyncio.wait_for(h.sidecar.sync.ready.wait(), 5)

        def where(name: str) -> tuple[str, str, str, str]:
            notes = h.pod("default", name)["metadata"]["annotations"]
            return (
                notes[keys.ASSIGNED_NODE],
                notes[keys.ASSIGNED_GPUS],
                notes[keys.ASSIGNED_MILLI],
                notes[keys.ASSIGNED_MEMORY],
            )

        await h.schedule(api.create(objects.pod("pct", percent=50)))
        taken = where("pct")[:2]
        placed = []
        # two fill an 80 GiB GPU: 80 GiB less the 1 GiB margin of nodes without the node
        # agent, each 38 GiB and its CUDA context (issue 43)
        for name in ("m1", "m2", "m3"):
            pod = api.create(objects.pod(name, percent=None, memory="38Gi"))
            node = await h.schedule(pod)
            assert h.pod("default", name)["spec"]["nodeName"] == node
            placed.append(where(name))
            grant = h.sidecar.sync.ledger.get(pod["metadata"]["uid"])
            assert grant is not None and grant.memory_only
            assert grant.state is GrantState.CONFIRMED
        assert all(milli == "0" and memory == "38912" for *_, milli, memory in placed)
        assert all(p[:2] != taken for p in placed), "memory-only joined a compute share"
        assert placed[0][:2] == placed[1][:2], "the second did not pack onto the first's GPU"
        assert placed[2][:2] != placed[0][:2]
        await h.synced(
            lambda: any(
                "memory only, 38912 MiB" in e.get("message", "")
                for e in api.objects("events", "default")
            )
        )
        # 4 GPUs: one with the compute share, one full, one with ~40 GiB left, one empty.
        big = api.create(objects.pod("big", percent=None, memory="60Gi"))
        verdict = await h.filter(big, ["gpu-0", "gpu-1"])
        assert len(verdict["NodeNames"]) == 1
        await h.schedule(big)
        late = api.create(objects.pod("late", percent=None, memory="50Gi"))
        verdict = await h.filter(late, ["gpu-0", "gpu-1"])
        assert verdict["NodeNames"] == []
        assert set(verdict["FailedNodes"].values()) == {"gpuplace: no GPU with enough memory free"}
