"""ResourceClaims in the ledger (`gpuplace.cluster.claims`, `LedgerSync`'s claim informer):
what a real allocated claim holds, under whose key, how a pod's planned grant yields to its
claim, and that a ledger rebuilt from the API equals the live one."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.cluster import assignments, claims, keys, nodes, pods
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev.localapi import objects
from gpuplace.placement.ledger import Grant, GrantState

FIXTURES = Path(__file__).parent / "fixtures" / "dra-claims"
NODE = "fake-1"
H100 = "NVIDIA-H100-80GB-HBM3"
AT = datetime(2026, 1, 1, tzinfo=UTC)


def fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return loaded


def dra_node(name: str = NODE) -> nodes.NodeRecord:
    body = objects.node(
        name, gpus=4, model=H100, gpu_memory_mib=81559, labels={keys.NODE_DRA: "true"}
    )
    body["metadata"]["uid"] = f"uid-{name}"
    return nodes.record(body)


def annotated(pod: dict[str, Any], grant: Grant | None = None) -> pods.PodRecord:
    """A fixture pod with the annotations the webhook left (30 %, 8Gi) and, for a plan,
    an assignment."""
    body = copy.deepcopy(pod)
    body["metadata"].setdefault("annotations", {}).update(
        {keys.GPU_PERCENT: "30", keys.GPU_MEMORY: "8Gi"}
    )
    if grant is not None:
        body["metadata"]["annotations"].update(assignments.annotations_for(grant, None, AT))
    return pods.record(body)


def sync_of(*nodes_: nodes.NodeRecord) -> LedgerSync:
    sync = LedgerSync(agent_silence=0)
    sync.replace_nodes(list(nodes_) or [dra_node()])
    sync.replace_pods([])
    return sync


def test_a_share_kube_scheduler_allocated_holds_its_ask_and_context_under_its_pods_uid() -> None:
    raw, pod = fixture("claim-share"), fixture("pod-share")
    record = claims.record(raw)
    assert (record.managed, record.owner, record.node) == (True, pod["metadata"]["uid"], NODE)
    assert record.held == (claims.Held(0, 300, 8486),)
    assert record.reserved == (pod["metadata"]["uid"],)
    sync = sync_of()
    sync.put_claim(record)
    grant = sync.ledger.get(pod["metadata"]["uid"])
    # 8486 MiB consumed is the whole MPS limit: 8192 asked + the H100's 294 MiB context at 30 %
    assert grant == Grant(pod["metadata"]["uid"], NODE, (0,), 300, 8192, state=GrantState.CONFIRMED)
    state = sync.ledger.state(NODE)
    assert state is not None
    assert state.free_milli[0] == 700
    assert state.node.gpus[0].memory_mib - state.free_memory[0] == 8486


def test_memory_only_whole_and_first_available_claims_read_back() -> None:
    sync = sync_of()
    for name in ("claim-memory-only", "claim-whole-preferred"):
        sync.put_claim(claims.record(fixture(name)))
    memory_only = fixture("pod-memory-only")["metadata"]["uid"]
    assert sync.ledger.get(memory_only) == Grant(
        memory_only, NODE, (0,), 0, 4096, state=GrantState.CONFIRMED
    )
    whole = sync.ledger.get(fixture("pod-whole-preferred")["metadata"]["uid"])
    assert whole is not None and (whole.gpus, whole.milli, whole.memory_mib) == ((1, 2), 1000, 0)
    state = sync.ledger.state(NODE)
    assert state is not None and state.free_milli[1:3] == [0, 0]
    required = claims.record(fixture("claim-whole-required"))
    assert [(h.gpu, h.milli) for h in required.held] == [(0, 1000), (1, 1000)]


def test_a_claim_gpuplace_did_not_make_is_counted_once_under_its_own_key() -> None:
    raw = fixture("claim-share")
    del raw["metadata"]["labels"]  # a user's claim, kube-scheduler's, a template's
    record = claims.record(raw)
    assert not record.managed and record.key == f"claim:{record.uid}"
    sync = sync_of()
    sync.put_claim(record)
    assert sync.ledger.get(record.key) is not None
    assert sync.ledger.get(record.owner) is None
    sync.drop_claim(record)
    assert len(sync.ledger) == 0


def test_an_unallocated_or_unreadable_claim_holds_nothing() -> None:
    raw = fixture("claim-share")
    pending = copy.deepcopy(raw)
    del pending["status"]
    broken = copy.deepcopy(raw)
    broken["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["compute"] = "x"
    foreign = copy.deepcopy(raw)
    foreign["status"]["allocation"]["devices"]["results"][0]["driver"] = "gpu.nvidia.com"
    sync = sync_of()
    for body in (pending, broken, foreign):
        record = claims.record(body)
        assert record.held == ()
        sync.put_claim(record)
        assert len(sync.ledger) == 0
    assert "compute" in claims.record(broken).problem


def test_a_planned_grant_yields_to_the_claim_and_returns_when_the_claim_does() -> None:
    raw, pod = fixture("claim-share"), fixture("pod-share")
    uid = pod["metadata"]["uid"]
    planned = Grant(uid, NODE, (3,), 300, 8192)
    sync = sync_of()
    sync.upsert_pod(annotated(pod, planned))
    held = sync.ledger.get(uid)
    assert held is not None and held.gpus == (3,)
    sync.put_claim(claims.record(raw))  # allocated on gpu-0 (first fit), not the plan's gpu-3
    held = sync.ledger.get(uid)
    assert held is not None and held.gpus == (0,)
    state = sync.ledger.state(NODE)
    assert state is not None and state.free_milli[3] == 1000
    sync.upsert_pod(annotated(pod, planned))  # a pod event changes nothing: the claim holds
    held = sync.ledger.get(uid)
    assert held is not None and held.gpus == (0,)
    sync.drop_claim(claims.record(raw))
    held = sync.ledger.get(uid)
    assert held is not None and held.gpus == (3,)


def test_a_deleted_pods_claim_holds_until_the_claim_goes() -> None:
    raw, pod = fixture("claim-share"), fixture("pod-share")
    record = annotated(pod)
    sync = sync_of()
    sync.upsert_pod(record)
    sync.put_claim(claims.record(raw))
    sync.delete_pod(record)  # kube-scheduler counts the claim until it is deleted: so do we
    assert sync.ledger.get(record.uid) is not None
    sync.drop_claim(claims.record(raw))
    assert sync.ledger.get(record.uid) is None


def test_a_dra_pod_waiting_is_unbound_but_never_scored_ahead_by_the_extender() -> None:
    pod = copy.deepcopy(fixture("pod-share"))
    del pod["spec"]["nodeName"]
    pod["status"] = {"phase": "Pending"}
    record = annotated(pod)
    assert record.claim == "share-gpu-19b25856"
    sync = sync_of()
    sync.upsert_pod(record)
    assert sync.unbound == {"waiting": 1}
    assert not sync.pending  # kube-scheduler's DRA allocator places it, not the extender


def test_a_second_claim_made_for_one_pod_is_not_counted() -> None:
    first = fixture("claim-share")
    second = copy.deepcopy(first)
    second["metadata"]["uid"] = "2222"
    second["metadata"]["name"] = "share-gpu-other"
    second["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-3"
    sync = sync_of()
    sync.put_claim(claims.record(first))
    sync.put_claim(claims.record(second))
    held = sync.ledger.get(first["metadata"]["ownerReferences"][0]["uid"])
    assert held is not None and held.gpus == (0,)
    assert len(sync.ledger) == 1


def test_a_node_republished_with_its_context_recounts_its_claims() -> None:
    raw = fixture("claim-share")
    sync = sync_of()
    sync.put_claim(claims.record(raw))
    body = objects.node(
        NODE, gpus=4, model=H100, gpu_memory_mib=81559, labels={keys.NODE_DRA: "true"}
    )
    body["metadata"]["uid"] = "uid-x"
    body["metadata"]["annotations"][keys.AGENT_HEARTBEAT] = "2026-01-01T00:00:00Z"
    body["metadata"]["annotations"][keys.NODE_GPUS] = json.dumps(
        [
            {"index": i, "uuid": f"GPU-{i}", "memoryMiB": 81559, "packableMiB": 80960,
             "model": "NVIDIA H100 80GB HBM3", "mpsContextMiB": {"base": 100, "perPercent": 0}}
            for i in range(4)
        ]
    )  # fmt: skip
    sync.put_node(nodes.record(body))
    held = sync.ledger.get(raw["metadata"]["ownerReferences"][0]["uid"])
    assert held is not None and held.memory_mib == 8486 - 100
    state = sync.ledger.state(NODE)
    assert state is not None and state.free_memory[0] == 80960 - 8486


def test_listeners_hear_claims_come_and_go() -> None:
    heard: list[tuple[str | None, str | None]] = []
    sync = sync_of()
    sync.claim_listeners.append(
        lambda old, new: heard.append((old.name if old else None, new.name if new else None))
    )
    record = claims.record(fixture("claim-share"))
    sync.replace_claims([record])
    sync.put_claim(record)
    sync.drop_claim(record)
    assert heard == [(None, record.name), (record.name, record.name), (record.name, None)]


# --- a restart rebuilds the same ledger -------------------------------------------------------

CLAIM_NAMES = ("claim-share", "claim-memory-only", "claim-whole-preferred", "claim-whole-required")
POD_NAMES = ("pod-share", "pod-memory-only", "pod-whole-preferred", "pod-whole-required")


def variants() -> list[dict[str, Any]]:
    """The fixture claims, each also as a user's (unlabelled) claim and unallocated."""
    found = []
    for name in CLAIM_NAMES:
        raw = fixture(name)
        found.append(raw)
        users = copy.deepcopy(raw)
        users["metadata"]["labels"] = {}
        users["metadata"]["uid"] += "-u"
        users["metadata"]["name"] += "-u"
        found.append(users)
        pending = copy.deepcopy(raw)
        del pending["status"]
        found.append(pending)
    return found


