"""filter and prioritize: which nodes fit a pod, and how the policy ranks them.

`filter` passes only the policy's best nodes of those the pod fits (usually one: the
default policy breaks exact ties itself), and fails the nodes it does not fit, with
why. kube-scheduler then has nothing left to choose: with one node passed it skips its
scoring altogether (`schedulePod`: "When only one node after predicate, just use it")
and calls no `prioritize`; with several (a policy's tie) its own plugin scores pick
among them. The shipped profile therefore has no `prioritizeVerb`: that is one HTTP
round trip a pod less, and no scoring of every feasible node, where most of the
gpuplace profile's scheduling cycle went at 1,000 nodes (docs/performance.md).

`prioritize` stays for a profile that still names it (an older KubeSchedulerConfiguration):
10 for the policy's best nodes, the others spread over 0-9 by rank
(`choosing.extender_scores`); with the extender's weight (100,000 per point) the node
kube-scheduler binds is then one the policy chose, as filter's narrowing makes it.
The fitting nodes filter leaves out are not failed: nothing is wrong with them, the
pod is bound elsewhere; they appear in neither list of the answer.

A pod that already holds a grant (a reservation: a bind that wrote its assignment but
not yet its Binding, or a gang plan) is offered only that grant's node, and every
other node is unresolvable for it, so preemption does not try them either. The planner's
hold (`gpuplace.planning`, plan then pin) is a preference, not a reservation: when
kube-scheduler does not offer its node (it tried that nominated node first and its own
filters refused it) or the node's GPUs filled meanwhile, filter drops it and chooses
again among the nodes offered, as for any pod (a stale plan planned again, never a pod
held to a node it cannot use).

The evaluation made for a pod's `filter` is kept (by pod UID) and reused by its
`prioritize` when neither the ledger nor the policy changed in between; otherwise the
policy's per-node cache (`choosing.Chooser`) re-scores only the nodes that changed.
Evaluations are the engine's own (`evaluate(shared=True)`): read only, and only at the
ledger generation they were made at, which every reuse checks. Synchronous: no await
between reading the ledger and answering.

With measured loads (`--load-aware`: `loads`, an `gpuplace.extender.load_polling.LoadBoard`), of the
nodes that tie at the policy's best score the least loaded alone gets 10 in
prioritize, and bind takes the least loaded of the GPU sets the policy scores alike
(`gpuplace.placement.load_ties`). That is applied to the evaluations when they are read, never
stored in them: the evaluations and kept answers (which no node passed) do not depend on
loads; filter's choice among the best does.
"""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster import grammar, pods, syncing
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender import node_names, reasons
from gpuplace.extender.load_polling import LoadBoard
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement import choosing, fit, load_ties
from gpuplace.placement.choosing import Choice
from gpuplace.placement.fences import Fences
from gpuplace.placement.ledger import Grant
from gpuplace.placement.requests import GpuRequest

CACHE_SIZE = 64
"""Pods whose filter evaluation is kept for their prioritize (which kube-scheduler
calls right after that pod's filter). Most share the engine's kept evaluation, but one
for a request some node lacks host memory for is a copy: ~0.2 MB at 10,000 nodes."""


_SCORE = operator.attrgetter("score")


def _at_top(names: Iterable[str], scores: list[float]) -> list[str]:
    """The `names` whose score (`scores`, in the same order; not empty) is the highest,
    in their order. max/count/index/compress in C, no Python frame per node (a
    comprehension over 1,000 nodes took most of filter's time). O(n)."""
    top = max(scores)
    if scores.count(top) == 1:
        return [next(itertools.islice(names, scores.index(top), None))]
    return list(itertools.compress(names, map(top.__eq__, scores)))


@dataclass(slots=True)
class Verdict:
    """filter's outcome for one pod."""

    passed: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    """Why not, per node, for kube-scheduler (a gang's fence included): filled when no
    node passed, the only time it reads them."""
    unresolvable: dict[str, str] = field(default_factory=dict)
    """The same, for nodes no preemption could help; filled when no node passed."""
    misfits: dict[str, fit.Misfit] = field(default_factory=dict)
    """Per node the pod does not fit, the engine's reason (for Events and logs)."""
    request: GpuRequest | None = None
    holding: Grant | None = None
    problem: str = ""
    """Why the pod cannot be placed at all (unreadable annotations), else ""."""
    fitting: int = 0
    """How many nodes the pod fits now (and no fence holds); `passed` is the policy's
    best of them."""

    @property
    def gpu_pod(self) -> bool:
        return self.request is not None and self.request.count > 0


