"""LedgerSync: the ledger is exactly what the pods' annotations say; holds serve only their
pod, survive events without annotations and give way to the annotations."""

from __future__ import annotations

import contextlib
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.cluster import assignments, keys, nodes, pods, syncing
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev.localapi import objects
from gpuplace.placement.choosing import scoring_shape
from gpuplace.placement.ledger import Grant, GrantState, LedgerError, Oversubscribed
from gpuplace.placement.requests import GpuRequest

AT = datetime(2026, 1, 1, tzinfo=UTC)


def node_record(name: str, gpus: int = 2, **options: Any) -> nodes.NodeRecord:
    body = objects.node(name, gpus=gpus, **options)
    body["metadata"]["uid"] = f"uid-{name}"
    return nodes.record(body)


def pod_record(
    name: str,
    *,
    grant: Grant | None = None,
    bound: bool = False,
    phase: str = "Pending",
    percent: int = 50,
    gated: bool = False,
    unschedulable: bool = False,
    unreadable: bool = False,
) -> pods.PodRecord:
    body = objects.pod(name, percent=percent)
    if gated:
        body["spec"]["schedulingGates"] = [{"name": "gpuplace.io/gang"}]
    if unreadable:
        body["metadata"]["annotations"][keys.GPU_PERCENT] = "half"
    body["metadata"]["uid"] = f"uid-{name}"
    body["metadata"]["resourceVersion"] = "1"
    body["status"] = {"phase": phase}
    if unschedulable:  # as kube-scheduler writes it after a failed try
        body["status"]["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
        ]
    if grant is not None:
        body["metadata"]["annotations"].update(assignments.annotations_for(grant, None, AT))
        if bound:
            body["spec"]["nodeName"] = grant.node
    return pods.record(body)


def grant(name: str, node: str = "n0", gpus: tuple[int, ...] = (0,), milli: int = 500) -> Grant:
    return Grant(f"uid-{name}", node, gpus, milli, 0, 1000, 1024)


@pytest.fixture
def sync() -> LedgerSync:
    synced = LedgerSync()
    synced.replace_nodes([node_record("n0"), node_record("n1")])
    return synced


def test_annotations_make_grants_and_binding_confirms(sync: LedgerSync) -> None:
    g = grant("a")
    sync.upsert_pod(pod_record("a", grant=g))
    assert sync.ledger.get("uid-a") == g
    sync.upsert_pod(pod_record("a", grant=g, bound=True))
    held = sync.ledger.get("uid-a")
    assert held is not None and held.state is GrantState.CONFIRMED
    sync.upsert_pod(pod_record("a", grant=g, bound=True, phase="Succeeded"))
    assert "uid-a" not in sync.ledger


def test_memory_only_grants_are_rebuilt_from_annotations_after_a_restart() -> None:
    def record(name: str, held: Grant, bound: bool) -> pods.PodRecord:
        body = objects.pod(name, percent=None, memory="8Gi")
        body["metadata"]["uid"] = f"uid-{name}"
        body["metadata"]["resourceVersion"] = "1"
        body["metadata"]["annotations"].update(assignments.annotations_for(held, None, AT))
        if bound:
            body["spec"]["nodeName"] = held.node
        return pods.record(body)

    first = Grant("uid-m1", "n0", (1,), 0, 8192, 1000, 1024)
    second = Grant("uid-m2", "n0", (1,), 0, 8192, 1000, 1024)
    share = grant("s", gpus=(0,))
    records = [
        record("m1", first, bound=True),
        record("m2", second, bound=False),
        pod_record("s", grant=share, bound=True),
    ]
    live = LedgerSync()
    live.replace_nodes([node_record("n0")])
    for item in records:
        live.upsert_pod(item)
    assert records[0].request is not None and records[0].request.memory_only
    restarted = LedgerSync()
    restarted.replace_nodes([node_record("n0")])
    restarted.replace_pods(records)
    assert restarted.ledger.snapshot() == live.ledger.snapshot()
    assert {g.pod_uid for g in restarted.ledger.snapshot() if g.memory_only} == {
        "uid-m1",
        "uid-m2",
    }
    for synced in (live, restarted):
        state = synced.ledger.state("n0")
        assert state is not None
        assert state.memory_only == [0, 2] and state.free_milli == [500, 0]
        # each memory-only share takes its ask and its CUDA context under MPS (issue 43)
        contexts = 2 * state.node.gpus[1].context.mib(0)
        assert state.free_memory[1] == state.node.gpus[1].memory_mib - 16_384 - contexts


