"""A gang ends together: a member that fails takes its run's other members down
(docs/gangs.md, "When a member fails").

Each round (`Restarts.step`, leader only) the gang controller asks the controller kit
which runs a failure broke (`gpuplace.controllers.restarts.broken`, read from the pods,
plus the tombstones of started members this process saw deleted before they completed)
and, for a gang whose `gang-on-failure` is `restart`:

1. evicts every live member of the broken run, the failed one too if it still runs (a
   container restarting in place; one whose containers all exited under `restartPolicy:
   Never` is left to end by itself, `PodRecord.controlled.ending`, so that its Job counts
   the failure and keeps the pod and its logs), through the Eviction API
   (`gpuplace.controllers.evictions.evict`, the UID as precondition, never a DELETE):
   kube-apiserver writes each one's `DisruptionTarget` condition itself (reason
   `EvictionByEvictionAPI`, kept by the kubelet through termination; an edit of it by
   gpuplace would be undone by the kubelet, as seen on v1.36.2), so a Job's
   `podFailurePolicy` rule on `DisruptionTarget` can ignore the restart; gpuplace adds
   why: the Event `GangRestarting` on each member naming the member that failed, the
   Event `GangMemberFailed` on that member, and the condition
   `gpuplace.io/GangReady=False` (reason `GangRestarting`, which the kubelet keeps);
2. a refused eviction (a PodDisruptionBudget, a conflict) is told (`GangRestartRefused`)
   and tried again after `retry_seconds`; one without an answer counts as sent once the
   pod shows its deletion (never evicted twice);
3. returns the gangs whose broken runs still hold GPUs (members not finished yet): the
   controller plans none of their new members until none is left, so a member of the old
   run never holds GPUs beside one of the new run; the queue controller holds back a
   queued gang's new members by the same rule.

Under `continue` the others run on: each live one hears once which member failed.
The evicted members' GPUs return to the ledger as they finish (the informer), exactly
as any pod's. Nothing here must live across a restart of the process: a broken run is
read again from the pods (the evictions sent show as deletions), only the tombstones of
pods that vanished at once are memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster import recording
from gpuplace.cluster.pods import PodRecord
from gpuplace.controllers import evictions, restarts, telling
from gpuplace.controllers.restarts import Broken, Gone
from gpuplace.gangs import events
from gpuplace.gangs.conditions import Conditions
from gpuplace.placement.gangs import GangKey

log = logging.getLogger(__name__)

TOMBSTONES = 10_000
"""Tombstones kept at most (the oldest go first): bounded memory."""


class RestartMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.restarts = Counter(
            "gpuplace_gang_restarts_total",
            "Runs of gangs a member's failure ended, by policy: restart (the others were "
            "evicted) or continue (they ran on).",
            ["policy"],
            registry=registry,
        )
        self.evictions = Counter(
            "gpuplace_gang_restart_evictions_total",
            "Evictions of the other members of a gang that restarts, by result: evicted or "
            "refused (tried again).",
            ["result"],
            registry=registry,
        )


@dataclass(frozen=True, slots=True)
class Held:
    """A gang whose new members wait for its broken run's members to finish."""

    key: GangKey
    cause: str
    stopping: tuple[PodRecord, ...]


