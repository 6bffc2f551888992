"""The preempt verb and elastic gangs (issue 29, point 4): a running elastic gang gives
back its extra members (beyond `gang-min`) one by one, the most recently started first,
before it goes whole; never is it left below `gang-min` unless it goes whole; a gang
that is not elastic still goes whole or not at all (gpuplace.extender.preempt_verb over
a LedgerSync, no HTTP)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from gpuplace.cluster import keys, pods
from gpuplace.cluster.nodes import NodeRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev.localapi import objects
from gpuplace.extender.preempt_verb import Preempter
from gpuplace.extender.preempt_wire import PreemptionArgs
from gpuplace.placement.ledger import Grant
from tests.placement.clusters import node

HIGH = 1000
WHOLE = 1000


def cluster(gpus: int = 4, nodes: Iterable[str] = ("n0", "n1")) -> LedgerSync:
    sync = LedgerSync()
    for name in nodes:
        sync.put_node(NodeRecord(name, name, True, node(name, gpus)))
    return sync


def running(
    sync: LedgerSync,
    name: str,
    where: str,
    gpu: int,
    *,
    gang: str = "",
    minimum: int = 0,
    size: int = 4,
    started: float = 0.0,
    priority: int = 0,
    milli: int = WHOLE,
) -> pods.PodRecord:
    """A bound pod holding `milli` of GPU `gpu` of `where`; a gang member when `gang`,
    its `gang-min` read from its annotations as the informer reads them."""
    notes = {}
    labels = {}
    if gang:
        notes = {keys.GANG_NAME: gang, keys.GANG_SIZE: str(size)}
        if minimum:
            notes[keys.GANG_MIN] = str(minimum)
        labels = {keys.GANG_LABEL: gang}
    base = pods.record(objects.pod(name, annotations=notes, labels=labels))
    assert base.minimum == (minimum if 0 < minimum < size else 0), base.problem
    record = replace(
        base,
        uid=name,
        node_name=where,
        phase="Running",
        grant=Grant(name, where, (gpu,), milli, 0, 0, 0),
        priority=priority,
        assigned_at=started,
    )
    sync.upsert_pod(record)
    return record


def answer(
    sync: LedgerSync, offered: dict[str, list[str]], *, count: int = 1, percent: int | None = None
) -> dict[str, set[str]]:
    """The verb's answer (victim UIDs per node) for a preemptor of priority HIGH asking
    for `count` whole GPUs (or a `percent` share of one)."""
    body = objects.pod("high", percent=percent, count=None if percent else count)
    body["metadata"]["uid"] = "high"
    body["spec"]["priority"] = HIGH
    args = PreemptionArgs.model_validate(
        {
            "Pod": body,
            "NodeNameToMetaVictims": {
                name: {"Pods": [{"UID": uid} for uid in uids]} for name, uids in offered.items()
            },
        }
    )
    result = Preempter(sync, pods.Reader().request).answer(args)
    return {name: set(victims) for name, (victims, _) in result.nodes.items()}


def ddp(sync: LedgerSync, minimum: int = 2, where: tuple[str, ...] = ("n0",) * 4) -> list[str]:
    """A gang of 4 whole-GPU members started one after another (m0 first), member i on
    GPU i of `where[i]`."""
    return [
        running(sync, f"m{i}", at, i, gang="ddp", minimum=minimum, started=100.0 + i).uid
        for i, at in enumerate(where)
    ]


def test_one_gpu_takes_exactly_one_extra_the_newest() -> None:
    sync = cluster()
    members = ddp(sync)
    assert answer(sync, {"n0": members}) == {"n0": {"m3"}}
    # offered nothing there (kube-scheduler's placeholder): the extender chooses the same
    assert answer(sync, {"n0": []}) == {"n0": {"m3"}}


def test_the_newest_extra_is_the_one_started_last_not_the_last_named() -> None:
    sync = cluster()
    for i, started in enumerate((100.0, 101.0, 103.0, 102.0)):
        running(sync, f"m{i}", "n0", i, gang="ddp", minimum=2, started=started)
    assert answer(sync, {"n0": ["m0", "m1", "m2", "m3"]}) == {"n0": {"m2"}}


def test_two_gpus_take_both_extras_three_take_the_whole_gang() -> None:
    sync = cluster()
    members = ddp(sync)
    assert answer(sync, {"n0": members}, count=2) == {"n0": {"m2", "m3"}}
    # a third GPU would leave one member below gang-min 2: the whole gang goes
    assert answer(sync, {"n0": members}, count=3) == {"n0": set(members)}


def test_three_gpus_leave_the_node_out_when_the_gang_runs_elsewhere_too() -> None:
    sync = cluster()
    members = ddp(sync, where=("n1", "n0", "n0", "n0"))
    running(sync, "top", "n0", 0, priority=HIGH)
    # m1 (core) is here, m0 (core) on n1: the gang cannot go whole through n0's answer,
    # and its extras m2, m3 free only two GPUs
    assert answer(sync, {"n0": members[1:]}, count=3) == {}
    assert answer(sync, {"n0": members[1:]}, count=2) == {"n0": {"m2", "m3"}}


def test_an_extra_elsewhere_of_a_gang_with_its_core_on_another_node_goes_alone() -> None:
    sync = cluster()
    ddp(sync, where=("n1", "n1", "n0", "n1"))
    assert answer(sync, {"n0": ["m2"]}) == {"n0": {"m2"}}


def test_a_gang_that_is_not_elastic_goes_whole_or_not_at_all() -> None:
    sync = cluster()
    members = ddp(sync, minimum=0)
    assert answer(sync, {"n0": members}) == {"n0": set(members)}
    sync = cluster()
    members = ddp(sync, minimum=4)  # gang-min = gang-size: not elastic
    assert answer(sync, {"n0": members}) == {"n0": set(members)}
    sync = cluster()
    members = ddp(sync, minimum=0, where=("n1", "n0", "n0", "n0"))
    running(sync, "top", "n0", 0, priority=HIGH)
    assert answer(sync, {"n0": members[1:]}) == {}


def test_at_gang_min_it_has_no_extras() -> None:
    sync = cluster()
    for i in range(2):  # 2 of 4 running, gang-min 2: both are needed
        running(sync, f"m{i}", "n0", i, gang="ddp", minimum=2, started=100.0 + i)
    running(sync, "top-2", "n0", 2, priority=HIGH)
    running(sync, "top-3", "n0", 3, priority=HIGH)
    assert answer(sync, {"n0": ["m0", "m1"]}) == {"n0": {"m0", "m1"}}
    assert answer(sync, {"n0": ["m1"]}) == {"n0": {"m0", "m1"}}


def test_an_extra_goes_before_a_pod_alone_of_the_same_priority_not_of_a_lower_one() -> None:
    sync = cluster()
    ddp(sync, where=("n1", "n1", "n0", "n1"))  # m2, an extra, on GPU 2 of n0
    running(sync, "lone", "n0", 0)
    running(sync, "top-1", "n0", 1, priority=HIGH)
    running(sync, "top-3", "n0", 3, priority=HIGH)
    assert answer(sync, {"n0": ["m2", "lone"]}) == {"n0": {"m2"}}
    sync = cluster()
    ddp(sync, where=("n1", "n1", "n0", "n1"))
    running(sync, "lone", "n0", 0, priority=-1)
    running(sync, "top-1", "n0", 1, priority=HIGH)
    running(sync, "top-3", "n0", 3, priority=HIGH)
    assert answer(sync, {"n0": ["m2", "lone"]}) == {"n0": {"lone"}}


def test_kept_victims_may_be_extras_but_not_a_core_member() -> None:
    """The preemptor fits the node's GPUs already: kube-scheduler's victims stand unless
    they split a running gang; an elastic gang's extras alone do not split it."""
    sync = cluster(gpus=5)
    members = ddp(sync, where=("n0", "n0", "n0", "n0"))  # GPU 4 of n0 is free
    assert answer(sync, {"n0": ["m3"]}) == {"n0": {"m3"}}
    assert answer(sync, {"n0": ["m2", "m3"]}) == {"n0": {"m2", "m3"}}
    assert answer(sync, {"n0": ["m0"]}) == {}
    assert answer(sync, {"n0": ["m1", "m2", "m3"]}) == {}
    assert answer(sync, {"n0": members}) == {"n0": set(members)}
