"""The controllers' pod indexes (`gpuplace.controllers.store`): fed by the one managed-pod
informer through the ledger sync, holding its very records, by gang and by queue."""

from __future__ import annotations

from typing import Any

from gpuplace.cluster import keys, pods
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import store
from gpuplace.dev.localapi import objects


def pod(name: str, *, gang: str = "", queue: str = "", uid: str = "") -> dict[str, Any]:
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    if gang:
        labels[keys.GANG_LABEL] = gang
        annotations.update({keys.GANG_NAME: gang, keys.GANG_SIZE: "2"})
    if queue:
        labels[keys.QUEUE_LABEL] = queue
    body = objects.pod(name, annotations=annotations, labels=labels)
    body["metadata"]["uid"] = uid or f"uid-{name}"
    body["metadata"]["resourceVersion"] = "1"
    return body


def test_each_index_keeps_the_sync_s_own_records_by_gang_and_by_queue() -> None:
    sync = LedgerSync()
    sync.replace_pods([pods.record(pod("a", gang="g")), pods.record(pod("plain"))])
    gangs = store.gang_members(sync)  # built over a listed ledger: it starts full
    queued = store.queued_pods(sync)
    assert set(gangs.pods) == {"uid-a"} and queued.pods == {}
    assert gangs.members(("default", "g"))[0] is sync.pods["uid-a"]
    assert gangs.synced is sync.ready
    sync.upsert_pod(pods.record(pod("b", gang="g", queue="q")))
    assert sorted(p.name for p in gangs.members(("default", "g"))) == ["a", "b"]
    assert set(queued.pods) == {"uid-b"} and queued.pods["uid-b"] is sync.pods["uid-b"]
    version = queued.version
    sync.upsert_pod(pods.record(pod("plain", uid="uid-plain")))  # not a queued pod
    assert queued.version == version
    sync.upsert_pod(pods.record(pod("b", gang="g")))  # its queue label went
    assert queued.pods == {} and queued.version == version + 1
    sync.delete_pod(sync.pods["uid-a"])
    assert [p.name for p in gangs.members(("default", "g"))] == ["b"]
    sync.replace_pods([pods.record(pod("c", gang="h"))])  # a relist
    assert set(gangs.pods) == {"uid-c"} and list(gangs.groups()) == [("default", "h")]


def test_a_labelled_member_without_a_readable_gang_is_kept_in_no_gang() -> None:
    sync = LedgerSync()
    gangs = store.gang_members(sync)
    body = pod("x", gang="g")
    del body["metadata"]["annotations"][keys.GANG_NAME]
    sync.upsert_pod(pods.record(body))
    assert set(gangs.pods) == {"uid-x"} and gangs.groups() == {}
    sync.delete_pod(sync.pods["uid-x"])
    assert gangs.pods == {}