class Restarts:
    """See the module docstring. `listen` is the ledger sync's pod listener (tombstones);
    `step` runs in the gang controller's round."""

    def __init__(
        self,
        api: evictions.EvictionApi,
        conditions: Conditions,
        *,
        recorder: recording.Recorder | None,
        told: telling.Told,
        clock: Callable[[], float],
        registry: CollectorRegistry | None = None,
        retry_seconds: float = 10.0,
    ) -> None:
        self.api = api
        self.conditions = conditions
        self.recorder = recorder
        self.told = told
        self.clock = clock
        self.retry_seconds = retry_seconds
        self.metrics = RestartMetrics(registry)
        self.gone: dict[GangKey, dict[str, Gone]] = {}
        """Started members seen deleted before they completed, by gang and UID."""
        self.first: dict[GangKey, dict[str, str]] = {}
        """Per gang, run -> the UID of the member first named as its failure."""
        self._retry: dict[str, float] = {}
        """Member UID -> when its refused eviction is tried again."""
        self._counted: set[tuple[GangKey, str]] = set()

    # --- the informer's side ---------------------------------------------------------

    def listen(self, old: PodRecord | None, new: PodRecord | None) -> None:
        """A managed pod changed: keep a tombstone of a started gang member that went
        before it completed (it cannot be read back from the API). O(1)."""
        if new is not None or old is None or not old.controlled.gang_name:
            return
        mark = old.controlled.plan
        if mark is None or not restarts.started(old) or old.phase == "Succeeded":
            return
        why = old.controlled.failure or restarts.VANISHED
        tombs = self.gone.setdefault(old.gang_key, {})
        tombs[old.uid] = Gone(old.uid, str(old), mark.run_id, why, old.controlled.disrupted)
        if sum(len(found) for found in self.gone.values()) > TOMBSTONES:
            oldest = next(iter(self.gone))
            del self.gone[oldest]

    # --- a round -----------------------------------------------------------------------

    async def step(self, groups: Mapping[GangKey, list[PodRecord]]) -> dict[GangKey, Held]:
        """Take the broken runs down (module docstring); the gangs whose new members
        must wait, with why. O(gang pods) plus one eviction per live member of a
        broken run (once)."""
        held: dict[GangKey, Held] = {}
        now = self.clock()
        for key, pods in groups.items():
            found = restarts.broken(
                key,
                pods,
                gone=self.gone.get(key),
                first=self.first.get(key),
                every_policy=True,
            )
            for run in found:
                self.first.setdefault(key, {}).setdefault(run.run, run.failed_uid)
                restart = any(pod.controlled.restart for pod in pods)
                if (key, run.run) not in self._counted:
                    self._counted.add((key, run.run))
                    self.metrics.restarts.labels("restart" if restart else "continue").inc()
                    log.info(
                        "gang member failed",
                        extra={"gang": "/".join(key), "run": run.run, "cause": run.cause},
                    )
                if not restart:
                    self._tell_continue(run)
                    continue
                self._tell_failed(run, pods)
                await self._take_down(run, now)
                held[key] = Held(key, run.cause, restarts.barrier(found))
        self._forget(groups)
        return held

    def _tell_failed(self, run: Broken, pods: Iterable[PodRecord]) -> None:
        failed = next((pod for pod in pods if pod.uid == run.failed_uid), None)
        if failed is None or not self.told.first(failed.uid, f"{events.MEMBER_FAILED}@{run.run}"):
            return
        others = len([pod for pod in run.running if pod.uid != failed.uid])
        telling.emit(
            self.recorder,
            failed,
            recording.WARNING,
            events.MEMBER_FAILED,
            f"this member failed ({run.why}); gang {run.key[1]} restarts (gang-on-failure: "
            f"restart): its {others} other running member{'s are' if others != 1 else ' is'} "
            "evicted, and the members its owner creates again start as one gang",
        )

    def _tell_continue(self, run: Broken) -> None:
        for pod in run.running:
            if pod.uid != run.failed_uid and self.told.first(
                pod.uid, f"{events.MEMBER_FAILED}@{run.run}"
            ):
                telling.emit(
                    self.recorder,
                    pod,
                    recording.NORMAL,
                    events.MEMBER_FAILED,
                    f"gang {run.key[1]}: {run.cause}; this member runs on "
                    "(gang-on-failure: continue)",
                )

    async def _take_down(self, run: Broken, now: float) -> None:
        """Evict the run's live members, once each; a refusal is tried again later."""
        message = (
            f"gang {run.key[1]} restarts: {run.cause}; this member is evicted through the "
            "Eviction API and its GPUs are released; the members its owner creates again "
            "start as one gang"
        )
        for pod in sorted(run.running, key=lambda pod: pod.name):
            if now < self._retry.get(pod.uid, 0.0):
                continue
            done = await evictions.evict(self.api, [pod])
            if done.refusal is None:
                self._retry.pop(pod.uid, None)
                self.metrics.evictions.labels("evicted").inc()
                log.info(
                    "gang member evicted for a restart",
                    extra={"gang": "/".join(run.key), "pod": str(pod), "run": run.run},
                )
                if self.told.first(pod.uid, f"{events.RESTARTING}@{run.run}"):
                    telling.emit(self.recorder, pod, recording.WARNING, events.RESTARTING, message)
                await self.conditions.set(pod, "False", events.RESTARTING, message)
                continue
            _, error = done.refusal
            if evictions.already_going(error):  # deleted meanwhile, or its namespace is
                self._retry.pop(pod.uid, None)
                continue
            self.metrics.evictions.labels("refused").inc()
            self._retry[pod.uid] = now + self.retry_seconds
            why = evictions.refusal_text(error)
            log.info(
                "gang restart eviction refused",
                extra={"gang": "/".join(run.key), "pod": str(pod), "status": error.status},
            )
            if self.told.first(pod.uid, f"{events.RESTART_REFUSED}@{run.run}@{error.status}"):
                telling.emit(
                    self.recorder,
                    pod,
                    recording.WARNING,
                    events.RESTART_REFUSED,
                    f"gang {run.key[1]} restarts ({run.cause}), but the eviction of this "
                    f"member was refused ({why}); it is tried again in "
                    f"{telling.duration(self.retry_seconds)}, and the gang's new members "
                    "wait until it has gone",
                )

    def retry_at(self) -> float | None:
        """When a refused eviction is next tried (None: none waits)."""
        return min(self._retry.values(), default=None)

    def _forget(self, groups: Mapping[GangKey, list[PodRecord]]) -> None:
        """Drop what concerns gangs or runs with nothing left to take down or wait for."""
        live_runs = {
            (key, pod.controlled.plan.run_id)
            for key, pods in groups.items()
            for pod in pods
            if pod.controlled.plan is not None and not pod.terminal
        }
        for memo in (self.gone, self.first):
            for key in [key for key in memo if key not in groups]:
                del memo[key]
        for key, tombs in self.gone.items():
            for uid in [uid for uid, tomb in tombs.items() if (key, tomb.run) not in live_runs]:
                del tombs[uid]
        for key, named in self.first.items():
            for run in [run for run in named if (key, run) not in live_runs]:
                del named[run]
        self._counted = {item for item in self._counted if item in live_runs}
        uids = {pod.uid for pods in groups.values() for pod in pods if pod.live}
        for uid in [uid for uid in self._retry if uid not in uids]:
            del self._retry[uid]
