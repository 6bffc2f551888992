"""The queue controller: queued GPU pods are admitted by their GpuQueue, in rounds.

One asyncio task in the sidecar (`QueueController.run`: the controller kit's round loop,
`gpuplace.controllers.rounds`), deciding only in the replica whose kube-scheduler leads
(the leader gate it shares with the gang controller, `gpuplace.controllers.leader`). A round
runs when something changed — a queued pod, a GpuQueue or namespace, the ledger (pods and
nodes coming and going), a capacity hold — never per pod: bursts of changes within
`settle_seconds` make one round, and rounds that decide are at least `min_round_seconds`
apart. Each round (`step`):

1. **Settle** plans found in the API (`gpuplace.queues.committing`: a queued gang's plan
   written before a crash rolls forward or back, never half).
2. **Collect** the workloads from the pods themselves (`gpuplace.queues.workloads`):
   what runs, what waits, what waits outside the round (a gang still missing members).
   At most `window` waiting workloads per queue enter the round (the most urgent: past
   `maxWait`, then priority, then age); the others wait their turn.
3. **Decide** (`gpuplace.placement.queueing.admitting.admit`, on a scratch copy of the live ledger)
   and reserve every admission's grants in the live ledger (holds), in one synchronous
   step: no await in between, so nothing the extender binds meanwhile can take them, and
   two admissions never count one GPU. This is the round's CPU work on the event loop
   the extender's verbs share (0.1-0.2 s at 100 nodes, 1-2 s at 1,000: bench/queue_round.py),
   which is why rounds are bounded (`window`) and spaced (`min_round_seconds`) and yield
   to the loop before and after.
4. **Admit**: write each admission (`committing`: a pod in one write; a gang's plan, then
   its queue gates; the gang controller starts it), with Events `QueueAdmitted`.
5. **Reclaim** for at most `reclaims` waiting workloads (`gpuplace.queues.reclaiming`:
   PodDisruptionBudgets checked, Eviction API).
6. **Hold** (with `hold_after_seconds`): capacity for the starving workload of the queue
   furthest below its fair share, in the fence the gang controller also uses
   (`gpuplace.placement.queueing.holds`); the next rounds admit nothing else on its nodes.
7. **Tell**: Events on waiting pods (once per reason), each GpuQueue's status (when it
   changed: `gpuplace.queues.statuses`; with fair sharing over time, its past share),
   the per-queue metrics.

A round that finds nothing changed since the last one (and no `poll_seconds` passed, for
`maxWait`) decides nothing; with no queued pod at all, the ledger's changes (binds of
pods outside queues) are not a change to it, so a cluster that uses no queues pays no
round per bind. API failures are logged and retried next round; nothing here
is kept only in memory that a restart could lose (admissions are read from the pods,
evictions in flight from their deletion, past shares from the GpuQueues' statuses; a
capacity hold is decided again by the first round).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from gpuplace.cluster import assignments, kube, recording
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.queue_directory import QueueDirectory
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import restarts, telling
from gpuplace.controllers.api import PodApi
from gpuplace.controllers.controller import Controller, Parts, Settings
from gpuplace.controllers.store import PodIndex
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import QUEUED, Fence
from gpuplace.placement.ledger import LedgerError
from gpuplace.placement.queueing import admitting, holds, quotas
from gpuplace.placement.queueing.share_history import ShareHistory
from gpuplace.queues import events, statuses, workloads
from gpuplace.queues.committing import Admitter, Written
from gpuplace.queues.metrics import QueueMetrics
from gpuplace.queues.reclaiming import Reclaimer

log = logging.getLogger(__name__)


class QueueApi(PodApi, Protocol):
    """What the controller calls: a pod's reads and writes (`PodApi`) and a GpuQueue's
    status."""

    async def patch_gpuqueue_status(
        self, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class QueueSettings(Settings):
    """The kit's `Settings` (polling, settling, spacing, holds, writes) with the queue
    controller's figures, and its own."""

    poll_seconds: float = 10.0
    """Longest wait between rounds when nothing wakes the controller (`maxWait`)."""
    settle_seconds: float = 0.2
    min_round_seconds: float = 1.0
    """Rounds that decide are at least this far apart (a round at 1,000 nodes costs 1-2 s
    of the event loop the extender shares)."""
    window: int = 100
    """Waiting workloads per queue one round looks at (the rest wait their turn)."""
    reclaims: int = 1
    """Waiting workloads a round may reclaim for (one at a time, like gang preemption)."""
    reclaim_retry_seconds: float = 10.0
    """After a refused reclaim: the wait before it is tried again."""
    half_life_seconds: float = 0.0
    """Fair sharing over time: each queue's past share is decayed with this half-life
    and counted in its fair share (`gpuplace.placement.queueing.share_history`); 0: off."""
    hold_after_seconds: float = 0.0
    """Capacity holds for queues: a workload of several GPUs starving this long, of the
    queue furthest below its fair share, gets nodes fenced for it
    (`gpuplace.placement.queueing.holds`); 0: off."""


