"""The preempt verb's answer, for any node state and any offer: only pods it may evict
(offered, or of lower priority than the preemptor when allowed; never a gang member
whose gang runs elsewhere, but for an elastic gang's extras; an elastic gang never left
below its `gang-min` unless it goes whole), at least one per node kept (a node where the pod already
fits with none offered is left out), the preemptor fits after them, and none is beyond
need (gpuplace.extender.preempt_verb over a LedgerSync, no HTTP)."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.cluster import pods
from gpuplace.cluster.nodes import NodeRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev.localapi import objects
from gpuplace.extender.preempt_verb import Preempter
from gpuplace.extender.preempt_wire import PreemptionArgs
from gpuplace.placement import elastic, victim_choice
from gpuplace.placement.ledger import Grant
from gpuplace.placement.victim_choice import Unit
from tests.placement.clusters import node

HIGH = 100

PODS = st.lists(
    st.tuples(
        st.sampled_from(["n0", "n1"]),  # node
        st.integers(0, 1),  # GPU
        st.integers(1, 10).map(lambda tenths: tenths * 100),  # share
        st.sampled_from([0, 50, HIGH, 200]),  # priority
        st.booleans(),  # offered
        st.sampled_from(["", "", "", "g"]),  # gang label
    ),
    max_size=10,
)


@settings(max_examples=200, deadline=None)
@given(
    pods_=PODS,
    milli=st.integers(1, 10).map(lambda t: t * 100),
    beyond=st.booleans(),
    minimum=st.integers(0, 3),
    order=st.randoms(use_true_random=False),
)
def test_answers_evict_only_allowed_pods_and_make_room_with_none_to_spare(
    pods_: list[tuple[str, int, int, int, bool, str]],
    milli: int,
    beyond: bool,
    minimum: int,
    order: random.Random,
) -> None:
    """`minimum`: gang g's `gang-min` (elastic when below its running members);
    `order`: the order its members started in."""
    sync = LedgerSync()
    for name in ("n0", "n1"):
        sync.put_node(NodeRecord(name, name, True, node(name, 2)))
    offered: dict[str, list[str]] = {"n0": [], "n1": []}
    records = {}
    starts = list(range(len(pods_)))
    order.shuffle(starts)
    for i, (where, gpu, share, priority, offer, gang) in enumerate(pods_):
        uid = f"p{i:02}"
        grant = Grant(uid, where, (gpu,), share, 0, 0, 0)
        base = pods.record(objects.pod(uid, labels={"gpuplace.io/gang": gang} if gang else None))
        record = replace(
            base,
            uid=uid,
            node_name=where,
            grant=grant,
            priority=priority,
            gang=gang,
            minimum=minimum if gang else 0,
            assigned_at=float(starts[i]),
        )
        sync.upsert_pod(record)
        records[uid] = record
        if offer:
            offered[where].append(uid)
    body = objects.pod("high", percent=milli // 10)
    body["metadata"]["uid"] = "high"
    body["spec"]["priority"] = HIGH
    preempter = Preempter(sync, pods.Reader().request, beyond_offered=beyond)
    args = PreemptionArgs.model_validate(
        {
            "Pod": body,
            "NodeNameToMetaVictims": {
                name: {"Pods": [{"UID": uid} for uid in uids]} for name, uids in offered.items()
            },
        }
    )
    request = preempter.request_of(body)
    assert request is not None
    for name, (victims, _) in preempter.answer(args).nodes.items():
        state = sync.ledger.state(name)
        assert state is not None
        assert victims, f"{name}: an answer with no victims fails kube-scheduler's preemption"
        chosen = [records[uid] for uid in victims]
        mates = [r for r in records.values() if r.gang == "g"]
        spares = {r.uid for r in elastic.extras(pods.started(mates), minimum)}
        whole = all(m.node_name == name and m.uid in victims for m in mates)
        for record in chosen:
            assert record.node_name == name
            assert record.uid in offered[name] or (
                (beyond or not offered[name]) and record.priority < HIGH
            )
            if record.gang:  # its whole gang goes, and it all runs here; or only extras
                assert whole or record.uid in spares, (record.uid, spares)
        if not whole:  # an elastic gang keeps gang-min members at least
            assert len([m for m in mates if m.uid not in victims]) >= min(minimum, len(mates))
        if victim_choice.fits_after(state, request, []):
            assert sorted(victims) == sorted(offered[name])  # GPUs not short: as offered
            continue  # (the gang checks above hold for these too)
        units = _units(chosen, whole)
        assert victim_choice.fits_after(state, request, units)
        for unit in units:
            rest = [other for other in units if other is not unit]
            assert not victim_choice.fits_after(state, request, rest), unit.uids


def _units(chosen: list[pods.PodRecord], whole: bool) -> list[Unit]:
    """The victims as eviction units: a gang's members together when it goes whole,
    else each of its extras alone."""
    groups: dict[str, list[pods.PodRecord]] = {}
    for record in chosen:
        groups.setdefault(record.gang if record.gang and whole else record.uid, []).append(record)
    return [
        Unit(
            tuple(r.uid for r in group),
            tuple(r.grant for r in group if r.grant is not None),
            tuple(r.priority for r in group),
        )
        for group in groups.values()
    ]
