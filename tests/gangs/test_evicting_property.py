"""A waiting gang's preemption on random clusters (gpuplace.gangs.evicting over a
LedgerSync, no HTTP): the units offered are only bound pods of strictly lower priority
than the gang's lowest member, a running gang whole across its nodes or not at all, or
(an elastic one) its extras alone, never leaving it below `gang-min` unless whole;
after the plan every member fits (the ledger accepts their grants), no victim is of the
gang's priority or above, and none is beyond need."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.cluster import pods
from gpuplace.cluster.nodes import NodeRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import victims
from gpuplace.dev.localapi import objects
from gpuplace.placement import choosing, elastic, gangs, policies, victim_choice
from gpuplace.placement.ledger import Grant, Ledger
from gpuplace.placement.requests import GpuRequest
from tests.placement.clusters import node, room_for

NODES = ("n0", "n1", "n2")

PODS = st.lists(
    st.tuples(
        st.sampled_from(NODES),
        st.integers(0, 3),  # GPU
        st.sampled_from([1000, 1000, 500, 300]),  # share
        st.sampled_from([0, 10, 50, 100]),  # priority
        st.sampled_from(["", "", "", "g", "h"]),  # running gang
        st.sampled_from([True, True, True, False]),  # bound (else a reservation)
    ),
    min_size=12,
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(
    pods_=PODS,
    priorities=st.lists(st.sampled_from([10, 50, 100, 100]), min_size=2, max_size=4),
    wants=st.sampled_from([(1000, 1), (1000, 2), (1000, 2), (1000, 4), (600, 1)]),
    odd=st.booleans(),
    minimum=st.integers(0, 3),
)
def test_gang_preemption_plans_evict_only_lower_whole_and_needed_units(
    pods_: list[tuple[str, int, int, int, str, bool]],
    priorities: list[int],
    wants: tuple[int, int],
    odd: bool,
    minimum: int,
) -> None:
    """Victims are lower, whole and needed; once they are gone the gang's own plan
    (`gangs.plan`, what the controller starts it with) places every member, also when
    one member wants one whole GPU more than the others (`odd`)."""
    sync = LedgerSync()
    for name in NODES:
        sync.put_node(NodeRecord(name, name, True, node(name, 4)))
    records = {}
    for i, (at, gpu, share, priority, gang, bound) in enumerate(pods_):
        uid = f"p{i:02}"
        grant = Grant(uid, at, (gpu,), share, 0, 0, 0)
        if sync.ledger.state(at) is None or not room_for(sync.ledger, grant):
            continue
        labels = {"gpuplace.io/gang": gang} if gang else None
        base = pods.record(objects.pod(uid, labels=labels))
        record = replace(
            base,
            uid=uid,
            node_name=at if bound else "",
            grant=grant,
            priority=priority,
            gang=gang,
            minimum=minimum if gang == "g" else 0,  # g is elastic when it runs more
            assigned_at=float(-i if i % 2 else i),  # members started out of name order
        )
        sync.upsert_pod(record)
        records[uid] = record
    gang_priority = min(priorities)
    units = victims.victim_units(sync, gang_priority)
    in_units = [uid for unit in units for uid in unit.uids]
    mates = {g: [r for r in records.values() if r.gang == g] for g in ("g", "h")}
    spares = {r.uid for r in elastic.extras(pods.started(mates["g"]), minimum)}
    for unit in units:
        members = [records[uid] for uid in unit.uids]
        assert all(m.priority < gang_priority for m in members)
        if members[0].gang and unit.spare == len(unit.uids) == 1:  # an extra alone
            assert unit.uids[0] in spares and members[0].bound
        elif members[0].gang:  # every live member of that gang, across nodes
            assert set(unit.uids) == {m.uid for m in mates[members[0].gang]}
        else:
            assert len(members) == 1 and members[0].bound
    # a pod is in one unit, or in an elastic gang's extra and its whole gang
    assert all(in_units.count(uid) == 1 or uid in spares for uid in in_units)
    for record in records.values():  # a lower, bound pod outside a gang is always offered
        if not record.gang and record.bound and record.priority < gang_priority:
            assert record.uid in in_units
    milli, count = wants
    request = GpuRequest(milli=milli, count=count, cpu_milli=0, host_memory_mib=0)
    waiting = [gangs.Member(f"m{i}", request) for i in range(len(priorities))]
    if odd and milli == 1000 and count < 4:
        bigger = replace(request, count=count + 1)
        waiting[-1] = gangs.Member(waiting[-1].uid, bigger)
    asks = {member.uid: member.request for member in waiting}
    policy = policies.make("best-fit")
    found = victim_choice.for_gang(sync.ledger, policy, waiting, units)
    if found is None:
        return
    assert all(records[uid].priority < gang_priority for uid in found.uids)
    gone = set(found.uids)
    assert len(gone) == len(found.uids)  # no pod twice (alternatives never both)
    for gang, running in mates.items():
        taken = {m.uid for m in running} & gone
        whole = taken == {m.uid for m in running}
        assert not taken or whole or (gang == "g" and taken <= spares), (gang, taken)
    scratch = Ledger(sync.ledger.inventory)
    scratch.restore(grant for grant in sync.ledger if grant.pod_uid not in gone)
    started = gangs.plan(scratch, policy, waiting)
    assert not isinstance(started, gangs.Shortfall), started.reason
    for member in waiting:
        scratch.reserve(choosing.grant_for(member.uid, found.choices[member.uid], asks[member.uid]))
    where = {uid: choice.node for uid, choice in found.choices.items()}
    for victim in found.units:
        rest = [other for other in found.units if other is not victim]
        if victim_choice.place(sync.ledger, waiting, where, rest) is None:
            continue
        # a first fit on the plan's nodes fits without it: the gang's own plan must not
        others = {uid for unit in rest for uid in unit.uids}
        without = Ledger(sync.ledger.inventory)
        without.restore(grant for grant in sync.ledger if grant.pod_uid not in others)
        short = gangs.plan(without, policy, waiting)
        assert isinstance(short, gangs.Shortfall), victim.uids
