"""The assignment annotations round-trip exactly (the grant's time to the microsecond),
unreadable ones are refused clearly, and the times `Stamps` issues order admissions
exactly: strictly increasing, after every stamp read back from the API (issue 41)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuplace.cluster import assignments, keys, mps_limits
from gpuplace.placement.inventory import Gpu, Node
from gpuplace.placement.ledger import Grant, GrantState
from gpuplace.placement.requests import GpuRequest

AT = datetime(2026, 11, 21, 5, 44, 24, 48213, tzinfo=UTC)


def node(gpus: int, uuids: bool) -> Node:
    return Node(
        name="n0",
        cpu_milli=64000,
        memory_mib=1 << 20,
        gpus=tuple(
            Gpu(i, "A100", 81920, uuid=f"GPU-{i:04d}" if uuids else "") for i in range(gpus)
        ),
    )


def pod_with(notes: dict[str, str], uid: str = "u-1", bound: str = "") -> dict[str, Any]:
    spec = {"nodeName": bound} if bound else {}
    return {"metadata": {"uid": uid, "annotations": notes}, "spec": spec}


@given(
    gpus=st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True),
    milli=st.integers(1, 1000),
    memory=st.integers(0, 81920),
    cpu=st.integers(0, 64000),
    host=st.integers(0, 1 << 20),
    uuids=st.booleans(),
    bound=st.booleans(),
)
def test_grant_round_trips_through_annotations(  # noqa: PLR0917 (hypothesis arguments)
    gpus: list[int], milli: int, memory: int, cpu: int, host: int, uuids: bool, bound: bool
) -> None:
    state = GrantState.CONFIRMED if bound else GrantState.RESERVED
    grant = Grant("u-1", "n0", tuple(gpus), milli, memory, cpu, host, state)
    notes = assignments.annotations_for(grant, node(8, uuids), AT)
    request = GpuRequest(cpu_milli=cpu, host_memory_mib=host)
    assert assignments.grant_of(pod_with(notes, bound="n0" if bound else ""), request) == grant
    assert notes[keys.ASSIGNED_AT] == "2026-11-21T05:44:24.048213Z"
    if uuids:
        assert notes[keys.VISIBLE_DEVICES] == ",".join(f"GPU-{i:04d}" for i in gpus)
    else:
        assert notes[keys.ASSIGNED_UUIDS] == ""
        assert notes[keys.VISIBLE_DEVICES] == ",".join(map(str, gpus))
    assert assignments.assigned_at(pod_with(notes)) == AT.timestamp()


def test_no_assignment_is_none_and_cleared_removes_every_key() -> None:
    assert assignments.grant_of(pod_with({})) is None
    assert set(assignments.cleared()) == set(assignments.KEYS)
    assert all(value is None for value in assignments.cleared().values())


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (keys.ASSIGNED_GPUS, ""),
        (keys.ASSIGNED_GPUS, "0,0"),
        (keys.ASSIGNED_GPUS, "a"),
        (keys.ASSIGNED_GPUS, "-1"),
        (keys.ASSIGNED_MILLI, "1001"),
        (keys.ASSIGNED_MILLI, "50%"),
        (keys.ASSIGNED_MEMORY, "-5"),
    ],
)
def test_unreadable_values_name_the_key(key: str, value: str) -> None:
    grant = Grant("u-1", "n0", (0,), 500, 100)
    notes = {**assignments.annotations_for(grant, None, AT), key: value}
    with pytest.raises(assignments.AssignmentError, match=key):
        assignments.grant_of(pod_with(notes))


@given(
    gpu=st.integers(0, 7),
    memory=st.integers(1, 81920),
    cpu=st.integers(0, 64000),
    bound=st.booleans(),
)
def test_memory_only_grant_round_trips_through_annotations(
    gpu: int, memory: int, cpu: int, bound: bool
) -> None:
    state = GrantState.CONFIRMED if bound else GrantState.RESERVED
    grant = Grant("u-1", "n0", (gpu,), 0, memory, cpu, 0, state)
    notes = assignments.annotations_for(grant, node(8, True), AT)
    assert notes[keys.ASSIGNED_MILLI] == "0"
    request = GpuRequest(cpu_milli=cpu)
    back = assignments.grant_of(pod_with(notes, bound="n0" if bound else ""), request)
    assert back == grant and back.memory_only


@pytest.mark.parametrize(
    ("gpus", "memory"),
    [("0", "0"), ("0,1", "1024")],
)
def test_a_memory_only_assignment_needs_one_gpu_and_memory(gpus: str, memory: str) -> None:
    notes = {
        **assignments.annotations_for(Grant("u-1", "n0", (0,), 0, 1024), None, AT),
        keys.ASSIGNED_GPUS: gpus,
        keys.ASSIGNED_MEMORY: memory,
    }
    with pytest.raises(assignments.AssignmentError, match="memory-only share"):
        assignments.grant_of(pod_with(notes))


@pytest.mark.parametrize(
    ("written", "seconds"),
    [
        ("2026-11-21T05:44:24Z", 0.0),  # whole seconds: what gpuplace wrote before
        ("2026-11-21T05:44:24.048213Z", 0.048213),
        ("2026-11-21T05:44:24.5Z", 0.5),
        ("2026-11-21T05:44:24.048213999Z", 0.048213),  # beyond microseconds: dropped
        ("2026-11-21T06:44:24.25+01:00", 0.25),
    ],
)
def test_assigned_at_reads_whole_seconds_and_any_fraction(written: str, seconds: float) -> None:
    whole = datetime(2026, 11, 21, 5, 44, 24, tzinfo=UTC).timestamp()
    found = assignments.assigned_at(pod_with({keys.ASSIGNED_AT: written}))
    assert found is not None and abs(found - (whole + seconds)) < 1e-7


def test_assigned_at_that_is_no_time_reads_as_none() -> None:
    assert assignments.assigned_at(pod_with({keys.ASSIGNED_AT: "now"})) is None
    assert assignments.assigned_at(pod_with({})) is None


def written_and_read(moment: datetime) -> float:
    """`moment` through the annotation and back, as the ledger's rebuild reads it."""
    at = assignments.assigned_at(pod_with({keys.ASSIGNED_AT: assignments.precise(moment)}))
    assert at is not None
    return at


