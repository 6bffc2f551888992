"""A pod record reads an elastic gang's `gang-min` from the same parse as its request
(the annotation grammar's `Gang.elastic_minimum`), and when it started, as the queue
controller orders a gang's members: its `assigned-at`, else its creation, then its name
(gpuplace.cluster.pods)."""

from __future__ import annotations

from typing import Any

from gpuplace.cluster import keys, pods
from gpuplace.dev.localapi import objects


def gang_pod(name: str, minimum: str | None, size: str = "4") -> dict[str, Any]:
    notes = {keys.GANG_NAME: "ddp", keys.GANG_SIZE: size}
    if minimum is not None:
        notes[keys.GANG_MIN] = minimum
    return objects.pod(name, annotations=notes, labels={keys.GANG_LABEL: "ddp"})


def test_gang_min_is_read_only_for_an_elastic_gang() -> None:
    reader = pods.Reader()
    assert reader.record(gang_pod("a", "2")).minimum == 2
    assert reader.read(gang_pod("b", "3"))[1] == 3
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
