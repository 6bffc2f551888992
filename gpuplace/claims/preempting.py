"""A lone pod on the DRA path of higher priority evicts lower-priority pods for its GPUs.

kube-scheduler does not preempt for a pod with a ResourceClaim ("Preemption is not
helpful": its DRA plugin cannot tell what evicting a pod would free) and so never asks
the extender's `preempt` verb either. A gang's DRA members preempt through the gang
controller (`gpuplace.gangs.evicting`); a pod alone preempts here, by the same rules
(`gpuplace.controllers.victims`, kube-scheduler's DefaultPreemption for one pod: victims
of strictly lower priority, a running gang whole, none for `preemptionPolicy: Never`,
never one already being deleted):

1. when the claim controller finds no room for a lone pod (`ClaimController._plan` chose
   nothing) — behind its gate, or released with an unpinned claim kube-scheduler found
   no room for (no victims then) — it asks `LonePreemptions.attempt` with the DRA nodes
   the pod may go to;
2. plan (`gpuplace.controllers.victims.plan`: the pod a gang of one): the victims that
   make room for it, only on the GPUs it takes, none beyond need. No plan: nothing (its
   claim is made unpinned, kube-scheduler's first fit says why it waits). The plan's
   node is the pod's *target* from the moment it is made (before anything is awaited):
   no other lone pod is planned there until the preemptor is placed, goes, or
   `target_seconds` pass (`held`; the claim controller keeps any lone pod without room
   elsewhere that could use that node behind its gate); PodDisruptionBudgets forbid
   every plan: the pod stays gated and is tried again after `retry_seconds` (each round
   plans it again: room that frees meanwhile is taken);
3. evict the victims through the Eviction API (UID precondition, in name order;
   `gpuplace.controllers.evictions.evict`); the pod's claim is then pinned to the GPUs the
   plan gives it and its node nominated (`status.nominatedNodeName`, as kube-scheduler
   nominates a preemptor), and its gate goes: kube-scheduler's allocator finds no room
   until the victims have terminated, then allocates exactly there. A refused eviction
   stops the evictions (a Warning `GpuPreemptionRefused` says which and why): the pod is
   not pinned to GPUs a victim still holds but waits (gated, or its claim stays), and
   plans again once those evicted are gone, not before `retry_seconds`; an eviction
   without an answer counts as one that went once the pod shows its deletion;
4. while the victims it evicted are there (the informer may show their deletion late; a
   DRA victim's claim holds its GPUs until the garbage collector deletes it), or pods of
   lower priority terminate on the plan's node (evicted by this replica before a
   restart, or deleted by anyone; claims of pods already gone count too), nothing more
   is evicted: the claim is pinned to the GPUs they free (all the plan needs is going),
   or the pod waits and plans again once they are gone (kube-scheduler's rule for a
   preemptor whose node has terminating victims).

The claim controller's replanning (`ClaimController._replan`) asks again when a released
preemptor's pinned GPUs have no room: its victims still terminating give the same pin
(the claim stays); GPUs a race took once they were free give a new plan, victims
included, and the claim is made again on it.

Kept only in memory (a restart reads the rest from the pods): the victims evicted (after
a restart, their deletion shows on the pods), the back-off and the targets (after a
restart a pod may be planned on a preemptor's node while its victims terminate, the
preemptor then plans again).

Not fenced: a gang's preemption holds the one fence (`gpuplace.placement.fences`), whose
nodes a lone pod never plans on; a gang's plan may count on GPUs a lone pod's victims
free (whichever of the two kube-scheduler places first gets them; the other plans
again).

Bounded work per round: at most `plans_per_round` pods plan a preemption in one round
(the others get no pin now: an unpinned claim, and they may preempt once kube-scheduler
finds no room for it), each at most `passes` plans; none for a pod no bound
pod of lower priority holds GPUs for on the DRA nodes, or as high as a pod asking the
same that found no plan this round; a pod whose plan found nothing plans again only when
the ledger or a pod record changes, and not before `retry_seconds`.

Events: `GpuPreempted` on each victim (the pod, and the GPUs freed), `GpuPreemption` on
the preemptor (victims, GPUs and node). Metrics: `gpuplace_dra_preemptions_total{result}`
(`complete`, `partial`), `gpuplace_dra_preemption_victims_total`,
`gpuplace_dra_preemption_plans_total`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster import recording
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import evictions, telling, victims
from gpuplace.placement import gangs, victim_choice
from gpuplace.placement.choosing import Choice, Policy
from gpuplace.placement.requests import GpuRequest, describe

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
    """UIDs of its victims whose eviction the API accepted."""
    unsure: set[str] = field(default_factory=set)
    """UIDs of victims whose eviction's outcome is unknown (timeout, 502-504): counted as
    going once the pod shows its deletion."""


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
        target_seconds: float = 300.0,
        plans_per_round: int = 1,
        passes: int = victims.PASSES,
    ) -> None:
        self.api = api
        self.sync = sync
        self.recorder = recorder
        self.retry_seconds = retry_seconds
        self.target_seconds = target_seconds
        self.plans_per_round = plans_per_round
        self.passes = passes
        self.metrics = LonePreemptionMetrics(registry)
        self._memos: dict[str, _Memo] = {}
        self._targets: dict[str, tuple[str, float]] = {}
        """Preemptor's UID -> the node its preemption frees GPUs on, and since when
        (POSIX seconds): no other lone pod is planned there meanwhile (`held`)."""
        self._plans_left = plans_per_round
        self._lowest: int | None = None
        self._nodes: frozenset[str] = frozenset()
        self._hopeless: list[tuple[int, GpuRequest, tuple[str, ...]]] = []

    def new_round(self, pods: Mapping[str, PodRecord], nodes: Iterable[str], now: float) -> None:
        """A claim controller round starts. `pods`: its pods (the others' memos go);
        `nodes`: those lone pods may go to (their victims are there). A preemptor's target
        goes once it is placed (bound, or its claim allocated), gone, or after
        `target_seconds`."""
        self._plans_left = self.plans_per_round
        self._lowest = None
        self._nodes = frozenset(nodes)
        self._hopeless = []
        self._memos = {uid: memo for uid, memo in self._memos.items() if uid in pods}
        self._targets = {
            uid: (node, since)
            for uid, (node, since) in self._targets.items()
            if (pod := pods.get(uid)) is not None
            and pod.live
            and not pod.bound
            and self.sync.ledger.get(uid) is None
            and now - since < self.target_seconds
        }

    def held(self, uid: str) -> frozenset[str]:
        """Nodes other lone pods' preemptions free GPUs on: not offered to pod `uid`.
        O(preemptions)."""
        return frozenset(node for owner, (node, _) in self._targets.items() if owner != uid)

    def worth(self, record: PodRecord) -> bool:
        """`record` may preempt and some bound pod of lower priority holds GPUs on the
        round's nodes (or a preemption of its own is under way). O(1) after the round's
        first call."""
        if not self.may_preempt(record):
            return False
        memo = self._memos.get(record.uid)
        return bool(memo and memo.evicted) or record.priority > self._lowest_held()

    @staticmethod
    def may_preempt(record: PodRecord) -> bool:
        """A lone pod (no gang's or queue's plan) whose `preemptionPolicy` is not `Never`."""
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
        terminating) are gone, or `Wait`, or None (no victims make room, or another pod
        planned this round: pin nothing now). The last answer again while its victims
        are there, while the ledger and the pods are as that plan saw them, or before its
        back-off. Its target goes with an answer of None or a budget's `Wait`. Raises
        `kube.ApiError` from the budget pre-check's reads (the round logs it; the pod is
        tried again next round)."""
        memo = self._memos.setdefault(record.uid, _Memo())
        answer = await self._answer(record, nodes, policy, memo, now=now)
        blocked = isinstance(answer, Wait) and answer.why is not None
        if (answer is None or blocked) and not memo.evicted:
            self._targets.pop(record.uid, None)  # no preemption under way: its node is free
        return answer

    async def _answer(
        self, record: PodRecord, nodes: Sequence[str], policy: Policy, memo: _Memo, *, now: float
    ) -> Answer:
        if not nodes or not self.may_preempt(record) or record.request is None:
            return None
        if self._terminating(memo):  # its victims are on their way out: never evicted twice
            answer = memo.answer
            if isinstance(answer, Choice) and answer.node not in nodes:
                return Wait()  # its node is held or gone meanwhile: not pinned there now
            return answer
        if record.priority <= self._lowest_held():
            return None  # nothing of lower priority holds a GPU there: no victim
        signature = (
            self.sync.ledger.generation,
            self.sync.ledger.relabelled,
            self.sync.pods_version,
            tuple(nodes),
        )
        if memo.tried == signature or now < memo.not_before:
            return memo.answer
        shape = (record.priority, record.request, tuple(nodes))
        if any(p >= shape[0] and r == shape[1] and n == shape[2] for p, r, n in self._hopeless):
            return None  # a pod as high asking the same found no plan this round
        if self._plans_left <= 0:
            return None  # another pod planned this round: unpinned now, it may preempt later
        self._plans_left -= 1
        memo.tried = signature
        try:
            memo.answer = await self._attempt(record, nodes, policy, memo, now=now)
        except BaseException:
            memo.tried = ()
            if not memo.evicted:
                memo.answer = None
            raise
        if memo.answer is None:
            self._hopeless.append(shape)
        return memo.answer

    def _terminating(self, memo: _Memo) -> bool:
        """Victims this replica evicted for the pod are still there: their pod not
        finished (the informer may not show its deletion yet), or their grant still in the
        ledger (a DRA victim's claim outlives its pod until the garbage collector deletes
        it); a plan now would take their GPUs for another's and evict again. A victim whose
        eviction's outcome is unknown counts once its pod shows its deletion. O(victims)."""
        pods = self.sync.pods

        def there(uid: str) -> bool:
            pod = pods.get(uid)
            return (pod is not None and not pod.terminal) or self.sync.ledger.get(uid) is not None

        memo.unsure = {uid for uid in memo.unsure if there(uid)}
        memo.evicted = {uid for uid in memo.evicted if there(uid)}
        memo.evicted |= {
            uid for uid in memo.unsure if (pod := pods.get(uid)) is None or pod.deleting
        }
        return bool(memo.evicted)

    def _lowest_held(self) -> int:
        """The lowest priority among the bound pods holding grants on the round's nodes
        (once a round, O(grants)); one being deleted counts too (a plan then waits for it)."""
        if self._lowest is None:
            pods = self.sync.pods
            held = (
                pods.get(grant.pod_uid) for grant in self.sync.ledger if grant.node in self._nodes
            )
            self._lowest = min(
                (
                    pod.priority
                    for pod in held
                    if pod is not None and pod.bound and not pod.terminal
                ),
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

        def target(eviction: victim_choice.GangEviction) -> None:
            choice = eviction.choices.get(record.uid)
            if choice is not None:  # before the plan's first await: nothing else there
                since = self._targets.get(record.uid, (choice.node, now))[1]
                self._targets[record.uid] = (choice.node, since)

        found = await victims.plan(
            self.api,
            self.sync,
            [member],
            policy,
            record.priority,
            passes=self.passes,
            counted=self.metrics.plans.inc,
            planned_on=target,
        )
        if found is None:
            memo.not_before = now + self.retry_seconds
            return None
        if isinstance(found, victims.Changed):  # a victim went meanwhile: plan again
            memo.tried = ()
            return Wait()
        if isinstance(found, str):  # budgets may change with no pod changing: retry then
            memo.tried, memo.not_before = (), now + self.retry_seconds
            log.info("DRA pod preemption blocked", extra={"pod": str(record), "why": found})
            return Wait(found)
        if isinstance(found, victims.Terminating):
            if all(victims.going(unit) for unit in found.eviction.units):
                return found.eviction.choices.get(record.uid)  # the GPUs they free
            return Wait()  # wait for them, then plan again (kube-scheduler's own rule)
        eviction, chosen = found
        choice = eviction.choices.get(record.uid)
        if choice is None:  # cannot happen: a plan places every member
            return None
        memo.answer = choice  # before the first eviction: what its victims are for
        gone = await self._evict(record, choice, chosen, memo)
        if gone == len(chosen):
            return choice
        # refused: not pinned on GPUs a victim still holds; it waits (gated, or its claim
        # stays) and plans again once the evicted ones are gone, not before the back-off
        memo.tried, memo.not_before = (), now + self.retry_seconds
        return Wait()

    async def _evict(
        self, record: PodRecord, choice: Choice, chosen: list[PodRecord], memo: _Memo
    ) -> int:
        """Evict every victim, in order; stop at the first refusal. How many went."""
        wants = describe(record.request) if record.request is not None else "GPUs"
        done = await evictions.preempt(
            self.api,
            self.sync,
            chosen,
            self.recorder,
            preemptor=f"pod {record} (priority {record.priority}, {wants})",
            evicted=memo.evicted,
            unsure=memo.unsure,
        )
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
            return len(gone)
        victim, error = refusal
        self._emit(
            record,
            recording.WARNING,
            PREEMPTION_REFUSED,
            f"the eviction of {victim} was refused ({evictions.refusal_text(error)}); "
            f"{len(gone)} of {len(chosen)} victims were evicted; tried again in "
            f"{self.retry_seconds:g}s",
        )
        return len(gone)

    def _emit(self, pod: PodRecord, kind: str, reason: str, message: str) -> None:
        telling.emit(self.recorder, pod, kind, reason, message)


def _gpus_text(choice: Choice) -> str:
    plural = "s" if len(choice.gpus) > 1 else ""
    return f"GPU{plural} {','.join(map(str, choice.gpus))} of node {choice.node}"