CLOCK = st.floats(1.7e9, 1.7e9 + 86400, allow_nan=False)


@given(st.lists(CLOCK | st.just(1.7e9), min_size=1, max_size=40))
def test_stamps_increase_strictly_whatever_the_clock_does(readings: list[float]) -> None:
    """Equal readings (one microsecond, a frozen test clock), a clock stepping back: the
    stamps still come out in the order they were issued, and survive the annotation."""
    stamps = assignments.Stamps()
    issued = [stamps.next(now) for now in readings]
    assert all(a < b for a, b in itertools.pairwise(issued))
    read = [written_and_read(moment) for moment in issued]
    assert all(a < b for a, b in itertools.pairwise(read))
    for now, moment in zip(readings, issued, strict=True):
        assert moment.timestamp() >= now - 1e-6  # never before the clock


@given(st.lists(CLOCK, min_size=1, max_size=20), st.floats(0, assignments.AHEAD - 1))
def test_after_a_restart_stamps_follow_every_one_in_the_api(
    before: list[float], behind: float
) -> None:
    """A new process (or the replica a lease moved to, its clock `behind` by up to
    `AHEAD`) reads every `assigned-at` from the API; its stamps come after all of them."""
    old = assignments.Stamps()
    written = [written_and_read(old.next(now)) for now in before]
    new = assignments.Stamps()
    for at in written:
        new.seen(at)
    first = written_and_read(new.next(max(before) - behind))
    assert first > max(written)


def test_a_stamp_far_ahead_of_the_clock_is_not_followed() -> None:
    """One from a clock that was wrong by more than `AHEAD`: later grants are dated by
    the clock (the reaper reads these times), not after it."""
    stamps = assignments.Stamps()
    stamps.seen(2e9)
    assert stamps.next(1.7e9).timestamp() == 1.7e9


def test_a_shares_mps_memory_limit_is_written_at_bind_with_its_gpus_context() -> None:
    """Issue 43: the webhook's env path reads CUDA_MPS_PINNED_DEVICE_MEM_LIMIT through the
    downward API from this annotation, which covers the CUDA context of the GPU granted."""
    context = mps_limits.MODELS["NVIDIA-H100-80GB-HBM3"].context
    h100 = Node(
        name="n0",
        cpu_milli=64000,
        memory_mib=1 << 20,
        gpus=(Gpu(0, "NVIDIA-H100-80GB-HBM3", 80960, context=context),),
    )
    share = assignments.annotations_for(Grant("u-1", "n0", (0,), 250, 2048), h100, AT)
    assert share[keys.MPS_MEMORY_LIMIT] == "0=2317M"  # 2048 + 144 + 5 × 25
    memory_only = assignments.annotations_for(Grant("u-1", "n0", (0,), 0, 1024), h100, AT)
    assert memory_only[keys.MPS_MEMORY_LIMIT] == "0=1668M"  # 1024 + 144 + 5 × 100
    for whole_or_no_memory in (Grant("u-1", "n0", (0,), 1000, 0), Grant("u", "n0", (0,), 500, 0)):
        assert (
            assignments.annotations_for(whole_or_no_memory, h100, AT)[keys.MPS_MEMORY_LIMIT] == ""
        )
    # a node gone from the inventory: the cautious default, never a limit below the ask's
    gone = assignments.annotations_for(Grant("u-1", "n0", (0,), 250, 2048), None, AT)
    assert gone[keys.MPS_MEMORY_LIMIT] == f"0={2048 + mps_limits.UNMEASURED.context.mib(250)}M"
    assert keys.MPS_MEMORY_LIMIT in keys.SYSTEM_ANNOTATIONS and keys.MPS_MEMORY_LIMIT in (
        assignments.KEYS
    )
