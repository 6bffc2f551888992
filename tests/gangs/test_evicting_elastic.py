"""A waiting gang of higher priority and a running elastic gang (issue 29, point 4): the
elastic gang's extra members (beyond `gang-min`, the most recently started first) may be
evicted one by one before its core; it is never left below `gang-min` unless it goes
whole. First the plan (`victims.victim_units` and `victim_choice.for_gang` over a
LedgerSync), then the real sidecar and gang controller against the local API."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gpuplace.cluster import assignments, keys, pods
from gpuplace.cluster.gang_marks import gated
from gpuplace.cluster.nodes import NodeRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import victims as eviction_victims
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.placement import gangs, policies, victim_choice
from gpuplace.placement.ledger import Grant
from gpuplace.placement.requests import GpuRequest
from tests.gangs.rig import Rig, member, nodes, rig
from tests.gangs.test_evicting import RUNNING, SETTINGS, evicted, kubelet_finishes
from tests.placement.clusters import node

ONE_GPU = GpuRequest(milli=1000, count=1, cpu_milli=0, host_memory_mib=0)


def gang_annotations(gang: str, size: int, minimum: int) -> dict[str, str]:
    notes = {keys.GANG_NAME: gang, keys.GANG_SIZE: str(size)}
    if minimum:
        notes[keys.GANG_MIN] = str(minimum)
    return notes


def cluster(minimum: int, *, priorities: tuple[int, ...] = (0, 0, 0, 0)) -> LedgerSync:
    """n0: gang ddp of 4 whole-GPU members (m0 started first, m3 last; `gang-min`
    `minimum`); n1: full of pods of priority 300."""
    sync = LedgerSync()
    for name in ("n0", "n1"):
        sync.put_node(NodeRecord(name, name, True, node(name, 4)))
    for i, priority in enumerate(priorities):
        uid = f"m{i}"
        body = objects.pod(
            uid, annotations=gang_annotations("ddp", 4, minimum), labels={keys.GANG_LABEL: "ddp"}
        )
        record = replace(
            pods.record(body),
            uid=uid,
            node_name="n0",
            phase="Running",
            grant=Grant(uid, "n0", (i,), 1000, 0, 0, 0),
            priority=priority,
            assigned_at=100.0 + i,
        )
        sync.upsert_pod(record)
    return full_n1(sync)


def full_n1(sync: LedgerSync) -> LedgerSync:
    """n1's four GPUs held by pods of priority 300 (no victims there)."""
    for i in range(4):
        uid = f"top{i}"
        record = replace(
            pods.record(objects.pod(uid)),
            uid=uid,
            node_name="n1",
            phase="Running",
            grant=Grant(uid, "n1", (i,), 1000, 0, 0, 0),
            priority=300,
        )
        sync.upsert_pod(record)
    return sync


def victims(sync: LedgerSync, members: int, priority: int = 100) -> set[str] | None:
    """Who a waiting gang of `members` one-GPU members would evict (None: nothing)."""
    units = eviction_victims.victim_units(sync, priority)
    waiting = [gangs.Member(f"w{i}", ONE_GPU) for i in range(members)]
    found = victim_choice.for_gang(sync.ledger, policies.make("best-fit"), waiting, units)
    return None if found is None else set(found.uids)


def test_extras_are_offered_alone_beside_the_whole_gang() -> None:
    units = eviction_victims.victim_units(cluster(2), 100)
    assert sorted(u.uids for u in units) == [("m0", "m1", "m2", "m3"), ("m2",), ("m3",)]
    assert {u.uids: u.spare for u in units} == {
        ("m0", "m1", "m2", "m3"): 2,
        ("m2",): 1,
        ("m3",): 1,
    }
    units = eviction_victims.victim_units(cluster(0), 100)
    assert [u.uids for u in units] == [("m0", "m1", "m2", "m3")]


def test_a_waiting_gang_takes_the_newest_extras_first_then_the_whole_gang() -> None:
    sync = cluster(2)
    assert victims(sync, 1) == {"m3"}
    assert victims(sync, 2) == {"m2", "m3"}
    # a third would leave ddp below gang-min 2: it goes whole
    assert victims(sync, 3) == {"m0", "m1", "m2", "m3"}
    assert victims(sync, 4) == {"m0", "m1", "m2", "m3"}


def test_the_newest_extra_is_known_within_one_second() -> None:
    """Issue 41: ddp's members started m0, m1, m3, m2, within one microsecond even (one
    clock reading), their `assigned-at` written and read back as the ledger's rebuild
    does: m2, the last started, is the extra a waiting gang takes, not m3 (the last by
    name, which a tie in whole seconds gave)."""
    sync = LedgerSync()
    for name in ("n0", "n1"):
        sync.put_node(NodeRecord(name, name, True, node(name, 4)))
    stamps, now = assignments.Stamps(), 1_700_000_000.0
    for i in (0, 1, 3, 2):
        uid = f"m{i}"
        body = objects.pod(
            uid, annotations=gang_annotations("ddp", 4, 2), labels={keys.GANG_LABEL: "ddp"}
        )
        grant = Grant(uid, "n0", (i,), 1000, 0, 0, 0)
        body["metadata"]["uid"] = uid
        body["metadata"]["annotations"].update(
            assignments.annotations_for(grant, None, stamps.next(now))
        )
        body["spec"]["nodeName"] = "n0"
        body["status"] = {"phase": "Running"}
        sync.upsert_pod(pods.record(body))
    full_n1(sync)
    members = [sync.pods[f"m{i}"] for i in range(4)]
    assert [m.name for m in pods.started(members)] == ["m0", "m1", "m3", "m2"]
    assert victims(sync, 1) == {"m2"}
    assert victims(sync, 2) == {"m2", "m3"}


