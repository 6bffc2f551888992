"""A queue takes back what it lent: the engine's reclaim carried out through the Eviction API.

The round (`gpuplace.placement.queueing.admitting`) names, for at most one waiting workload, the
borrowed workloads to preempt — an elastic gang's extra members first, then whole
workloads, lowest priority and most recently admitted first, each of them needed. Here:

1. the victims are read again and their namespaces' PodDisruptionBudgets listed, and all
   of them are checked together as the API server would
   (`gpuplace.controllers.evictions.budget_refusals`, as the gang controller's preemption
   does); one refused: nothing is evicted, a
   Warning `QueueReclaimBlocked` on the waiting workload's pods says which and why, and
   the reclaim is not tried again before `retry_seconds`;
2. each victim is evicted (`pods/NAME/eviction`, its UID as precondition: never a plain
   DELETE; `gpuplace.controllers.evictions.evict`), in the engine's order; a refusal (a
   budget that changed meanwhile, the pod gone) stops there, honestly partial, and is
   retried later; an eviction without an answer may have gone through and counts as
   leaving;
3. every evicted pod is *leaving* for the workload (`leaving`): the next rounds count it
   gone when they look for victims (a reclaim is never repeated) while its GPUs still
   count until it is gone; the waiting workload goes first in its queue and is admitted
   on the freed GPUs. After a restart the same is read from the pods (being deleted).

The API server sets `DisruptionTarget` on every pod it evicts, so a Job whose
`podFailurePolicy` ignores that condition neither counts the preemption as a failure nor
gives up: its replacement waits in the queue again (docs/queues.md, "Jobs").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from gpuplace.cluster import kube, recording
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import evictions, telling
from gpuplace.controllers.api import Pod
from gpuplace.placement.queueing import admitting
from gpuplace.queues import events
from gpuplace.queues.metrics import QueueMetrics

log = logging.getLogger(__name__)


class Reclaimer:
    """Carries out reclaims; see the module docstring."""

    def __init__(
        self,
        api: evictions.EvictionApi,
        sync: LedgerSync,
        metrics: QueueMetrics,
        *,
        recorder: recording.Recorder | None = None,
        retry_seconds: float = 10.0,
    ) -> None:
        self.api = api
        self.sync = sync
        self.metrics = metrics
        self.recorder = recorder
        self.retry_seconds = retry_seconds
        self.leaving: dict[str, str] = {}
        """UID of each pod a reclaim evicted -> the workload it was evicted for."""
        self._retry: dict[str, float] = {}
        """Per waiting workload, no reclaim before this (after a refusal)."""

    def keep(self, uids: Iterable[str], keys: Iterable[str]) -> None:
        """Forget the pods and workloads the API no longer has (bounded memory)."""
        alive, waiting = set(uids), set(keys)
        self.leaving = {uid: key for uid, key in self.leaving.items() if uid in alive}
        self._retry = {key: at for key, at in self._retry.items() if key in waiting}

    def _emit(self, pod: Pod, kind: str, reason: str, message: str) -> None:
        telling.emit(self.recorder, pod, kind, reason, message)

    async def apply(
        self, reclaim: admitting.Reclaim, claimants: Sequence[PodRecord], now: float
    ) -> None:
        """Evict `reclaim`'s victims for the waiting workload whose pods are `claimants`
        (module docstring). Never raises on API failures (logged; retried later)."""
        if now < self._retry.get(reclaim.key, 0.0):
            return
        uids = [uid for victim in reclaim.victims for uid in victim.uids]
        records = [self.sync.pods.get(uid) for uid in uids]
        victims = [record for record in records if record is not None]
        if len(victims) < len(uids):
            return  # a victim went meanwhile: the next round looks again
        queue_of = {uid: victim.queue for victim in reclaim.victims for uid in victim.uids}
        try:
            refused = await evictions.budget_refusals(self.api, victims)
        except kube.ApiError as error:
            log.warning(
                "queue reclaim pre-check failed",
                extra={"workload": reclaim.key, "status": error.status, "reason": error.reason},
            )
            self._retry[reclaim.key] = now + self.retry_seconds
            return
        if refused is None:
            return
        if refused:
            why = "; ".join(f"{v}: {refused[v.uid]}" for v in victims if v.uid in refused)
            self._blocked(reclaim, claimants, f"PodDisruptionBudgets forbid it now ({why})")
            self._retry[reclaim.key] = now + self.retry_seconds
            return
        freed = evictions.freed(self.sync, victims)

        def evicted(victim: PodRecord) -> None:
            self.leaving[victim.uid] = reclaim.key
            self.metrics.preempted.labels(queue_of[victim.uid]).inc()
            self._emit(
                victim,
                recording.NORMAL,
                recording.PREEMPTED,
                f"preempted to free {freed.get(victim.uid, 'its GPUs')}: GpuQueue "
                f"{queue_of[victim.uid]} uses quota its cohort lent it, and GpuQueue "
                f"{reclaim.queue} needs it for {reclaim.key}",
            )

        done = await evictions.evict(self.api, victims, evicted)
        gone = done.gone
        if done.refusal is not None:
            victim, refusal = done.refusal
            if done.unsure is not None:
                self.leaving[victim.uid] = reclaim.key
            self._blocked(
                reclaim,
                claimants,
                f"the eviction of {victim} was refused ({evictions.refusal_text(refusal)}); "
                f"{len(gone)} of {len(victims)} victims were evicted",
            )
            self._retry[reclaim.key] = now + self.retry_seconds
        if not gone:
            return
        self.metrics.reclaims.labels(reclaim.queue).inc()
        names = ", ".join(str(victim) for victim in gone)
        log.info(
            "queue reclaim",
            extra={"workload": reclaim.key, "queue": reclaim.queue, "evicted": names},
        )
        for pod in claimants:
            self._emit(
                pod,
                recording.NORMAL,
                events.RECLAIMING,
                f"GpuQueue {reclaim.queue} preempts borrowed workloads of its cohort for "
                f"{reclaim.key}: evicted {names}; it is admitted on their GPUs once they are "
                "gone",
            )

    def _blocked(
        self, reclaim: admitting.Reclaim, claimants: Sequence[PodRecord], why: str
    ) -> None:
        log.info("queue reclaim blocked", extra={"workload": reclaim.key, "why": why})
        for pod in claimants:
            self._emit(
                pod,
                recording.WARNING,
                events.RECLAIM_BLOCKED,
                f"GpuQueue {reclaim.queue} cannot reclaim for {reclaim.key} yet: {why}; it "
                f"tries again in {self.retry_seconds:g}s",
            )
