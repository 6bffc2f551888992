"""filter and prioritize (gpuplace.extender.deciding): filter passes exactly the nodes
prioritize gives 10, the policy's best of those the pod fits; prioritize's answer
prepared right after filter reads filter's evaluation (in order while it is exactly the
nodes filter passed, looking names up otherwise) while it is current."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev.localapi import objects
from gpuplace.extender.deciding import Decider
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement import choosing
from tests.cluster.test_syncing import node_record


def test_prioritize_ahead_reads_filters_choices_while_they_are_current() -> None:
    sync = LedgerSync()
    sync.replace_nodes([node_record(f"n{index}", gpus=4) for index in range(6)])
    # The random policy scores every node alike: filter passes the whole tie, and
    # prioritize follows (a profile that names it).
    holder = PolicyHolder(sync, "random", rng=random.Random(3))
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


def test_filter_passes_the_policys_best_alone_and_prioritize_agrees() -> None:
    """The default policy: of the nodes a pod fits, filter passes the one prioritize
    gives 10 (kube-scheduler then binds it without scoring); the others are neither
    passed nor failed, and a node the pod does not fit is failed with why."""
    sync = LedgerSync()
    sync.replace_nodes(
        [*(node_record(f"n{index}", gpus=2) for index in range(4)), node_record("tiny", gpus=1)]
    )
    decider = Decider(sync, PolicyHolder(sync, "default"))
    names = ["n3", "tiny", "n1", "n0", "n2"]
    pod = objects.pod("p", percent=100, count=2)
    pod["metadata"]["uid"] = "uid-p"
    verdict = decider.filter(pod, names)
    scores = decider.prioritize(pod, names)
    assert scores.count(choosing.MAX_EXTENDER_SCORE) == 1
    assert verdict.passed == [names[scores.index(choosing.MAX_EXTENDER_SCORE)]]
    assert verdict.fitting == 4
    assert set(verdict.misfits) == {"tiny"}
    # a node passed: kube-scheduler reads no failed node, none is worded
    assert not verdict.failed and not verdict.unresolvable
    alone = decider.filter(pod, ["tiny"])
    assert alone.passed == [] and set(alone.failed) | set(alone.unresolvable) == {"tiny"}


pods_drawn = st.lists(
    st.tuples(st.sampled_from([10, 25, 50, 100]), st.sampled_from([1, 1, 2, 4])),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(
    pods_drawn,
    st.sampled_from(["default", "fgd", "best-fit", "first-fit", "random"]),
    st.randoms(use_true_random=False),
)
def test_filter_passes_exactly_what_prioritize_gives_ten(
    drawn: list[tuple[int, int]], policy: str, rng: random.Random
) -> None:
    """Whatever the cluster holds and the policy: filter passes a node iff the pod fits
    some node, and then exactly the nodes prioritize gives 10 (the node kube-scheduler
    bound before filter narrowed), each one the pod fits; none passed, every node named
    is failed with why. Pods are placed as kube-scheduler would with the shipped
    profile: the node filter passed (one of a tie at random), the GPUs bind picks."""
    sync = LedgerSync()
    sync.replace_nodes(
        [node_record(f"n{index}", gpus=gpus) for index, gpus in enumerate([1, 2, 4, 4, 8, 8])]
    )
    decider = Decider(sync, PolicyHolder(sync, policy, rng=random.Random(1)))
    everyone = sorted(sync.nodes)
    for index, (percent, count) in enumerate(drawn):
        pod = objects.pod(f"p{index}", percent=percent, count=count)
        pod["metadata"]["uid"] = f"uid-{index}"
        names = rng.sample(everyone, rng.randint(1, len(everyone)))
        verdict = decider.filter(pod, names)
        chosen = decider.chosen(pod, names)
        fitting = [name for name, choice in zip(names, chosen, strict=True) if choice]
        assert verdict.fitting == len(fitting)
        if not fitting:
            assert verdict.passed == []
            assert set(verdict.failed) | set(verdict.unresolvable) == set(names)
            continue
        scores = decider.prioritize(pod, names)
        assert sorted(verdict.passed) == sorted(  # in any order: kube-scheduler's is its own
            name
            for name, score in zip(names, scores, strict=True)
            if score == choosing.MAX_EXTENDER_SCORE
        )
        assert set(verdict.passed) <= set(fitting)
        assert set(verdict.misfits) == set(names) - set(fitting)
        node = rng.choice(verdict.passed)
        request = decider.request(pod)
        assert request is not None
        choice = decider.best_on(node, request)
        assert isinstance(choice, choosing.Choice)
        sync.ledger.reserve(choosing.grant_for(f"uid-{index}", choice, request))
        decider.forget(f"uid-{index}")