def test_hold_survives_events_without_annotations_and_yields_to_them(sync: LedgerSync) -> None:
    g = grant("a")
    assert sync.hold(g, seconds=60)
    sync.upsert_pod(pod_record("a"))  # an older event: no assignment yet
    assert sync.ledger.get("uid-a") == g
    other = grant("b", milli=600)
    with pytest.raises(Oversubscribed):
        sync.hold(other, seconds=60)
    sync.upsert_pod(pod_record("a", grant=g))
    assert sync.hold_of("uid-a") is None  # the API backs it now
    assert sync.unhold("uid-a") is None  # and unhold no longer releases it
    assert "uid-a" in sync.ledger


def test_annotations_differing_from_a_hold_win(sync: LedgerSync) -> None:
    sync.hold(grant("a", gpus=(0,)), seconds=60)
    sync.upsert_pod(pod_record("a", grant=grant("a", gpus=(1,))))
    held = sync.ledger.get("uid-a")
    assert held is not None and held.gpus == (1,)
    state = sync.ledger.state("n0")
    assert state is not None and state.free_milli == [1000, 500]


def test_delete_releases_and_relist_equals_incremental(sync: LedgerSync) -> None:
    records = [
        pod_record("a", grant=grant("a"), bound=True),
        pod_record("b", grant=grant("b", node="n1")),
        pod_record("c"),
        pod_record("d", grant=grant("d", gpus=(1,)), bound=True, phase="Failed"),
    ]
    for record in records:
        sync.upsert_pod(record)
    sync.delete_pod(records[1])
    rebuilt = LedgerSync()
    rebuilt.replace_nodes([node_record("n0"), node_record("n1")])
    rebuilt.replace_pods([records[0], records[2], records[3]])
    assert sync.ledger.snapshot() == rebuilt.ledger.snapshot()
    assert [g.pod_uid for g in rebuilt.ledger.snapshot()] == ["uid-a"]


def test_relist_keeps_live_holds_and_drops_those_of_vanished_pods(sync: LedgerSync) -> None:
    sync.upsert_pod(pod_record("a"))
    sync.upsert_pod(pod_record("b"))
    sync.hold(grant("a"), seconds=60)
    sync.hold(grant("b", gpus=(1,)), seconds=60)
    sync.replace_pods([pod_record("a")])
    assert sync.hold_of("uid-a") is not None
    assert sync.hold_of("uid-b") is None
    assert [g.pod_uid for g in sync.ledger.snapshot()] == ["uid-a"]


def test_expired_holds_skip_busy_pods() -> None:
    now = [0.0]
    sync = LedgerSync(clock=lambda: now[0])
    sync.replace_nodes([node_record("n0")])
    sync.hold(grant("a"), seconds=10)
    sync.hold(grant("b"), seconds=10)
    sync.busy.add("uid-b")
    assert sync.expired_holds() == []
    now[0] = 11
    assert [hold.grant.pod_uid for hold in sync.expired_holds()] == ["uid-a"]


def test_node_leaving_gpuplace_leaves_the_inventory(sync: LedgerSync) -> None:
    sync.put_node(node_record("n1", enabled=False))
    assert "n1" not in sync.ledger.inventory
    sync.put_node(node_record("n1"))
    assert "n1" in sync.ledger.inventory
    broken = node_record("n1", labels={"nvidia.com/gpu.count": "many"})
    sync.put_node(broken)
    assert broken.problem and "n1" not in sync.ledger.inventory


