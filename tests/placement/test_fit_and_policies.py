"""Table tests per policy on hand-built clusters, and fit's reasons."""

from __future__ import annotations

import random

import pytest

from gpuplace.placement import choosing, fit, policies
from gpuplace.placement.fragmentation import TaskType, Workload
from gpuplace.placement.ledger import Grant
from gpuplace.placement.requests import GpuRequest, Topology

from .clusters import ledger, node, share, whole

WORKLOAD = Workload(
    [
        (TaskType(1000, 500, 1, frozenset()), 0.5),
        (TaskType(1000, 1000, 1, frozenset()), 0.5),
    ]
)


def choose(book: object, request: GpuRequest, name: str) -> choosing.Choice | None:
    policy = policies.make(name, workload=WORKLOAD, rng=random.Random(3))
    return choosing.Chooser(book, policy).choose(request, random.Random(3))  # type: ignore[arg-type]


def test_share_never_spans_gpus_and_reports_the_best_gpu() -> None:
    book = ledger(node("a", 2))
    book.reserve(Grant("x", "a", (0,), 600, 0))
    book.reserve(Grant("y", "a", (1,), 700, 0))
    request = share(500)
    assert choose(book, request, "first-fit") is None
    reason = fit.misfit(book.state("a"), request)  # type: ignore[arg-type]
    assert reason is not None
    assert reason.kind is fit.MisfitKind.GPU_SHARE
    assert reason.message == "gpu 0: 40% free, needs 50%"
    assert reason.resolvable


@pytest.mark.parametrize(
    ("name", "expected_node", "expected_gpu"),
    [
        ("best-fit", "busy", 1),  # least left after placement: the busy node, its fullest GPU
        ("first-fit", "busy", 0),  # inventory order: busy comes first; first fitting GPU
        ("fgd", "busy", 1),  # filling the 500-left GPU removes fragment for 1000-types
        ("default", "busy", 1),
    ],
)
def test_policies_on_a_partly_used_cluster(
    name: str, expected_node: str, expected_gpu: int
) -> None:
    book = ledger(node("busy", 2), node("empty", 2))
    book.reserve(Grant("x", "busy", (1,), 500, 0))
    choice = choose(book, share(500), name)
    assert choice is not None
    assert (choice.node, choice.gpus) == (expected_node, (expected_gpu,))


def test_random_policy_spreads_over_feasible_nodes() -> None:
    book = ledger(node("a", 1), node("b", 1), node("c", 1))
    seen = set()
    policy = policies.make("random", rng=random.Random(0))
    chooser = choosing.Chooser(book, policy)
    rng = random.Random(0)
    for _ in range(60):
        choice = chooser.choose(share(100), rng)
        assert choice is not None
        seen.add(choice.node)
    assert seen == {"a", "b", "c"}


def test_wrong_model_and_too_few_gpus_are_unresolvable() -> None:
    book = ledger(node("t4", 2, model="T4"), node("small", 1))
    request = whole(2, models=frozenset({"A100"}))
    evaluation = choosing.evaluate(book, request, policies.make("first-fit"), ["t4", "small"])
    assert not evaluation.choices
    assert evaluation.misfits["t4"].kind is fit.MisfitKind.WRONG_MODEL
    assert evaluation.misfits["small"].kind is fit.MisfitKind.TOO_FEW_GPUS
    assert not any(m.resolvable for m in evaluation.misfits.values())
    unknown = choosing.evaluate(book, request, policies.make("first-fit"), ["nope"])
    assert unknown.misfits["nope"].kind is fit.MisfitKind.UNKNOWN_NODE


def test_gpu_memory_too_small_is_unresolvable_and_busy_memory_is_not() -> None:
    book = ledger(node("a", 1, memory=16_384))
    too_big = share(100, memory=20_480)
    assert fit.misfit(book.state("a"), too_big).kind is fit.MisfitKind.GPU_TOO_SMALL  # type: ignore[arg-type,union-attr]
    book.reserve(Grant("x", "a", (0,), 100, 10_000))
    busy = fit.misfit(book.state("a"), share(100, memory=8_192))  # type: ignore[arg-type]
    assert busy is not None and busy.kind is fit.MisfitKind.GPU_MEMORY and busy.resolvable