@dataclass(frozen=True, slots=True)
class Decided:
    """One round's decision with what it was made from (for the writes and the tells)."""

    round: admitting.Round
    found: workloads.Found
    waiting: tuple[admitting.Workload, ...]
    """What entered the round."""
    cut: Mapping[str, tuple[int, int]]
    """Per queue, (workloads, pods) left out by the window."""


def urgency(workload: admitting.Workload, spec: quotas.QueueSpec, now: float) -> tuple[Any, ...]:
    """The engine's order within a queue, as far as the controller can tell it before a
    round (past `maxWait`, then priority, then age)."""
    overdue = spec.max_wait is not None and now - workload.created > spec.max_wait
    return (not overdue, -workload.priority, workload.created, workload.key)


def window(
    waiting: Sequence[admitting.Workload],
    specs: Sequence[quotas.QueueSpec],
    now: float,
    size: int,
) -> tuple[list[admitting.Workload], dict[str, tuple[int, int]]]:
    """At most `size` waiting workloads per queue, the most urgent; and per queue what was
    left out, (workloads, pods). O(W log W)."""
    by_name = {spec.name: spec for spec in specs}
    lines: dict[str, list[admitting.Workload]] = {}
    for workload in waiting:
        lines.setdefault(workload.queue, []).append(workload)
    kept: list[admitting.Workload] = []
    cut: dict[str, tuple[int, int]] = {}
    for queue, line in lines.items():
        spec = by_name.get(queue)
        if spec is not None:
            line.sort(key=lambda w: urgency(w, spec, now))
        kept.extend(line[:size])
        rest = line[size:]
        if rest:
            cut[queue] = (len(rest), sum(len(w.members) for w in rest))
    return kept, cut


def decide(
    sync: LedgerSync,
    policy: Policy,
    specs: Sequence[quotas.QueueSpec],
    pods: Mapping[str, PodRecord],
    *,
    now: float,
    fenced: frozenset[str] = frozenset(),
    leaving: Mapping[str, str] | None = None,
    size: int = 100,
    reclaims: int = 1,
    fence_members: frozenset[str] = frozenset(),
    past: Mapping[str, float] | None = None,
) -> Decided:
    """Steps 2 and 3 of the module docstring without the holds: the round on a scratch
    copy of `sync`'s ledger (which stays as it was). Synchronous; its cost is the
    engine's (`gpuplace.placement.queueing.admitting`). Also what `gpuplace explain` asks.
    `past`: each queue's past share (fair sharing over time)."""
    found = workloads.collect(
        pods.values(),
        sync.ledger.inventory,
        fenced=fenced,
        fence_members=fence_members,
        leaving=leaving,
    )
    waiting, cut = window(found.waiting, specs, now, size)
    placer = admitting.Placer.scratch(sync.ledger, policy)
    result = admitting.admit(
        placer, specs, found.running, waiting, now=now, reclaims=reclaims, past=past
    )
    return Decided(result, found, tuple(waiting), cut)


