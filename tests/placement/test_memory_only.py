"""Memory-only shares (`gpu-memory` alone): memory reserved, no compute; they keep a GPU to
themselves and pack onto it by memory (docs/placement.md, "Memory-only shares")."""

from __future__ import annotations

import math
import random

import pytest

from gpuplace.placement import choosing, fit, gangs, policies
from gpuplace.placement.fragmentation import TaskType, Workload
from gpuplace.placement.ledger import Grant, Oversubscribed
from gpuplace.placement.requests import GpuRequest

from .clusters import ledger, node, share, whole

WORKLOAD = Workload(
    [
        (TaskType(1000, 500, 1, frozenset()), 0.5),
        (TaskType(1000, 1000, 1, frozenset()), 0.5),
    ]
)


def memory_only(mib: int, cpu: int = 1000) -> GpuRequest:
    return GpuRequest(milli=0, memory_mib=mib, count=1, cpu_milli=cpu, host_memory_mib=1024)


def place(book: object, request: GpuRequest, name: str, uid: str) -> choosing.Choice | None:
    policy = policies.make(name, workload=WORKLOAD, rng=random.Random(3))
    choice = choosing.Chooser(book, policy).choose(request, random.Random(3))  # type: ignore[arg-type]
    if choice is not None:
        book.reserve(choosing.grant_for(uid, choice, request))  # type: ignore[attr-defined]
    return choice


def test_a_request_of_memory_alone_is_valid_only_on_one_gpu_with_memory() -> None:
    request = memory_only(8192)
    assert request.memory_only and request.shares and request.total_milli == 0
    with pytest.raises(ValueError, match="memory-only"):
        GpuRequest(milli=0, count=1)
    with pytest.raises(ValueError, match="memory-only"):
        GpuRequest(milli=0, memory_mib=8192, count=2)


@pytest.mark.parametrize("name", policies.NAMES)
def test_memory_only_shares_pack_onto_one_gpu_by_memory(name: str) -> None:
    book = ledger(node("a", 4, memory=16_384))
    for i in range(4):
        choice = place(book, memory_only(4096), name, f"m{i}")
        assert choice is not None
    held = {grant.gpus for grant in book}
    assert len(held) == 1, f"{name} spread memory-only shares over {held}"
    state = book.state("a")
    assert state is not None
    (gpu,) = next(iter(held))
    assert state.free_memory[gpu] == 0 and state.memory_only[gpu] == 4
    # The fifth no longer fits there and opens another GPU.
    assert place(book, memory_only(4096), name, "m4") is not None
    assert state.memory_only.count(0) == 2


def test_memory_only_joins_the_fullest_gpu_it_fits() -> None:
    book = ledger(node("a", 3, memory=16_384))
    book.reserve(Grant("x", "a", (0,), 0, 4096))
    book.reserve(Grant("y", "a", (1,), 0, 10_240))
    choice = place(book, memory_only(4096), "default", "z")
    assert choice is not None and choice.gpus == (1,)  # 6 GiB left there, 12 on gpu 0
    choice = place(book, memory_only(8192), "default", "w")
    assert choice is not None and choice.gpus == (0,)


def test_memory_only_and_compute_never_share_a_gpu() -> None:
    book = ledger(node("a", 2, memory=16_384))
    book.reserve(Grant("pct", "a", (0,), 300, 0))
    book.reserve(Grant("mem", "a", (1,), 0, 4096))
    state = book.state("a")
    assert state is not None
    # Neither a compute share, a whole GPU nor a memory-only share finds a GPU.
    assert fit.gpu_sets(state, share(500)) == [(0,)]
    assert fit.gpu_sets(state, whole(1)) == []
    assert fit.gpu_sets(state, memory_only(4096)) == [(1,)]
    with pytest.raises(Oversubscribed, match="never joins"):
        book.reserve(Grant("mem2", "a", (0,), 0, 1024))
    with pytest.raises(Oversubscribed, match="0% free"):
        book.reserve(Grant("pct2", "a", (1,), 100, 0))
    # Once the last memory-only share leaves, its GPU's compute is free again.
    book.release("mem")
    assert state.free_milli[1] == 1000 and state.memory_only[1] == 0
    assert fit.gpu_sets(state, whole(1)) == [(1,)]


def test_a_gpu_filled_by_compute_shares_refuses_memory_only_with_a_reason() -> None:
    book = ledger(node("a", 2, memory=16_384))
    book.reserve(Grant("x", "a", (0,), 1000, 0))
    book.reserve(Grant("y", "a", (1,), 500, 1024))
    state = book.state("a")
    assert state is not None
    reason = fit.misfit(state, memory_only(1024))
    assert reason is not None and reason.kind is fit.MisfitKind.MEMORY_ONLY_BUSY
    assert reason.resolvable
    assert "only joins GPUs without them" in reason.message


def test_no_gpu_with_the_memory_free_is_said_in_mib() -> None:
    book = ledger(node("a", 1, memory=16_384))
    book.reserve(Grant("x", "a", (0,), 0, 12_288))
    state = book.state("a")
    assert state is not None
    reason = fit.misfit(state, memory_only(8192))
    assert reason is not None and reason.kind is fit.MisfitKind.GPU_MEMORY
    assert reason.message == "gpu 0: 4096 MiB free, needs 8192 MiB"
    too_big = fit.misfit(state, memory_only(32_768))
    assert too_big is not None and too_big.kind is fit.MisfitKind.GPU_TOO_SMALL
    assert not too_big.resolvable


@pytest.mark.parametrize("name", policies.NAMES)
def test_scores_are_finite_with_memory_only_in_the_typical_workload(name: str) -> None:
    requests = [memory_only(4096), memory_only(8192), share(500), whole(2)]
    workload = Workload.from_requests(requests, popularity=1.0)
    # Memory-only shares use no compute: the measure of idle compute leaves them out.
    assert sorted((task.milli, task.count) for task, _ in workload.types) == [(500, 1), (1000, 2)]
    assert Workload.from_requests([memory_only(4096)]).types == ()
    book = ledger(node("a", 4, memory=16_384), node("b", 2, memory=16_384))
    book.reserve(Grant("x", "a", (0,), 0, 4096))
    policy = policies.make(name, workload=workload, rng=random.Random(1))
    evaluation = choosing.Chooser(book, policy).evaluate(memory_only(8192))
    assert set(evaluation.choices) == {"a", "b"}
    assert all(math.isfinite(choice.score) for choice in evaluation.choices.values())
    assert evaluation.choices["a"].gpus == (0,)


def test_default_policy_prefers_joining_over_opening_a_gpu() -> None:
    book = ledger(node("a", 2, memory=16_384), node("b", 2, memory=16_384))
    book.reserve(Grant("x", "b", (1,), 0, 4096))
    for name in ("default", "fgd"):
        policy = policies.make(name, workload=WORKLOAD, rank={"a": 0, "b": 1})
        choice = choosing.Chooser(book, policy).choose(memory_only(4096), random.Random(0))
        assert choice is not None and (choice.node, choice.gpus) == ("b", (1,)), name


def test_gang_capacity_counts_memory_only_copies_by_memory() -> None:
    book = ledger(node("a", 2, memory=16_384))
    book.reserve(Grant("x", "a", (0,), 250, 0))
    state = book.state("a")
    assert state is not None
    # gpu 0 holds a compute share: only gpu 1 takes memory-only shares, four of 4 GiB.
    assert gangs.capacity(state, memory_only(4096)) == (4, 4)