def test_a_relabelled_node_is_seen_with_its_new_labels(sync: LedgerSync) -> None:
    """A node labelled into a rack after the sidecar started, or one whose DRA label went
    (its agent moved back to the device plugin): nothing else changed, and the ledger kept
    the old labels, so gang members asking for the label never found the node (seen on the
    real tier: a gang waited "no node matches the pod's node affinity" after the DRA tests
    relabelled the kit's node)."""
    sync.put_node(node_record("n1", labels={keys.NODE_DRA: "true"}))
    generation, relabelled = sync.ledger.generation, sync.ledger.relabelled
    sync.put_node(node_record("n1", labels={"example.com/rack": "a"}))
    node = sync.ledger.inventory.get("n1")
    assert node is not None
    assert node.labels.get("example.com/rack") == "a" and keys.NODE_DRA not in node.labels
    # nothing the ledger counts changed: the scoring caches keep what they hold, and the
    # planners, which read labels, see `relabelled` grow and plan again
    assert sync.ledger.generation == generation and sync.ledger.relabelled == relabelled + 1
    sync.put_node(node_record("n1", labels={"example.com/rack": "a"}))
    assert sync.ledger.relabelled == relabelled + 1  # an unchanged node changes nothing


def test_workload_window_counts_arrivals_once() -> None:
    sync = LedgerSync(window=2)
    for name in ("a", "b", "a", "c"):
        sync.upsert_pod(pod_record(name))
    assert len(sync.requests) == 2
    assert sync.requests_version == 3


def test_bound_elsewhere_than_assigned_holds_nothing(sync: LedgerSync) -> None:
    record = pod_record("a", grant=grant("a", node="n0"))
    body = objects.pod("a")
    body["metadata"].update(uid="uid-a", resourceVersion="2")
    body["metadata"]["annotations"].update(assignments.annotations_for(grant("a"), None, AT))
    body["spec"]["nodeName"] = "n1"
    moved = pods.record(body)
    assert moved.grant is None and "bound to n1" in moved.problem
    sync.upsert_pod(record)
    sync.upsert_pod(moved)
    assert "uid-a" not in sync.ledger


def test_relist_keeps_the_hold_of_a_bind_in_flight_for_a_pod_it_did_not_list(
    sync: LedgerSync,
) -> None:
    sync.busy.add("uid-new")
    sync.hold(grant("new"), seconds=60)
    sync.replace_pods([])
    assert sync.hold_of("uid-new") is not None
    assert "uid-new" in sync.ledger


def waiting_from_scratch(synced: LedgerSync) -> Counter[GpuRequest]:
    """What `LedgerSync.pending` must equal: the shapes of the pods waiting for a node."""
    return Counter(
        scoring_shape(record.request)
        for uid, record in synced.pods.items()
        if record.request is not None
        and record.request.count
        and not record.node_name
        and not record.terminal
        and not record.deleting
        and not record.gated
        and synced.ledger.get(uid) is None
    )


def unbound_from_scratch(synced: LedgerSync) -> Counter[str]:
    """What `LedgerSync.unbound` must equal, from every pod (see `PENDING_REASONS`)."""
    reasons: Counter[str] = Counter()
    for uid, record in synced.pods.items():
        request = record.request
        if record.node_name or record.terminal or record.deleting:
            continue
        if (request is None and not record.problem) or (request is not None and not request.count):
            continue
        if record.gated:
            reasons[syncing.GATED] += 1
        elif request is None:
            reasons[syncing.UNREADABLE] += 1
        elif synced.ledger.get(uid) is not None:
            reasons[syncing.RESERVED] += 1
        elif record.unschedulable:
            reasons[syncing.UNSCHEDULABLE] += 1
        else:
            reasons[syncing.WAITING] += 1
    return reasons


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["upsert", "upsert", "upsert", "delete", "relist", "hold", "unhold"]),
        st.sampled_from(["a", "b", "c", "d"]),
        st.sampled_from(
            [
                "waiting",
                "gated",
                "unschedulable",
                "unreadable",
                "assigned",
                "bound",
                "Succeeded",
                "Failed",
            ]
        ),
        st.sampled_from([25, 50, 100]),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(EVENTS)
