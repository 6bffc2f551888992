"""Trace replay the way the FGD paper's simulator does it, and its figures.

Pods are shuffled with a seeded RNG; then, when the list asks for less than
`TUNE` × the cluster's GPU capacity, pods drawn uniformly from the list are
appended until the next one's per-GPU request would pass it (the simulator's rule;
when the list asks for more, random pods are dropped until it does not). Each
pod is placed or rejected once and never leaves.
After every arrival the replay records the arrived GPU request, the allocated
GPU and the cluster's fragmentation (Σ over nodes of `Workload.amount`, kept
incrementally: O(1) nodes re-measured per arrival).

With `priorities` (one per pod of the order; the openb trace has none, the caller
draws them) and `preempt`, a GPU pod the policy rejects evicts pods of lower priority
the way the extender's preempt verb answers (`gpuplace.placement.victim_choice.evict` on every
node, the cheapest eviction wins, as kube-scheduler picks the node with the least
victims), then takes the GPUs freed. Evicted pods leave for good (the trace has no
time: they count as evicted, not as rejected). Each preemption also checks what
kube-scheduler would have evicted on that node by itself, on node totals
(`victim_choice.totals_pick`, older pods more important): nothing (totals already fit:
no preemption there), or pods that free no GPU set.

Figures follow the paper's analysis scripts: the arrived workload is binned to
whole percent of GPU capacity (round half to even, as pandas does), and a figure
"at X% arrived" is the mean over the arrivals in bin X (the nearest bins within
±1 when X is empty).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from gpuplace.placement import fit, victim_choice
from gpuplace.placement.choosing import Choice, grant_for
from gpuplace.placement.fragmentation import Workload
from gpuplace.placement.inventory import Inventory, Node
from gpuplace.placement.ledger import Ledger
from gpuplace.placement.requests import WHOLE, GpuRequest
from gpuplace.placement.trace import TracePod

TUNE = 1.3

Decide = Callable[[Ledger, GpuRequest, str], Choice | None]
"""(ledger, request, pod uid) → the node and GPUs to take, or None to reject."""


def arrival_order(pods: Sequence[TracePod], capacity_milli: int, seed: int) -> list[TracePod]:
    """Shuffled pods, tuned to `TUNE` × capacity of GPU request. O(pods)."""
    rng = random.Random(seed)
    by_name = sorted(pods, key=lambda pod: pod.name)
    order = list(by_name)
    rng.shuffle(order)
    target = TUNE * capacity_milli
    total = sum(pod.total_milli for pod in order)
    if total > target:
        while total > target and order:
            dropped = order.pop(rng.randrange(len(order)))
            total -= dropped.total_milli
        return order
    tuned = 0
    while by_name:
        pod = by_name[rng.randrange(len(by_name))]
        # The simulator's stop rule: it compares the request *per GPU* with what is
        # left, so a multi-GPU pod may end the list a few GPUs past the target.
        if total + pod.gpu_milli > target:
            break
        total += pod.total_milli
        order.append(replace(pod, name=f"{pod.name}-tuned-{tuned}"))
        tuned += 1
    return order


@dataclass(frozen=True, slots=True)
class Arrival:
    seq: int
    pod: TracePod
    node: str | None
    gpus: tuple[int, ...]


@dataclass(slots=True)
class Replay:
    """Everything one run produced: per-arrival samples and decisions."""

    capacity_milli: int
    arrived: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    fragmented: list[float] = field(default_factory=list)
    arrivals: list[Arrival] = field(default_factory=list)
    first_reject: int | None = None
    """Index of the first rejected GPU pod in `arrivals`."""
    high: int = 0
    """GPU pods of a priority above 0 (with priorities)."""
    high_rejected: int = 0
    preemptions: int = 0
    """GPU pods placed by evicting others."""
    victims: int = 0
    victim_milli: int = 0
    """GPU share of the evicted pods (milli-GPU)."""
    totals_blind: int = 0
    """Preemptions where kube-scheduler alone, on node totals, would see no victim needed
    on that node (node totals fit, no single GPU set does)."""
    totals_wrong: int = 0
    """Preemptions where kube-scheduler's own victims on that node free no GPU set."""

    def percent(self, milli: float) -> float:
        return 100.0 * milli / self.capacity_milli

    def _bin(self, series: Sequence[float], arrived_percent: int) -> float:
        """Mean of `series` over the arrivals in that whole-percent bin, else over the
        bins within ±1, else (a small cluster, where one pod can jump a bin) the
        arrival nearest to it; NaN when the replay never came within 2 points."""
        bins = [round(self.percent(a)) for a in self.arrived]
        for spread in (0, 1):
            picked = [
                value
                for value, b in zip(series, bins, strict=True)
                if abs(b - arrived_percent) <= spread
            ]
            if picked:
                return sum(picked) / len(picked)
        if not series:
            return float("nan")
        distance, index = min(
            (abs(self.percent(a) - arrived_percent), i) for i, a in enumerate(self.arrived)
        )
        return series[index] if distance <= 2 else float("nan")

    def allocation_at(self, arrived_percent: int) -> float:
        """Mean GPU allocation ratio (%) over the arrivals in that arrived bin."""
        ratios = [round(self.percent(a), 2) for a in self.allocated]
        return self._bin(ratios, arrived_percent)

    def allocation_at_first_reject(self) -> float:
        if self.first_reject is None:
            return float("nan")
        return self.percent(self.allocated[self.first_reject])

    def frag_rate_at(self, arrived_percent: int) -> float:
        """Mean fragmentation rate: % of idle GPU that is fragment."""
        rates = [
            100.0 * frag / idle if idle > 0 else 0.0
            for frag, idle in zip(
                self.fragmented,
                (self.capacity_milli - a for a in self.allocated),
                strict=True,
            )
        ]
        return self._bin(rates, arrived_percent)

    def frag_amount_at(self, arrived_percent: int) -> float:
        """Mean fragmentation amount as % of the cluster's GPU capacity."""
        amounts = [self.percent(frag) for frag in self.fragmented]
        return self._bin(amounts, arrived_percent)

    @property
    def rejected(self) -> int:
        return sum(1 for arrival in self.arrivals if arrival.node is None)

    @property
    def rejected_gpu(self) -> int:
        return sum(1 for a in self.arrivals if a.node is None and a.pod.num_gpu > 0)


