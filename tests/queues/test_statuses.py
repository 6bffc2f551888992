"""What the controller writes into a GpuQueue's status with fair sharing over time: the
past share's decay alone is no reason to write (the status still gives it exactly), its
coming and going is; turned off, the write removes it; what a status remembers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuplace.cluster.queue_directory import QueueRecord
from gpuplace.placement.queueing import quotas
from gpuplace.placement.queueing.admitting import QueueStatus
from gpuplace.queues import statuses

SPEC = quotas.QueueSpec("a", {(quotas.GPUS, quotas.ANY_MODEL): quotas.Quota(1000)}, cohort="c")
NOW = QueueStatus("a", "c", {}, {}, {}, 1, 0, 0, 0.5)


def record(status: dict[str, object]) -> QueueRecord:
    return QueueRecord("a", "uid", 1, SPEC, None, status=status)


def test_the_past_shares_decay_alone_writes_nothing() -> None:
    shown = statuses.body(record({}), NOW, "2026-11-27T10:00:00Z", past=0.25)
    assert shown[statuses.PAST] == 250
    later = statuses.body(record(shown), NOW, "2026-11-27T11:00:00Z", past=0.375)
    assert not statuses.changed(record(shown), later)
    assert statuses.remembered(record(shown)) == (0.25, 0.5, 1795773600.0)
    # the share it shows changes: written, with the past share and time of now
    moved = statuses.body(record(shown), replace(NOW, share=0.75), "x", past=0.3)
    assert statuses.changed(record(shown), moved) and moved[statuses.PAST] == 300


def test_turned_on_writes_it_and_turned_off_removes_it() -> None:
    plain = statuses.body(record({}), NOW, "2026-11-27T10:00:00Z")
    assert statuses.PAST not in plain
    on = statuses.body(record(plain), NOW, "2026-11-27T10:00:00Z", past=0.0)
    assert statuses.changed(record(plain), on) and on[statuses.PAST] == 0
    off = statuses.body(record(on), NOW, "2026-11-27T10:00:00Z")
    assert off[statuses.PAST] is None and off[statuses.PAST_TIME] is None  # merge patch: gone
    assert statuses.changed(record(on), off)
    assert not statuses.changed(record(plain), off)  # once gone, nothing more to write


@pytest.mark.parametrize(
    "status",
    [
        {},
        {"pastShare": 250, "weightedShare": 500},
        {"pastShare": "250", "weightedShare": 500, "pastShareTime": "2026-11-27T10:00:00Z"},
        {"pastShare": 250, "weightedShare": 500, "pastShareTime": "yesterday"},
        {"pastShare": 250, "weightedShare": 500, "pastShareTime": "2026-11-27T10:00:00"},
    ],
)
def test_a_status_without_a_readable_past_share_remembers_nothing(
    status: dict[str, object],
) -> None:
    assert statuses.remembered(record(status)) is None