def test_nvlink_required_stays_in_one_domain_and_preferred_prefers_it() -> None:
    domains = (0, 0, 0, 0, 1, 1, 1, 1)
    book = ledger(node("n", 8, nvlink=domains))
    for index in (0, 1, 4):
        book.reserve(Grant(f"x{index}", "n", (index,), 1000, 0))
    state = book.state("n")
    assert state is not None
    required = whole(3, topology=Topology.REQUIRED)
    sets = fit.gpu_sets(state, required)
    assert sets == [(2, 3, 5)] or all(len({domains[i] for i in gpu_set}) == 1 for gpu_set in sets)
    assert all(len({domains[i] for i in gpu_set}) == 1 for gpu_set in sets)
    preferred = fit.gpu_sets(state, whole(3, topology=Topology.PREFERRED))
    assert len({domains[i] for i in preferred[0]}) == 1
    four = whole(4, topology=Topology.REQUIRED)
    assert fit.gpu_sets(state, four) == []
    reason = fit.misfit(state, four)
    assert reason is not None and reason.kind is fit.MisfitKind.NVLINK_BUSY


def test_host_resources_are_checked() -> None:
    book = ledger(node("a", 1, cpu=2000, ram=4096))
    assert fit.misfit(book.state("a"), share(100, cpu=3000)).kind is fit.MisfitKind.CPU  # type: ignore[arg-type,union-attr]
    assert fit.misfit(book.state("a"), share(100, ram=8192)).kind is fit.MisfitKind.MEMORY  # type: ignore[arg-type,union-attr]


def test_extender_scores_give_ten_only_to_the_best() -> None:
    evaluation = choosing.Evaluation(
        choices={
            "a": choosing.Choice("a", (0,), 5.0),
            "b": choosing.Choice("b", (0,), 5.0),
            "c": choosing.Choice("c", (0,), 1.0),
            "d": choosing.Choice("d", (0,), -3.0),
        }
    )
    scores = choosing.extender_scores(evaluation)
    assert scores["a"] == scores["b"] == 10
    assert scores["c"] > scores["d"]
    assert max(scores["c"], scores["d"]) <= 9 and min(scores.values()) >= 0


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of default, fgd"):
        policies.make("fastest")


def test_requests_refuse_impossible_shapes() -> None:
    with pytest.raises(ValueError, match="whole GPUs"):
        GpuRequest(milli=500, count=2)
    with pytest.raises(ValueError, match=r"1\.\.1000"):
        GpuRequest(milli=0, count=1)
    with pytest.raises(ValueError, match="0 GPUs"):
        GpuRequest(milli=10, count=0)


def test_dra_first_fit_takes_the_first_device_with_room_in_pool_order() -> None:
    """kube-scheduler's DRA allocator on its own: pools by name (whatever the inventory's
    order), devices as published (by index); no packing onto a used GPU, no scoring."""
    book = ledger(node("b", 2), node("a", 2), node("c", 2))
    rank = policies.pool_order(["b", "a", "c"])
    policy = policies.make("dra-first-fit", rank=rank)
    chooser = choosing.Chooser(book, policy)
    first = chooser.choose(share(300), random.Random(0))
    assert first is not None and (first.node, first.gpus) == ("a", (0,))
    book.reserve(Grant("x", "a", (0,), 800, 0))
    second = chooser.choose(share(300), random.Random(0))
    assert second is not None and (second.node, second.gpus) == ("a", (1,))
    book.reserve(Grant("y", "a", (1,), 900, 0))
    third = chooser.choose(share(300), random.Random(0))
    assert third is not None and (third.node, third.gpus) == ("b", (0,))
    # a share that fits the used GPU still goes to the first device with room
    small = chooser.choose(share(200), random.Random(0))
    assert small is not None and (small.node, small.gpus) == ("a", (0,))
    with pytest.raises(ValueError, match="pool order"):
        policies.make("dra-first-fit")
