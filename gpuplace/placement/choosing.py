"""Choosing a node and GPUs for a request across the cluster.

`evaluate` scores every node it is given with a policy (for the extender's filter
and prioritize); `choose` takes the best over the whole cluster. Exact ties between
nodes go to the node earliest in the policy's line (`Policy.place`: packing); only a
policy without a line (random) leaves them to chance, drawn uniformly as
kube-scheduler's selectHost would. A multi-GPU request whose topology is `preferred`
takes a GPU set inside one NVLink domain wherever one fits (`LINKED`), before the
policy's scores. `evaluate` folds the line into its scores, and
`extender_scores` maps them onto kube-scheduler's 0-10 extender scale so that only the
policy's best node gets 10: the stock scheduler then binds the node the policy chose.

Never does I/O, reads a clock or logs (see the package docstring).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import filterfalse
from typing import Protocol

from gpuplace.placement import fit
from gpuplace.placement.inventory import NO_NVLINK
from gpuplace.placement.ledger import Grant, Ledger, NodeState
from gpuplace.placement.requests import WHOLE, GpuRequest, Topology

MAX_EXTENDER_SCORE = 10


class Policy(Protocol):
    """Scores one candidate GPU set on one node; higher is better."""

    name: str

    def score(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float: ...

    def prefer(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        """Ranks GPU sets of equal score on one node; ties go to the first set."""
        ...

    def place(self, name: str) -> float | None:
        """The node's place in line, 0 first, below 1: breaks exact ties between nodes.
        None: no preference, ties are broken uniformly at random."""
        ...


@dataclass(frozen=True, slots=True)
class Choice:
    node: str
    gpus: tuple[int, ...]
    score: float
    """The policy's score, with the node's place in line folded in where the chooser
    has one (`Chooser.evaluate`)."""
    base: float | None = field(default=None, compare=False)
    """The policy's own score before the place in line was folded in (None: `score` is
    it). Exact: `gpuplace.placement.load_ties` finds the nodes whose policy scores tie with it."""
    tied: tuple[tuple[int, ...], ...] = field(default=(), compare=False)
    """Other GPU sets of the node that tie exactly with `gpus` on the policy's score and
    preference, in the order tried (only from a Chooser built with `ties`; the load
    tie-break of `gpuplace.placement.load_ties` picks among them)."""

    @property
    def policy_score(self) -> float:
        """The policy's own score of this choice, without the place in line. O(1)."""
        return self.score if self.base is None else self.base


@dataclass(slots=True)
class Evaluation:
    """Per node: the best choice where the request fits, the reason where it does not."""

    choices: dict[str, Choice] = field(default_factory=dict)
    misfits: dict[str, fit.Misfit] = field(default_factory=dict)
    top: Callable[[], list[str] | None] | None = field(default=None, compare=False)
    """On a shared evaluation (`Chooser.evaluate(shared=True)`): the names of its
    choices at the highest score, from a heap kept with it (O(log nodes) per node scored
    since, not a pass over every choice), or None where more than `TOP_TIES` tie.
    Valid, like the evaluation, while the ledger's generation is unchanged."""

    def known(self, names: Iterable[str]) -> int:
        """How many of `names` have a choice or a misfit: choices and misfits are
        disjoint, so all of `names` (unique) are known iff this is their number.
        O(names) lookups in C, no set built."""
        listed = names if isinstance(names, list | tuple) else list(names)
        choices, misfits = self.choices, self.misfits
        return sum(map(choices.__contains__, listed)) + sum(map(misfits.__contains__, listed))

    def best(self) -> list[Choice]:
        """Choices with the highest score. O(choices)."""
        if not self.choices:
            return []
        top = max(choice.score for choice in self.choices.values())
        return [choice for choice in self.choices.values() if choice.score == top]


def best_on(
    state: NodeState, request: GpuRequest, policy: Policy, *, ties: bool = False
) -> Choice | fit.Misfit:
    """The policy's best GPU set on one node, or why none fits; with `ties`, the other
    sets that tie with it exactly on score and preference too (`Choice.tied`).
    O(GPU sets × score)."""
    reason = fit.static_misfit(state, request) or fit.host_misfit(state, request)
    if reason is not None:
        return reason
    best: tuple[float, float, tuple[int, ...]] | None = None
    tied: list[tuple[int, ...]] = []
    for gpus in fit.gpu_sets(state, request):
        rank = (scored(policy, state, request, gpus), policy.prefer(state, request, gpus), gpus)
        if best is None or rank[:2] > best[:2]:
            best = rank
            tied.clear()
        elif ties and rank[:2] == best[:2]:
            tied.append(gpus)
    if best is None:
        return fit.dynamic_misfit(state, request)
    if tied:
        return Choice(state.node.name, best[2], best[0], tied=tuple(tied))
    return Choice(state.node.name, best[2], best[0])


