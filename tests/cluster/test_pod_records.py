"""A pod record reads an elastic gang's `gang-min` from the same parse as its request
(the annotation grammar's `Gang.elastic_minimum`), and when it started, as the queue
controller orders a gang's members: its `assigned-at`, else its creation, then its name;
it is the one reading of a pod that the ledger, the extender and both controllers share
(gpuplace.cluster.pods)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuplace.cluster import grammar, keys, pods
from gpuplace.cluster.gang_marks import PlanMark
from gpuplace.dev.localapi import objects


def gang_pod(name: str, minimum: str | None, size: str = "4") -> dict[str, Any]:
    notes = {keys.GANG_NAME: "ddp", keys.GANG_SIZE: size}
    if minimum is not None:
        notes[keys.GANG_MIN] = minimum
    return objects.pod(name, annotations=notes, labels={keys.GANG_LABEL: "ddp"})


def test_gang_min_is_read_only_for_an_elastic_gang() -> None:
    reader = pods.Reader()
    assert reader.record(gang_pod("a", "2")).minimum == 2
    assert reader.read(gang_pod("b", "3"))[0].minimum == 3
    assert reader.record(gang_pod("c", None)).minimum == 0
    assert reader.record(gang_pod("d", "4")).minimum == 0  # gang-min = gang-size: not elastic
    assert reader.record(objects.pod("e")).minimum == 0
    bad = reader.record(gang_pod("f", "5"))  # above gang-size: refused, recorded anyway
    assert bad.minimum == 0 and bad.request is None and keys.GANG_MIN in bad.problem


def test_started_is_the_assignment_else_the_creation_then_the_name() -> None:
    body = gang_pod("a", "2")
    body["metadata"]["creationTimestamp"] = "2026-01-01T00:00:10Z"
    body["metadata"]["uid"] = "uid-a"
    record = pods.record(body)
    assert record.created == pods.timestamp("2026-01-01T00:00:10Z") > 0
    assert record.started == (record.created, "a")
    body["metadata"]["annotations"].update(
        {
            keys.ASSIGNED_AT: "2026-01-01T00:01:00Z",
            keys.ASSIGNED_NODE: "n0",
            keys.ASSIGNED_GPUS: "0",
            keys.ASSIGNED_MILLI: "500",
            keys.ASSIGNED_MEMORY: "0",
        }
    )
    assigned = pods.record(body)
    assert assigned.grant is not None, assigned.problem
    assert assigned.started == (record.created + 50, "a")
    assert pods.timestamp("yesterday") == 0.0 and pods.timestamp(None) == 0.0


def test_one_record_holds_what_the_gang_and_queue_controllers_decide_with() -> None:
    body = objects.pod(
        "m-0",
        "team-a",
        percent=None,
        count=2,
        annotations={
            keys.GANG_NAME: "ddp",
            keys.GANG_SIZE: "4",
            keys.GANG_TIMEOUT: "90s",
            keys.GANG_PLAN: PlanMark("p1", 4, "gpu-1").encode(),
        },
        labels={keys.GANG_LABEL: "ddp", keys.QUEUE_LABEL: "team-a"},
        gates=[keys.QUEUE_GATE, keys.GANG_GATE],
    )
    body["spec"]["priority"] = 7
    body["spec"]["preemptionPolicy"] = "Never"
    body["spec"]["nodeSelector"] = {"zone": "b"}
    body["spec"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    body["status"] = {
        "conditions": [{"type": keys.GANG_CONDITION, "status": "False", "reason": "GangTimeout"}]
    }
    record = pods.record(body)
    assert (record.gang, record.controlled.gang_name, record.controlled.gang_size) == (
        "ddp",
        "ddp",
        4,
    )
    assert record.controlled.gang_timeout == 90.0 and record.gang_key == ("team-a", "ddp")
    assert record.controlled.queue == "team-a" and record.workload == "gang team-a/ddp"
    assert record.gated and record.controlled.gang_gated and record.controlled.queue_gated
    assert record.controlled.plan == PlanMark("p1", 4, "gpu-1") and not record.controlled.assigned
    assert record.priority == 7 and record.controlled.preemption_policy == "Never"
    assert (
        record.controlled.affinity.selector == (("zone", "b"),)
        and len(record.controlled.tolerations) == 1
    )
    assert record.controlled.gang_ready == ("False", "GangTimeout")
    alone = pods.record(objects.pod("solo", "team-a", labels={keys.QUEUE_LABEL: "team-a"}))
    assert (
        alone.workload == "team-a/solo"
        and alone.controlled.gang_name == ""
        and not alone.controlled.gang_gated
    )
    assert alone.controlled.gang_timeout == grammar.DEFAULT_GANG_TIMEOUT_SECONDS


def test_only_the_pods_a_controller_keeps_have_what_it_decides_with_read() -> None:
    body = objects.pod("plain")
    body["spec"]["nodeSelector"] = {"zone": "b"}
    body["spec"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    record = pods.record(body)
    assert record.controlled is pods.UNCONTROLLED  # shared: no memory of its own
    assert record.controlled.affinity is pods.NO_CONSTRAINTS and record.controlled.tolerations == ()


def test_a_gang_member_whose_request_cannot_be_read_keeps_its_gang() -> None:
    body = gang_pod("bad", None)
    body["spec"]["overhead"] = {"cpu": "lots"}  # the annotations parse, the request cannot
    reader = pods.Reader()
    for _ in range(2):  # the second read comes from the memo
        record = reader.record(body)
        assert record.request is None and record.problem
        assert (record.controlled.gang_name, record.controlled.gang_size) == ("ddp", 4)


def test_priority_is_an_int32_whatever_the_pod_says() -> None:
    for raw, read in ((5, 5), (True, 0), ("7", 0), (1 << 40, (1 << 31) - 1), (None, 0)):
        body = objects.pod("p")
        body["spec"]["priority"] = raw
        assert pods.record(body).priority == read


def exited(code: int, *, last: bool = False, reason: str = "Error") -> dict[str, Any]:
    state = {"terminated": {"exitCode": code, "reason": reason}}
    key = "lastState" if last else "state"
    return {"name": "main", key: state, **({"state": {"running": {}}} if last else {})}


@pytest.mark.parametrize(
    ("status", "deleting", "why"),
    [
        ({"phase": "Running"}, False, ""),
        ({"phase": "Succeeded", "containerStatuses": [exited(1)]}, True, ""),
        (
            {"phase": "Failed", "containerStatuses": [exited(3)]},
            False,
            "its container main exited with code 3",
        ),
        (
            {"phase": "Running", "containerStatuses": [exited(137, last=True, reason="OOMKilled")]},
            False,
            "its container main exited with code 137 (OOMKilled) and was restarted",
        ),
        ({"phase": "Running", "containerStatuses": [exited(0, last=True)]}, False, ""),
        (
            {"phase": "Failed", "reason": "Evicted", "message": "low on memory"},
            False,
            "it failed (Evicted: low on memory)",
        ),
        (
            {
                "phase": "Running",
                "conditions": [
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "EvictionByEvictionAPI",
                    }
                ],
            },
            True,
            "it was disrupted (EvictionByEvictionAPI)",
        ),
        ({"phase": "Running"}, True, "it was deleted before it completed"),
        ({"phase": "Pending", "containerStatuses": "junk"}, False, ""),
    ],
)
def test_a_gang_members_failure_is_read_from_its_status(
    status: dict[str, Any], deleting: bool, why: str
) -> None:
    """Issue 45: what counts as a member's failure (a success never does)."""
    assert pods.failure_of(status, deleting=deleting) == why


@pytest.mark.parametrize(
    ("policy", "statuses", "ends"),
    [
        ("Never", [exited(3)], True),
        ("Never", [exited(3), {"name": "side", "state": {"running": {}}}], False),
        ("Never", [], False),
        ("OnFailure", [exited(3)], False),
        (None, [exited(3)], False),
        ("Never", [exited(137, last=True)], False),
    ],
)
def test_a_pod_whose_containers_all_exited_under_never_ends_by_itself(
    policy: str | None, statuses: list[dict[str, Any]], ends: bool
) -> None:
    """Issue 45: the kubelet ends such a pod itself (its phase follows its exit, seconds
    later on v1.36), so a gang restart leaves it to end rather than evict it."""
    spec = {} if policy is None else {"restartPolicy": policy}
    status = {"phase": "Running", "containerStatuses": statuses}
    assert pods.ending(spec, status) is ends