def run(
    nodes: Sequence[Node],
    order: Sequence[TracePod],
    decide: Decide,
    measure: Workload,
    ledger: Ledger | None = None,
    *,
    priorities: Sequence[int] | None = None,
    preempt: bool = False,
) -> Replay:
    """Place every pod of `order` once (see the module docstring for `priorities` and
    `preempt`). O(pods × decision), plus O(nodes × eviction search) per preemption."""
    ledger = ledger if ledger is not None else Ledger(Inventory(nodes))
    capacity = sum(len(node.gpus) for node in nodes) * WHOLE
    result = Replay(capacity)
    frag: dict[str, float] = {}
    for state in ledger.states():
        frag[state.node.name] = measure.amount(
            state.node.model, state.cpu, tuple(sorted(state.free_milli))
        )
    frag_total = sum(frag.values())
    arrived = 0
    allocated = 0
    owners: dict[str, dict[str, tuple[int, int]]] = {}
    """Per node, its pods' (priority, arrival) by uid (kept with priorities only)."""
    for seq, pod in enumerate(order):
        request = pod.request()
        uid = f"{seq}/{pod.name}"
        choice = decide(ledger, request, uid)
        priority = priorities[seq] if priorities is not None else 0
        if priority > 0 and pod.num_gpu:
            result.high += 1
        if choice is None and preempt and priority > 0 and pod.num_gpu:
            eviction = _eviction(ledger, request, priority, owners, result)
            if eviction is not None:
                for victim in eviction.uids:
                    gone = ledger.release(victim)
                    owners[eviction.node].pop(victim, None)
                    if gone is not None:
                        allocated -= gone.milli * len(gone.gpus)
                        result.victim_milli += gone.milli * len(gone.gpus)
                    result.victims += 1
                result.preemptions += 1
                choice = Choice(eviction.node, eviction.gpus, 0.0)
        if choice is None and priority > 0 and pod.num_gpu:
            result.high_rejected += 1
        if choice is not None and priorities is not None:
            owners.setdefault(choice.node, {})[uid] = (priority, seq)
        arrived += pod.total_milli
        if choice is None:
            result.arrivals.append(Arrival(seq, pod, None, ()))
            if pod.num_gpu and result.first_reject is None:
                result.first_reject = seq
        else:
            ledger.reserve(grant_for(uid, choice, request))
            allocated += pod.total_milli
            placed = ledger.state(choice.node)
            if placed is not None:
                value = measure.amount(
                    placed.node.model, placed.cpu, tuple(sorted(placed.free_milli))
                )
                frag_total += value - frag[choice.node]
                frag[choice.node] = value
            result.arrivals.append(Arrival(seq, pod, choice.node, choice.gpus))
        result.arrived.append(arrived)
        result.allocated.append(allocated)
        result.fragmented.append(frag_total)
    return result


def _eviction(
    ledger: Ledger,
    request: GpuRequest,
    priority: int,
    owners: dict[str, dict[str, tuple[int, int]]],
    result: Replay,
) -> victim_choice.Eviction | None:
    """The cheapest eviction of lower-priority pods over every node (ties: node name),
    and what kube-scheduler on totals would have done there (`result`'s counts).
    O(nodes × (grants + search))."""
    best: (
        tuple[victim_choice.Cost, str, victim_choice.Eviction, list[victim_choice.Unit]] | None
    ) = None
    for name, pods in owners.items():
        state = ledger.state(name)
        if state is None or fit.static_misfit(state, request):
            continue
        units = []
        for uid, (held, _arrival) in sorted(
            pods.items(), key=lambda item: (-item[1][0], item[1][1])
        ):
            grant = ledger.get(uid)
            if held < priority and grant is not None:
                units.append(victim_choice.Unit((uid,), (grant,), (held,)))
        if not units or not victim_choice.fits_after(state, request, units):
            continue
        found = victim_choice.evict(state, request, units)
        if found is not None and (best is None or (found.cost, name) < best[:2]):
            best = (found.cost, name, found, units)
    if best is None:
        return None
    _, name, found, units = best
    state = ledger.state(name)
    assert state is not None
    picked = victim_choice.totals_pick(state, request, units)
    if not picked:
        result.totals_blind += 1
    elif not victim_choice.fits_after(state, request, picked):
        result.totals_wrong += 1
    return found