@pytest.mark.parametrize("a7_at", [1.0, 20.0])
def test_a_waiting_gang_evicts_one_whole_gpu_where_two_shares_free_the_same(
    a7_at: float,
) -> None:
    """Issue 41's cluster for a waiting gang of higher priority (one whole-GPU member):
    six 50% shares two per GPU on GPUs 0-2, a-7 whole on GPU 3, admitted before or
    after them: a-7 alone goes (the plan's cost counts pods before start times)."""
    sync = LedgerSync()
    sync.put_node(NodeRecord("n0", "n0", True, node("n0", 4)))
    held = [(f"a-{i}", i // 2, 500, 10.0 + i) for i in range(6)] + [("a-7", 3, 1000, a7_at)]
    for uid, gpu, milli, at in held:
        record = replace(
            pods.record(objects.pod(uid)),
            uid=uid,
            node_name="n0",
            phase="Running",
            grant=Grant(uid, "n0", (gpu,), milli, 0, 0, 0),
            assigned_at=at,
        )
        sync.upsert_pod(record)
    assert victims(sync, 1) == {"a-7"}


def test_a_gang_that_is_not_elastic_still_goes_whole() -> None:
    assert victims(cluster(0), 1) == {"m0", "m1", "m2", "m3"}
    assert victims(cluster(4), 1) == {"m0", "m1", "m2", "m3"}


def test_an_extra_of_higher_priority_is_no_victim_nor_is_its_gang() -> None:
    sync = cluster(2, priorities=(0, 0, 0, 200))
    # m3 (the newest extra) outranks the waiting gang: m2 may go alone, nothing more
    assert victims(sync, 1) == {"m2"}
    assert victims(sync, 2) is None


async def bind(r: Rig, pod: dict[str, Any], where: str) -> None:
    """Create `pod` and bind it through the extender to `where`."""
    uid = r.api.create(pod)["metadata"]["uid"]
    await r.h.synced(lambda: uid in r.h.sidecar.sync.pods)
    assert await r.h.bind(r.h.pod("default", pod["metadata"]["name"]), where) == ""


async def elastic_runner(r: Rig, gang: str, size: int, minimum: int, where: str) -> None:
    """A running elastic gang of `size` one-GPU members on `where`, bound one after the
    other (same second: the name breaks the tie, so the last named started last)."""
    for i in range(size):
        name = f"{gang}{i}"
        pod = objects.pod(
            name,
            percent=None,
            count=1,
            annotations=gang_annotations(gang, size, minimum),
            labels={keys.GANG_LABEL: gang},
        )
        await bind(r, pod, where)
        r.api.patch("pods", name, {"status": RUNNING}, "default", subresource="status")


async def fillers(r: Rig, where: str, count: int) -> None:
    for i in range(count):
        name = f"top{i}"
        pod = objects.pod(name, percent=None, count=1)
        pod["spec"]["priority"] = 300
        await bind(r, pod, where)


@pytest.mark.parametrize(
    ("members", "gone"),
    [
        (2, ["ddp2", "ddp3"]),  # its two extras, and its core runs on
        (3, ["ddp0", "ddp1", "ddp2", "ddp3"]),  # a third would leave it below gang-min
    ],
)
async def test_the_controller_evicts_the_extras_a_waiting_gang_needs_or_the_whole_gang(
    server: localapi.Server, members: int, gone: list[str]
) -> None:
    """gpu-0 runs the elastic gang ddp (4 one-GPU members, gang-min 2), gpu-1 pods of
    priority 300; a gang of priority 100 with `members` one-GPU members arrives."""
    nodes(server.api, 2)
    async with rig(server, settings=SETTINGS) as r:
        await elastic_runner(r, "ddp", 4, 2, "gpu-0")
        await fillers(r, "gpu-1", 4)
        for i in range(members):
            r.api.create(member(f"w{i}", "new", members, count=1, priority=100))
        await r.quiet()
        assert evicted(r.api) == gone
        kubelet_finishes(r.api)
        await r.quiet()
        await r.rounds(2)
        assert evicted(r.api) == gone  # nothing more
        assert not any(gated(pod) for pod in r.gang_pods("new"))
        running = {p["metadata"]["name"] for p in r.gang_pods("ddp")}
        assert running == {"ddp0", "ddp1", "ddp2", "ddp3"} - set(gone)
