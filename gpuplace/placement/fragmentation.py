"""How fragmented a node is, measured against the typical workload.

The measure of Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing
Workloads with Fragmentation Gradient Descent" (USENIX ATC '23), as their
simulator computes it: for each task type t of the typical workload, with
popularity p_t, the node's idle GPU milli that t could not use counts as
fragment; the node's fragmentation is Σ p_t × fragment_t. A type cannot use any
of a node's idle GPUs when it needs no GPU, when the node's model is not one it
allows, when the node lacks its CPU, or when fewer than its GPU count of GPUs
have its share free; otherwise only GPUs with less than its share free are
fragment for it.

The typical workload is built like theirs: pods grouped by (CPU, share per GPU,
GPU count, allowed models), each pod counting once, the most popular types kept
until they cover 95% of pods, their frequencies renormalised.

gpuplace adds a prior (`Prior`), for where the observed mix alone misleads: a fresh
or quiet cluster, whose typical workload is a handful of pods, and a cluster that
has run only shares for a while. Whole GPUs weigh at least `Prior.floor` of the
workload, and more while few pods were seen: as much as `Prior.pods` whole-GPU pods
would among those seen (`WHOLE_TYPE` makes up what the observed whole-GPU types
lack). So a GPU opened for a share always counts as a whole GPU lost, and one pod's
shape seen first cannot make packing look like fragmenting. `observing` counts the
pod being placed as one more observation of its own shape, so a shape the workload
has not seen yet is not scored as if nothing like it would come (while the workload
was seen through fewer than `OWN_SHAPE_BELOW` pods: beyond, one pod weighs under 1%).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from gpuplace.placement.requests import WHOLE as WHOLE_MILLI
from gpuplace.placement.requests import GpuRequest

POPULARITY = 0.95
MIN_CPU_MILLI = 100
"""kube-scheduler's non-zero default for a pod that requests no CPU."""
MEMO_LIMIT = 1 << 17
"""Entries of a fragmentation memo's table before it retires (bounds a long-running
sidecar; see `Memo`)."""
K = TypeVar("K")
V = TypeVar("V")


class Memo(Generic[K, V]):
    """A memo of at most about 2 × `limit` entries that never empties all at once.

    When its table is full it retires it: the retired table is still read, and two of
    its entries are dropped on every insert, so it is empty before the next one
    retires. Freeing a quarter of a million entries in one go stalls the process for
    tens of milliseconds (in the middle of an extender verb); this spreads it out.
    get and put are O(1).
    """

    __slots__ = ("_limit", "_new", "_old")

    def __init__(self, limit: int = MEMO_LIMIT) -> None:
        self._limit = limit
        self._new: dict[K, V] = {}
        self._old: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        value = self._new.get(key)
        if value is None and self._old:
            value = self._old.get(key)
        return value

    def put(self, key: K, value: V) -> None:
        if len(self._new) >= self._limit:
            self._old = self._new
            self._new = {}
        self._new[key] = value
        old = self._old
        if old:
            old.popitem()
            if old:
                old.popitem()

    def __len__(self) -> int:
        return len(self._new) + len(self._old)


@dataclass(frozen=True, slots=True, order=True)
class TaskType:
    cpu_milli: int
    milli: int
    count: int
    models: frozenset[str]

    @classmethod
    def of(cls, request: GpuRequest) -> TaskType:
        """The request's type. `from_requests` leaves memory-only shares out; given one,
        it counts as one whole GPU (what it needs to open a GPU), never as `milli` 0,
        which means "uses no GPU" here."""
        milli = WHOLE_MILLI if request.memory_only else request.milli
        return cls(max(request.cpu_milli, MIN_CPU_MILLI), milli, request.count, request.models)


WHOLE_TYPE = TaskType(MIN_CPU_MILLI, WHOLE_MILLI, 1, frozenset())
"""The prior's whole GPU: one, any model, the least CPU."""


def _whole(task: TaskType) -> bool:
    return task.milli >= WHOLE_MILLI and task.count > 0 and not task.models


@dataclass(frozen=True, slots=True)
class Prior:
    """What the typical workload assumes of whole GPUs before and beyond what it saw:
    their share is at least `floor`, and at least pods / (pods + seen) of a workload
    seen through `seen` pods (as if `pods` whole-GPU pods had been seen too)."""

    floor: float = 0.25
    pods: int = 8

    def least(self, seen: int) -> float:
        """The least share of whole GPUs in a workload seen through `seen` pods. O(1)."""
        return max(self.floor, self.pods / (self.pods + seen)) if self.pods else self.floor