@dataclass(frozen=True, slots=True)
class _Entry:
    generation: int
    version: int
    request: GpuRequest
    evaluation: choosing.Evaluation
    every_choice: list[str] | None = None
    """filter's `passed` when it was every node of the evaluation's `choices`, in their
    order (`chosen_ahead` then reads the choices in order, with no lookup per name)."""


class Decider:
    """filter / prioritize over a LedgerSync with the holder's policy."""

    def __init__(
        self,
        sync: LedgerSync,
        holder: PolicyHolder,
        *,
        mode: reasons.Mode = "kind",
        cache_size: int = CACHE_SIZE,
        registry: CollectorRegistry | None = None,
        fences: Fences | None = None,
        loads: LoadBoard | None = None,
        reader: pods.Reader | None = None,
    ) -> None:
        self.sync = sync
        self.holder = holder
        self.fences = fences
        self.loads = loads
        """Measured GPU loads for the tie-break (None: off, `--load-aware` false)."""
        """Capacity holds of a starving gang: filter does not offer their nodes to others."""
        self.mode: reasons.Mode = mode
        self.cache_size = cache_size
        self.reader = reader or pods.Reader()
        """How a pod's annotations read: the process's one `pods.Reader` (the managed-pod
        informer's, `Mirror.reader`: one memo of parsed requests per process), or its own."""
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self.stale_plans = Counter(
            "gpuplace_extender_stale_plans_total",
            "Pods whose planned node (the planner's hold) kube-scheduler did not offer, or "
            "that filled meanwhile: filter dropped the plan and chose again.",
            registry=registry,
        )
        self.cache_lookups = Counter(
            "gpuplace_evaluation_cache_total",
            "prioritize calls that reused filter's evaluation (hit) or scored again (miss).",
            ["result"],
            registry=registry,
        )

    # --- helpers -------------------------------------------------------------------

    def request(self, pod: Mapping[str, Any]) -> GpuRequest | None:
        """The pod's GPU request (None: not a GPU pod). Raises `AnnotationError`."""
        request = self.reader.request(pod)
        return request if request is not None and request.count > 0 else None

    def _remember(
        self,
        uid: str,
        request: GpuRequest,
        evaluation: choosing.Evaluation,
        every_choice: list[str] | None = None,
    ) -> None:
        self._cache[uid] = _Entry(
            self.sync.ledger.generation, self.holder.version, request, evaluation, every_choice
        )
        self._cache.move_to_end(uid)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def forget(self, uid: str) -> None:
        self._cache.pop(uid, None)

    def _evaluate(
        self, uid: str, request: GpuRequest, names: Sequence[str], *, reuse: bool
    ) -> choosing.Evaluation:
        chooser = self.holder.current()
        if reuse:
            entry = self._cache.get(uid)
            if (
                entry is not None
                and entry.generation == self.sync.ledger.generation
                and entry.version == self.holder.version
                and entry.request == request
            ):
                evaluation = entry.evaluation
                if evaluation.known(names) == len(names):
                    self.cache_lookups.labels("hit").inc()
                    return evaluation
            self.cache_lookups.labels("miss").inc()
        return chooser.evaluate(request, names, shared=True)

    # --- verbs ---------------------------------------------------------------------

    def filter(self, pod: Mapping[str, Any], names: Sequence[str]) -> Verdict:
        """The policy's best of the nodes of `names` where the pod fits now (with loads,
        the least loaded of those tied at the best), and why not for the nodes it does
        not fit. O(names) with the evaluation cached."""
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid") or "")
        try:
            request = self.request(pod)
        except grammar.AnnotationError as error:
            problem = f"gpuplace annotations: {error}"
            return Verdict(
                passed=[],
                unresolvable=dict.fromkeys(names, problem[:500]),
                problem=problem,
            )
        if request is None:
            return Verdict(passed=list(names))
        holding = self.sync.ledger.get(uid) if uid else None
        if holding is not None and self._plan_gone_stale(uid, holding, names):
            self.sync.unhold(uid)  # the planner's choice no longer fits: choose again
            self.stale_plans.inc()
            holding = None
        if holding is not None:
            return self._reserved(names, request, holding)
        evaluation = self._evaluate(uid, request, names, reuse=False)
        # On 10,000 names the per-name Python work is most of filter's time. Names
        # (unique, as kube-scheduler sends them) as many as the evaluation's nodes are
        # exactly its nodes: the answer is then read off the evaluation; otherwise it
        # is built in comprehensions, not one loop with branches.
        choices, misfits = evaluation.choices, evaluation.misfits
        whole = len(names) == len(choices) + len(misfits)
        fences = self.fences
        fenced = fences is not None and fences.current is not None
        held: dict[str, str] = {}  # fitting nodes a gang's fence keeps from this pod
        view = self.current_loads()
        if whole and not fenced and view is None:
            # Every fitting node is a candidate: the evaluation's best, from the heap the
            # engine keeps with a shared evaluation (a pass over 10,000 choices touches
            # 10,000 objects: ~2.7 ms in the sidecar), else scanned.
            # A tie is scanned: its nodes are then in the evaluation's order, which the
            # answer prepared ahead for prioritize relies on (`chosen_ahead`).
            top = evaluation.top() if evaluation.top is not None else None
            best = top if top is not None and len(top) == 1 else self._best_of_every(choices)
            verdict = Verdict(passed=best, request=request)
            verdict.fitting = len(choices)
        else:
            passed = list(choices) if whole else [name for name in names if name in choices]
            verdict = Verdict(passed=passed, request=request)
            if fences is not None and fenced:
                offered = []
                for name in verdict.passed:
                    why = fences.blocks(uid, name)
                    if why is None:
                        offered.append(name)
                    else:
                        held[name] = why
                verdict.passed = offered
            verdict.fitting = len(verdict.passed)
            if len(verdict.passed) > 1:
                verdict.passed = self._best(choices, verdict.passed, view)
        if uid:
            every = verdict.passed if whole and len(verdict.passed) == len(choices) else None
            self._remember(uid, request, evaluation, every)
        if whole:
            verdict.misfits = misfits
        else:
            get, unknown = misfits.get, choosing.UNKNOWN
            verdict.misfits = {name: get(name) or unknown for name in names if name not in choices}
        if not verdict.passed:  # kube-scheduler reads them only then: O(names) of strings
            verdict.failed, verdict.unresolvable = reasons.for_nodes(verdict.misfits, self.mode)
            verdict.failed.update(held)
        return verdict

    @staticmethod
    def _best_of_every(choices: Mapping[str, Choice]) -> list[str]:
        """The names of `choices` at the best score, in their order; without loads.
        Two passes in C over the choices (attrgetter, max, count): ~0.4 ms at 10,000
        nodes, where a comprehension took twice that."""
        if len(choices) < 2:
            return list(choices)
        return _at_top(choices, list(map(_SCORE, choices.values())))

    def _best(
        self, choices: Mapping[str, Choice], passed: list[str], view: load_ties.Loads | None
    ) -> list[str]:
        """Of `passed` (each has a choice), those at the policy's best score, with the
        load tie-break of `view` applied (`_tie_broken`): the nodes prioritize would give
        10, in their order. O(passed), + the tie-break's cost with loads."""
        found = self._tie_broken(list(map(choices.__getitem__, passed)), view)
        return _at_top(passed, list(map(_SCORE, found)))  # every passed node has a choice

    def _plan_gone_stale(self, uid: str, holding: Grant, names: Sequence[str]) -> bool:
        """The pod's grant is the planner's hold (`syncing.PLANNED`, a preference) and
        kube-scheduler does not offer its node (its own filters refused it), or a grant
        the informer brought in since overcommits its GPUs. O(names) once."""
        hold = self.sync.hold_of(uid)
        if hold is None or hold.owner != syncing.PLANNED:
            return False
        return holding.node not in names or bool(self.sync.ledger.overcommitted(holding))

    def _reserved(self, names: Sequence[str], request: GpuRequest, holding: Grant) -> Verdict:
        verdict = Verdict(passed=[], request=request, holding=holding)
        why = f"{reasons.PREFIX}GPUs are reserved for this pod on node {holding.node}"
        busy = self.sync.ledger.overcommitted(holding)
        for name in names:
            if name == holding.node and busy:  # preempted pods still on them: wait
                verdict.failed[name] = (
                    f"{reasons.PREFIX}GPU {','.join(map(str, busy))} reserved for this pod "
                    "is still used by pods being preempted"
                )
            elif name == holding.node:
                verdict.passed.append(name)
            else:
                verdict.unresolvable[name] = why
        if not verdict.passed and busy:
            verdict.problem = (
                f"GPUs {','.join(map(str, holding.gpus))} of node {holding.node} are held for "
                "this pod while the pods preempted for it terminate; it is bound there once "
                "they are gone"
            )
        elif not verdict.passed:
            verdict.problem = (
                f"GPUs {','.join(map(str, holding.gpus))} are reserved for this pod on node "
                f"{holding.node}, which the scheduler did not offer (its own filters rejected "
                "it); the reservation expires if the pod is not bound"
            )
        return verdict

    def current_loads(self) -> load_ties.Loads | None:
        """The loads that break ties now (None: none, or too old, or off). O(1)."""
        return self.loads.current() if self.loads is not None else None

    def _tie_broken(
        self, found: list[Choice | None], view: load_ties.Loads | None
    ) -> list[Choice | None]:
        """`found` with the load tie-break among the nodes tied at the best policy score
        (`gpuplace.placement.load_ties.tie_broken`); `found` itself without loads. O(found) +
        O(nodes tied × GPUs of one)."""
        if view is None:
            return found
        chooser = self.holder.current()
        return load_ties.tie_broken(found, view, self.sync.ledger.state, chooser.policy.place)

    def prioritize(self, pod: Mapping[str, Any], names: Sequence[str]) -> list[int]:
        """A 0-10 score per node of `names`, in their order: 10 only for the policy's best.
        (Plain ints, no pair per node: 10,000 tuples per call would feed the collector.)"""
        return choosing.ranked_found(self.chosen(pod, names))

    def chosen(self, pod: Mapping[str, Any], names: Sequence[str]) -> list[Choice | None]:
        """Each of `names`' choice for the pod, in their order: the policy's, None where
        the request does not fit (or the pod asks for no GPU); for a pod holding a grant,
        the grant alone, on its node. prioritize ranks them (`choosing.ranked_found`,
        `wire.ranked_priorities_json`). With loads, those tied at the best policy score
        carry the load tie-break in their scores (`_tie_broken`). O(names) with the
        evaluation cached."""
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid") or "")
        try:
            request = self.request(pod)
        except grammar.AnnotationError:
            return [None] * len(names)
        if request is None:
            return [None] * len(names)
        holding = self.sync.ledger.get(uid) if uid else None
        if holding is not None:
            held = Choice(holding.node, holding.gpus, 1.0)
            return [held if name == holding.node else None for name in names]
        evaluation = self._evaluate(uid, request, names, reuse=bool(uid))
        return self._tie_broken(list(map(evaluation.choices.get, names)), self.current_loads())

    def chosen_ahead(
        self, uid: str, names: Sequence[str], view: load_ties.Loads | None = None
    ) -> list[Choice | None] | None:
        """`chosen` for pod `uid` and the nodes its filter passed (each has a choice),
        while the evaluation filter made is current; else None. With `view` (the loads
        of `current_loads`), the load tie-break applied. O(names)."""
        entry = self._cache.get(uid)
        if (
            entry is None
            or entry.generation != self.sync.ledger.generation
            or entry.version != self.holder.version
        ):
            return None
        choices = entry.evaluation.choices
        if entry.every_choice is names and len(choices) == len(names):
            # Same generation: a kept evaluation only gains nodes since (scored ahead,
            # appended), so with no more choices than then they are `names`, in order.
            found: list[Choice | None] = list(choices.values())
        elif not all(map(choices.__contains__, names)):
            return None
        else:
            found = list(map(choices.__getitem__, names))
        return self._tie_broken(found, view)

    def still_current(self, pod: Mapping[str, Any], uid: str, generation: int) -> bool:
        """Whether prioritize for `pod` would use the evaluation filter made for it at
        ledger `generation`: same ledger, policy and request, and no grant since. O(1)."""
        entry = self._cache.get(uid)
        if (
            entry is None
            or entry.generation != generation
            or generation != self.sync.ledger.generation
            or entry.version != self.holder.version
            or self.sync.ledger.get(uid) is not None
        ):
            return False
        try:
            return self.request(pod) == entry.request
        except grammar.AnnotationError:
            return False

    def every_node(self) -> node_names.EveryNode | None:
        """Every node's name as the policy's chooser holds them (`Chooser.every_name`),
        as a set: filter's arguments naming exactly these are not parsed. None without
        the C helper. O(1) while no node was added or removed."""
        return self.holder.every_node.of(self.holder.current())

    def best_on(self, node: str, request: GpuRequest) -> choosing.Choice | fit.Misfit:
        """The policy's GPUs for `request` on `node` now (bind); with loads, the least
        loaded of the sets it scores alike (`gpuplace.placement.load_ties.pick`). O(1) when cached,
        + O(tied sets × GPUs log GPUs) with loads."""
        found = self.holder.current().outcome(node, request)
        view = self.current_loads()
        if view is None or not isinstance(found, Choice):
            return found
        state = self.sync.ledger.state(node)
        return found if state is None else load_ties.pick(state, found, view)