VARIANTS = variants()
OPS = st.lists(
    st.tuples(
        st.sampled_from(["claim", "unclaim", "pod", "plan", "unpod"]),
        st.integers(min_value=0, max_value=len(VARIANTS) - 1),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_the_live_ledger_equals_one_rebuilt_from_the_api(ops: list[tuple[str, int]]) -> None:
    live = sync_of()
    stored_claims: dict[str, dict[str, Any]] = {}
    stored_pods: dict[str, pods.PodRecord] = {}
    for op, index in ops:
        raw = VARIANTS[index]
        pod = fixture(POD_NAMES[index // 3])
        uid = pod["metadata"]["uid"]
        if op == "claim":
            stored_claims[raw["metadata"]["uid"]] = raw
            live.put_claim(claims.record(raw))
        elif op == "unclaim" and raw["metadata"]["uid"] in stored_claims:
            del stored_claims[raw["metadata"]["uid"]]
            live.drop_claim(claims.record(raw))
        elif op in ("pod", "plan"):
            plan = Grant(uid, NODE, (3,), 300, 8192) if op == "plan" else None
            stored_pods[uid] = annotated(pod, plan)
            live.upsert_pod(stored_pods[uid])
        elif op == "unpod" and uid in stored_pods:
            live.delete_pod(stored_pods.pop(uid))
    for order in ("claims first", "pods first"):
        rebuilt = LedgerSync()
        rebuilt.replace_nodes([dra_node()])
        records = [claims.record(raw) for raw in stored_claims.values()]
        if order == "claims first":
            rebuilt.replace_claims(records)
            rebuilt.replace_pods(list(stored_pods.values()))
        else:
            rebuilt.replace_pods(list(stored_pods.values()))
            rebuilt.replace_claims(records)
        assert rebuilt.ledger.snapshot() == live.ledger.snapshot(), order
        live_state, rebuilt_state = live.ledger.state(NODE), rebuilt.ledger.state(NODE)
        assert live_state is not None and rebuilt_state is not None
        assert (live_state.free_milli, live_state.free_memory) == (
            rebuilt_state.free_milli,
            rebuilt_state.free_memory,
        )