def test_pending_counts_the_shapes_of_the_pods_waiting_for_a_node(
    events: list[tuple[str, str, str, int]],
) -> None:
    """After any sequence of pod events and relists, `pending` counts exactly the waiting
    pods' scoring shapes (what the warmer scores ahead), `unbound` the unbound GPU pods by
    reason (gpuplace_pending_pods), and `stale` finds exactly the
    annotated, unbound pods (what the reaper releases) without a pass over every pod."""
    synced = LedgerSync()
    synced.replace_nodes([node_record("n0", gpus=4), node_record("n1", gpus=4)])
    for action, name, state, percent in events:
        if action == "delete":
            record = synced.pod("default", name)
            if record is not None:
                synced.delete_pod(record)
        elif action == "relist":
            synced.replace_pods(list(synced.pods.values()))
        elif action == "hold":  # a bind in flight: reserved before any pod event says so
            with contextlib.suppress(LedgerError):
                synced.hold(Grant(f"uid-{name}", "n1", (ord(name) % 4,), 100, 0), seconds=60)
        elif action == "unhold":  # the bind failed: the pod waits again
            synced.unhold(f"uid-{name}")
        else:
            given_grant = None
            unplaced = {"waiting", "gated", "unschedulable", "unreadable"}
            if state not in unplaced:
                given_grant = Grant(f"uid-{name}", "n0", (ord(name) % 4,), percent * 10, 0)
            phase = state if state in ("Succeeded", "Failed") else "Pending"
            synced.upsert_pod(
                pod_record(
                    name,
                    grant=given_grant,
                    bound=state not in {*unplaced, "assigned"},
                    phase=phase,
                    percent=percent,
                    gated=state == "gated",
                    unschedulable=state == "unschedulable",
                    unreadable=state == "unreadable",
                )
            )
        assert synced.pending == waiting_from_scratch(synced)
        assert synced.unbound == unbound_from_scratch(synced)
        assert synced.unbound[syncing.WAITING] + synced.unbound[syncing.UNSCHEDULABLE] == sum(
            synced.pending.values()
        )
        assert {record.uid for record in synced.stale(float("inf"))} == {
            uid
            for uid, record in synced.pods.items()
            if record.grant is not None
            and not record.bound
            and not record.terminal
            and not record.gated
            and uid not in synced.busy
        }


def test_a_failed_bind_puts_its_pod_back_among_the_waiting(sync: LedgerSync) -> None:
    """A hold (bind in flight) takes the pod out of `pending` at once; its release, with
    no pod event after it, puts the pod back."""
    sync.upsert_pod(pod_record("a"))
    assert sum(sync.pending.values()) == 1
    assert sync.hold(grant("a"), seconds=60)
    assert not sync.pending
    sync.upsert_pod(pod_record("a"))  # an event while the bind is in flight
    assert not sync.pending
    sync.unhold("uid-a")
    assert sync.pending == waiting_from_scratch(sync)
    assert sum(sync.pending.values()) == 1


def test_unbound_gpu_pods_are_counted_by_the_first_reason_that_holds(sync: LedgerSync) -> None:
    sync.upsert_pod(pod_record("w"))
    sync.upsert_pod(pod_record("u", unschedulable=True))
    sync.upsert_pod(pod_record("g", gated=True, unschedulable=True))
    sync.upsert_pod(pod_record("x", unreadable=True))
    sync.upsert_pod(pod_record("r", grant=grant("r")))
    sync.upsert_pod(pod_record("b", grant=grant("b", gpus=(1,)), bound=True))
    assert sync.unbound == {"waiting": 1, "unschedulable": 1, "gated": 1, "unreadable": 1,
                            "reserved": 1}  # fmt: skip
    assert sync.hold(grant("u", node="n1"), seconds=60)  # a bind in flight
    assert sync.unbound["unschedulable"] == 0 and sync.unbound["reserved"] == 2
    sync.upsert_pod(pod_record("r", grant=grant("r"), bound=True))
    sync.delete_pod(pod_record("x", unreadable=True))
    assert sync.unbound == {"waiting": 1, "gated": 1, "reserved": 1}
