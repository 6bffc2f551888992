"""A lone DRA pod's preemption on random clusters (`gpuplace.claims.preempting` over a
LedgerSync, its API an in-memory one that accepts every eviction and lists no budgets; the
local API's are in tests/claims/test_preempting.py): every pod evicted is of strictly lower
priority and was not being deleted already; the GPUs the pod is pinned to take it once the
victims and the pods already being deleted are gone; a pod no lower pod holds GPUs for
evicts nothing; asked again before the informer shows its victims' deletion (another pod
changed, the back-off over), nothing more is evicted."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.claims.preempting import LonePreemptions, Wait
from gpuplace.cluster import pods
from gpuplace.cluster.nodes import NodeRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev.localapi import objects
from gpuplace.placement import choosing, policies
from gpuplace.placement.ledger import Grant, Ledger
from gpuplace.placement.requests import GpuRequest
from tests.placement.clusters import node, room_for

NODES = ("n0", "n1")

PODS = st.lists(
    st.tuples(
        st.sampled_from(NODES),
        st.integers(0, 3),  # GPU
        st.sampled_from([1000, 1000, 500, 300]),  # share
        st.sampled_from([0, 10, 50, 100]),  # priority
        st.sampled_from([False, False, False, True]),  # being deleted already
    ),
    min_size=4,
    max_size=16,
)


class Api:
    """Evictions accepted and remembered; the pods as the sync has them; no budgets."""

    def __init__(self, sync: LedgerSync) -> None:
        self.sync = sync
        self.evicted: list[str] = []

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        record = next(r for r in self.sync.pods.values() if r.name == name)
        metadata: dict[str, Any] = {"name": name, "namespace": namespace, "uid": record.uid}
        if record.deleting:
            metadata["deletionTimestamp"] = "2026-12-01T00:00:00Z"
        return {"metadata": metadata, "status": {"phase": "Running"}}

    async def evict_pod(self, namespace: str, name: str, *, uid: str) -> None:
        self.evicted.append(uid)

    async def disruption_budgets(self, namespace: str) -> list[dict[str, Any]]:
        return []


@settings(max_examples=200, deadline=None)
@given(
    pods_=PODS,
    priority=st.sampled_from([0, 10, 50, 100, 1000]),
    wants=st.sampled_from([(1000, 1), (1000, 2), (600, 1), (300, 1)]),
)
def test_a_lone_pods_preemption_evicts_only_lower_live_pods_and_its_pin_fits_once_they_go(
    pods_: list[tuple[str, int, int, int, bool]],
    priority: int,
    wants: tuple[int, int],
) -> None:
    sync = LedgerSync()
    for name in NODES:
        sync.put_node(NodeRecord(name, name, True, node(name, 4)))
    records = {}
    for i, (at, gpu, share, rank, deleting) in enumerate(pods_):
        uid = f"p{i:02}"
        grant = Grant(uid, at, (gpu,), share, 0, 0, 0)
        if not room_for(sync.ledger, grant):
            continue
        base = pods.record(objects.pod(uid))
        record = replace(base, uid=uid, node_name=at, grant=grant, priority=rank, deleting=deleting)
        sync.upsert_pod(record)
        records[uid] = record
    milli, count = wants
    request = GpuRequest(milli=milli, count=count, cpu_milli=0, host_memory_mib=0)
    preemptor = replace(
        pods.record(objects.pod("urgent")), uid="urgent", request=request, priority=priority
    )
    api = Api(sync)
    preemptions = LonePreemptions(api, sync, retry_seconds=10.0)
    policy = policies.make("best-fit")

    async def twice() -> tuple[object, object]:
        live = {**records, "urgent": preemptor}
        preemptions.new_round(live, NODES, 0.0)
        first = await preemptions.attempt(preemptor, list(NODES), policy, now=0.0)
        # another pod changes before the informer shows the victims' deletion
        sync.upsert_pod(replace(pods.record(objects.pod("other")), uid="other"))
        preemptions.new_round(live, NODES, 20.0)
        again = await preemptions.attempt(preemptor, list(NODES), policy, now=20.0)
        return first, again

    first, again = asyncio.run(twice())
    evicted = list(api.evicted)
    assert len(evicted) == len(set(evicted))
    for uid in evicted:
        assert records[uid].priority < priority, uid
        assert not records[uid].deleting, uid
    assert again == first  # its victims not yet seen going: the same answer, no new eviction
    if not any(r.priority < priority for r in records.values()):
        assert first is None and not evicted
    if first is None or isinstance(first, Wait):
        assert not evicted
        return
    assert isinstance(first, choosing.Choice)
    gone = set(evicted) | {uid for uid, r in records.items() if r.deleting}
    scratch = Ledger(sync.ledger.inventory)
    scratch.restore(grant for grant in sync.ledger if grant.pod_uid not in gone)
    scratch.reserve(choosing.grant_for("urgent", first, request))  # raises if it does not fit
