"""Queue quotas in GPU units: what a grant counts, what each queue may use, and what its
cohort lends; the weighted dominant share that orders queues.

Three resources, each counted per GPU model (a queue's quota names a model, or `*` for
every model it does not name):

- `gpus`: GPU equivalents, in milli-GPU. A whole GPU counts 1000; a share counts the
  larger of its compute and its memory as fractions of the GPU it lands on (50% and
  10 GiB of an 80 GiB GPU: 500; a memory-only share of 20 GiB there: 250), i.e. the part
  of one GPU it denies others. A share without a memory limit counts its compute only.
- `gpu-compute`: compute reserved, in milli-GPU: a whole GPU 1000, a share its percent
  x 10, a memory-only share 0.
- `gpu-memory`: GPU memory, MiB: a whole GPU all of its memory, a share what it asks.

A queue covers the GPU models it names a quota for (any model with a `*` line); it
cannot admit a workload onto a model it does not cover (as Kueue's flavors). On a model it
covers, it limits the resources it names and leaves the others unlimited: a queue with
only a `gpus` line counts every grant there, memory-only shares included (by their
memory); one with only `gpu-compute` would let memory-only shares through uncounted,
which is why `gpus` is the resource to name first.

Borrowing (Kueue's rules, flat cohorts): each queue keeps `nominal - lendable` to itself
(`lendable` is its lending limit, or all of its nominal), pools its lendable part with the
other queues of its cohort, and may use up to `nominal + borrowing limit` (no limit:
whatever the pool has). A queue's *pooled* use is what it uses beyond its own kept part;
per cohort and bucket, the pooled uses never exceed the pool. So per bucket the cohort
uses at most the sum of its nominals, and a queue without a cohort at most its nominal.

Values and one mutable ledger of use (`Accounts`): no I/O, no clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gpuplace.placement.inventory import Gpu, Inventory
from gpuplace.placement.ledger import Grant
from gpuplace.placement.requests import WHOLE, GpuRequest

GPUS = "gpus"
GPU_COMPUTE = "gpu-compute"
GPU_MEMORY = "gpu-memory"
RESOURCES = (GPUS, GPU_COMPUTE, GPU_MEMORY)
"""The quota resources by their names in the GpuQueue API, in `Vector` order (plain
strings: bucket keys are hashed on every check)."""
ANY_MODEL = "*"
"""The model of a quota that covers every model its queue names no quota for."""

Bucket = tuple[str, str]
"""(resource, model) of one quota line: a name of `RESOURCES`, and `ANY_MODEL` or a
`nvidia.com/gpu.product` value."""
Use = dict[Bucket, int]
"""Amounts per bucket of one queue (milli-GPU, or MiB for memory)."""
Vector = tuple[int, int, int]
"""(gpus, gpu-compute, gpu-memory) on one model."""
NOTHING: Vector = (0, 0, 0)


def held(gpu: Gpu, milli: int, memory_mib: int) -> Vector:
    """What a grant of `milli` and `memory_mib` holds of one `gpu`, per resource. O(1)."""
    if milli >= WHOLE:
        return (WHOLE, WHOLE, gpu.memory_mib)
    fraction = math.ceil(memory_mib * WHOLE / gpu.memory_mib) if gpu.memory_mib else 0
    return (max(milli, min(fraction, WHOLE)), milli, memory_mib)


def add(a: Vector, b: Vector) -> Vector:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def usage(grants: Iterable[Grant], inventory: Inventory) -> dict[str, Vector]:
    """Per GPU model, what `grants` hold. A grant on a node the inventory no longer has,
    or on a GPU it lacks, counts nothing (its GPUs are gone). O(GPUs of the grants)."""
    per_model: dict[str, Vector] = {}
    for grant in grants:
        node = inventory.get(grant.node)
        if node is None:
            continue
        for index in grant.gpus:
            if 0 <= index < len(node.gpus):
                gpu = node.gpus[index]
                per_model[gpu.model] = add(
                    per_model.get(gpu.model, NOTHING), held(gpu, grant.milli, grant.memory_mib)
                )
    return per_model


def estimate(requests: Iterable[GpuRequest], model: str, memory_mib: int) -> Vector:
    """What `requests` would hold if every GPU they take were a `model` GPU of
    `memory_mib` (the largest of that model: an upper bound of `usage` there). O(requests)."""
    gpu = Gpu(0, model, memory_mib)
    total = NOTHING
    for request in requests:
        if request.count:
            one = held(gpu, request.milli, request.memory_mib)
            total = add(
                total, (one[0] * request.count, one[1] * request.count, one[2] * request.count)
            )
    return total


@dataclass(frozen=True, slots=True)
class Quota:
    """One quota line: `nominal`, and in a cohort how much more it may borrow and how
    much of its nominal others may borrow. Units: milli-GPU, or MiB for memory."""

    nominal: int
    borrowing_limit: int | None = None
    """None: no limit of its own (the cohort's pool still bounds it)."""
    lending_limit: int | None = None
    """None: all of `nominal` may be lent."""

    def __post_init__(self) -> None:
        if self.nominal < 0:
            raise ValueError(f"nominal quota must be >= 0, got {self.nominal}")
        if self.borrowing_limit is not None and self.borrowing_limit < 0:
            raise ValueError(f"borrowing limit must be >= 0, got {self.borrowing_limit}")
        if self.lending_limit is not None and not 0 <= self.lending_limit <= self.nominal:
            raise ValueError(
                f"lending limit must be 0..nominal ({self.nominal}), got {self.lending_limit}"
            )

    @property
    def lendable(self) -> int:
        return self.nominal if self.lending_limit is None else self.lending_limit

    @property
    def kept(self) -> int:
        """The part of `nominal` nobody else may borrow."""
        return self.nominal - self.lendable


class Preemption(enum.Enum):
    """Which borrowed workloads of its cohort a queue may preempt (`QueueSpec.reclaim`,
    `QueueSpec.fair_sharing`): none, those of lower priority than the waiting workload,
    or any."""

    NEVER = "Never"
    LOWER_PRIORITY = "LowerPriority"
    ANY = "Any"

    def allows(self, victim: int, waiting: int) -> bool:
        """Whether a workload of priority `victim` may go for one of `waiting`. O(1)."""
        if self is Preemption.NEVER:
            return False
        return self is Preemption.ANY or victim < waiting


class FairStrategy(enum.Enum):
    """When fair sharing lets a waiting workload preempt a workload of another queue
    (Kueue's `preemptionStrategies`), with S(q) the weighted share of queue q
    (`Accounts.share`): the waiting workload's queue with it admitted, against the
    victim's queue."""

    FINAL_SHARE = "LessThanOrEqualToFinalShare"
    """S(waiting's queue, after) <= S(victim's queue, after the preemption): no queue is
    ever taken below the share its preemptor reaches."""
    INITIAL_SHARE = "LessThanInitialShare"
    """S(waiting's queue, after) < S(victim's queue, before the preemption): more
    preemptions (the victim's queue may end below the preemptor's), so that a queue
    whose workloads are large gets its turn."""


class Queueing(enum.Enum):
    """BestEffortFIFO: a workload that cannot be admitted does not hold back the ones
    behind it; StrictFIFO: it does (nothing behind it is admitted before it)."""

    BEST_EFFORT_FIFO = "BestEffortFIFO"
    STRICT_FIFO = "StrictFIFO"


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """A queue as the engine sees it (the GpuQueue's spec, parsed at the edge)."""

    name: str
    quotas: Mapping[Bucket, Quota]
    cohort: str = ""
    weight: float = 1.0
    reclaim: Preemption = Preemption.ANY
    """To get back quota it lent: when a waiting workload fits inside its nominal quota,
    it may preempt workloads of queues of its cohort that borrow (Kueue's
    `reclaimWithinCohort`)."""
    fair_sharing: Preemption = Preemption.NEVER
    """Beyond its nominal: a waiting workload may preempt workloads of queues of its
    cohort that borrow more than it would, weights counted (`Accounts.share`: the victim's
    queue keeps at least the share this queue reaches; Kueue's fair sharing)."""
    fair_strategies: tuple[FairStrategy, ...] = (FairStrategy.FINAL_SHARE,)
    """Tried in order for each waiting workload, the next one only when the one
    before finds no victims that make room (Kueue's order)."""
    queueing: Queueing = Queueing.BEST_EFFORT_FIFO
    max_wait: float | None = None
    """Seconds a workload may wait before it goes first (`admitting`); None: no limit."""
    models: frozenset[str] = field(init=False, repr=False, compare=False)
    """The models its quota lines name (`ANY_MODEL` among them for a `*` line)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", frozenset(model for _, model in self.quotas))
        if not self.name:
            raise ValueError("a queue needs a name")
        if not self.weight > 0 or not math.isfinite(self.weight):
            raise ValueError(f"queue {self.name}: weight must be > 0, got {self.weight}")
        if not self.cohort:
            limited = [
                bucket
                for bucket, quota in self.quotas.items()
                if quota.borrowing_limit is not None or quota.lending_limit is not None
            ]
            if limited:
                raise ValueError(
                    f"queue {self.name}: borrowing and lending limits need a cohort "
                    f"({_bucket_text(limited[0])})"
                )
        if not self.fair_strategies or len(set(self.fair_strategies)) != len(self.fair_strategies):
            raise ValueError(f"queue {self.name}: fair-sharing strategies must be 1 or 2, distinct")
        if self.max_wait is not None and not self.max_wait > 0:
            raise ValueError(f"queue {self.name}: max wait must be > 0 seconds")

    def covers(self, model: str) -> bool:
        """Whether the queue names any quota for `model` (or for every model). O(1)."""
        return ANY_MODEL in self.models or model in self.models

    def bucket(self, resource: str, model: str) -> Bucket | None:
        """The bucket that `model`'s use of `resource` counts in: the model's own line,
        else the `*` line; None when the queue has neither. O(1)."""
        own = (resource, model)
        if own in self.quotas:
            return own
        anywhere = (resource, ANY_MODEL)
        return anywhere if anywhere in self.quotas else None


def _bucket_text(bucket: Bucket) -> str:
    resource, model = bucket
    return resource if model == ANY_MODEL else f"{resource} on {model}"


def with_past(share: float, past: float) -> float:
    """A queue's fair share from its share now and its past share: the past counts only
    while it borrows (share above 0), so it never weighs on use inside a nominal. O(1)."""
    return share + past if share > 0 else 0.0


def amount_text(resource: str, amount: int) -> str:
    """An amount as a person reads it: `2.5 GPUs`, `40960 MiB`. O(1)."""
    if resource is GPU_MEMORY:
        return f"{amount} MiB"
    return f"{amount / WHOLE:g}"


class Refusal(enum.Enum):
    """Why quota refuses a use."""

    NO_QUOTA = "no quota"
    """The queue names no quota for a resource (on a model) the workload uses."""
    QUOTA = "over quota"
    """Beyond the queue's nominal (no cohort) or its nominal plus borrowing limit."""
    COHORT = "cohort exhausted"
    """Within the queue's limits, but its cohort has not enough left to lend."""


@dataclass(frozen=True, slots=True)
class Verdict:
    refusal: Refusal
    message: str


@dataclass(slots=True)
class _Pool:
    lendable: int = 0
    pooled: int = 0


class Accounts:
    """Use of every queue per bucket, and of every cohort's pool, kept incrementally.

    `check` and `charge` are O(buckets of the use); `share` is O(buckets of the queue);
    building is O(queues x buckets).
    """

    __slots__ = ("_orders", "_pools", "_totals", "past", "specs", "used")

    def __init__(
        self, queues: Iterable[QueueSpec], past: Mapping[str, float] | None = None
    ) -> None:
        self.past: Mapping[str, float] = past or {}
        """Per queue, its share in the past (`share_history`): added to `fair_share`."""
        self.specs: dict[str, QueueSpec] = {}
        self.used: dict[str, Use] = {}
        self._pools: dict[tuple[str, Bucket], _Pool] = {}
        self._orders: dict[str, tuple[float, float, str]] = {}
        """`order` per queue, until its use changes."""
        self._totals: dict[Bucket, int] = {}
        """Per bucket, the nominal of every queue: the scale of `share` without a cohort."""
        for spec in queues:
            if spec.name in self.specs:
                raise ValueError(f"queue {spec.name} given twice")
            self.specs[spec.name] = spec
            self.used[spec.name] = {}
            for bucket, quota in spec.quotas.items():
                self._totals[bucket] = self._totals.get(bucket, 0) + quota.nominal
                if spec.cohort:
                    pool = self._pools.setdefault((spec.cohort, bucket), _Pool())
                    pool.lendable += quota.lendable

    # --- converting ---------------------------------------------------------------------

    def use_of(
        self, queue: str, per_model: Mapping[str, Vector], *, strict: bool = True
    ) -> Use | Verdict:
        """`per_model` (from `usage` or `estimate`) in `queue`'s buckets: resources it
        names no quota for are left out (unlimited). With `strict`, a model the queue does
        not cover is refused; without, it counts nowhere (what already runs on a model
        since removed from the queue). O(models x lines of a model not covered by `*`)."""
        spec = self.specs[queue]
        use: Use = {}
        for model, vector in per_model.items():
            if not any(vector):
                continue
            if not spec.covers(model):
                if strict:
                    return Verdict(
                        Refusal.NO_QUOTA, f"queue {queue} has no quota for GPU model {model}"
                    )
                continue
            for resource, amount in zip(RESOURCES, vector, strict=True):
                bucket = spec.bucket(resource, model)
                if bucket is not None and amount > 0:
                    use[bucket] = use.get(bucket, 0) + amount
        return use

    # --- deciding -----------------------------------------------------------------------

    def check(self, queue: str, use: Mapping[Bucket, int]) -> Verdict | None:
        """None when `queue` may take `use` on top of what it uses now, else why not.
        O(buckets of `use`)."""
        spec = self.specs[queue]
        used = self.used[queue]
        for bucket, amount in use.items():
            quota = spec.quotas.get(bucket)
            if quota is None:
                return Verdict(
                    Refusal.NO_QUOTA, f"queue {queue} has no quota for {_bucket_text(bucket)}"
                )
            now = used.get(bucket, 0)
            after = now + amount
            resource = bucket[0]
            if not spec.cohort:
                if after > quota.nominal:
                    return Verdict(
                        Refusal.QUOTA,
                        f"queue {queue}: {_bucket_text(bucket)} {amount_text(resource, now)} "
                        f"of {amount_text(resource, quota.nominal)} used, needs "
                        f"{amount_text(resource, amount)} more",
                    )
                continue
            if quota.borrowing_limit is not None and after > quota.nominal + quota.borrowing_limit:
                return Verdict(
                    Refusal.QUOTA,
                    f"queue {queue}: {_bucket_text(bucket)} {amount_text(resource, now)} used "
                    f"of nominal {amount_text(resource, quota.nominal)} plus borrowing limit "
                    f"{amount_text(resource, quota.borrowing_limit)}, needs "
                    f"{amount_text(resource, amount)} more",
                )
            more = max(0, after - quota.kept) - max(0, now - quota.kept)
            pool = self._pools[(spec.cohort, bucket)]
            left = pool.lendable - pool.pooled
            if more > left:
                return Verdict(
                    Refusal.COHORT,
                    f"cohort {spec.cohort}: {amount_text(resource, max(left, 0))} "
                    f"{_bucket_text(bucket)} left to lend, queue {queue} needs "
                    f"{amount_text(resource, more)} from it",
                )
        return None

    def within_nominal(self, queue: str, use: Mapping[Bucket, int]) -> bool:
        """Whether `queue` could take `use` inside its own nominal quota: what reclaim may
        preempt for. O(buckets of `use`)."""
        spec = self.specs[queue]
        used = self.used[queue]
        for bucket, amount in use.items():
            quota = spec.quotas.get(bucket)
            if quota is None or used.get(bucket, 0) + amount > quota.nominal:
                return False
        return True

    def charge(self, queue: str, use: Mapping[Bucket, int], sign: int = 1) -> None:
        """Add (`sign` 1) or remove (-1) `use` from `queue`; never checks (the API may
        report use beyond quota: what already runs is recorded as it is). O(buckets)."""
        spec = self.specs[queue]
        used = self.used[queue]
        self._orders.pop(queue, None)
        for bucket, amount in use.items():
            now = used.get(bucket, 0)
            after = now + sign * amount
            if after:
                used[bucket] = after
            else:
                used.pop(bucket, None)
            quota = spec.quotas.get(bucket)
            if spec.cohort and quota is not None:
                pool = self._pools[(spec.cohort, bucket)]
                pool.pooled += max(0, after - quota.kept) - max(0, now - quota.kept)

    # --- reading ------------------------------------------------------------------------

    def borrowing(self, queue: str) -> Use:
        """Per bucket, what `queue` uses beyond its nominal. O(buckets)."""
        spec = self.specs[queue]
        found: Use = {}
        for bucket, amount in self.used[queue].items():
            quota = spec.quotas.get(bucket)
            nominal = quota.nominal if quota is not None else 0
            if amount > nominal:
                found[bucket] = amount - nominal
        return found

    def lent(self, queue: str) -> Use:
        """Per bucket, the part of `queue`'s lendable quota others use now. The cohort's
        borrowing is not tied to lenders, so it is attributed to the queues whose lendable
        part lies idle, in proportion (rounded down). O(queues of the cohort x buckets)."""
        spec = self.specs[queue]
        if not spec.cohort:
            return {}
        found: Use = {}
        members = [other for other in self.specs.values() if other.cohort == spec.cohort]
        for bucket in spec.quotas:
            borrowed = sum(
                max(0, self.used[o.name].get(bucket, 0) - o.quotas[bucket].nominal)
                for o in members
                if bucket in o.quotas
            )
            if not borrowed:
                continue
            idle = {
                o.name: min(
                    o.quotas[bucket].lendable,
                    max(0, o.quotas[bucket].nominal - self.used[o.name].get(bucket, 0)),
                )
                for o in members
                if bucket in o.quotas
            }
            total = sum(idle.values())
            if total and idle[queue]:
                found[bucket] = min(idle[queue], borrowed * idle[queue] // total)
        return found

    def share(self, queue: str) -> float:
        """The queue's weighted dominant share: per bucket what it borrows beyond its
        nominal over what its cohort may lend (Kueue's fair-sharing value), the largest,
        divided by its weight. 0 while it uses no more than its nominal. O(buckets)."""
        spec = self.specs[queue]
        top = 0.0
        if spec.cohort:
            for bucket, amount in self.borrowing(queue).items():
                pool = self._pools.get((spec.cohort, bucket))
                if pool is not None and pool.lendable:
                    top = max(top, amount / pool.lendable)
        return top / spec.weight

    def fair_share(self, queue: str) -> float:
        """`share`, plus the queue's past share (`past`) while it borrows now: what fair
        sharing compares. 0 while it uses no more than its nominal (the past never weighs
        on use inside a nominal). O(buckets)."""
        return with_past(self.share(queue), self.past.get(queue, 0.0))

    def fair_share_with(self, queue: str, use: Mapping[Bucket, int], sign: int = 1) -> float:
        """`fair_share` of `queue` were `use` added (`sign` 1) or removed (-1). O(buckets)."""
        return self._with(queue, use, sign, self.fair_share)

    def fill(self, queue: str) -> float:
        """The largest fraction of a nominal quota the queue uses (above 1: borrowing),
        divided by its weight: orders queues whose `share` ties (inside their nominal).
        A bucket of nominal 0 counts against every queue's total instead. O(buckets)."""
        spec = self.specs[queue]
        top = 0.0
        for bucket, amount in self.used[queue].items():
            quota = spec.quotas.get(bucket)
            scale = (
                quota.nominal
                if quota is not None and quota.nominal
                else self._totals.get(bucket, 0)
            )
            if scale:
                top = max(top, amount / scale)
        return top / spec.weight

    def share_with(self, queue: str, use: Mapping[Bucket, int], sign: int = 1) -> float:
        """`share` of `queue` were `use` added (`sign` 1) or removed (-1). O(buckets)."""
        return self._with(queue, use, sign, self.share)

    def _with(
        self, queue: str, use: Mapping[Bucket, int], sign: int, read: Callable[[str], float]
    ) -> float:
        self.charge(queue, use, sign)
        try:
            return read(queue)
        finally:
            self.charge(queue, use, -sign)

    def order(self, queue: str) -> tuple[float, float, str]:
        """Queues first that are furthest below their weighted fair share: (`fair_share`,
        `fill`, name). O(buckets) after the queue's use changed, else O(1)."""
        found = self._orders.get(queue)
        if found is None:
            found = self._orders[queue] = (self.fair_share(queue), self.fill(queue), queue)
        return found

    def pool_left(self, cohort: str, bucket: Bucket) -> int:
        """What `cohort` still has to lend of `bucket` (0 without a pool). O(1)."""
        pool = self._pools.get((cohort, bucket))
        return 0 if pool is None else pool.lendable - pool.pooled
