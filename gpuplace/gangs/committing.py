"""The crash-safe commit of a gang's plan: every member starts, or none holds GPUs.

A plan is the set of members carrying the same `gpuplace.io/gang-plan` mark
(`gpuplace.cluster.gang_marks.PlanMark`). Its commit, in the API only, so that a crash
at any point (this process, a lost Lease, the API failing a write) leaves a gang
entirely ungated or entirely gated, never half:

1. **write** (`start`): one PATCH per member with its assignment annotations
   (`gpuplace.cluster.assignments`: what a bind writes) and the plan mark, with the UID
   and resourceVersion the planner read as preconditions. The plan is *committed* once
   every member carries the mark; from then on it only rolls forward. A write that
   fails rolls the plan back at once.
2. **settle** (`settle`, also every round for plans found in the API): on fresh reads
   (`fetch`) of the plan's members, if any of them is already ungated, or all of them
   are still there, roll forward: **narrow** each gated member's node affinity to its
   node (`gpuplace.controllers.pinning`), then **ungate** each (remove our gate, stamp
   `assigned-at`). Otherwise (a member is gone before any started, or the plan was
   never fully written) **roll back**: **clear** the mark and assignment from each
   member still unbound, and release what the ledger held for them.

A queued gang's plan is written by its queue (`gpuplace.queues.committing`, with the queue
gate still on every member) and handed over here once the queue removed its gates: a
plan is never settled while a member carries the queue gate, and once none does it only
rolls forward (the queue admitted it; a gate is never added back).

Every step is a `gpuplace.controllers.writing.Writer.write`: a merge patch with UID and
resourceVersion preconditions, recomputed from a fresh read on 409, and a no-op when
the pod already shows it, so settling a plan twice (two rounds, two replicas during a
failover) ends the same way; the steps the queue controller takes too (the plan's
annotations, reading it back, narrowing, clearing) are `gpuplace.controllers.plans`.
`settle` returns what happened (`Placed`, `RolledBack`) for the controller to tell
(Events, metrics, conditions).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import assignments, keys, kube, recording
from gpuplace.cluster.gang_marks import PlanMark, gated, plan_mark, queued
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import plans, telling
from gpuplace.controllers.store import PodIndex
from gpuplace.controllers.writing import Writer, raise_first
from gpuplace.gangs import events
from gpuplace.gangs.metrics import GangMetrics
from gpuplace.placement.gangs import GangKey
from gpuplace.placement.ledger import Grant

log = logging.getLogger(__name__)

Bodies = list[tuple[PodRecord, dict[str, Any]]]
"""Members with their pods as just read or written."""


@dataclass(frozen=True, slots=True)
class Committed:
    """A plan this process wrote completely (it rolls forward from here)."""

    key: GangKey
    members: tuple[PodRecord, ...]
    since: float


@dataclass(frozen=True, slots=True)
class Placed:
    """A plan rolled forward: `ready` were ungated now (`present`: every member of the
    plan still there, with its pod)."""

    key: GangKey
    plan_id: str
    present: Bodies
    ready: list[PodRecord]


@dataclass(frozen=True, slots=True)
class RolledBack:
    """A plan undone before any member started."""

    key: GangKey


Outcome = Placed | RolledBack | None
"""None: nothing to tell (the plan was already settled, or is gone)."""


class Commits:
    """The commit protocol of the module docstring, for the plans of one controller."""

    def __init__(
        self,
        writer: Writer,
        store: PodIndex[GangKey],
        sync: LedgerSync,
        *,
        metrics: GangMetrics,
        recorder: recording.Recorder | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.writer = writer
        self.store = store
        self.sync = sync
        self.metrics = metrics
        self.recorder = recorder
        self.plans = plans.Plans(writer, sync, clock)
        self.committed: dict[str, Committed] = {}
        """Plans this process wrote completely and has not settled yet, by plan id."""

    def open_plans(self) -> list[tuple[GangKey, str]]:
        """Plans to settle: those committed here, and those the store shows on gated live
        members (written before a restart, or by another replica, or by a queue). A plan
        with a member its queue still gates is the queue's to settle (`gpuplace.queues`):
        left alone. O(gang pods)."""
        found: dict[str, GangKey] = {
            plan_id: committed.key for plan_id, committed in self.committed.items()
        }
        queues: set[str] = set()
        for pod in self.store.pods.values():
            if pod.controlled.plan is not None and pod.live and pod.controlled.gang_name:
                if pod.controlled.queue_gated:
                    queues.add(pod.controlled.plan.id)
                elif pod.controlled.gang_gated:
                    found.setdefault(pod.controlled.plan.id, pod.gang_key)
        return [(key, plan_id) for plan_id, key in found.items() if plan_id not in queues]

    async def start(
        self,
        key: GangKey,
        members: Sequence[PodRecord],
        since: float,
        grants: Sequence[Grant],
        nodes: int,
        *,
        running: int = 0,
    ) -> Outcome:
        """Write a new plan (one `grants` entry per member, already held in the ledger),
        then settle it. A failed write rolls it back and releases the holds. `running`:
        members of the gang already started (its `gang-count` counts them too)."""
        plan_id = plans.new_id()
        by_uid = {grant.pod_uid: grant for grant in grants}
        size = len(members)
        at = self.plans.now()

        bodies: dict[str, dict[str, Any]] = {}

        async def annotate(pod: PodRecord) -> bool:
            grant = by_uid[pod.uid]
            annotations = self.plans.annotations(grant, plan_id, size, running + size, at)
            try:
                metadata = {
                    "uid": pod.uid,
                    "resourceVersion": pod.resource_version,
                    "annotations": annotations,
                }
                body = await self.writer.api.patch_pod(
                    pod.namespace, pod.name, {"metadata": metadata}
                )
            except kube.ApiError as error:
                log.info(
                    "gang plan not written",
                    extra={"pod": str(pod), "status": error.status, "reason": error.reason},
                )
                return False
            bodies[pod.uid] = body
            return gated(body) and plan_mark(body) == PlanMark(plan_id, size, grant.node)

        written = await self.writer.each(members, annotate)
        if not all(result is True for result in written):
            present = []
            for pod in members:
                body = await self.writer.fetch_quietly(pod)
                if body is not None:
                    present.append((pod, body))
            outcome: Outcome = None
            with contextlib.suppress(kube.ApiError):
                outcome = await self.roll_back(
                    key, plan_id, present, size, "its plan could not be written"
                )
            for pod in members:
                self.sync.unhold(pod.uid)
            return outcome
        self.committed[plan_id] = Committed(key, tuple(members), since)
        log.info(
            "gang plan written",
            extra={"gang": "/".join(key), "plan": plan_id, "members": size, "nodes": nodes},
        )
        return await self.settle(key, plan_id, bodies)

    async def settle(
        self, key: GangKey, plan_id: str, known: dict[str, dict[str, Any]] | None = None
    ) -> Outcome:
        """Roll a plan found in the API forward or back (rule in the module docstring).
        `known`: members' bodies just returned by our own writes (not read again).
        Raises `kube.ApiError` (the plan stays open: the next round settles it)."""
        committed = self.committed.get(plan_id)
        if committed is not None:
            members = list(committed.members)
            size = len(members)
        else:
            members = [
                pod
                for pod in self.store.members(key)
                if pod.controlled.plan is not None and pod.controlled.plan.id == plan_id
            ]
            if not members:
                return None
            size = max(
                pod.controlled.plan.members for pod in members if pod.controlled.plan is not None
            )
        present = await self.plans.present(plan_id, members, known)
        # a queue that admitted the plan (no member gated by it any more) started it too:
        # its members can never be queued again (a gate is never added back)
        started = any(
            not gated(body) or (queued(body) and not gated(body, keys.QUEUE_GATE))
            for _, body in present
        )
        if not started and len(present) < size:
            return await self.roll_back(key, plan_id, present, size)
        waiting = [(pod, body) for pod, body in present if gated(body)]
        narrowed = raise_first(
            await self.writer.each(waiting, lambda item: self._narrow(item[0], item[1], plan_id))
        )
        if not started and any(body is None for body in narrowed):
            still = [
                (pod, body)
                for (pod, _), body in zip(waiting, narrowed, strict=True)
                if body is not None
            ]
            return await self.roll_back(key, plan_id, still, size)
        ready = [
            (pod, body)
            for (pod, _), body in zip(waiting, narrowed, strict=True)
            if body is not None
        ]
        # the members start now: one `assigned-at` for all, after every earlier one
        stamp = assignments.restamped(self.plans.now())
        raise_first(
            await self.writer.each(ready, lambda item: self._ungate(item[0], item[1], stamp))
        )
        self.committed.pop(plan_id, None)
        if not ready:
            return None
        return Placed(key, plan_id, present, [pod for pod, _ in ready])

    async def roll_back(
        self, key: GangKey, plan_id: str, present: Bodies, size: int, why: str = ""
    ) -> Outcome:
        """Clear the plan from the members still carrying it and release their holds;
        each gets a `GangPlanRolledBack` Event saying `why` (default: members went)."""
        if not present:
            self.committed.pop(plan_id, None)
            return None
        await self.plans.clear(plan_id, present, lambda body: not plans.bound(body))
        self.committed.pop(plan_id, None)
        self.metrics.rollbacks.inc()
        log.info(
            "gang plan rolled back",
            extra={"gang": "/".join(key), "plan": plan_id, "present": len(present), "size": size},
        )
        why = why or (
            f"{size - len(present)} of its {size} planned members went away before the gang started"
        )
        message = (
            f"gang {key[1]}: {why}; the plan was undone and the gang waits for all "
            "members and room again (no GPU is held meanwhile)"
        )
        for pod, _ in present:
            telling.emit(self.recorder, pod, recording.WARNING, events.ROLLED_BACK, message)
        return RolledBack(key)

    async def _narrow(
        self, pod: PodRecord, body: dict[str, Any], plan_id: str
    ) -> dict[str, Any] | None:
        def change(current: dict[str, Any]) -> dict[str, Any] | None:
            mark = plan_mark(current)
            if not gated(current) or mark is None or mark.id != plan_id:
                return None
            affinity = plans.narrowed(current, mark.node)
            return None if affinity is None else {"spec": {"affinity": affinity}}

        return await self.writer.write(pod, body, change)

    async def _ungate(self, pod: PodRecord, body: dict[str, Any], stamp: dict[str, str]) -> None:
        def change(current: dict[str, Any]) -> dict[str, Any] | None:
            if not gated(current):
                return None
            return {
                "metadata": {"annotations": dict(stamp)},
                "spec": {"schedulingGates": plans.without_gate(current, keys.GANG_GATE)},
            }

        await self.writer.write(pod, body, change)
