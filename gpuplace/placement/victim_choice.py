"""Which pods to evict on one node so that a preemptor fits on one GPU set.

kube-scheduler's DefaultPreemption picks victims per node by its own filter plugins,
on node totals of `gpuplace.io/gpu-percent`: on a node whose two GPUs hold 50%+40% and
60%+30%, a 70% pod "fits" once the 40% and the 30% pods go (70% free in total), yet no
single GPU then has 70% free. Through the extender's `preempt` verb we get its victims
per node and answer, per node, the victims that really make room: all on the GPUs the
preemptor will take, and no more than needed.

The unit of eviction is a `Unit`: one pod, or every running member of a gang on the node
(a gang member is never evicted alone; the caller leaves out a gang with members
elsewhere, which kube-scheduler cannot evict through one node's answer). A unit frees
its grants' shares, memory, CPU, host memory and pod slots.

A running *elastic* gang (more live members than its `gang-min`) also offers each of
its extra members as a unit of its own (`extras`: those `gpuplace.placement.elastic.extras`
gives back first, the most recently started first), beside the whole gang: units that
share pods are alternatives, and a selection never holds two of them. So a victim set
takes an elastic gang's extras one by one, or the whole gang, and never leaves it with
fewer than `gang-min` members otherwise; its core members (the `gang-min` started first)
go only with the whole gang.

`evict(state, request, units, ...)` answers for one node:

- per candidate GPU set the preemptor could take once freed (one GPU for a share, `count`
  whole GPUs for a multi-GPU request, within one NVLink domain when required), only the
  units holding those GPUs matter (and, when the node is short of CPU, host memory or
  pod slots, the others too);
- among the selections that make the preemptor fit (`fit.misfit` on a scratch copy: the
  engine's own fit, so share and memory on one GPU, whole GPUs and NVLink rules hold),
  the smallest by `cost`: fewest pods kube-scheduler did not offer, then fewest PDB
  violations (an upper bound: kube-scheduler reports only how many of its victims on the
  node violate one), then the lowest highest priority, then the lowest sum of priorities
  (each shifted by 2^31, as kube-scheduler's own `pickOneNodeForPreemption`, so one pod
  fewer always weighs more than a lower priority), then fewest pods that are not an
  elastic gang's extras, then the most recently started extras (the lowest sum of their
  places in `elastic.extras`' order), then fewest pods, then the least share and memory
  freed. So between an extra and a pod alone of the same priority the extra goes first:
  its gang keeps running with what it declared it needs (`gang-min`) and grows back as
  GPUs free, where the pod alone would stop; priority still comes first (an extra of
  higher priority is spared before a pod alone of lower priority), and so does the
  count of pods (two extras weigh more than one pod alone);
- a final pass drops any unit whose eviction is not needed (the bounded search may have
  stopped early): every unit of the answer is needed — without it the preemptor does
  not fit.

`for_gang(ledger, policy, members, units)` does the same for a waiting gang, all members
at once or nothing (the gang controller's side; see docs/gangs.md).

Complexity, with G GPUs on the node, U units on one GPU set and S candidate GPU sets
(≤ G for shares; for `count` whole GPUs the combinations, at most `SETS_LIMIT`, beyond
which the cheapest GPUs by their own cost are taken per NVLink domain): the search is a
branch and bound over the units of one set, stopped after `VISITS_LIMIT` selections
(exact below that: U ≤ 12 always is), so O(S × min(2^U, VISITS_LIMIT) × U) for the
search and O(U × G) for each fit check of the final pass. Memory O(U + G).

Pure: no I/O, no clock, no randomness (ties go to the lower GPU index, then pod UIDs).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from gpuplace.placement import elastic, fit, gangs
from gpuplace.placement.choosing import Choice, Policy
from gpuplace.placement.inventory import NO_NVLINK
from gpuplace.placement.ledger import Grant, Ledger, NodeState
from gpuplace.placement.requests import WHOLE, GpuRequest, Topology

PRIORITY_SHIFT = 1 << 31
"""Added to each priority before summing (priorities are int32): sums stay >= 0, so a
selection with one pod more never sums lower."""
VISITS_LIMIT = 4096
"""Selections the search looks at per GPU set before it keeps the best found so far."""
SETS_LIMIT = 512
STRICT_LIMIT = 64
"""Units `for_gang` prunes one by one, each with a plan of the gang, when its greedy plan
needs more victims than the chosen ones (step 5)."""
"""Whole-GPU sets enumerated per node before falling back to the cheapest GPUs."""


@dataclass(frozen=True, slots=True)
class Unit:
    """Pods evicted together: one pod, or all running members of a gang on this node."""

    uids: tuple[str, ...]
    grants: tuple[Grant, ...]
    """Their GPU grants on this node (empty for pods that hold no GPU)."""
    priorities: tuple[int, ...]
    """One per pod of `uids`."""
    unoffered: int = 0
    """How many of `uids` kube-scheduler did not offer as victims."""
    spare: int = 0
    """How many of `uids` are extra members of a running elastic gang (`extras`)."""
    age: int = 0
    """The sum of those extras' places in `elastic.extras`' order (0: the most recently
    started): the newest extras are taken first."""

    def __post_init__(self) -> None:
        if not self.uids or len(self.priorities) != len(self.uids):
            raise ValueError("a unit names at least one pod and one priority per pod")
        if not 0 <= self.spare <= len(self.uids):
            raise ValueError("a unit's extras are among its pods")

    def gpus(self) -> frozenset[int]:
        return frozenset(index for grant in self.grants for index in grant.gpus)

    def milli(self) -> int:
        return sum(grant.milli * len(grant.gpus) for grant in self.grants)

    def memory(self) -> int:
        return sum(grant.memory_mib * len(grant.gpus) for grant in self.grants)


Cost = tuple[int, int, int, int, int, int, int, int, int]


def cost(units: Iterable[Unit], *, pdb_violations: int = 0) -> Cost:
    """The order selections are compared by (smaller is better); see the module
    docstring. Adding a unit never lowers any component. `pdb_violations` is the
    number kube-scheduler reported for its victims on the node; a selection of k of
    them violates at most min(k, that). O(pods)."""
    chosen = list(units)
    priorities = [p for unit in chosen for p in unit.priorities]
    offered = sum(len(unit.uids) - unit.unoffered for unit in chosen)
    return (
        sum(unit.unoffered for unit in chosen),
        min(pdb_violations, offered),
        max(priorities, default=-PRIORITY_SHIFT),
        sum(p + PRIORITY_SHIFT for p in priorities),
        sum(len(unit.uids) - unit.spare for unit in chosen),
        sum(unit.age for unit in chosen),
        len(priorities),
        sum(unit.milli() for unit in chosen),
        sum(unit.memory() for unit in chosen),
    )


def extras(started: Sequence[Unit], minimum: int) -> list[Unit]:
    """The extra members of a running elastic gang as units of their own, the most
    recently started first, each marked (`spare`, `age`): `started` holds one unit per
    started live member, oldest first (see `gpuplace.placement.elastic.extras`); none when
    the gang is not elastic or runs with `minimum` members. O(members)."""
    return [
        replace(unit, spare=len(unit.uids), age=place)
        for place, unit in enumerate(elastic.extras(started, minimum))
    ]


def whole(unit: Unit, spares: Iterable[Unit]) -> Unit:
    """`unit` (a whole gang) marked with its extras (`spares`, from `extras`). O(pods)."""
    uids = set(unit.uids)
    inside = [spare for spare in spares if uids.issuperset(spare.uids)]
    return replace(
        unit,
        spare=sum(spare.spare for spare in inside),
        age=sum(spare.age for spare in inside),
    )


def clash(units: Sequence[Unit]) -> list[int]:
    """Per unit, the bitmask of the others that share a pod with it (alternatives, such
    as an elastic gang's extra and the whole gang). O(pods of the units)."""
    holders: dict[str, int] = {}
    for position, unit in enumerate(units):
        for uid in unit.uids:
            holders[uid] = holders.get(uid, 0) | (1 << position)
    return [
        _or(holders[uid] for uid in unit.uids) & ~(1 << position)
        for position, unit in enumerate(units)
    ]


def _or(masks: Iterable[int]) -> int:
    found = 0
    for mask in masks:
        found |= mask
    return found


@dataclass(frozen=True, slots=True)
class Eviction:
    """The answer for one node: evict `units`, then the preemptor takes `gpus`."""

    node: str
    gpus: tuple[int, ...]
    units: tuple[Unit, ...]
    cost: Cost

    @property
    def uids(self) -> tuple[str, ...]:
        return tuple(uid for unit in self.units for uid in unit.uids)

    @property
    def pdb_violations(self) -> int:
        return self.cost[1]


def after(state: NodeState, units: Iterable[Unit]) -> NodeState:
    """A scratch copy of `state` with the units' grants given back. O(G + grants)."""
    copy = state.copy()
    for unit in units:
        for grant in unit.grants:
            # `hold` gives a GPU's compute back with its last memory-only share
            on_node = [index for index in grant.gpus if 0 <= index < len(copy.free_milli)]
            copy.hold(on_node, grant.milli, grant.memory_mib, +1)
            copy.cpu += grant.cpu_milli
            copy.memory += grant.host_memory_mib
        copy.pods += len(unit.uids)
    return copy


def takes(state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> bool:
    """Whether `request` fits on exactly `gpus` of `state` (host resources included). O(G)."""
    if fit.static_misfit(state, request) or fit.host_misfit(state, request):
        return False
    node = state.node
    if len(gpus) != request.count:
        return False
    for index in gpus:
        gpu = node.gpus[index]
        need = gpu.takes(request.milli, request.memory_mib)
        if not request.allows(gpu.model) or gpu.memory_mib < need:
            return False
        if request.memory_only:  # memory-only shares keep their GPU to themselves
            if not state.open_to_memory_only(index):
                return False
            if state.free_memory[index] < need:
                return False
        elif request.milli < WHOLE:
            if state.free_milli[index] < request.milli:
                return False
            if state.free_memory[index] < need:
                return False
        elif state.free_milli[index] != WHOLE or state.free_memory[index] != gpu.memory_mib:
            return False
    if request.count > 1 and request.topology is Topology.REQUIRED:
        domains = {node.gpus[index].nvlink for index in gpus}
        if len(domains) != 1 or NO_NVLINK in domains:
            return False
    return True


def fits_after(state: NodeState, request: GpuRequest, units: Iterable[Unit]) -> bool:
    """Whether the request fits anywhere on the node once `units` are gone. O(G log G)."""
    return fit.misfit(after(state, units), request) is None


def _sets(state: NodeState, request: GpuRequest, units: Sequence[Unit]) -> list[tuple[int, ...]]:
    """GPU sets the preemptor could take once freed: the GPUs it may use (model, memory
    size), one per share candidate, `count` of them for whole GPUs (one NVLink domain
    when required). O(G) for shares, O(min(C(G, count), SETS_LIMIT) × count) else."""
    node = state.node
    usable = [
        gpu.index
        for gpu in node.gpus
        if request.allows(gpu.model) and gpu.memory_mib >= request.memory_mib
    ]
    if request.milli < WHOLE:
        return [(index,) for index in usable]
    if request.topology is Topology.REQUIRED and request.count > 1:
        pools: list[list[int]] = []
        for domain in sorted(node.nvlink_domains()):
            members = [i for i in node.nvlink_domains()[domain] if i in usable]
            if len(members) >= request.count:
                pools.append(members)
    else:
        pools = [usable] if len(usable) >= request.count else []
    sets: list[tuple[int, ...]] = []
    for pool in pools:
        combos = itertools.combinations(pool, request.count)
        chunk = list(itertools.islice(combos, SETS_LIMIT + 1))
        if len(chunk) <= SETS_LIMIT:
            sets.extend(chunk)
        else:  # too many: the cheapest GPUs of the pool, each by the units holding it
            holders = {i: [u for u in units if i in u.gpus()] for i in pool}
            cheapest = sorted(pool, key=lambda i: (cost(holders[i]), i))
            sets.append(tuple(sorted(cheapest[: request.count])))
    return sets


Parts = tuple[int, int, int, int, int, int, int, int, int]
"""A selection's sums: (unoffered, offered pods, top priority, shifted priority sum,
pods that are not extras, extras' places, pods, milli freed, memory freed); `cost` is
these with the PDB bound applied."""


def _parts(unit: Unit) -> Parts:
    return (
        unit.unoffered,
        len(unit.uids) - unit.unoffered,
        max(unit.priorities),
        sum(p + PRIORITY_SHIFT for p in unit.priorities),
        len(unit.uids) - unit.spare,
        unit.age,
        len(unit.uids),
        unit.milli(),
        unit.memory(),
    )


def _add(a: Parts, b: Parts) -> Parts:
    return (
        a[0] + b[0],
        a[1] + b[1],
        max(a[2], b[2]),
        a[3] + b[3],
        a[4] + b[4],
        a[5] + b[5],
        a[6] + b[6],
        a[7] + b[7],
        a[8] + b[8],
    )


def _needs(state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> tuple[int, ...]:
    """What must be freed for `request` to take `gpus` (already usable: model, size,
    NVLink): per GPU share then memory, then CPU, host memory and a pod slot."""
    needs: list[int] = []
    for index in gpus:
        need = state.memory_taken(index, request.milli, request.memory_mib)
        if request.memory_only:  # every compute share of the GPU must go
            pooled = WHOLE if state.memory_only[index] else 0
            needs += [WHOLE - state.free_milli[index] - pooled]
            needs += [need - state.free_memory[index]]
        elif request.milli < WHOLE:
            needs += [request.milli - state.free_milli[index]]
            needs += [need - state.free_memory[index]]
        else:
            needs += [WHOLE - state.free_milli[index]]
            needs += [state.node.gpus[index].memory_mib - state.free_memory[index]]
    return (
        *needs,
        request.cpu_milli - state.cpu,
        request.host_memory_mib - state.memory,
        1 - state.pods,
    )


def _frees(unit: Unit, gpus: tuple[int, ...]) -> tuple[int, ...]:
    """What evicting `unit` frees, in `_needs`' order. A memory-only share counts as its
    GPU's whole compute, which only its GPU's last memory-only share really gives back:
    an upper bound, so the search's sums never rule out a selection that would do, and
    `_search` checks a selection exactly before taking it."""
    frees: list[int] = []
    for index in gpus:
        held = [grant for grant in unit.grants if index in grant.gpus]
        milli = sum(WHOLE if grant.milli == 0 else grant.milli for grant in held)
        frees += [milli, sum(grant.memory_mib for grant in held)]
    cpu = sum(grant.cpu_milli for grant in unit.grants)
    host = sum(grant.host_memory_mib for grant in unit.grants)
    return (*frees, cpu, host, len(unit.uids))


def _search(
    state: NodeState,
    request: GpuRequest,
    gpus: tuple[int, ...],
    forced: list[Unit],
    optional: list[Unit],
    *,
    pdb_violations: int,
) -> tuple[Cost, list[Unit]] | None:
    """The cheapest `forced + some of optional` after which the request takes `gpus`
    (usable ones: `_sets`), never two units that share a pod (`clash`; an optional unit
    sharing one with a forced unit is left out). Branch and bound (a selection's cost
    bounds every extension's), sums kept incrementally; at most `VISITS_LIMIT` selections looked at;
    stopped before any fit, the cheapest units first until one does (`evict` then drops
    those not needed). O(min(2^U, VISITS_LIMIT) × G) after O(U × grants) set-up, plus
    O(G + grants) for each complete selection where memory-only shares are involved."""
    taken = {uid for unit in forced for uid in unit.uids}
    optional = sorted(
        (unit for unit in optional if taken.isdisjoint(unit.uids)),
        key=lambda u: (cost([u]), u.uids),
    )
    clashes = clash(optional)
    needs = _needs(state, request, gpus)
    # the sums are exact unless a memory-only share is involved (see `_frees`)
    exact = not request.memory_only and not any(
        grant.milli == 0 for unit in (*forced, *optional) for grant in unit.grants
    )
    parts = [_parts(unit) for unit in optional]
    frees = [_frees(unit, gpus) for unit in optional]
    nothing: Parts = (0, 0, -PRIORITY_SHIFT, 0, 0, 0, 0, 0, 0)
    base_parts, base_freed = nothing, (0,) * len(needs)
    for unit in forced:
        base_parts = _add(base_parts, _parts(unit))
        base_freed = tuple(map(sum, zip(base_freed, _frees(unit, gpus), strict=True)))

    def bound(total: Parts) -> Cost:
        return (total[0], min(pdb_violations, total[1]), *total[2:])

    best: tuple[Cost, tuple[int, ...]] | None = None
    visits = 0
    stack: list[tuple[int, tuple[int, ...], Parts, tuple[int, ...], int]] = [
        (0, (), base_parts, base_freed, 0)
    ]
    while stack and visits < VISITS_LIMIT:
        start, chosen, total, freed, mask = stack.pop()
        visits += 1
        current = bound(total)
        if best is not None and current >= best[0]:
            continue
        if all(got >= need for got, need in zip(freed, needs, strict=True)) and (
            exact or takes(after(state, [*forced, *(optional[i] for i in chosen)]), request, gpus)
        ):
            best = (current, chosen)
            continue
        # deeper selections go on the stack last-first, so the cheapest is tried first
        for position in range(len(optional) - 1, start - 1, -1):
            if clashes[position] & mask:
                continue
            stack.append(
                (
                    position + 1,
                    (*chosen, position),
                    _add(total, parts[position]),
                    tuple(map(sum, zip(freed, frees[position], strict=True))),
                    mask | (1 << position),
                )
            )
    if best is not None:
        return best[0], [*forced, *(optional[i] for i in best[1])]
    if stack:  # stopped early: take the cheapest first until it fits
        chosen_units = list(forced)
        for unit in optional:
            if any(not set(unit.uids).isdisjoint(other.uids) for other in chosen_units):
                continue
            chosen_units.append(unit)
            if takes(after(state, chosen_units), request, gpus):
                return cost(chosen_units, pdb_violations=pdb_violations), chosen_units
    return None


def _needed(state: NodeState, request: GpuRequest, units: list[Unit]) -> list[Unit]:
    """`units` without the ones whose eviction the preemptor does not need (most
    important first: those are spared first). O(U² × G)."""
    kept = list(units)
    for unit in sorted(units, key=lambda u: cost([u]), reverse=True):
        rest = [other for other in kept if other is not unit]
        if rest and fits_after(state, request, rest):
            kept = rest
    return kept


def evict(
    state: NodeState,
    request: GpuRequest,
    units: Sequence[Unit],
    *,
    pdb_violations: int = 0,
) -> Eviction | None:
    """The cheapest eviction among `units` (those that may go) after which `request`
    fits on one GPU set of the node, or None when none does, and when it fits already
    (GPUs are then not what it lacks). Units that share pods are alternatives (an elastic
    gang's extra and the whole gang): the answer holds at most one of them. See the
    module docstring for the order and the complexity."""
    if request.count == 0 or fit.misfit(state, request) is None:
        return None
    if fit.static_misfit(state, request):
        return None
    host_short = fit.host_misfit(state, request) is not None
    best: tuple[Cost, tuple[int, ...], list[Unit]] | None = None
    for gpus in _sets(state, request, units):
        wanted = set(gpus)
        on_set = [unit for unit in units if unit.gpus() & wanted]
        if request.milli >= WHOLE:  # all on the set go; of alternatives, the search picks
            clashes = clash(on_set)
            forced = [unit for unit, mask in zip(on_set, clashes, strict=True) if not mask]
            optional = [unit for unit, mask in zip(on_set, clashes, strict=True) if mask]
        else:
            forced, optional = [], on_set
        if host_short:
            optional += [unit for unit in units if not unit.gpus() & wanted]
        found = _search(state, request, gpus, forced, optional, pdb_violations=pdb_violations)
        if found is None or not found[1]:
            continue
        if best is None or (found[0], gpus) < (best[0], best[1]):
            best = (found[0], gpus, found[1])
    if best is None:
        return None
    chosen = _needed(state, request, best[2])
    freed = after(state, chosen)
    gpus = best[1] if takes(freed, request, best[1]) else _first_set(freed, request)
    if not gpus:
        return None
    ordered = tuple(sorted(chosen, key=lambda u: u.uids))
    return Eviction(state.node.name, gpus, ordered, cost(ordered, pdb_violations=pdb_violations))


def _first_set(state: NodeState, request: GpuRequest) -> tuple[int, ...]:
    sets = fit.gpu_sets(state, request)
    return sets[0] if sets else ()


def totals_pick(state: NodeState, request: GpuRequest, units: Sequence[Unit]) -> list[Unit]:
    """kube-scheduler's own pick on node totals (DefaultPreemption's reprieve): every
    unit removed, then each given back, most important first (`units` in that order),
    unless the node's *totals* of GPU share, CPU and memory would no longer hold the
    request; nothing when the totals hold it already (no victim needed, to its eyes).
    What it evicts without the extender; the replay measures how often that frees no
    GPU set. O(U × (grants + G))."""
    need = request.total_milli

    def totals_fit(gone: list[Unit]) -> bool:
        freed = after(state, gone)
        total = sum(max(milli, 0) for milli in freed.free_milli)
        return (
            total >= need
            and freed.cpu >= request.cpu_milli
            and freed.memory >= (request.host_memory_mib)
        )

    if totals_fit([]):
        return []  # totals fit already: kube-scheduler sees no victim needed here
    victims = list(units)
    for unit in units:
        kept = [other for other in victims if other is not unit]
        if totals_fit(kept):
            victims = kept
    return victims


@dataclass(frozen=True, slots=True)
class GangEviction:
    """What a waiting gang would evict to start: `units` (all or nothing), and where its
    members would then go (`gpuplace.placement.gangs.Plan` on the freed nodes)."""

    units: tuple[Unit, ...]
    choices: Mapping[str, Choice]
    nodes: tuple[str, ...]

    @property
    def uids(self) -> tuple[str, ...]:
        return tuple(uid for unit in self.units for uid in unit.uids)


def for_gang(
    ledger: Ledger,
    policy: Policy,
    members: Sequence[gangs.Member],
    units: Sequence[Unit],
    *,
    exclude: Collection[str] = frozenset(),
) -> GangEviction | None:
    """The pods a waiting gang would evict to start, all members at once, or None (evict
    nothing) when even evicting every unit would not make room for all of them. A gang
    that fits already gets a plan with no victims.

    1. plan the gang (`gpuplace.placement.gangs.plan`) on a scratch ledger without any of `units`
       (the pods of lower priority, whole gangs as one unit: the caller's choice);
    2. node by node of that plan, member by member, evict only what the member needs
       there (`evict` over the units on that node, a unit spanning nodes counted where
       it is looked at), so only pods on the GPUs the members take go, and as few as
       needed; any member left without room: None;
    3. the same with the members that fit in free capacity now placed there first and
       only the others planned as above; the cheaper victims of the two (`cost`) win,
       so a gang that half fits evicts for its other half only;
    4. drop every chosen unit the members can do without (`place` still fits them all
       on their nodes): a unit evicted for an early member may be spared once a later
       member's victims freed enough. So no victim is beyond need;
    5. the gang's own plan (`gpuplace.placement.gangs.plan`, greedy: what the controller starts
       it with) must succeed once the victims are gone, else the controller would find
       no room and preempt again: if it falls short, step 4 is done again keeping only
       removals after which that plan still succeeds, starting from every unit on the
       plan's nodes when the chosen ones are not enough (at most `STRICT_LIMIT` units);
       still short: None. The answer's `choices` are that plan's;
    6. no victim that plan does without (`_only_needed`: sparing for step 4's nodes may
       leave one once the gang's own plan moved members).

    Units that share pods are alternatives (an elastic gang's extras and the whole gang,
    `extras`): step 2 takes at most one of them per pod, and once it took an extra, the
    whole gang stays a candidate for a later member with its other pods only (taking it
    then takes the gang whole); step 5 starts from the widest of them. So an elastic
    gang is left with its `gang-min` members at least, or evicted whole.

    Unlike kube-scheduler's preemption, which evicts on the one node it nominates, the
    units may span nodes: a victim gang goes whole. The ledger is never changed.
    O(grants) for the scratch ledgers, plus at most (placed + 3) plans (see
    `gpuplace.placement.gangs`), plus per member the `evict` search on its node, plus O(V)
    `place` checks for V victims, plus one scratch ledger and plan (O(V) of them, V ≤
    `STRICT_LIMIT`, when step 5 has to prune again), plus step 6 (`_only_needed`: O(V²)
    `place` checks, at most V scratch ledgers and plans, only for units `place` can do
    without)."""
    if not members:
        return None
    fits = gangs.plan(ledger, policy, members, exclude=exclude)
    if not isinstance(fits, gangs.Shortfall):
        return GangEviction((), fits.choices, fits.nodes)
    best = _evicting(ledger, policy, members, units, exclude)
    for k in range(min(fits.placed, len(members) - 1), 0, -1):
        first = gangs.plan(ledger, policy, members[:k], exclude=exclude)
        if isinstance(first, gangs.Shortfall):
            continue
        base = Ledger(ledger.inventory)
        base.restore([*ledger, *first.grants(members[:k])])
        others = _evicting(base, policy, members[k:], units, exclude)
        if others is not None and (best is None or cost(others.units) < cost(best.units)):
            nodes = tuple(dict.fromkeys((*first.nodes, *others.nodes)))
            best = GangEviction(others.units, {**first.choices, **others.choices}, nodes)
        break
    if best is None:
        return None
    where = {uid: choice.node for uid, choice in best.choices.items()}
    victims = _spare(ledger, members, where, list(best.units))
    started = _starts(ledger, policy, members, victims, exclude)
    if started is not None:
        # the gang's own plan may use other nodes: spare what it does without there too
        there = {uid: choice.node for uid, choice in started.choices.items()}
        fewer = _spare(ledger, members, there, victims) if there != where else victims
        if len(fewer) < len(victims):
            again = _starts(ledger, policy, members, fewer, exclude)
            if again is not None:
                victims, started = fewer, again
    if started is None:
        # `place` fits the members on their nodes, but the gang's own plan (greedy, as
        # the controller will start it) does not: spare only what keeps that plan whole
        def starts(rest: list[Unit]) -> bool:
            return place(ledger, members, where, rest) is not None and (
                _starts(ledger, policy, members, rest, exclude) is not None
            )

        victims = list(best.units)
        if not starts(victims):
            # more must go: every unit on the plan's nodes, then spared one by one
            on = set(best.nodes)
            victims = _widest([u for u in units if any(g.node in on for g in u.grants)])
            if len(victims) > STRICT_LIMIT or not starts(victims):
                return None  # evicting would not start the gang: evict nothing
        victims = _spare(ledger, members, where, victims, starts)
        started = _starts(ledger, policy, members, victims, exclude)
        if started is None:
            return None
    victims, started = _only_needed(ledger, policy, members, victims, started, exclude=exclude)
    nodes = tuple(dict.fromkeys((*best.nodes, *started.nodes)))
    return GangEviction(tuple(sorted(victims, key=lambda u: u.uids)), started.choices, nodes)


def _spare(
    ledger: Ledger,
    members: Sequence[gangs.Member],
    where: Mapping[str, str],
    victims: list[Unit],
    keeps: Callable[[list[Unit]], bool] | None = None,
) -> list[Unit]:
    """Step 4 of `for_gang`: a unit evicted for one member may be spared once a later
    member's victims freed enough; drop every unit the members can do without (most
    important first), by `keeps` (default: `place` still fits them on `where`)."""

    def fits(rest: list[Unit]) -> bool:
        return place(ledger, members, where, rest) is not None

    test = keeps or fits
    if not test(victims):
        return victims
    for candidate in sorted(victims, key=lambda u: cost([u]), reverse=True):
        rest = [other for other in victims if other is not candidate]
        if test(rest):
            victims = rest
    return victims


def _only_needed(
    ledger: Ledger,
    policy: Policy,
    members: Sequence[gangs.Member],
    victims: list[Unit],
    started: gangs.Plan,
    *,
    exclude: Collection[str],
) -> tuple[list[Unit], gangs.Plan]:
    """Step 6 of `for_gang`: no victim the plan the gang starts with does without. A unit
    whose members still fit on that plan's nodes without it (`place`) and without which
    the gang's own plan still starts is spared, and the plan made again, until none is
    left (the plan may move members between nodes, so sparing for one plan's nodes can
    leave a unit the next one does without). A unit the gang's plan could not start
    without is not tried again (with fewer victims it could not either). O(V) `place`
    checks per pass, at most V passes (each spares one), and at most V gang plans in all
    (each on an O(grants) scratch ledger): O(V² × place + V × (grants + plan))."""
    kept: set[int] = set()
    for _ in range(len(victims)):
        there = {uid: choice.node for uid, choice in started.choices.items()}
        for candidate in sorted(victims, key=lambda u: cost([u]), reverse=True):
            if id(candidate) in kept:
                continue
            rest = [other for other in victims if other is not candidate]
            if place(ledger, members, there, rest) is None:
                continue
            again = _starts(ledger, policy, members, rest, exclude)
            if again is None:
                kept.add(id(candidate))
                continue
            victims, started = rest, again
            break
        else:
            break
    return victims, started


def _starts(
    ledger: Ledger,
    policy: Policy,
    members: Sequence[gangs.Member],
    victims: Sequence[Unit],
    exclude: Collection[str],
) -> gangs.Plan | None:
    """The gang's own plan (`gpuplace.placement.gangs.plan`, what the controller starts it with)
    on a scratch ledger without `victims`, or None when it falls short. O(grants) plus
    one plan."""
    gone = {uid for unit in victims for uid in unit.uids}
    scratch = Ledger(ledger.inventory)
    scratch.restore(grant for grant in ledger if grant.pod_uid not in gone)
    planned = gangs.plan(scratch, policy, members, exclude=exclude)
    return None if isinstance(planned, gangs.Shortfall) else planned


def _evicting(
    ledger: Ledger,
    policy: Policy,
    members: Sequence[gangs.Member],
    units: Sequence[Unit],
    exclude: Collection[str],
) -> GangEviction | None:
    """Steps 1 and 2 of `for_gang`."""
    gone = {uid for unit in units for uid in unit.uids}
    scratch = Ledger(ledger.inventory)
    scratch.restore(grant for grant in ledger if grant.pod_uid not in gone)
    planned = gangs.plan(scratch, policy, members, exclude=exclude)
    if isinstance(planned, gangs.Shortfall):
        return None
    chosen: dict[int, Unit] = {}
    choices: dict[str, Choice] = {}
    for node in planned.nodes:
        live = ledger.state(node)
        if live is None:
            return None
        state = live.copy()
        gone = {uid for unit in chosen.values() for uid in unit.uids}
        local: dict[int, Unit] = {}
        for unit in units:
            if id(unit) in chosen or gone.issuperset(unit.uids):
                continue
            part = _part(unit, node, gone)
            if part is not None:
                local[id(unit)] = part
        originals = {id(part): key for key, part in local.items()}
        for member in members:
            if planned.choices[member.uid].node != node:
                continue
            gpus = planned.choices[member.uid].gpus
            if not takes(state, member.request, gpus):
                sets = (
                    fit.gpu_sets(state, member.request)
                    if fit.misfit(state, member.request) is None
                    else []
                )
                if sets:
                    gpus = sets[0]
                else:
                    found = evict(state, member.request, list(local.values()))
                    if found is None:
                        return None
                    state = after(state, found.units)
                    for part in found.units:
                        key = originals[id(part)]
                        taken = next(u for u in units if id(u) == key)
                        # a whole gang taken after one of its extras: it holds that one
                        for other in [
                            k for k, u in chosen.items() if set(taken.uids) >= set(u.uids)
                        ]:
                            del chosen[other]
                        chosen[key] = taken
                        del local[key]
                    # what shares pods with the chosen ones is left with its other pods
                    gone = {uid for unit in found.units for uid in unit.uids}
                    for key, part in list(local.items()):
                        if gone.isdisjoint(part.uids):
                            continue
                        del local[key]
                        rest = _part(part, node, gone)
                        if rest is not None:
                            local[key] = rest
                            originals[id(rest)] = key
                    gpus = found.gpus
            gangs.take(state, member.request, gpus)
            choices[member.uid] = Choice(node, gpus, 0.0)
    victims = tuple(sorted(chosen.values(), key=lambda unit: unit.uids))
    return GangEviction(victims, choices, planned.nodes)


def _widest(units: Sequence[Unit]) -> list[Unit]:
    """`units` less those whose pods another holds (an elastic gang's extra beside the
    whole gang), so that none is counted twice. O(U × pods) with U units."""
    return [
        unit
        for unit in units
        if not any(
            other is not unit
            and set(other.uids) >= set(unit.uids)
            and (len(other.uids) > len(unit.uids) or id(other) < id(unit))
            for other in units
        )
    ]


def _part(unit: Unit, node: str, gone: Collection[str]) -> Unit | None:
    """`unit`'s pods on `node` less those in `gone` (None: no grant left there), with
    their priorities; its extras' marks kept as far as they can be. O(pods of the unit)."""
    here = tuple(g for g in unit.grants if g.node == node and g.pod_uid not in gone)
    if not here:
        return None
    on_node = tuple(g.pod_uid for g in here)
    priorities = tuple(
        p for uid, p in zip(unit.uids, unit.priorities, strict=True) if uid in on_node
    )
    if len(priorities) != len(on_node):  # a pod with two grants here: one priority each
        priorities = (max(unit.priorities),) * len(on_node)
    return Unit(on_node, here, priorities, spare=min(unit.spare, len(on_node)), age=unit.age)


def place(
    ledger: Ledger,
    members: Sequence[gangs.Member],
    where: Mapping[str, str],
    units: Sequence[Unit],
) -> dict[str, Choice] | None:
    """Each member on its node (`where`, by UID) once `units` are gone, on the first GPU
    set the engine's fit offers, in order; None when one finds no room. The check behind
    "no victim beyond need" of `for_gang`. O(grants of the units + members × G log G)."""
    states: dict[str, NodeState] = {}
    choices: dict[str, Choice] = {}
    for member in members:
        node = where.get(member.uid)
        if node is None:
            return None
        state = states.get(node)
        if state is None:
            live = ledger.state(node)
            if live is None:
                return None
            here = []
            for unit in units:
                grants = tuple(grant for grant in unit.grants if grant.node == node)
                if grants:
                    uids = tuple(grant.pod_uid for grant in grants)
                    here.append(Unit(uids, grants, (0,) * len(uids)))
            state = states[node] = after(live, here)
        if fit.misfit(state, member.request) is not None:
            return None
        gpus = fit.gpu_sets(state, member.request)[0]
        gangs.take(state, member.request, gpus)
        choices[member.uid] = Choice(node, gpus, 0.0)
    return choices
