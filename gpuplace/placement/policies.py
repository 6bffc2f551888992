"""Scoring policies, all behind `choosing.Policy`: `score` ranks nodes (higher is
better; exact ties are broken at random by the chooser), `prefer` ranks GPU sets
of equal score within one node (ties: the lowest GPU index).

- `random`: every feasible node alike; a random fitting GPU within it.
- `first-fit`: the first node, in inventory order, that fits.
- `best-fit`: the node with the least CPU and GPU left after placement (the FGD
  paper's baseline, integer score 0-100); the fitting GPU with the least left.
- `fgd`: fragmentation gradient descent (Weng et al., ATC '23) as published: the
  fragmentation decrease through a sigmoid, truncated to an integer 0-100.
- `default`: ours; see `DefaultPolicy`.
- `dra-first-fit` (replays only, `REPLAY_ONLY`): kube-scheduler's DRA allocator on its
  own, as a baseline: the first device with room in the order the node agent publishes
  them, pools by name, then each slice's devices as listed; no scoring
  (`DraFirstFitPolicy`).

Each `score` is O(types × GPUs) on a fragmentation-memo miss, O(GPUs) otherwise.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Iterable, Mapping

from gpuplace.placement.fragmentation import MIN_CPU_MILLI, TaskType, Workload
from gpuplace.placement.ledger import NodeState
from gpuplace.placement.requests import GpuRequest

PLACES_KEPT = 1 << 17
"""Node places remembered (bounded for a long-running sidecar)."""
VARIANTS_KEPT = 256
"""Request shapes whose own workload (`Workload.observing`) the default policy keeps."""
MAX_SPEC_CPU = 128_000
MAX_SPEC_GPU = 8_000


def _after(state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> tuple[int, ...]:
    lefts = list(state.free_milli)
    for index in gpus:
        lefts[index] -= state.milli_taken(index, request.milli)
    lefts.sort()
    return tuple(lefts)


def _closed(state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> int:
    """milli-GPU of compute a memory-only share closes to everyone else: a whole GPU
    where it is the first memory-only share (it keeps its GPU to memory-only shares),
    none where it joins others; 0 for any other request. fgd and default count it as
    fragmentation added, so memory-only shares pack by memory instead of spreading over
    empty GPUs (the fragmentation measure itself sees no idle compute lost there). O(GPUs
    of the set)."""
    if not request.memory_only:
        return 0
    return sum(state.milli_taken(index, 0) for index in gpus)


class RandomPolicy:
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def score(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        return 0.0

    def prefer(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        return self._rng.random()

    def place(self, name: str) -> float | None:
        return None


class FirstFitPolicy:
    name = "first-fit"

    def __init__(self) -> None:
        self._order: dict[str, int] = {}

    def score(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        return 0.0

    def prefer(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        return 0.0

    def place(self, name: str) -> float | None:
        """Order of first sight (the inventory's order when scored in that order)."""
        ordinal = self._order.get(name)
        if ordinal is None:
            ordinal = self._order[name] = len(self._order)
        return ordinal / float(1 << 31)


def pool_order(names: Iterable[str]) -> dict[str, int]:
    """Nodes in the order kube-scheduler's DRA allocator takes their pools: by name (the
    node agent names a node's one pool after the node, `gpuplace.cluster.dra.pool_name`).
    O(n log n)."""
    return {name: position for position, name in enumerate(sorted(names))}


class Ranked:
    """A fixed line of nodes for exact ties: `rank` (lower first) where given, else a
    stable hash of the name, so ties pack onto the same nodes instead of spreading."""

    def __init__(self, rank: Mapping[str, int] | None = None) -> None:
        self._rank = rank
        self._spread = float(max(len(rank), 1)) if rank else float(1 << 32)
        self._places: dict[str, float] = {}

    def place(self, name: str) -> float | None:
        found = self._places.get(name)
        if found is None:
            position = self._rank.get(name) if self._rank is not None else None
            if position is not None:
                found = position / (self._spread + 1)
            else:
                found = zlib.crc32(name.encode()) / float(1 << 32)
            if len(self._places) < PLACES_KEPT:
                self._places[name] = found
        return found


class BestFitPolicy(Ranked):
    name = "best-fit"

    def score(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        gpu_left = sum(left for left in state.free_milli if left > 0)
        taken = sum(state.milli_taken(index, request.milli) for index in gpus)
        spare = (state.cpu - request.cpu_milli) / MAX_SPEC_CPU * 0.5 + (
            gpu_left - taken
        ) / MAX_SPEC_GPU * 0.5
        return float(int((1.0 - spare) * 100))

    def prefer(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        return -float(sum(state.free_milli[index] for index in gpus))


class DraFirstFitPolicy(Ranked):
    """kube-scheduler's own device choice under DRA, which scores no device: the first
    device that has room, in the order the node agent publishes them. Pools in name order
    (`rank`: `pool_order`, required), one slice per pool, its devices as listed: by GPU
    index (`gpu-0`, `gpu-1`, ...; `gpuplace.cluster.dra.slice_spec`). Every fitting node
    scores alike, so the chooser takes the first in pool order; within it, the GPU set
    whose first GPU comes first (`prefer`). What fits is the engine's own rule either
    way (shares by compute and memory, whole GPUs free, a model asked for), so a replay
    compares where pods go, not what fits."""

    name = "dra-first-fit"

    def __init__(self, rank: Mapping[str, int] | None) -> None:
        if rank is None:
            raise ValueError("dra-first-fit needs the pool order (policies.pool_order)")
        super().__init__(rank)

    def score(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        return 0.0

    def prefer(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        return -float(min(gpus)) if gpus else 0.0


def _sigmoid(x: float) -> float:
    if x < -500:
        return 0.0
    return 1.0 / (1.0 + math.exp(-x))


class FgdPolicy(Ranked):
    """Fragmentation gradient descent as published: integer score; exact ties go to
    the node earliest in line (the paper's simulator takes the first of its
    randomly-permuted node list)."""

    name = "fgd"

    def __init__(self, workload: Workload, rank: Mapping[str, int] | None = None) -> None:
        super().__init__(rank)
        self.workload = workload

    def gradient(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        """Fragmentation before minus after placing (milli-GPU; higher is better)."""
        model = state.node.model
        before = self.workload.amount(model, state.cpu, tuple(sorted(state.free_milli)))
        cpu_after = state.cpu - max(request.cpu_milli, MIN_CPU_MILLI)
        after = self.workload.amount(model, cpu_after, _after(state, request, gpus))
        return before - after - _closed(state, request, gpus)

    def score(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        return float(int(_sigmoid(self.gradient(state, request, gpus) / 1000) * 100))

    def prefer(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        return 0.0


class _Variant:
    """The typical workload as one request shape sees it (`Workload.observing`), and
    each node's own measure against it, kept until the node's state changes."""

    __slots__ = ("kept", "workload")

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.kept: dict[str, tuple[int, float]] = {}


class DefaultPolicy(Ranked):
    """Ours: FGD's fragmentation gradient, exact, blended with the gradient of
    *stranded* GPU (`Workload.stranded`), and a fixed line of nodes for exact ties.

    FGD's measure asks whether *one* pod of each typical type still fits; the
    stranded measure asks how many could, given the node's CPU as well, so it sees
    GPU that CPU-hungry pods would leave unusable. FGD's gradient leads (weight
    `FGD_WEIGHT`; alone and exact it does worse than truncated FGD), the stranded one
    settles what FGD sees as nearly equal. Scores are exact, not truncated to 101
    levels; exact ties go to the node earliest in line (packing instead of
    spreading), and through the extender's scores the best node is unique, so
    kube-scheduler's random tie-break never decides. The weight was chosen on the
    openb default list, seeds 42-51 (docs/placement.md has the figures).

    A request is scored against the typical workload *as it sees it*: with its own
    shape counted as one more observed pod where the workload lacks it
    (`Workload.observing`; only in a workload seen through few pods). The workload
    then follows each arrival's shape at once without touching any other shape's
    scores: a variant is built once per shape, O(types), and scored only for that
    shape's own requests (which the chooser keeps per scoring shape anyway).
    """

    name = "default"
    FGD_WEIGHT = 10.0
    QUANTUM = 1000.0
    PREFER_EXACT = True

    def __init__(self, workload: Workload, rank: Mapping[str, int] | None = None) -> None:
        super().__init__(rank)
        self.workload = workload
        self._variants: dict[TaskType, _Variant] = {}
        self._of: dict[GpuRequest, _Variant] = {}
        self._base = _Variant(workload)
        """Shapes the workload already counts share it (and its kept measures)."""
        self._recent: tuple[GpuRequest | None, _Variant] = (None, self._base)
        self._last: tuple[object, float] = (None, 0.0)

    def seen_by(self, request: GpuRequest) -> Workload:
        """The typical workload as `request` is scored against. O(1) when kept."""
        return self._variant(request).workload

    def _variant(self, request: GpuRequest) -> _Variant:
        """O(1) when kept; O(types) to build a shape's variant."""
        recent = self._recent
        if recent[0] is request:
            return recent[1]
        variant = self._of.get(request)
        if variant is None and request.memory_only:
            variant = self._base  # left out of the workload, as `Workload.from_requests` does
        if variant is None:
            task = TaskType.of(request)
            variant = self._variants.get(task)
            if variant is None:
                if len(self._variants) >= VARIANTS_KEPT:
                    self._variants.clear()
                    self._of.clear()
                seen = self.workload.observing(task)
                variant = self._base if seen is self.workload else _Variant(seen)
                self._variants[task] = variant
            if len(self._of) >= PLACES_KEPT:
                self._of.clear()  # requests differing in what no variant depends on
            self._of[request] = variant
        self._recent = (request, variant)
        return variant

    def _before(self, state: NodeState, variant: _Variant) -> float:
        """The node's own measure now, kept until its state changes. O(1) when kept."""
        kept = variant.kept.get(state.node.name)
        if kept is not None and kept[0] == state.version:
            return kept[1]
        model = state.node.model
        lefts = tuple(sorted(state.free_milli))
        workload = variant.workload
        value = self.FGD_WEIGHT * workload.amount(model, state.cpu, lefts) + workload.stranded(
            model, state.cpu, lefts
        )
        if len(variant.kept) >= PLACES_KEPT:
            variant.kept.clear()
        variant.kept[state.node.name] = (state.version, value)
        return value

    def gradient(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        """The blended gradient, exact. O(types × GPUs) on a memo miss, O(types) otherwise.

        `score` and `prefer` both need it for the same candidate, one after the other:
        the last value is kept for that."""
        key = (state.node.name, state.version, request, gpus)
        if key == self._last[0]:
            return self._last[1]
        value = self._gradient(state, request, gpus)
        self._last = (key, value)
        return value

    def _gradient(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        variant = self._variant(request)
        workload = variant.workload
        model = state.node.model
        lefts = _after(state, request, gpus)
        cpu = state.cpu - max(request.cpu_milli, MIN_CPU_MILLI)
        after = self.FGD_WEIGHT * workload.amount(model, cpu, lefts) + workload.stranded(
            model, cpu, lefts
        )
        return (
            self._before(state, variant) - after - self.FGD_WEIGHT * _closed(state, request, gpus)
        )

    def score(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        """The gradient rounded to `QUANTUM`: nodes within it are equal, and the line
        decides between them (packing)."""
        if self.QUANTUM <= 0:
            return self.gradient(state, request, gpus)
        return math.floor(self.gradient(state, request, gpus) / self.QUANTUM + 0.5) * self.QUANTUM

    def prefer(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        """Within a node, the exact gradient picks the GPUs."""
        return self.gradient(state, request, gpus) if self.PREFER_EXACT else 0.0


NAMES = ("default", "fgd", "best-fit", "first-fit", "random")
"""The sidecar's policies (`--policy`)."""
REPLAY_ONLY = ("dra-first-fit",)
"""Baselines a replay may run, never the sidecar (`gpuplace simulate --policy`)."""


Made = RandomPolicy | FirstFitPolicy | BestFitPolicy | FgdPolicy | DefaultPolicy | DraFirstFitPolicy


def make(
    name: str,
    *,
    workload: Workload | None = None,
    rng: random.Random | None = None,
    rank: Mapping[str, int] | None = None,
) -> Made:
    """The policy called `name`. fgd and default need the typical workload; `rank`
    (a node's place in line, lower first) is default's last tie-break, and dra-first-fit's
    pool order (`pool_order`)."""
    factories: dict[str, Callable[[], Made]]
    factories = {
        "random": lambda: RandomPolicy(rng or random.Random(0)),
        "first-fit": FirstFitPolicy,
        "best-fit": lambda: BestFitPolicy(rank),
        "fgd": lambda: FgdPolicy(_need(workload, name), rank),
        "default": lambda: DefaultPolicy(_need(workload, name), rank),
        "dra-first-fit": lambda: DraFirstFitPolicy(rank),
    }
    factory = factories.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(NAMES + REPLAY_ONLY)}")
    return factory()


def _need(workload: Workload | None, name: str) -> Workload:
    if workload is None:
        raise ValueError(f"policy {name} needs the typical workload")
    return workload