LINKED = 1e7
"""Added to the policy's score of a GPU set inside one NVLink domain when a multi-GPU
request's topology is `preferred` (the annotation's default for several GPUs): such a
set beats, on any node, every set that spans domains or has no NVLink, and the policy
orders the sets of each kind among themselves. Far above any policy's scores (at most
about 1e5 in magnitude) and far below a float's limits, so the place in line (`TIE`)
still tells nodes apart."""


def linked(state: NodeState, gpus: tuple[int, ...]) -> bool:
    """Whether `gpus` all lie in one NVLink domain of the node. O(len(gpus))."""
    node_gpus = state.node.gpus
    domain = node_gpus[gpus[0]].nvlink
    return domain != NO_NVLINK and all(node_gpus[i].nvlink == domain for i in gpus)


def scored(policy: Policy, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
    """The policy's score of `gpus` on the node, plus `LINKED` where the request prefers
    NVLink and gets it. O(policy.score)."""
    score = policy.score(state, request, gpus)
    if request.count > 1 and request.topology is Topology.PREFERRED and linked(state, gpus):
        score += LINKED
    return score


def scoring_shape(request: GpuRequest) -> GpuRequest:
    """The request without its host memory: that only decides whether a node fits,
    never a score or the GPUs, so requests differing only in it share their scores. O(1)."""
    return replace(request, host_memory_mib=0) if request.host_memory_mib else request


def candidates(ledger: Ledger, request: GpuRequest) -> Iterable[str]:
    """Node names worth trying: with an allowed model when models are named. O(1)."""
    if request.count and request.models:
        names: dict[str, None] = {}
        for model in sorted(request.models):
            names.update(dict.fromkeys(ledger.inventory.nodes_with_model(model)))
        return names.keys()
    return ledger.inventory.names()


Outcome = Choice | fit.Misfit
UNKNOWN = fit.Misfit(fit.MisfitKind.UNKNOWN_NODE, "not a gpuplace node")
ID_LIMIT = 1 << 14
"""Distinct requests remembered before the cache starts over (bounds a long-running sidecar)."""
EVALUATIONS_KEPT = 128
"""Scoring shapes whose evaluation `evaluate` keeps for incremental reuse (the least
recently used is dropped first)."""
TOP_TIES = 64
"""`Evaluation.top` names at most this many nodes tied at the best score; beyond, the
caller scans (a policy without a line of nodes, e.g. `random`, ties them all)."""
TIE = 1e-6
"""Weight of a node's place in line in `evaluate`'s scores: far below any real difference."""

GroupKey = tuple[object, ...]
_BEFORE_MEMORY = fit.UNRESOLVABLE | {fit.MisfitKind.PODS, fit.MisfitKind.CPU, fit.MisfitKind.MEMORY}
"""Misfit kinds `fit.misfit` reports before (or as) a lack of host memory."""


class _Kept:
    """An evaluation kept for a scoring shape, current as of (`epoch`, `cursor`) of the
    ledger's change log, and the cluster's nodes it lacks (`missing`: every node not
    scored since it was last changed, perhaps with nodes since removed)."""

    __slots__ = ("cursor", "epoch", "evaluation", "heap", "missing")

    def __init__(self, epoch: int, cursor: int, nodes: Iterable[str]) -> None:
        self.epoch = epoch
        self.cursor = cursor
        self.evaluation = Evaluation()
        self.missing = set(nodes)
        self.heap: list[tuple[float, str]] = []
        """(-score, name) of the choices, pushed as each node is scored (in the warmer's
        slices, for the shapes it keeps current), with stale entries (nodes re-scored
        or gone) left in until they reach the top (`Chooser._top`). ~90 bytes a node."""


class _MemoryIndex:
    """Nodes sorted by free host memory, kept up to date from the ledger's change log:
    which nodes have less than some amount free, in O(log nodes + their number)."""

    __slots__ = ("_cursor", "_epoch", "_of", "_sorted")

    def __init__(self) -> None:
        self._epoch = -1
        self._cursor = 0
        self._of: dict[str, int] = {}
        self._sorted: list[tuple[int, str]] = []

    def below(self, ledger: Ledger, memory_mib: int) -> list[str]:
        """Nodes with less than `memory_mib` free (none for 0, without a look)."""
        if memory_mib <= 0:
            return []
        self.update(ledger)
        end = bisect.bisect_left(self._sorted, (memory_mib, ""))
        return [name for _, name in self._sorted[:end]]

    def update(self, ledger: Ledger) -> None:
        """Catch up with the ledger: O(changed × nodes) memmoves, O(nodes log nodes)
        when built (first use, or too far behind the change log)."""
        epoch, cursor, changed = ledger.changes(self._epoch, self._cursor)
        if changed is None:
            self._of = {state.node.name: state.memory for state in ledger.states()}
            self._sorted = sorted((memory, name) for name, memory in self._of.items())
        else:
            for name in dict.fromkeys(changed):
                old = self._of.pop(name, None)
                if old is not None:
                    del self._sorted[bisect.bisect_left(self._sorted, (old, name))]
                state = ledger.state(name)
                if state is not None:
                    self._of[name] = state.memory
                    bisect.insort(self._sorted, (state.memory, name))
        self._epoch, self._cursor = epoch, cursor


class _Group:
    """Nodes in the same state: same shape, same free CPU, memory and GPU shares.

    Keeps what a quick feasibility check needs, and the policy's outcome per request.
    """

    __slots__ = ("cpu", "heap", "max_free", "members", "memory", "outcomes", "whole_free")

    def __init__(self, state: NodeState) -> None:
        self.members: dict[str, None] = {}
        self.heap: list[tuple[float, str]] = []
        self.outcomes: dict[int, Outcome] = {}
        self.cpu = state.cpu if state.pods > 0 else -1
        self.memory = state.memory
        self.max_free = max(state.free_milli, default=0)
        self.whole_free = sum(1 for left in state.free_milli if left >= WHOLE)

    def may_fit(self, request: GpuRequest) -> bool:
        """False when the request surely does not fit (CPU, memory, GPU shares). O(1)."""
        if request.cpu_milli > self.cpu or request.host_memory_mib > self.memory:
            return False
        if request.count == 0:
            return True
        if request.count == 1 and request.milli < WHOLE:
            return self.max_free >= request.milli
        return self.whole_free >= request.count


class Chooser:
    """Evaluates requests on a ledger with one policy, with two caches.

    Per node: a node's outcomes stay valid until its ledger `version` changes, so
    `evaluate` over given names re-scores only nodes that changed: O(names) lookups
    plus O(changed × GPU sets × score). Per state: nodes in the same state (same
    shape, free CPU, memory and GPU shares) score alike, so `choose` over the whole
    cluster scores one node per distinct state, tracked incrementally from the
    ledger's change log: O(changed nodes + distinct states) per decision, not
    O(nodes). Call `reset` when the policy's inputs change (a new typical workload).

    With `ties`, each node's choice also lists the GPU sets tied with it
    (`Choice.tied`) for the load tie-break (`gpuplace.placement.load_ties`), which is applied to the
    cached choices when read, never inside them: measured load changes no cached
    outcome, so a new measurement makes nothing here stale.
    """

    __slots__ = (
        "_by_free",
        "_by_whole",
        "_cache",
        "_cursor",
        "_epoch",
        "_evaluations",
        "_every",
        "_free_values",
        "_groups",
        "_ids",
        "_keys",
        "_memory",
        "_names",
        "_shapes",
        "ledger",
        "policy",
        "ties",
    )

    def __init__(self, ledger: Ledger, policy: Policy, *, ties: bool = False) -> None:
        self.ledger = ledger
        self.policy = policy
        self.ties = ties
        self._ids: dict[GpuRequest, int] = {}
        self._cache: dict[str, tuple[int, dict[int, Outcome]]] = {}
        self._groups: dict[GroupKey, _Group] = {}
        self._by_free: dict[int, dict[GroupKey, _Group]] = {}
        self._free_values: list[int] = []
        self._by_whole: dict[int, dict[GroupKey, _Group]] = {}
        self._keys: dict[str, GroupKey] = {}
        self._shapes: dict[str, tuple[object, tuple[object, ...], bool]] = {}
        self._epoch = -1
        self._cursor = 0
        self._evaluations: dict[int, _Kept] = {}
        """Per scoring shape, its evaluation so far (see `evaluate`)."""
        self._memory = _MemoryIndex()
        self._names: dict[str, str] = {}
        """Each known node's name as a str object of the chooser's own, the key of its
        entries in every kept evaluation (see `_own_names`)."""
        self._every: tuple[int, list[str]] | None = None
        """`every_name()`'s list, as of the inventory's `membership` count."""

    def reset(self) -> None:
        self._ids.clear()
        self._cache.clear()
        self._evaluations.clear()
        for group in self._groups.values():
            group.outcomes.clear()

    def _id(self, request: GpuRequest) -> int:
        rid = self._ids.get(request)
        if rid is None:
            if len(self._ids) >= ID_LIMIT:
                self.reset()
            rid = self._ids[request] = len(self._ids)
        return rid

    # --- per node ------------------------------------------------------------

    def outcome(self, name: str, request: GpuRequest) -> Outcome:
        """The best choice on one node, or why it does not fit. O(1) when cached."""
        return self._outcome(name, request, self._id(request))

    def _outcome(self, name: str, request: GpuRequest, rid: int) -> Outcome:
        state = self.ledger.state(name)
        if state is None:
            return UNKNOWN
        entry = self._cache.get(name)
        if entry is None or entry[0] != state.version:
            entry = (state.version, {})
            self._cache[name] = entry
        found = entry[1].get(rid)
        if found is None:
            found = best_on(state, request, self.policy, ties=self.ties)
            if type(found) is Choice:
                position = self.policy.place(name)
                if position is not None:
                    found = Choice(
                        found.node,
                        found.gpus,
                        found.score - TIE * position,
                        base=found.score,
                        tied=found.tied,
                    )
            entry[1][rid] = found
        return found

    def evaluate(
        self, request: GpuRequest, names: Iterable[str] | None = None, *, shared: bool = False
    ) -> Evaluation:
        """Every node of `names` (default: the candidates): choice or misfit.

        A choice's score includes the policy's place in line (× `TIE`), so that
        where the policy has one, exactly one node has the highest score. Returns a
        fresh object, exactly `names`' nodes.

        With `shared`, the result may instead hold the kept evaluation's own dicts
        (no copy: O(1), where a copy is O(nodes) and, at 10,000 nodes, ~0.2 MB per
        result kept): read only, valid while the ledger's `generation` is unchanged,
        and possibly with entries for nodes not named. A request whose host memory
        some node lacks gets a fresh object as without `shared`.

        Incremental: per *scoring shape* (the request without its host memory, which
        only decides fit, never a score or the GPUs) the evaluation of every node seen
        so far is kept and brought up to date from the ledger's change log, so a call
        costs O(names) set and dict operations plus O(changed or unseen nodes × GPU
        sets × score). Nodes short of the request's host memory are then found in a
        sorted index, O(log nodes + their number). `prepare` fills the kept
        evaluation ahead of requests.

        `names` may be `every_name()` itself (kube-scheduler sent every node):
        the nodes the kept evaluation lacks are then those it misses, with no lookup
        per name: O(changed or unseen nodes) before scoring them.
        """
        inventory = self.ledger.inventory
        every = self._every
        if every is not None and (names is not every[1] or every[0] != inventory.membership):
            every = None
        if every is not None:
            listed = every[1]
        else:
            listed = list(candidates(self.ledger, request) if names is None else names)
        shaped = scoring_shape(request)
        kept = self._kept(shaped)
        choices, misfits = kept.evaluation.choices, kept.evaluation.misfits
        if every is not None:
            # Every node is in the kept evaluation or among its missing ones (`_kept`).
            lacking = sorted(name for name in kept.missing if name in inventory)
        else:
            # The names it lacks, found in C (a Python loop over 10,000 names costs
            # more than scoring the few nodes that changed since the last call).
            lacking = list(
                filterfalse(misfits.__contains__, filterfalse(choices.__contains__, listed))
            )
        if lacking:
            self._fill(kept, shaped, lacking)
        short = self._memory.below(self.ledger, request.host_memory_mib)
        if shared and not short:
            return Evaluation(choices, misfits, top=partial(self._top, kept))
        if len(listed) == len(choices) + len(misfits):  # (names are unique, as the scheduler's)
            result = Evaluation(dict(choices), dict(misfits))
        else:
            result = Evaluation()
            for name in listed:
                found = choices.get(name)
                if found is not None:
                    result.choices[name] = found
                else:
                    result.misfits[name] = misfits[name]
        if short:
            self._short_of_memory(result, request, short)
        return result

    def prepare(self, request: GpuRequest, names: Iterable[str]) -> int:
        """Evaluate `names` for `request`'s scoring shape ahead of `evaluate`, so that
        its first call finds them done. Returns how many nodes were scored now (0: all
        were current). O(names + scored × GPU sets × score)."""
        shaped = scoring_shape(request)
        return self._fill(self._kept(shaped), shaped, names)

    def _fill(self, kept: _Kept, shaped: GpuRequest, names: Iterable[str]) -> int:
        """Score the nodes of `names` that `kept` (current) lacks; how many it scored."""
        evaluation, missing, heap = kept.evaluation, kept.missing, kept.heap
        choices, misfits = evaluation.choices, evaluation.misfits
        rid = self._id(shaped)
        scored = 0
        for name in names:
            if name not in choices and name not in misfits:
                own, found = self._record(evaluation, name, shaped, rid)
                if type(found) is Choice:
                    heapq.heappush(heap, (-found.score, own))
                missing.discard(name)
                scored += 1
        if len(heap) > 2 * len(choices) + 1024:  # stale entries over half: O(choices),
            self._reheap(kept)  # after at least that many pushes
        return scored

    @staticmethod
    def _reheap(kept: _Kept) -> list[tuple[float, str]]:
        """`kept`'s heap rebuilt from its choices alone. O(choices)."""
        heap = kept.heap = [(-c.score, name) for name, c in kept.evaluation.choices.items()]
        heapq.heapify(heap)
        return heap

    def _top(self, kept: _Kept) -> list[str] | None:
        """`Evaluation.top` of `kept` (current): its choices at the highest score, or
        None where more than `TOP_TIES` tie (the caller scans them). O(log choices) per
        stale entry that surfaces (dropped) and per tied node; rebuilt, O(choices), when
        stale entries are over half of the heap."""
        choices = kept.evaluation.choices
        heap = kept.heap
        if len(heap) > 2 * len(choices) + 1024:
            heap = self._reheap(kept)
        while heap:
            negated, name = heap[0]
            found = choices.get(name)
            if found is not None and -found.score == negated:
                break
            heapq.heappop(heap)
        if not heap:
            return []
        best = heap[0][0]
        tied: list[str] = []
        while heap and heap[0][0] == best and len(tied) <= TOP_TIES:
            _, name = heapq.heappop(heap)
            found = choices.get(name)
            if found is not None and -found.score == best and name not in tied:
                tied.append(name)
        for name in tied:  # the current ones go back; stale ones and repeats do not
            heapq.heappush(heap, (best, name))
        return tied if len(tied) <= TOP_TIES else None

    def prepare_memory(self) -> None:
        """Bring the index of free host memory up to date ahead of `evaluate` (built on
        first use otherwise: ~8 ms at 10,000 nodes, inside a filter). O(changes), or
        O(nodes log nodes) the first time."""
        self._memory.update(self.ledger)

    def missing(self, request: GpuRequest) -> list[str]:
        """The cluster's nodes that `evaluate` would still have to score for `request`'s
        scoring shape (what the warmer `prepare`s), sorted. O(changes since the last
        look + missing × log missing): no pass over every node."""
        return sorted(self._kept(scoring_shape(request)).missing)

    def unseen(self, request: GpuRequest, names: Iterable[str]) -> set[str]:
        """The nodes of `names` that `evaluate` would still have to score for `request`
        (what `prepare` would do). O(names) set operations."""
        shaped = scoring_shape(request)
        kept = self._kept(shaped).evaluation
        wanted: set[str] | frozenset[str] = (
            names if isinstance(names, set | frozenset) else set(names)
        )
        return set(wanted.difference(kept.choices, kept.misfits))

    def _kept(self, shaped: GpuRequest) -> _Kept:
        """The kept evaluation of a scoring shape, without the nodes changed since it was
        last brought up to date. O(changes).

        At most `EVALUATIONS_KEPT` are kept; the least recently used goes first, so
        shapes seen once never push out the ones the warmer keeps current (each worth a
        pass over every node)."""
        rid = self._id(shaped)
        evaluations = self._evaluations
        kept = evaluations.pop(rid, None)
        if kept is None:
            if len(evaluations) >= EVALUATIONS_KEPT:
                evaluations.pop(next(iter(evaluations)))
            epoch, cursor, _ = self.ledger.changes(-1, 0)
            kept = _Kept(epoch, cursor, self._own_names())
        evaluations[rid] = kept  # the most recently used last
        epoch, cursor, changed = self.ledger.changes(kept.epoch, kept.cursor)
        if changed is None:
            kept.evaluation = Evaluation()
            kept.missing = set(self._own_names())
            kept.heap = []
        else:
            # Changed nodes are dropped, not re-scored here: the caller scores what is
            # missing (`evaluate` at once, the warmer in slices).
            choices, misfits = kept.evaluation.choices, kept.evaluation.misfits
            for name in changed:
                choices.pop(name, None)
                misfits.pop(name, None)
            kept.missing.update(changed)
        kept.epoch, kept.cursor = epoch, cursor
        return kept

    def _short_of_memory(self, result: Evaluation, request: GpuRequest, short: list[str]) -> None:
        """Nodes of `result` among `short` (less memory free than the request's): a
        MEMORY misfit unless a reason `fit.misfit` checks first applies (static, pods,
        CPU)."""
        for name in short:
            found = result.choices.pop(name, None)
            if found is None:
                misfit = result.misfits.get(name)
                if misfit is None or misfit.kind in _BEFORE_MEMORY:
                    continue
            state = self.ledger.state(name)
            if state is None:
                continue
            reason = fit.host_misfit(state, request)
            if reason is not None:
                result.misfits[name] = reason

    def every_name(self) -> list[str]:
        """Every node's name, as the chooser's own copies in one list: the same list
        object while no node was added or removed, so that `evaluate` given this very
        list knows by identity that it names every node (the extender's filter hands it
        over when kube-scheduler named every node: `gpuplace.extender.node_names`). Read
        only. O(1) while no node was added or removed, else O(nodes) to build."""
        membership = self.ledger.inventory.membership
        every = self._every
        if every is None or every[0] != membership:
            every = self._every = (membership, self._own_names())
        return every[1]

    def _own_names(self) -> list[str]:
        """Every node's name as the chooser's own str object (`_names`). O(nodes); the
        first call copies them all, one after another.

        filter looks up ~10,000 names, freshly parsed, in a kept evaluation; each lookup
        compares the name with the key it finds, so it reads that key's characters, and
        filter's answer is written from those keys. The names as the API sent them lie
        far apart on a large heap, among everything else parsed with them; copies made
        one after another mostly lie side by side. In the sidecar at 10,000 nodes (300
        filters, two runs each way) `evaluate` took 1.43-1.56 ms at the median with the
        copies, 1.62-1.74 without; encoding the answer 0.41-0.44 against 0.45-0.51."""
        names = self._names
        if len(names) > 2 * len(self.ledger.inventory) + 1024:
            names.clear()  # nodes removed over time; keys already kept stay valid
        get = names.get
        return [get(name) or self._own(name) for name in self.ledger.inventory.names()]

    def _own(self, name: str) -> str:
        """A copy of `name` (an equal str, another object) kept as its own. O(len(name))."""
        own = self._names[name] = name.encode("utf-8", "surrogatepass").decode(
            "utf-8", "surrogatepass"
        )
        return own

    def _record(
        self, evaluation: Evaluation, name: str, request: GpuRequest, rid: int
    ) -> tuple[str, Choice | fit.Misfit]:
        """Score `name` into `evaluation`; the name as kept and what it got."""
        found = self._outcome(name, request, rid)
        own = self._names.get(name)
        if own is not None:
            name = own
        elif found is not UNKNOWN:
            name = self._own(name)  # a node added since the kept evaluation was made
        if type(found) is Choice:
            evaluation.choices[name] = found
        else:
            evaluation.misfits[name] = found  # type: ignore[assignment]
        return name, found

    # --- per state -------------------------------------------------------------

    def _shape(self, state: NodeState) -> tuple[object, bool]:
        node = state.node
        known = self._shapes.get(node.name)
        if known is None or known[1] is not node.gpus:
            shape = tuple(
                (gpu.model, gpu.memory_mib, gpu.nvlink, gpu.numa, gpu.healthy, gpu.context)
                for gpu in node.gpus
            )
            linked = any(gpu.nvlink != -1 for gpu in node.gpus)
            known = self._shapes[node.name] = (shape, node.gpus, linked)
        return known[0], known[2]

    def _key(self, state: NodeState) -> GroupKey:
        shape, linked = self._shape(state)
        # memory_only: a memory-only share may join a GPU with 0 compute free only when
        # memory-only shares hold it, so nodes that differ there are not alike.
        gpus = zip(state.free_milli, state.free_memory, state.memory_only, strict=True)
        frees = tuple(gpus) if linked else tuple(sorted(gpus))
        return (shape, state.node.closed, state.cpu, state.memory, state.pods > 0, frees)

    def _sync(self) -> None:
        epoch, cursor, changed = self.ledger.changes(self._epoch, self._cursor)
        if changed is None:
            self._groups.clear()
            self._by_free.clear()
            self._free_values.clear()
            self._by_whole.clear()
            self._keys.clear()
            changed = list(self.ledger.inventory.names())
        self._epoch, self._cursor = epoch, cursor
        place = self.policy.place
        for name in dict.fromkeys(changed):
            old = self._keys.pop(name, None)
            if old is not None:
                group = self._groups.get(old)
                if group is not None:
                    group.members.pop(name, None)
                    if not group.members:
                        self._drop(old, group)
            state = self.ledger.state(name)
            if state is None:
                self._shapes.pop(name, None)
                continue
            key = self._key(state)
            self._keys[name] = key
            group = self._groups.get(key)
            if group is None:
                group = self._add(key, state)
            group.members[name] = None
            position = place(name)
            if position is not None:
                heapq.heappush(group.heap, (position, name))

    def _add(self, key: GroupKey, state: NodeState) -> _Group:
        group = self._groups[key] = _Group(state)
        bucket = self._by_free.get(group.max_free)
        if bucket is None:
            bucket = self._by_free[group.max_free] = {}
            bisect.insort(self._free_values, group.max_free)
        bucket[key] = group
        self._by_whole.setdefault(group.whole_free, {})[key] = group
        return group

    def _drop(self, key: GroupKey, group: _Group) -> None:
        del self._groups[key]
        bucket = self._by_free[group.max_free]
        del bucket[key]
        if not bucket:
            del self._by_free[group.max_free]
            del self._free_values[bisect.bisect_left(self._free_values, group.max_free)]
        whole = self._by_whole[group.whole_free]
        del whole[key]
        if not whole:
            del self._by_whole[group.whole_free]

    def _groups_for(self, request: GpuRequest) -> Iterator[tuple[GroupKey, _Group]]:
        """Groups that have the GPU shares the request needs. O(their number)."""
        if request.count == 0:
            yield from self._groups.items()
        elif request.count == 1 and request.milli < WHOLE:
            values = self._free_values
            for position in range(len(values) - 1, -1, -1):
                if values[position] < request.milli:
                    break
                yield from self._by_free[values[position]].items()
        else:
            for whole, bucket in self._by_whole.items():
                if whole >= request.count:
                    yield from bucket.items()

    def _first(self, key: GroupKey, group: _Group) -> tuple[float, str]:
        """The member earliest in line (lazy heap: drops members that left). O(log n)."""
        heap = group.heap
        while heap and self._keys.get(heap[0][1]) != key:
            heapq.heappop(heap)
        if len(heap) > 4 * len(group.members) + 16:
            place = self.policy.place
            group.heap = heap = [(place(name) or 0.0, name) for name in group.members]
            heapq.heapify(heap)
        return heap[0]

    def choose(
        self, request: GpuRequest, rng: random.Random, names: Iterable[str] | None = None
    ) -> Choice | None:
        """The policy's choice: the highest score; among equals the node earliest in
        the policy's line, or, without one, uniformly at random by `rng`.

        Without `names`: O(changed nodes + distinct node states). With `names`:
        O(names).
        """
        rid = self._id(request)
        if names is not None:
            top = self._best_of(names, request, rid)
        else:
            top = self._best_of_groups(request, rid, rng)
        if not top:
            return None
        if len(top) == 1:
            return top[0]
        place = self.policy.place
        if place(top[0].node) is not None:
            return min(top, key=lambda choice: place(choice.node) or 0.0)
        return top[rng.randrange(len(top))]

    def _best_of(self, names: Iterable[str], request: GpuRequest, rid: int) -> list[Choice]:
        top: list[Choice] = []
        top_score = 0.0
        for name in names:
            found = self._outcome(name, request, rid)
            if type(found) is not Choice:
                continue
            if not top or found.score > top_score:
                top = [found]
                top_score = found.score
            elif found.score == top_score:
                top.append(found)
        return top

    def _best_of_groups(self, request: GpuRequest, rid: int, rng: random.Random) -> list[Choice]:
        self._sync()
        # Host memory only decides whether a node fits (`may_fit` checks it), never the
        # score or the GPUs: requests differing only in it share their scores.
        shaped = scoring_shape(request)
        shape = self._id(shaped)
        models = request.models if request.count else frozenset()
        best_score = 0.0
        best: list[tuple[GroupKey, _Group]] = []
        for key, group in self._groups_for(request):
            if not group.may_fit(request):
                continue
            found = group.outcomes.get(shape)
            if found is None:
                name = next(iter(group.members))
                state = self.ledger.state(name)
                if state is None:
                    continue
                if models and not any(gpu.model in models for gpu in state.node.gpus):
                    found = UNKNOWN
                else:
                    found = best_on(state, shaped, self.policy)
                group.outcomes[shape] = found
            if type(found) is not Choice:
                continue
            if not best or found.score > best_score:
                best = [(key, group)]
                best_score = found.score
            elif found.score == best_score:
                best.append((key, group))
        if not best:
            return []
        place = self.policy.place
        probe = next(iter(best[0][1].members))
        if place(probe) is not None:
            first = min(self._first(key, group) for key, group in best)
            name = first[1]
        else:
            total = sum(len(group.members) for _, group in best)
            pick = rng.randrange(total)
            for _, group in best:
                if pick < len(group.members):
                    name = list(group.members)[pick]
                    break
                pick -= len(group.members)
        found = self._outcome(name, request, rid)
        return [found] if isinstance(found, Choice) else []


def evaluate(
    ledger: Ledger,
    request: GpuRequest,
    policy: Policy,
    names: Iterable[str] | None = None,
) -> Evaluation:
    """Score `names` (default: every candidate node), uncached. O(nodes × GPU sets × score)."""
    return Chooser(ledger, policy).evaluate(request, names)


def choose(
    ledger: Ledger,
    request: GpuRequest,
    policy: Policy,
    rng: random.Random,
    names: Iterable[str] | None = None,
) -> Choice | None:
    """The policy's choice, exact ties broken uniformly by `rng`, uncached. O(evaluate)."""
    return Chooser(ledger, policy).choose(request, rng, names)


def extender_scores(evaluation: Evaluation) -> dict[str, int]:
    """Policy scores on kube-scheduler's 0-10 scale; 10 only for the best. O(n).

    The others are spread linearly over 0-9 between the lowest score and the best,
    so that even with the scheduler's own scores added the policy's order among
    them survives as far as integers allow.
    """
    names = list(evaluation.choices)
    return dict(zip(names, ranked(names, evaluation.choices), strict=True))


def ranked(names: Sequence[str], choices: Mapping[str, Choice]) -> list[int]:
    """The 0-10 score of each of `names`, in their order, as `extender_scores` scales
    them; 0 for a name without a choice. O(n)."""
    return ranked_found(list(map(choices.get, names)))


def ranked_found(found: Sequence[Choice | None]) -> list[int]:
    """The 0-10 score of each node given its choice, in order (None: no choice, 0), as
    `extender_scores` scales them. One pass to find the range, one to scale. O(n)."""
    values = [choice.score for choice in found if choice is not None]
    if not values:
        return [0] * len(found)
    top, low, scale = _scale(values)
    ten = MAX_EXTENDER_SCORE
    if not scale:  # all ties, or a span that cannot be scaled: the best alone scores
        return [ten if choice is not None and choice.score == top else 0 for choice in found]
    return [
        0 if choice is None else ten if choice.score == top else int(scale * (choice.score - low))
        for choice in found
    ]


def _scale(values: list[float]) -> tuple[float, float, float]:
    """(top, low, scale) of non-empty scores: a score below the top maps to
    int(scale × (score - low)), at most 9 since (score - low) / span < 1. 0 when every
    score is the top, or the span cannot be scaled (too small to divide by, or beyond
    the floats): only the top scores then. O(n)."""
    top = max(values)
    low = min(values)
    span = top - low
    scale = (MAX_EXTENDER_SCORE - 1) / span if top > low else 0.0
    return top, low, scale if math.isfinite(span) and math.isfinite(scale) else 0.0


def grant_for(pod_uid: str, choice: Choice, request: GpuRequest) -> Grant:
    """The grant that realises `choice` for a pod. O(1)."""
    return Grant(
        pod_uid=pod_uid,
        node=choice.node,
        gpus=choice.gpus,
        milli=request.milli,
        memory_mib=request.memory_mib,
        cpu_milli=request.cpu_milli,
        host_memory_mib=request.host_memory_mib,
    )
