"""A lone pod on the DRA path of higher priority evicts lower-priority pods for its GPUs.

kube-scheduler does not preempt for a pod with a ResourceClaim ("Preemption is not
helpful": its DRA plugin cannot tell what evicting a pod would free) and so never asks
the extender's `preempt` verb either. A gang's DRA members preempt through the gang
controller (`gpuplace.gangs.evicting`); a pod alone preempts here, by the same rules
(`gpuplace.controllers.victims`, kube-scheduler's DefaultPreemption for one pod: victims
of strictly lower priority, a running gang whole, none for `preemptionPolicy: Never`,
never one already being deleted):

1. when the claim controller finds no room for a lone pod (`ClaimController._plan` chose
   nothing), it asks `LonePreemptions.attempt` with the DRA nodes the pod may go to;
2. plan (`gpuplace.controllers.victims.plan`: the pod a gang of one): the victims that
   make room for it, only on the GPUs it takes, none beyond need; no plan: nothing (its
   claim is made unpinned, kube-scheduler's first fit says why it waits); PodDisruptionBudgets
   forbid every plan: the pod stays gated and is tried again after `retry_seconds` (each
   round plans it again: room that frees meanwhile is taken);
3. evict the victims through the Eviction API (UID precondition, in name order;
   `gpuplace.controllers.evictions.evict`); the pod's claim is then pinned to the GPUs the
   plan gives it and its node nominated (`status.nominatedNodeName`, as kube-scheduler
   nominates a preemptor), and its gate goes: kube-scheduler's allocator finds no room
   until the victims have terminated, then allocates exactly there. A refused eviction
   stops the evictions (a Warning `GpuPreemptionRefused` says which and why) and the next
   attempt is not before `retry_seconds`;
4. while pods of lower priority terminate on the plan's node (evicted by this or another
   replica before a restart, or deleted by anyone), the plan counts on them and evicts
   nothing more (`gpuplace.controllers.victims.Terminating`): the claim is pinned to the
   GPUs they free. So nothing is kept only in memory but the back-off: a restart reads
   the same from the pods.

The claim controller's replanning (`ClaimController._replan`) asks again when a released
preemptor's pinned GPUs have no room: its victims still terminating give the same pin
(the claim stays); GPUs a race took once they were free give a new plan, victims
included, and the claim is made again on it.

Not fenced: a gang's preemption holds the one fence (`gpuplace.placement.fences`), whose
nodes a lone pod never plans on; the freed GPUs are kept for the preemptor by the claim
controller's order (highest priority first, its pin held in the ledger once they are
free) and by kube-scheduler's own (a higher priority first out of its queue).

Bounded work per round: at most `plans_per_round` pods plan a preemption in one round,
each at most `passes` plans; a pod whose plan found nothing plans again only when the
ledger or a pod record changes, and not before `retry_seconds`.

Events: `GpuPreempted` on each victim (the pod, and the GPUs freed), `GpuPreemption` on
the preemptor (victims, GPUs and node). Metrics: `gpuplace_dra_preemptions_total{result}`
(`complete`, `partial`), `gpuplace_dra_preemption_victims_total`,
`gpuplace_dra_preemption_plans_total`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster import recording
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import evictions, telling, victims
from gpuplace.placement import gangs
from gpuplace.placement.choosing import Choice, Policy
from gpuplace.placement.requests import describe

log = logging.getLogger(__name__)

PREEMPTION_REFUSED = "GpuPreemptionRefused"
"""On a lone DRA pod whose eviction of a victim the API refused."""
PREEMPTION_BLOCKED = "GpuPreemptionBlocked"
"""On a lone DRA pod every plan of which a PodDisruptionBudget forbids (it waits gated)."""


@dataclass(frozen=True, slots=True)
class Wait:
    """No pin yet and no first fit either: the pod stays gated (or its pinned claim
    stays). `why`: budgets forbid every plan now (said once in an Event); None: another
    pod planned a preemption this round."""

    why: str | None = None


Answer = Choice | Wait | None
"""What `LonePreemptions.attempt` comes to: the GPUs to pin the pod's claim to, `Wait`,
or None (no plan: pin nothing)."""


@dataclass(slots=True)
class _Memo:
    tried: tuple[object, ...] = ()
    """What the last plan saw (the ledger's and the pods' versions, the nodes)."""
    answer: Answer = None
    """What it came to: given again while nothing changed or before `not_before`."""
    not_before: float = 0.0
    """No new plan before this (POSIX seconds): after a refusal, a plan budgets blocked
    or one that found nothing."""
    evicted: set[str] = field(default_factory=set)


class LonePreemptionMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.preemptions = Counter(
            "gpuplace_dra_preemptions_total",
            "Preemptions started for a lone pod on the DRA path (its victims' evictions "
            "sent), by result: complete, or partial (an eviction was refused; retried later).",
            ["result"],
            registry=registry,
        )
        self.plans = Counter(
            "gpuplace_dra_preemption_plans_total",
            "Preemption plans made for lone pods on the DRA path "
            "(gpuplace.controllers.victims.plan passes, each synchronous work on the event loop).",
            registry=registry,
        )
        self.victims = Counter(
            "gpuplace_dra_preemption_victims_total",
            "Pods evicted to make room for a lone pod on the DRA path.",
            registry=registry,
        )
        for result in ("complete", "partial"):
            self.preemptions.labels(result)


class LonePreemptions:
    """See the module docstring. `attempt` is called by the claim controller's round."""

    def __init__(
        self,
        api: evictions.EvictionApi,
        sync: LedgerSync,
        *,
        recorder: recording.Recorder | None = None,
        registry: CollectorRegistry | None = None,
        retry_seconds: float = 10.0,
        plans_per_round: int = 1,
        passes: int = victims.PASSES,
    ) -> None:
        self.api = api
        self.sync = sync
        self.recorder = recorder
        self.retry_seconds = retry_seconds
        self.plans_per_round = plans_per_round
        self.passes = passes
        self.metrics = LonePreemptionMetrics(registry)
        self._memos: dict[str, _Memo] = {}
        self._plans_left = plans_per_round
        self._lowest: int | None = None
        """The lowest priority among the pods holding grants, this round (None: not read
        yet): a pod not above it has no victim, and costs no plan."""

    def new_round(self, uids: Iterable[str]) -> None:
        """A claim controller round starts; `uids`: its live pods (the others' memos go)."""
        self._plans_left = self.plans_per_round
        self._lowest = None
        alive = set(uids)
        self._memos = {uid: memo for uid, memo in self._memos.items() if uid in alive}

    @staticmethod
    def may_preempt(record: PodRecord) -> bool:
        """A lone pod (no gang's or queue's plan) that may preempt: kube-scheduler's rule,
        `preemptionPolicy` not `Never`, and a priority some pod can be below."""
        return (
            record.request is not None
            and record.grant is None
            and not record.gang
            and not victims.never_preempts([record])
        )

    async def attempt(
        self, record: PodRecord, nodes: Sequence[str], policy: Policy, *, now: float
    ) -> Answer:
        """Preempt for `record` on `nodes` if it may and needs to (module docstring): the
        GPUs its claim is to be pinned to once the victims (evicted now, or already
        terminating) are gone, or `Wait`, or None (no plan: pin nothing). The last answer
        again while the ledger and the pods are as that plan saw them, or before its
        back-off. Raises `kube.ApiError` from the budget pre-check's reads (the round logs
        it; the pod is tried again next round)."""
        if not nodes or not self.may_preempt(record) or record.request is None:
            return None
        if record.priority <= self._lowest_held():
            return None  # nothing of lower priority holds a GPU: no victim anywhere
        memo = self._memos.setdefault(record.uid, _Memo())
        signature = (
            self.sync.ledger.generation,
            self.sync.ledger.relabelled,
            self.sync.pods_version,
            tuple(nodes),
        )
        if memo.tried == signature or now < memo.not_before:
            return memo.answer
        if self._plans_left <= 0:
            return Wait()  # another pod planned a preemption this round: next round
        self._plans_left -= 1
        memo.tried = signature
        try:
            memo.answer = await self._attempt(record, nodes, policy, memo, now=now)
        except BaseException:
            memo.tried, memo.answer = (), None
            raise
        return memo.answer

    def _lowest_held(self) -> int:
        """The lowest priority among pods holding a grant or hold (once a round,
        O(grants)); one being deleted counts too (a plan then waits for it)."""
        if self._lowest is None:
            pods = self.sync.pods
            held = (pods.get(grant.pod_uid) for grant in self.sync.ledger)
            self._lowest = min(
                (pod.priority for pod in held if pod is not None and not pod.terminal),
                default=1 << 31,
            )
        return self._lowest

    async def _attempt(
        self,
        record: PodRecord,
        nodes: Sequence[str],
        policy: Policy,
        memo: _Memo,
        *,
        now: float,
    ) -> Answer:
        assert record.request is not None
        member = gangs.Member(
            record.uid,
            record.request,
            frozenset(nodes),
            record.controlled.tolerations,
        )
        found = await victims.plan(
            self.api,
            self.sync,
            [member],
            policy,
            record.priority,
            passes=self.passes,
            counted=self.metrics.plans.inc,
        )
        if found is None:
            memo.not_before = now + self.retry_seconds
            return None
        if isinstance(found, str):  # budgets may change with no pod changing: retry then
            memo.tried, memo.not_before = (), now + self.retry_seconds
            log.info("DRA pod preemption blocked", extra={"pod": str(record), "why": found})
            return Wait(found)
        if isinstance(found, victims.Terminating):
            return found.eviction.choices.get(record.uid)
        eviction, chosen = found
        choice = eviction.choices.get(record.uid)
        if choice is None:  # cannot happen: a plan places every member
            return None
        refused = await self._evict(record, choice, chosen, memo)
        if refused:
            memo.tried, memo.not_before = (), now + self.retry_seconds
        return choice

    async def _evict(
        self, record: PodRecord, choice: Choice, chosen: list[PodRecord], memo: _Memo
    ) -> bool:
        """Evict every victim, in order; stop at the first refusal (True then)."""
        freed = evictions.freed(self.sync, chosen)
        wants = describe(record.request) if record.request is not None else "GPUs"

        def evicted(victim: PodRecord) -> None:
            memo.evicted.add(victim.uid)
            self._emit(
                victim,
                recording.NORMAL,
                recording.PREEMPTED,
                f"preempted to free {freed.get(victim.uid, 'its GPUs')} for pod {record} "
                f"(priority {record.priority}, {wants})",
            )

        done = await evictions.evict(self.api, chosen, evicted)
        gone, refusal = done.gone, done.refusal
        self.metrics.victims.inc(len(gone))
        self.metrics.preemptions.labels("partial" if refusal else "complete").inc()
        where = _gpus_text(choice)
        names = ", ".join(str(v) for v in gone) or "none"
        log.info(
            "DRA pod preemption",
            extra={
                "pod": str(record),
                "node": choice.node,
                "evicted": [str(v) for v in gone],
                "refused": str(refusal[0]) if refusal else "",
            },
        )
        if gone:
            self._emit(
                record,
                recording.NORMAL,
                recording.PREEMPTION,
                f"preempts lower-priority pods for {where}: evicted {names}; its "
                "ResourceClaim is pinned there and kube-scheduler allocates it once they "
                "have terminated",
            )
        if refusal is None:
            return False
        victim, error = refusal
        self._emit(
            record,
            recording.WARNING,
            PREEMPTION_REFUSED,
            f"the eviction of {victim} was refused ({evictions.refusal_text(error)}); "
            f"{len(gone)} of {len(chosen)} victims were evicted; tried again in "
            f"{self.retry_seconds:g}s",
        )
        return True

    def _emit(self, pod: PodRecord, kind: str, reason: str, message: str) -> None:
        telling.emit(self.recorder, pod, kind, reason, message)


def _gpus_text(choice: Choice) -> str:
    plural = "s" if len(choice.gpus) > 1 else ""
    return f"GPU{plural} {','.join(map(str, choice.gpus))} of node {choice.node}"