PRIOR = Prior()
"""The sidecar's prior (docs/placement.md says why these figures)."""
OWN_SHAPE_BELOW = 100
"""`observing` counts a request's own shape only in a workload seen through fewer pods:
beyond, one pod weighs under 1%, and each shape's variant would cost memos of its own
(each up to about 2 × `MEMO_LIMIT` entries) for scores that barely move."""


def with_prior(
    types: tuple[tuple[TaskType, float], ...], floor: float
) -> tuple[tuple[TaskType, float], ...]:
    """`types` (popularities summing to 1, or none) with whole GPUs weighing at least
    `floor`: all scaled down alike and `WHOLE_TYPE` given the difference. O(types)."""
    if floor <= 0:
        return types
    if not types:
        return ((WHOLE_TYPE, 1.0),)
    share = sum(p for task, p in types if _whole(task))
    if share >= floor:
        return types
    scale = (1.0 - floor) / (1.0 - share)
    scaled = {task: p * scale for task, p in types}
    scaled[WHOLE_TYPE] = scaled.get(WHOLE_TYPE, 0.0) + 1.0 - scale
    return tuple(scaled.items())


class Workload:
    """The typical workload: task types with popularities summing to 1.

    `pods` is how many pods it was built from (`observing` weighs one more against
    them; 0: a mix given as it is), `prior` what it assumes of whole GPUs (see the
    module docstring; None: nothing), `observed` the types as observed, `types` as
    scored (the prior applied).

    `amount` is memoised on (model, CPU left, sorted GPU lefts): O(types × GPUs)
    on a miss, O(GPUs) for the key on a hit.
    """

    __slots__ = (
        "_cpu_memo",
        "_gpu_memo",
        "_memo",
        "_per_model",
        "_stranded_memo",
        "_units",
        "observed",
        "pods",
        "prior",
        "types",
    )

    def __init__(
        self,
        types: Iterable[tuple[TaskType, float]],
        *,
        pods: int = 0,
        prior: Prior | None = None,
    ) -> None:
        self.observed: tuple[tuple[TaskType, float], ...] = tuple(
            (task, p) for task, p in types if task.cpu_milli > 0 and p > 0
        )
        self.pods = pods
        self.prior = prior
        least = prior.least(pods) if prior is not None else 0.0
        self.types: tuple[tuple[TaskType, float], ...] = with_prior(self.observed, least)
        self._units = tuple((p, task.milli * task.count) for task, p in self.types)
        self._per_model: dict[str, tuple[tuple[int, int, int, float], ...]] = {}
        self._memo: Memo[tuple[str, int, tuple[int, ...]], float] = Memo()
        self._stranded_memo: Memo[tuple[str, int, tuple[int, ...]], float] = Memo()
        self._gpu_memo: Memo[tuple[str, tuple[int, ...]], tuple[int, ...]] = Memo()
        self._cpu_memo: Memo[int, tuple[int, ...]] = Memo()

    @classmethod
    def from_requests(
        cls,
        requests: Iterable[GpuRequest],
        popularity: float = POPULARITY,
        *,
        prior: Prior | None = None,
    ) -> Workload:
        """Most popular task types covering `popularity` of the pods, and `prior` (see
        the module docstring; None: FGD's workload as published). O(pods + types log
        types).

        Memory-only shares are left out: they use no compute, and the measure is of idle
        compute the typical requests could not use."""
        counts = Counter(TaskType.of(request) for request in requests if not request.memory_only)
        total = sum(counts.values())
        if total == 0:
            return cls((), prior=prior)

        def rank(item: tuple[TaskType, int]) -> tuple[int, int, int, int, str]:
            task, count = item
            return (count, task.cpu_milli, task.milli, task.count, "|".join(sorted(task.models)))

        ordered = sorted(counts.items(), key=rank, reverse=True)
        kept: list[tuple[TaskType, int]] = []
        covered = 0
        for task, count in ordered:
            if covered >= popularity * total:
                break
            kept.append((task, count))
            covered += count
        return cls(
            ((task, count / covered) for task, count in kept),
            pods=total,
            prior=prior,
        )

    def observing(self, task: TaskType) -> Workload:
        """This workload with one more pod of `task` observed, when `task` is not among
        its observed types (weight 1 / (pods + 1), the others scaled to make room; the
        prior applied again); else this very workload, and also for a workload not built
        from pods (`pods` 0: a mix given as it is, such as the sidecar's fallback), one
        seen through `OWN_SHAPE_BELOW` pods or more, or a task of no GPU. A new object,
        with memos of its own, so the caller keeps one per shape. O(types)."""
        if (
            not 0 < self.pods < OWN_SHAPE_BELOW
            or not task.count
            or any(known == task for known, _ in self.observed)
        ):
            return self
        share = self.pods / (self.pods + 1)
        return Workload(
            ((*((known, p * share) for known, p in self.observed), (task, 1.0 - share))),
            pods=self.pods + 1,
            prior=self.prior,
        )

    def _for_model(self, model: str) -> tuple[tuple[int, int, int, float], ...]:
        # (cpu, milli, count, p) per type; milli 0 marks "uses none of these GPUs".
        cached = self._per_model.get(model)
        if cached is None:
            cached = tuple(
                (
                    task.cpu_milli,
                    task.milli if (not task.models or model in task.models) else 0,
                    task.count,
                    p,
                )
                for task, p in self.types
            )
            self._per_model[model] = cached
        return cached

    def amount(self, model: str, cpu_left: int, lefts: tuple[int, ...]) -> float:
        """Fragmentation (milli-GPU) of a node of `model` with `cpu_left` and GPU `lefts`.

        `lefts` must be sorted ascending (callers pass sorted tuples). Memoised.
        """
        key = (model, cpu_left, lefts)
        value = self._memo.get(key)
        if value is not None:
            return value
        idle = 0
        for left in lefts:
            if left > 0:
                idle += left
        value = 0.0
        for cpu, milli, count, p in self._for_model(model):
            if milli == 0 or cpu > cpu_left:
                value += p * idle
                continue
            fitting = 0
            fragment = 0
            for left in lefts:
                if left >= milli:
                    fitting += 1
                elif left > 0:
                    fragment += left
            value += p * (idle if fitting < count else fragment)
        self._memo.put(key, value)
        return value

    def stranded(self, model: str, cpu_left: int, lefts: tuple[int, ...]) -> float:
        """Idle milli-GPU that repeated placements of each type could not use.

        gpuplace's refinement of `amount`: FGD asks whether *one* pod of a type fits
        and counts the GPUs too small for it; this asks how many pods of the type the
        node could still take — as many as its GPU shares allow and its CPU allows —
        and counts every idle milli-GPU beyond what those pods would use. A node whose
        CPU runs out before its GPUs do is fragmented even when each GPU is roomy.
        `lefts` sorted ascending. The GPU side is memoised on (model, lefts) and the
        CPU side on the CPU left, so a call is O(types) once both are known, and
        O(types × GPUs) for a GPU state never seen.
        """
        key = (model, cpu_left, lefts)
        value = self._stranded_memo.get(key)
        if value is not None:
            return value
        idle = 0
        for left in lefts:
            if left > 0:
                idle += left
        value = 0.0
        if idle > 0:
            gpu_slots = self._gpu_slots(model, lefts)
            cpu_slots = self._cpu_slots(cpu_left)
            for (p, unit), by_gpu, by_cpu in zip(self._units, gpu_slots, cpu_slots, strict=True):
                pods = by_gpu if by_gpu < by_cpu else by_cpu
                usable = pods * unit
                value += p * (idle - usable if usable < idle else 0)
        self._stranded_memo.put(key, value)
        return value

    def _gpu_slots(self, model: str, lefts: tuple[int, ...]) -> tuple[int, ...]:
        """Per type, how many of its pods the GPU shares alone could take. O(types × GPUs)."""
        key = (model, lefts)
        slots = self._gpu_memo.get(key)
        if slots is None:
            counts: list[int] = []
            for _cpu, milli, count, _p in self._for_model(model):
                if milli == 0:
                    counts.append(0)
                elif milli < WHOLE_MILLI:
                    counts.append(sum(left // milli for left in lefts if left >= milli))
                else:
                    counts.append(sum(1 for left in lefts if left >= WHOLE_MILLI) // count)
            slots = tuple(counts)
            self._gpu_memo.put(key, slots)
        return slots

    def _cpu_slots(self, cpu_left: int) -> tuple[int, ...]:
        """Per type, how many of its pods the CPU left alone could take. O(types)."""
        slots = self._cpu_memo.get(cpu_left)
        if slots is None:
            slots = tuple(
                cpu_left // task.cpu_milli if cpu_left > 0 else 0 for task, _p in self.types
            )
            self._cpu_memo.put(cpu_left, slots)
        return slots