class QueueController(Controller[QueueSettings, None, QueueApi]):
    """See the module docstring. Collaborators are passed in (`gpuplace.wiring.queues`
    builds them for the sidecar and the tests alike): the kit's `parts`
    (`gpuplace.controllers.controller.Parts`: the pod and GpuQueue API, the ledger sync,
    the policy, fences, recorder, clock and leader gate), the queued pods (`store`,
    `gpuplace.controllers.store.queued_pods(parts.sync)`), and its own: the `directory` of
    queues and namespaces, and `registry`, where its metrics go."""

    def __init__(
        self,
        parts: Parts[QueueApi],
        store: PodIndex[None],
        directory: QueueDirectory,
        *,
        registry: CollectorRegistry | None = None,
        settings: QueueSettings | None = None,
    ) -> None:
        self.metrics = QueueMetrics(registry)
        settings = settings or QueueSettings()
        super().__init__("queue", parts, store, settings=settings, leading=self.metrics.leading)
        sync, clock = parts.sync, parts.clock
        self.directory = directory
        self.admitter = Admitter(self.writer, sync, clock=clock)
        self.reclaimer = Reclaimer(
            self.api,
            sync,
            self.metrics,
            recorder=self.recorder,
            retry_seconds=self.settings.reclaim_retry_seconds,
        )
        self.decisions = 0
        """Rounds that ran the engine."""
        self.last: Decided | None = None
        """The last round's decision (tests, metrics)."""
        self._signature: tuple[object, ...] = ()
        self._written: dict[str, dict[str, Any]] = {}
        self.history = (
            ShareHistory(self.settings.half_life_seconds)
            if self.settings.half_life_seconds > 0
            else None
        )
        """Each queue's past share (None: fair sharing looks at shares now only). Read
        back from the GpuQueues' statuses at the first round (`_past`), so a restart or a
        failover goes on from what the last leader wrote."""
        self._restored = False
        if self.settings.hold_after_seconds > 0 and self.history is None:
            log.warning(
                "capacity holds without fair sharing over time: a held node may drain for a "
                "workload that may not preempt what is left there (docs/performance.md, "
                "Queues); set a fair-sharing half-life too"
            )
        directory.listeners.append(self.loop.poke)

    # --- running ---------------------------------------------------------------------

    async def run(self) -> None:
        """Run rounds until cancelled; never raises on API failures."""
        ready = (
            self.store.synced,
            self.directory.queues_synced,
            self.directory.namespaces_synced,
            self.sync.ready,
        )
        await self.loop.run(self.step, self._follow, ready=ready)

    def _follow(self) -> None:
        """A round while another replica decides: tell waiting pods if gpuplace is
        blocked (the Lease cannot be read), nothing else; the next leader writes the past
        shares, read back when this replica leads again."""
        self._restored = False
        reason = self.blocked() if self.blocked is not None else None
        if reason is None:
            return
        for pod in self.store.pods.values():
            if (
                pod.controlled.queue_gated
                and pod.live
                and self._told.first(pod.uid, f"{events.BLOCKED}")
            ):
                self._emit(pod, recording.WARNING, events.BLOCKED, reason)

    def _fenced(self) -> frozenset[str]:
        return self.fences.nodes if self.fences is not None else frozenset()

    def _fence_members(self) -> frozenset[str]:
        fence = self.fences.current if self.fences is not None else None
        return fence.members if fence is not None else frozenset()

    def _past(self, now: float) -> dict[str, float]:
        """Each queue's past share now; at the first round, read back from the statuses
        the last leader wrote (`statuses.remembered`)."""
        if self.history is None:
            return {}
        if not self._restored:
            self._restored = True
            found = {}
            for name, record in self.directory.queues.items():
                remembered = statuses.remembered(record)
                if remembered is not None:
                    found[name] = remembered
            self.history.restore(now, found)
        return self.history.past(now)

    def _update_hold(self, decided: Decided, now: float, past: Mapping[str, float]) -> None:
        """Hold capacity for the starving workload of the queue furthest below its fair
        share (`gpuplace.placement.queueing.holds`), in the one fence the gang controller also
        uses: never over a gang's fence; lifted once no workload starves."""
        if self.fences is None or self.settings.hold_after_seconds <= 0:
            return
        current = self.fences.current
        if current is not None and current.kind != QUEUED:
            self.metrics.held.set(0)  # a starving gang's: it goes first
            return
        by_key = {workload.key: workload for workload in decided.waiting}
        head = holds.starving(
            decided.round,
            by_key,
            now=now,
            after=self.settings.hold_after_seconds,
            past=past,
            current=_key(current.owner, by_key) if current is not None else "",
        )
        if head is None:
            if current is not None:
                self.fences.release()
                self.metrics.held.set(0)
            return
        uids = frozenset(member.uid for member in head.members)
        owner = _owner(head.key)
        inventory = self.sync.ledger.inventory
        running = [run for run in decided.found.running if not run.leaving_for]
        queue_of = {uid: run.queue for run in running for uid in run.uids}
        stay = holds.staying(decided.round, head, queue_of, past)
        same = (
            current is not None
            and current.owner == owner
            and current.members == uids
            and all(name in inventory for name in current.nodes)
        )
        held = current.nodes if current is not None and same else None
        nodes = holds.choose(self.sync.ledger, head, stay, held)
        if nodes is None:
            return
        if not nodes:
            if current is not None:
                self.fences.release()
                self.metrics.held.set(0)
            return
        self.fences.hold(Fence(owner, frozenset(nodes), uids, head.created, QUEUED))
        self.metrics.held.set(len(nodes))
        log.info(
            "queue capacity held",
            extra={"workload": head.key, "queue": head.queue, "nodes": len(nodes)},
        )
        shown = ", ".join(nodes[:8]) + (f" and {len(nodes) - 8} more" if len(nodes) > 8 else "")
        message = (
            f"nodes {shown} are kept for this workload (no new pod there) until they "
            f"have room for it: its queue {head.queue} is furthest below its fair share"
        )
        for member in head.members:
            pod = decided.found.pods.get(member.uid)
            if pod is not None and self._told.first(pod.uid, f"{events.HELD}:{sorted(nodes)}"):
                self._emit(pod, recording.NORMAL, events.HELD, message)

    async def step(self) -> None:
        """One round (module docstring)."""
        now = self.clock()
        await self._settle()
        policy = self.policy()
        # With no queued pod at all, the round cannot depend on the ledger (nothing to
        # admit, nothing running to count): a cluster that uses no queues pays no round
        # per bind (each an O(nodes) scratch copy of the ledger), only one per change
        # of the GpuQueues (their statuses) or every `poll_seconds`.
        queued = bool(self.store.pods)
        signature = (
            self.sync.ledger.generation if queued else None,
            self.sync.ledger.relabelled if queued else None,
            self.sync.pods_version if queued else None,
            self.store.version,
            self.directory.version,
            self.fences.version if self.fences is not None else 0,
            id(policy),
            len(self.reclaimer.leaving),
        )
        fresh = time.monotonic() - self.loop.decided_at >= self.settings.poll_seconds
        if signature == self._signature and not fresh:
            return
        await asyncio.sleep(0)  # let the extender's verbs in before the round's CPU work
        started = time.perf_counter()
        specs = self.directory.specs()
        past = self._past(now)
        decided = decide(
            self.sync,
            policy,
            specs,
            self.store.pods,
            now=now,
            fenced=self._fenced(),
            fence_members=self._fence_members(),
            leaving=self.reclaimer.leaving,
            size=self.settings.window,
            reclaims=self.settings.reclaims,
            past=past,
        )
        if self.history is not None:
            self.history.observe(now, {q.name: q.share for q in decided.round.queues})
        held = self._hold(decided.round.admissions)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        self._signature = signature
        self.loop.decided()
        self.last = decided
        self.decisions += 1
        await asyncio.sleep(0)
        for admission in held:
            await self._admit(admission, decided.found, now)
        await self._reclaim(decided, now)
        self._update_hold(decided, now, past)
        self._tell(decided)
        await self._statuses(decided, specs, now)
        self._forget()

    # --- settling, holding, admitting ------------------------------------------------

    async def _settle(self) -> None:
        for plan_id, members in self.admitter.open_plans(self.store.pods).items():
            try:
                written = await self.admitter.settle(plan_id, members)
            except kube.ApiError as error:
                log.warning(
                    "queue plan not settled",
                    extra={"plan": plan_id, "status": error.status, "reason": error.reason},
                )
                continue
            for pod in written.admitted:
                self._admitted(pod, "its plan was settled after a restart or a failover")

    def _hold(self, admissions: Sequence[admitting.Admission]) -> list[admitting.Admission]:
        """Reserve every admission's grants in the live ledger, all or none per admission
        (synchronous). The round was decided on a copy of this very ledger with nothing in
        between, so a refusal means a bug or a grant the copy did not see: that admission
        is left for the next round."""
        held = []
        for admission in admissions:
            taken: list[str] = []
            try:
                for grant in admission.grants:
                    self.sync.hold(
                        grant, seconds=self.settings.hold_seconds, owner=f"queue:{admission.key}"
                    )
                    taken.append(grant.pod_uid)
            except LedgerError as error:
                log.warning(
                    "queue admission not reserved",
                    extra={"workload": admission.key, "error": str(error)},
                )
                for uid in taken:
                    self.sync.unhold(uid)
                continue
            held.append(admission)
        return held

    async def _admit(
        self, admission: admitting.Admission, found: workloads.Found, now: float
    ) -> None:
        pods = [found.pods[uid] for uid in admission.uids if uid in found.pods]
        by_uid = {grant.pod_uid: grant for grant in admission.grants}
        if len(pods) != len(admission.uids):
            for uid in admission.uids:
                self.sync.unhold(uid)
            return
        if len(pods) == 1 and not pods[0].controlled.gang_name:
            written = await self.admitter.pod(pods[0], by_uid[pods[0].uid])
        else:
            going = [
                found.pods[uid]
                for r in found.running
                if r.key == admission.key and not r.leaving_for
                for uid in r.uids
                if uid in found.pods
            ]
            written = await self.admitter.gang(
                pods,
                [by_uid[pod.uid] for pod in pods],
                running=len(going),
                run=restarts.current_run(going),
            )
        self._written_admission(admission, pods, written, now)

    def _written_admission(
        self,
        admission: admitting.Admission,
        pods: Sequence[PodRecord],
        written: Written,
        now: float,
    ) -> None:
        if not written.admitted:
            log.info(
                "queue admission not written",
                extra={"workload": admission.key, "why": written.why},
            )
            return
        self.metrics.admissions.labels(admission.queue).inc()
        spec = next((s for s in self.directory.specs() if s.name == admission.queue), None)
        cohort = spec.cohort if spec is not None else ""
        borrowing = f", borrowing from cohort {cohort}" if admission.borrowing else ""
        growth = " (the elastic gang grows)" if admission.growth else ""
        waited = max(now - min(pod.created for pod in pods), 0.0)
        log.info(
            "queue admitted",
            extra={
                "workload": admission.key,
                "queue": admission.queue,
                "pods": len(written.admitted),
                "borrowing": admission.borrowing,
            },
        )
        for pod in written.admitted:
            grant = next(g for g in admission.grants if g.pod_uid == pod.uid)
            gpus = ",".join(map(str, grant.gpus))
            self._admitted(
                pod,
                f"admitted by GpuQueue {admission.queue}{borrowing}{growth} after "
                f"{telling.duration(waited)}: GPUs {gpus} of node {grant.node} are "
                "reserved for it",
            )

    def _admitted(self, pod: PodRecord, message: str) -> None:
        self._emit(pod, recording.NORMAL, events.ADMITTED, message)

    # --- reclaiming --------------------------------------------------------------------

    async def _reclaim(self, decided: Decided, now: float) -> None:
        members = {w.key: w for w in decided.waiting}
        for reclaim in decided.round.reclaims:
            workload = members.get(reclaim.key)
            claimants = (
                [decided.found.pods[m.uid] for m in workload.members if m.uid in decided.found.pods]
                if workload is not None
                else []
            )
            await self.reclaimer.apply(reclaim, claimants, now)

    # --- telling -----------------------------------------------------------------------

    def _tell(self, decided: Decided) -> None:
        """Events on waiting pods, once per (pod, reason kind)."""
        members = {w.key: w for w in decided.waiting}
        for waiting in decided.round.waiting:
            workload = members.get(waiting.key)
            if workload is None:
                continue
            for member in workload.members:
                pod = decided.found.pods.get(member.uid)
                if pod is None or not self._told.first(pod.uid, waiting.why.value):
                    continue
                if waiting.why is admitting.Why.NEVER:
                    kind, reason = recording.WARNING, events.UNPLACEABLE
                elif waiting.why is admitting.Why.NO_QUEUE:
                    kind, reason = recording.WARNING, events.MISSING
                else:
                    kind, reason = recording.NORMAL, events.WAITING
                self._emit(
                    pod,
                    kind,
                    reason,
                    f"waiting in GpuQueue {waiting.queue} ({waiting.why.value}): {waiting.reason}",
                )
        for aside in decided.found.aside:
            kind = recording.WARNING if aside.why == workloads.UNREADABLE else recording.NORMAL
            for pod in aside.pods:
                if self._told.first(pod.uid, aside.why):
                    self._emit(
                        pod,
                        kind,
                        events.WAITING,
                        f"waiting in GpuQueue {aside.queue}: {aside.reason}",
                    )

    async def _statuses(
        self, decided: Decided, specs: Sequence[quotas.QueueSpec], now: float
    ) -> None:
        """Each GpuQueue's status, written when it changed; the per-queue metrics."""
        by_name = {status.name: status for status in decided.round.queues}
        past = self.history.past(now) if self.history is not None else None
        stamp = assignments.rfc3339(datetime.fromtimestamp(self.clock(), UTC))
        for spec in specs:
            status = by_name.get(spec.name)
            if status is not None:
                workloads_cut, pods_cut = decided.cut.get(spec.name, (0, 0))
                status = dataclasses.replace(
                    status,
                    waiting=status.waiting + workloads_cut,
                    waiting_pods=status.waiting_pods + pods_cut,
                )
                by_name[spec.name] = status
                self.metrics.show(status, spec, past.get(spec.name, 0.0) if past else 0.0)
        self.metrics.keep(by_name)
        for name, record in list(self.directory.queues.items()):
            wanted = statuses.body(
                record, by_name.get(name), stamp, None if past is None else past.get(name, 0.0)
            )
            written = self._written.get(name)
            if not statuses.changed(record, wanted) or (
                written is not None and not statuses.differs(written, wanted)
            ):
                continue
            try:
                await self.api.patch_gpuqueue_status(name, {"status": wanted})
            except kube.ApiError as error:
                log.warning(
                    "queue status not written",
                    extra={"queue": name, "status": error.status, "reason": error.reason},
                )
                continue
            self._written[name] = wanted

    def _forget(self) -> None:
        """Drop memos of pods and queues the API no longer has (bounded memory)."""
        self._told.keep(self.store.pods)
        self._written = {n: s for n, s in self._written.items() if n in self.directory.queues}
        waiting = {pod.workload for pod in self.store.pods.values() if pod.controlled.queue_gated}
        self.reclaimer.keep(self.store.pods, waiting)


def _owner(key: str) -> tuple[str, str]:
    """A workload key (`namespace/name` or `gang namespace/name`) as a fence's owner."""
    namespace, _, name = key.removeprefix("gang ").partition("/")
    return namespace, name


def _key(owner: tuple[str, str], workloads: Mapping[str, admitting.Workload]) -> str:
    """The key of the workload a fence's owner names (a pod's or a gang's)."""
    namespace, name = owner
    pod = f"{namespace}/{name}"
    return pod if pod in workloads else f"gang {pod}"
