"""A waiting gang of higher priority evicts lower-priority pods: all it needs, or none.

The gang controller asks `GangPreemptions.attempt` for a complete gang that does not fit
in free capacity (docs/gangs.md, "Priority and preemption"). Who may preempt and who
may go, as kube-scheduler's DefaultPreemption decides for one pod (the rules and the plan
are the controller kit's, `gpuplace.controllers.victims`, which the claim controller's
lone DRA pods preempt by too):

- the gang's priority is its *lowest* member's `spec.priority`, running members
  included (a replacement joining a started gang preempts at the gang's priority, not
  its own); a gang with a member whose `spec.preemptionPolicy` is `Never` never
  preempts;
- victims are bound, unfinished pods gpuplace granted GPUs to, of strictly lower
  priority; a running gang is one unit across all its nodes, and a victim only when all
  its live members are of lower priority (evicted whole or not at all), except that a
  running elastic gang's extra members (beyond `gang-min`, the most recently started
  first: `gpuplace.placement.elastic.extras`) may also go one by one, before its whole
  gang: it is left with `gang-min` members at least, or evicted whole;
- while victims this gang evicted earlier are still terminating, it does not preempt
  again (their GPUs are on their way back); the same read from the cluster, so that a
  restart or a lost lease (which drop what this replica remembers) changes nothing: a
  pod already being deleted is never a victim again, its GPUs count as freed, and while
  pods of lower priority terminate on the nodes of the gang's plan, the gang holds
  those nodes (the fence) and waits for them instead of evicting (kube-scheduler's own
  rule for a preemptor whose nominated node has terminating victims);
- one gang preempts at a time: while another gang's preemption is under way (from its
  first eviction until it starts, times out or stops waiting) no other gang preempts.
  There is one fence (`gpuplace.placement.fences`), and it holds the first gang's nodes; GPUs
  freed for a second gang would be held by nothing, a new pod could take them, and
  that gang would evict again.

An attempt:

1. plan (`gpuplace.controllers.victims.plan`, over
   `gpuplace.placement.victim_choice.for_gang`): the victims that make room for every
   member, only on the GPUs the members take, none beyond need; no plan: evict nothing;
2. PodDisruptionBudget pre-check (`gpuplace.controllers.evictions.budget_refusals`, with fresh
   reads of the victims and their namespaces' budgets): a unit with a victim the API server would
   refuse is excluded and the plan made again without it, until one passes or none is
   left (evict nothing);
3. fence the plan's nodes for the gang (`gpuplace.placement.fences`: no new pod and no other
   gang goes there), then evict every victim through the Eviction API (UID
   precondition: never a plain DELETE; `gpuplace.controllers.evictions.evict`). An
   eviction still refused (429 from a budget that changed meanwhile, 404/409: the pod
   went or was replaced) stops the evictions: the fence stays, a Warning Event
   `GangPreemptionRefused` says which victim and why, and the gang tries again after
   `retry_seconds`. An eviction without an answer
   (timeout, 502-504) may have gone through: it stops the evictions the same way, and
   the victim counts as terminating once the pod shows its deletion (never evicted
   twice). A race with another disruption can
   therefore leave a preemption partial; the fence keeps what was freed for the gang.

A gang whose plan found no victims is not planned again until the ledger
(`Ledger.generation`) or a pod record victim selection reads (`LedgerSync.pods_version`:
a pod bound, deleted, finished...) changes, and not before `retry_seconds`. Bounded work
per round: at most `PLANS_PER_ROUND` gangs plan a preemption in one controller round
(the others on the next), each with at most `PASSES` plans (see `_plan`).

Events: `GpuPreempted` on each victim (the gang, and the GPUs freed), `GpuPreemption` on
each member (victims and nodes). The controller owns the fence's lifetime: it keeps it
while `underway(key)` and releases it when the gang starts, times out or goes away.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster import kube, recording
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import evictions, telling, victims
from gpuplace.placement import gangs, requests, victim_choice
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import Fence, Fences
from gpuplace.placement.gangs import GangKey

log = logging.getLogger(__name__)

PLANS_PER_ROUND = 1
"""Gangs that may plan a preemption in one controller round (each plan is synchronous
work on the event loop the extender's verbs share)."""


@dataclass(slots=True)
class Underway:
    """A gang's preemption in progress: what it evicted, where, and when to try again."""

    nodes: frozenset[str]
    evicted: set[str] = field(default_factory=set)
    """UIDs of the victims whose eviction the API accepted."""
    retry_at: float = 0.0
    """After a refused eviction: no new attempt before this (POSIX seconds)."""
    unsure: set[str] = field(default_factory=set)
    """UIDs of victims whose eviction's outcome is unknown (timeout, 502-504): the API
    may have accepted it; counted as terminating once the pod shows deletion."""


class GangPreemptionMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.preemptions = Counter(
            "gpuplace_gang_preemptions_total",
            "Preemptions started for a waiting gang (its victims' evictions sent), by "
            "result: complete, or partial (an eviction was refused; retried later).",
            ["result"],
            registry=registry,
        )
        self.plans = Counter(
            "gpuplace_gang_preemption_plans_total",
            "Preemption plans made for waiting gangs (gpuplace.placement.victim_choice.for_gang "
            "runs, each synchronous work on the event loop).",
            registry=registry,
        )
        self.victims = Counter(
            "gpuplace_gang_preemption_victims_total",
            "Pods evicted to make room for a waiting gang.",
            registry=registry,
        )


class GangPreemptions:
    """See the module docstring. `attempt` is called by the gang controller's round."""

    def __init__(
        self,
        api: evictions.EvictionApi,
        sync: LedgerSync,
        fences: Fences,
        *,
        recorder: recording.Recorder | None = None,
        registry: CollectorRegistry | None = None,
        retry_seconds: float = 10.0,
        plans_per_round: int = PLANS_PER_ROUND,
        passes: int = victims.PASSES,
    ) -> None:
        self.api = api
        self.sync = sync
        self.fences = fences
        self.recorder = recorder
        self.retry_seconds = retry_seconds
        """After a refused eviction or a plan that found nothing: the wait before the
        gang plans a preemption again."""
        self.plans_per_round = plans_per_round
        self.passes = passes
        self.metrics = GangPreemptionMetrics(registry)
        self.underway: dict[GangKey, Underway] = {}
        self._tried: dict[GangKey, tuple[object, ...]] = {}
        self._backoff: dict[GangKey, float] = {}
        self._plans_left = plans_per_round

    def new_round(self) -> None:
        """The controller starts a round: `plans_per_round` gangs may plan in it."""
        self._plans_left = self.plans_per_round

    def forget(self, key: GangKey) -> None:
        """The gang started, timed out or went away: nothing of its preemption is kept."""
        self.underway.pop(key, None)
        self._tried.pop(key, None)
        self._backoff.pop(key, None)

    def keep_only(self, keys: Iterable[GangKey]) -> None:
        alive = set(keys)
        memos: tuple[dict[GangKey, Any], ...] = (self.underway, self._tried, self._backoff)
        for memo in memos:
            for key in [key for key in memo if key not in alive]:
                del memo[key]

    def terminating(self, key: GangKey) -> list[PodRecord]:
        """Victims this gang evicted that have not finished terminating."""
        found = self.underway.get(key)
        if found is None:
            return []
        records = [self.sync.pods.get(uid) for uid in found.evicted]
        unsure = [self.sync.pods.get(uid) for uid in found.unsure - found.evicted]
        return [r for r in records if r is not None and not r.terminal] + [
            r for r in unsure if r is not None and r.deleting and not r.terminal
        ]

    async def attempt(
        self,
        key: GangKey,
        members: Sequence[PodRecord],
        planned: Sequence[gangs.Member],
        policy: Policy,
        *,
        since: float,
        now: float,
        exclude: frozenset[str] = frozenset(),
        running: Sequence[PodRecord] = (),
    ) -> float | None:
        """Preempt for the complete gang `key` if it may and needs to (module docstring).
        `members`: those waiting to be placed; `running`: the gang's started live members
        (a replacement joining a started gang), which count for its priority and for
        `preemptionPolicy: Never`. Returns when to try again (POSIX seconds), or None.
        Never raises on API failures of the pre-check (logged; the gang is tried again
        next round)."""
        if not members or victims.never_preempts([*members, *running]):
            return None
        if any(other != key for other in self.underway):
            return None  # one preemption at a time: the fence is one (module docstring)
        if self.terminating(key):
            return None
        underway = self.underway.get(key)
        if underway is not None and now < underway.retry_at:
            return underway.retry_at
        priority = victims.priority_of([*members, *running])
        signature = (
            self.sync.ledger.generation,
            self.sync.ledger.relabelled,
            self.sync.pods_version,
            tuple(m.uid for m in members),
            priority,
        )
        retrying = underway is not None and underway.retry_at > 0
        if not retrying and self._tried.get(key) == signature:
            return None  # nothing changed since a plan found nothing (or all went)
        backoff = self._backoff.get(key, 0.0)
        if not retrying and now < backoff:
            return backoff  # its last plan found nothing: not again so soon
        if self._plans_left <= 0:
            return now + min(1.0, self.retry_seconds)  # another gang planned this round
        self._plans_left -= 1
        self._tried[key] = signature
        try:
            found = await victims.plan(
                self.api,
                self.sync,
                planned,
                policy,
                priority,
                exclude=exclude,
                passes=self.passes,
                counted=self.metrics.plans.inc,
            )
        except kube.ApiError as error:
            log.warning(
                "gang preemption pre-check failed",
                extra={"gang": "/".join(key), "status": error.status, "reason": error.reason},
            )
            self._tried.pop(key, None)
            self._backoff[key] = now + self.retry_seconds
            return self._backoff[key]
        if found is None or isinstance(found, victims.Changed):
            self._backoff[key] = now + self.retry_seconds
            return None
        if isinstance(found, victims.Terminating):
            # their GPUs are on their way back (evicted by this gang before a restart
            # or a lost lease, or deleted by anyone): hold the nodes and wait for them
            if underway is None:
                underway = self.underway[key] = Underway(found.nodes)
            underway.nodes = found.nodes
            underway.evicted |= found.uids
            self.fences.hold(Fence(key, found.nodes, frozenset(m.uid for m in members), since))
            return None
        if isinstance(found, str):  # only budgets stand in the way: they may change
            log.info("gang preemption blocked", extra={"gang": "/".join(key), "why": found})
            self._tried.pop(key, None)
            self._backoff[key] = now + self.retry_seconds
            return self._backoff[key]
        eviction, chosen = found
        nodes = frozenset(eviction.nodes)
        if underway is None:
            underway = self.underway[key] = Underway(nodes)
        else:
            underway.nodes = nodes
        self.fences.hold(Fence(key, nodes, frozenset(m.uid for m in members), since))
        return await self._evict(
            key,
            members=members,
            priority=priority,
            eviction=eviction,
            victims=chosen,
            underway=underway,
            now=now,
        )

    async def _evict(
        self,
        key: GangKey,
        *,
        members: Sequence[PodRecord],
        priority: int,
        eviction: victim_choice.GangEviction,
        victims: list[PodRecord],
        underway: Underway,
        now: float,
    ) -> float | None:
        """Evict every victim, in order; stop at the first refusal (module docstring)."""
        wants = ", ".join(sorted({requests.describe(m.request) for m in members if m.request}))
        done = await evictions.preempt(
            self.api,
            self.sync,
            victims,
            self.recorder,
            preemptor=f"gang {key[0]}/{key[1]} (priority {priority}, "
            f"{len(members)} members: {wants})",
            evicted=underway.evicted,
            unsure=underway.unsure,
        )
        gone, refusal = done.gone, done.refusal
        self.metrics.victims.inc(len(gone))
        self.metrics.preemptions.labels("partial" if refusal else "complete").inc()
        nodes = ", ".join(sorted(eviction.nodes))
        names = ", ".join(str(v) for v in gone) or "none"
        log.info(
            "gang preemption",
            extra={
                "gang": "/".join(key),
                "nodes": sorted(eviction.nodes),
                "evicted": [str(v) for v in gone],
                "refused": str(refusal[0]) if refusal else "",
            },
        )
        for member in members if gone else ():
            self._emit(
                member,
                recording.NORMAL,
                recording.PREEMPTION,
                f"gang {key[1]} preempts lower-priority pods to start: evicted {names}; nodes "
                f"{nodes} are held for the gang until they have terminated",
            )
        if refusal is None:
            underway.retry_at = 0.0
            return None
        victim, error = refusal
        underway.retry_at = now + self.retry_seconds
        why = evictions.refusal_text(error)
        for member in members:
            self._emit(
                member,
                recording.WARNING,
                recording.GANG_PREEMPTION_REFUSED,
                f"gang {key[1]}: the eviction of {victim} was refused ({why}); "
                f"{len(gone)} of {len(victims)} victims were evicted, nodes {nodes} stay "
                f"held for the gang, and it tries again in {self.retry_seconds:g}s",
            )
        return underway.retry_at

    def _emit(self, pod: PodRecord, kind: str, reason: str, message: str) -> None:
        telling.emit(self.recorder, pod, kind, reason, message)
