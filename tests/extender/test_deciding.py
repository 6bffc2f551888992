"""filter and prioritize's shared work (gpuplace.extender.deciding): prioritize's answer prepared
right after filter reads filter's evaluation (in order while it is exactly the nodes
filter passed, looking names up otherwise) while it is current."""

from __future__ import annotations

from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev.localapi import objects
from gpuplace.extender.deciding import Decider
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement import choosing
from tests.cluster.test_syncing import node_record


def test_prioritize_ahead_reads_filters_choices_while_they_are_current() -> None:
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

    def ahead(names: list[str]) -> list[choosing.Choice | None]:
        chosen = decider.chosen_ahead("uid-p", names)
        assert chosen is not None
        assert chosen == [evaluation.choices[name] for name in names]
        return chosen

    # Filter's nodes are the kept evaluation's: its choices, read in order.
    assert choosing.ranked_found(ahead(verdict.passed)) == want
    # The warmer scores the other nodes for the same shape, in the same generation: the
    # kept choices are no longer filter's nodes alone, so the names are looked up.
    assert holder.current().prepare(request, ["n3", "n4", "n5"]) == 3
    assert choosing.ranked_found(ahead(verdict.passed)) == want
    # Other names than filter passed (in another order): looked up too.
    again = decider.filter(pod, ["n0", "n1", "n2"])
    assert choosing.ranked_found(ahead(list(reversed(again.passed)))) == list(
        reversed(choosing.ranked(again.passed, evaluation.choices))
    )
    # A name without a choice (filter did not pass it): nothing ahead.
    assert decider.chosen_ahead("uid-p", [*again.passed, "n9"]) is None
    # A newer ledger (a node added): nothing ahead either.
    before = sync.ledger.generation
    sync.replace_nodes([node_record(f"n{index}", gpus=4) for index in range(7)])
    assert sync.ledger.generation != before
    assert decider.chosen_ahead("uid-p", again.passed) is None
