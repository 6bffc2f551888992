"""The plan mark gpuplace writes on a gang member (`gpuplace.cluster.gang_marks`): it
round-trips, and anything unreadable is no plan."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuplace.cluster.gang_marks import PlanMark


@given(st.text(max_size=80))
def test_unreadable_plan_marks_are_no_plan(raw: str) -> None:
    mark = PlanMark.decode(raw)
    if mark is not None:
        assert PlanMark.decode(mark.encode()) == mark


def test_plan_marks_round_trip() -> None:
    mark = PlanMark("3f9c0a1b2c4d", 4, "gpu-a100-7")
    assert PlanMark.decode(mark.encode()) == mark
    for bad in (
        "",
        "{",
        "[]",
        '{"id": "", "members": 4, "node": "n"}',
        '{"id": "x", "members": true, "node": "n"}',
        '{"id": "x", "members": 0, "node": "n"}',
    ):
        assert PlanMark.decode(bad) is None
