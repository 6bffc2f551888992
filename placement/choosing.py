"""Choosing a node and GPUs for a request across the cluster.

`evaluate` scores every candidate node with a policy (for the extender's filter
and prioritize); `choose` takes the best, breaking exact ties uniformly at random
the way kube-scheduler's selectHost does. `extender_scores` maps policy scores onto
kube-scheduler's 0-10 extender scale so that the policy's best nodes, and only
they, get 10: the stock scheduler then picks among exactly the nodes the policy
considers best.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from placement import fit
from placement.ledger import Grant, Ledger, NodeState
from placement.requests import GpuRequest

MAX_EXTENDER_SCORE = 10


class Policy(Protocol):
    """Scores one candidate GPU set on one node; higher is better."""

    name: str

    def score(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float: ...

    def prefer(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        """Ranks GPU sets of equal score on one node; ties go to the first set."""
        ...


@dataclass(frozen=True, slots=True)
class Choice:
    node: str
    gpus: tuple[int, ...]
    score: float


@dataclass(slots=True)
class Evaluation:
    """Per node: the best choice where the request fits, the reason where it does not."""

    choices: dict[str, Choice] = field(default_factory=dict)
    misfits: dict[str, fit.Misfit] = field(default_factory=dict)

    def best(self) -> list[Choice]:
        """Choices with the highest score. O(choices)."""
        if not self.choices:
            return []
        top = max(choice.score for choice in self.choices.values())
        return [choice for choice in self.choices.values() if choice.score == top]


def best_on(state: NodeState, request: GpuRequest, policy: Policy) -> Choice | fit.Misfit:
    """The policy's best GPU set on one node, or why none fits. O(GPU sets × score)."""
    reason = fit.static_misfit(state, request) or fit.host_misfit(state, request)
    if reason is not None:
        return reason
    best: tuple[float, float, tuple[int, ...]] | None = None
    for gpus in fit.gpu_sets(state, request):
        rank = (policy.score(state, request, gpus), policy.prefer(state, request, gpus), gpus)
        if best is None or rank[:2] > best[:2]:
            best = rank
    if best is None:
        return fit.dynamic_misfit(state, request)
    return Choice(state.node.name, best[2], best[0])


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


class Chooser:
    """Evaluates requests on a ledger with one policy, caching per node and request.

    A node's cached outcomes stay valid until its ledger `version` changes, so a
    decision re-scores only the nodes that changed since the same request was last
    seen: O(nodes) dictionary lookups plus O(changed nodes × GPU sets × score).
    Call `reset` when the policy's inputs change (e.g. a new typical workload).
    """

    __slots__ = ("_cache", "_ids", "ledger", "policy")

    def __init__(self, ledger: Ledger, policy: Policy) -> None:
        self.ledger = ledger
        self.policy = policy
        self._ids: dict[GpuRequest, int] = {}
        self._cache: dict[str, tuple[int, dict[int, Outcome]]] = {}

    def reset(self) -> None:
        self._ids.clear()
        self._cache.clear()

    def _id(self, request: GpuRequest) -> int:
        rid = self._ids.get(request)
        if rid is None:
            if len(self._ids) >= ID_LIMIT:
                self.reset()
            rid = self._ids[request] = len(self._ids)
        return rid

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
            found = entry[1][rid] = best_on(state, request, self.policy)
        return found

    def evaluate(self, request: GpuRequest, names: Iterable[str] | None = None) -> Evaluation:
        """Every node of `names` (default: the candidates): choice or misfit. O(nodes)."""
        rid = self._id(request)
        result = Evaluation()
        for name in candidates(self.ledger, request) if names is None else names:
            found = self._outcome(name, request, rid)
            if isinstance(found, Choice):
                result.choices[name] = found
            else:
                result.misfits[name] = found
        return result

    def best(self, request: GpuRequest, names: Iterable[str] | None = None) -> list[Choice]:
        """The choices with the highest score, in node order. O(nodes), no per-node output."""
        rid = self._id(request)
        top: list[Choice] = []
        top_score = 0.0
        outcome = self._outcome
        for name in candidates(self.ledger, request) if names is None else names:
            found = outcome(name, request, rid)
            if type(found) is not Choice:
                continue
            if not top or found.score > top_score:
                top = [found]
                top_score = found.score
            elif found.score == top_score:
                top.append(found)
        return top

    def choose(
        self, request: GpuRequest, rng: random.Random, names: Iterable[str] | None = None
    ) -> Choice | None:
        """The policy's choice, exact ties broken uniformly by `rng`. O(nodes)."""
        top = self.best(request, names)
        if not top:
            return None
        return top[0] if len(top) == 1 else top[rng.randrange(len(top))]


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
    """Policy scores on kube-scheduler's 0-10 scale; 10 only for the best. O(n log n).

    The others are spread over 0-9 by rank, so that even with the scheduler's own
    scores added the policy's order among them survives as far as integers allow.
    """
    choices = evaluation.choices
    if not choices:
        return {}
    distinct = sorted({choice.score for choice in choices.values()})
    top = distinct[-1]
    lower = distinct[:-1]
    rank = {score: i for i, score in enumerate(lower)}
    scale = (MAX_EXTENDER_SCORE - 1) / max(len(lower) - 1, 1)
    scores: dict[str, int] = {}
    for name, choice in choices.items():
        if choice.score == top:
            scores[name] = MAX_EXTENDER_SCORE
        elif len(lower) == 1:
            scores[name] = MAX_EXTENDER_SCORE - 1
        else:
            scores[name] = int(rank[choice.score] * scale)
    return scores


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
