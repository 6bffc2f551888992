"""The load-aware tie-break (opt-in): among placements the policy scores *exactly* the
same, prefer GPUs whose measured utilisation is lower (after Genius, cited in issue 22:
co-located work slows down on a busy GPU even when its grant is honoured).

What it may change, and what it never does:

- It orders only what the policy leaves equal. Between nodes: among the nodes whose
  policy score (`Choice.policy_score`, before the place in line) ties with the best,
  the one whose chosen GPUs carry the lowest load wins; the place in line (or chance,
  for a policy without one) still decides among equal loads. Within a node: among the
  GPU sets that tie on the policy's score and preference (`Choice.tied`), and among
  GPUs interchangeable for the engine (`interchangeable`), the least loaded.
- It never decides whether anything fits: it reads only choices the engine already
  made from the ledger of grants, and picks among GPU sets the engine found fitting or
  GPUs identical to them in everything the ledger and inventory know. Measured use
  never admits more than the granted free capacity, nor rejects a fit.
- It is applied when choices are read (prioritize, bind, `choose`), never inside the
  engine's caches (`Chooser`'s per-node outcomes and kept evaluations, the
  fragmentation memo, filter's kept answers): a new measurement makes none of them
  stale, and filter, which answers only which nodes fit, never looks at it.

Loads are compared in whole percent of utilisation (`LEVELS`), so that noise of a
measurement does not reorder GPUs; a GPU or node not measured counts at the cluster's
mean measured level (`Loads.neutral`): neither preferred nor avoided. The caller says
when loads are too old to use (`Loads.fresh`: this room reads no clock); old loads are
not used at all, and the order is then exactly the policy's.

Pure: no I/O, clock or logging (see the package docstring).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuplace.placement import choosing
from gpuplace.placement.choosing import Choice
from gpuplace.placement.ledger import NodeState
from gpuplace.placement.requests import GpuRequest

LEVELS = 100
"""A GPU's load level: its utilisation (0-1) in whole percent, 0-`LEVELS`."""


@dataclass(frozen=True, slots=True)
class Loads:
    """Each measured GPU's load level (node -> GPU index -> 0-`LEVELS`), as measured at
    `measured_at` (seconds, on the caller's clock), and the level an unmeasured GPU
    counts at (`neutral`: the mean measured level, rounded)."""

    levels: Mapping[str, Mapping[int, int]]
    measured_at: float
    neutral: int = field(default=0)
    floors: Mapping[str, int] = field(default_factory=dict)
    """Per measured node, a level no GPU of it is below: its lightest measured GPU's,
    or `neutral` if lower (a GPU not measured counts at that)."""

    @classmethod
    def measured(cls, utilization: Mapping[str, Mapping[int, float]], measured_at: float) -> Loads:
        """From utilisations (0-1; clamped; a value that is not a finite number counts
        as not measured). O(GPUs measured)."""
        levels: dict[str, dict[int, int]] = {}
        total = count = 0
        for node, gpus in utilization.items():
            kept: dict[int, int] = {}
            for index, value in gpus.items():
                if not math.isfinite(value):
                    continue
                level = round(min(max(value, 0.0), 1.0) * LEVELS)
                kept[index] = level
                total += level
                count += 1
            if kept:
                levels[node] = kept
        neutral = round(total / count) if count else 0
        floors = {node: min(*gpus.values(), neutral) for node, gpus in levels.items()}
        return cls(levels, measured_at, neutral, floors)

    def fresh(self, now: float, max_age: float) -> bool:
        """Whether these loads are young enough to break ties at `now`. O(1)."""
        return 0.0 <= now - self.measured_at <= max_age

    def level(self, node: str, index: int) -> int:
        """GPU `index` of `node`'s load level (`neutral` where not measured). O(1)."""
        gpus = self.levels.get(node)
        if gpus is None:
            return self.neutral
        return gpus.get(index, self.neutral)

    def of(self, node: str, gpus: Iterable[int]) -> int:
        """A GPU set's load: the sum of its GPUs' levels (sets of one request have one
        size, so this orders them as their mean does, in integers). O(len(gpus))."""
        measured = self.levels.get(node)
        if measured is None:
            return self.neutral * sum(1 for _ in gpus)
        neutral = self.neutral
        return sum(measured.get(index, neutral) for index in gpus)


def interchangeable(state: NodeState, index: int) -> tuple[object, ...]:
    """What the engine knows of GPU `index` of a node: GPUs of one node with the same
    key are interchangeable, for fit and for every policy (which see a node only
    through these values: `fit.gpu_sets` already offers one GPU per such class of a
    share's candidates). O(1)."""
    gpu = state.node.gpus[index]
    return (
        gpu.model,
        gpu.memory_mib,
        gpu.nvlink,
        gpu.numa,
        gpu.healthy,
        gpu.context,
        state.free_milli[index],
        state.free_memory[index],
        state.memory_only[index],
    )


def lightest(state: NodeState, gpus: tuple[int, ...], loads: Loads) -> tuple[int, ...]:
    """`gpus` with each GPU swapped for an interchangeable one of the node where that
    lowers the set's load: per class, the least loaded of its GPUs as many as the set
    takes of it, the set's own first among equal levels (so with no loads, or equal
    ones, `gpus` itself, sorted). O(GPUs of the node log GPUs)."""
    name = state.node.name
    if name not in loads.levels or len(state.node.gpus) < 2:
        return gpus
    wanted: dict[tuple[object, ...], int] = {}
    for index in gpus:
        key = interchangeable(state, index)
        wanted[key] = wanted.get(key, 0) + 1
    pool: dict[tuple[object, ...], list[tuple[int, int, int]]] = {}
    own = set(gpus)
    for gpu in state.node.gpus:
        key = interchangeable(state, gpu.index)
        if key in wanted:
            rank = (loads.level(name, gpu.index), gpu.index not in own, gpu.index)
            pool.setdefault(key, []).append(rank)
    picked: list[int] = []
    for key, count in wanted.items():
        picked.extend(index for _, _, index in sorted(pool[key])[:count])
    return tuple(sorted(picked))


