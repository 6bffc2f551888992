"""filter and prioritize's shared work (extender.deciding): prioritize's answer prepared
right after filter reads filter's evaluation in order while it is exactly the nodes
filter passed, and looks names up otherwise."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

from cluster.syncing import LedgerSync
from extender.deciding import Decider
from extender.workloads import PolicyHolder
from placement import choosing
from tests.cluster.test_syncing import node_record
from tests.fakeapi import objects


def test_prioritize_ahead_reads_filters_choices_in_order_only_while_they_are_its_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sync = LedgerSync()
    sync.replace_nodes([node_record(f"n{index}", gpus=4) for index in range(6)])
    holder = PolicyHolder(sync, "default")
    decider = Decider(sync, holder)
    pod = objects.pod("p", percent=30)
    pod["metadata"]["uid"] = "uid-p"
    request = decider.request(pod)
    assert request is not None
    verdict = decider.filter(pod, ["n2", "n0", "n1"])
    assert verdict.passed == ["n2", "n0", "n1"]
    evaluation = holder.current().evaluate(request, verdict.passed)
    want = choosing.ranked(verdict.passed, evaluation.choices)
    assert choosing.MAX_EXTENDER_SCORE in want

    def no_lookup(names: Sequence[str], choices: object) -> list[int]:
        raise AssertionError("looked the names up")

    with monkeypatch.context() as patched:
        patched.setattr(choosing, "ranked", no_lookup)
        assert decider.ranked_ahead("uid-p", verdict.passed) == want

    # The warmer scores the other nodes for the same shape, in the same generation: the
    # kept choices are no longer filter's nodes alone, so the names are looked up.
    assert holder.current().prepare(request, ["n3", "n4", "n5"]) == 3
    looked: list[Iterable[str]] = []
    ranked = choosing.ranked

    def counted(names: Sequence[str], choices: dict[str, choosing.Choice]) -> list[int]:
        looked.append(names)
        return ranked(names, choices)

    monkeypatch.setattr(choosing, "ranked", counted)
    assert decider.ranked_ahead("uid-p", verdict.passed) == want
    assert looked == [verdict.passed]
    # Other names than filter passed (in another order): looked up too.
    again = decider.filter(pod, ["n0", "n1", "n2"])
    assert decider.ranked_ahead("uid-p", list(reversed(again.passed))) == list(
        reversed(ranked(again.passed, evaluation.choices))
    )