def pick(state: NodeState, choice: Choice, loads: Loads | None) -> Choice:
    """`choice` with the least loaded of its GPU sets: the policy's set and its ties
    (`Choice.tied`), each made `lightest`; the earliest among equal loads, so without
    loads the policy's own set. Same node, same scores. O(sets × GPUs log GPUs)."""
    if loads is None or state.node.name not in loads.levels:
        return choice
    best = lightest(state, choice.gpus, loads)
    best_load = loads.of(choice.node, best)
    for gpus in choice.tied:
        candidate = lightest(state, gpus, loads)
        load = loads.of(choice.node, candidate)
        if load < best_load:
            best, best_load = candidate, load
    if best == choice.gpus:
        return choice
    return Choice(choice.node, best, choice.score, base=choice.base, tied=choice.tied)


States = Callable[[str], NodeState | None]
"""A node's state by name (`Ledger.state`)."""
Place = Callable[[str], float | None]
"""A node's place in line (`Policy.place`)."""


def _lightest_of(
    tied: list[tuple[int, Choice]], loads: Loads, states: States, lined: bool
) -> list[tuple[int, Choice]]:
    """Of `tied` (position, choice: nodes whose policy scores are equal), the least
    loaded, each with its `pick`ed GPUs: with a line (`lined`: a choice's score then
    folds in its place, the earliest highest), the earliest of them, else all of them.

    Branch and bound: a node's load is at least its set size × its lightest GPU's level
    (`Loads.floors`), so nodes are looked at in the order of that bound (then place)
    and only while it could still beat the best found: O(tied) to order them + O(looked
    at × `pick`), and in a cluster of alike nodes the first one looked at is mostly the
    last."""
    size = len(tied[0][1].gpus)
    floors, neutral = loads.floors, loads.neutral
    line = [(size * floors.get(choice.node, neutral), -choice.score, at) for at, choice in tied]
    heapq.heapify(line)
    by_position = dict(tied)
    best: tuple[int, float] | None = None
    found: list[tuple[int, Choice]] = []
    while line:
        bound, later, at = heapq.heappop(line)
        if best is not None and (bound, later if lined else -math.inf) > best:
            break
        choice = by_position[at]
        state = states(choice.node)
        chosen = pick(state, choice, loads) if state is not None else choice
        rank = (loads.of(choice.node, chosen.gpus), later if lined else -math.inf)
        if best is None or rank < best:
            best, found = rank, [(at, chosen)]
        elif rank == best:
            found.append((at, chosen))
    return found[:1] if lined else found


def _raised(choice: Choice, top: float) -> Choice:
    """`choice` scored just above `top` (the best policy score, which no folded score
    exceeds): the one prioritize gives 10. O(1)."""
    return Choice(
        choice.node,
        choice.gpus,
        max(top + choosing.TIE, math.nextafter(top, math.inf)),
        base=top,
        tied=choice.tied,
    )


def tie_broken(
    found: Sequence[Choice | None], loads: Loads | None, states: States, place: Place
) -> list[Choice | None]:
    """prioritize's choices (per node, in order; None: none) with the load tie-break:
    of the nodes whose policy score ties with the best, the least loaded (its `pick`ed
    GPUs; the earliest in line among equals, or, for a policy without a line, every
    one of them) is scored just above that best score, so that it alone (they alone)
    get 10; every other choice is returned as it is, so no policy score is passed by
    another it was below. Without loads, or with one node at the best, the list as it is.

    O(n) to find the best score and its nodes + `_lightest_of` them. Nothing is kept."""
    listed = list(found)
    if loads is None:
        return listed
    top = max((choice.policy_score for choice in listed if choice is not None), default=None)
    if top is None:
        return listed
    tied = [
        (at, choice)
        for at, choice in enumerate(listed)
        if choice is not None and choice.policy_score == top
    ]
    if len(tied) < 2:
        return listed
    lined = place(tied[0][1].node) is not None
    for at, chosen in _lightest_of(tied, loads, states, lined):
        listed[at] = _raised(chosen, top)
    return listed


def choose(
    chooser: choosing.Chooser,
    request: GpuRequest,
    rng: random.Random,
    loads: Loads | None,
    names: Iterable[str] | None = None,
) -> Choice | None:
    """`chooser.choose` with the load tie-break: of the nodes whose policy score ties
    with the best, the one whose (`pick`ed) GPUs carry the lowest load; among equal
    loads the earliest in the policy's line, or, without a line, one drawn uniformly by
    `rng`. Without loads, `chooser.choose` itself. O(names, default the candidates,
    × outcome) + `_lightest_of` the tied: no per-state shortcut, each node is looked at."""
    if loads is None:
        return chooser.choose(request, rng, names)
    listed = choosing.candidates(chooser.ledger, request) if names is None else names
    found = [
        outcome
        for outcome in map(lambda name: chooser.outcome(name, request), listed)
        if type(outcome) is Choice
    ]
    if not found:
        return None
    top = max(choice.policy_score for choice in found)
    tied = [(at, choice) for at, choice in enumerate(found) if choice.policy_score == top]
    lined = chooser.policy.place(tied[0][1].node) is not None
    best = _lightest_of(tied, loads, chooser.ledger.state, lined)
    return best[0][1] if lined else best[rng.randrange(len(best))][1]
