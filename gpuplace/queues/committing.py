"""An admission written to the API crash-safe: the reservation recorded, the pod pinned to
its node, the queue gate removed; a queued gang's plan handed over to the gang controller.

The controller reserves an admission's grants in the live ledger (holds) before it writes
anything; from the first write on the reservation lives in the API (the assignment
annotations, which the ledger is rebuilt from), so a crash loses nothing and counts
nothing twice. Every write is a `gpuplace.controllers.writing.Writer.write`: a merge patch with
the pod's UID and resourceVersion as preconditions, recomputed from a fresh read on 409,
and a no-op once the pod shows it (so two rounds, or two replicas in a failover, end the
same way).

- **A pod alone** (`pod`): one write does it all: the assignment annotations
  (`gpuplace.cluster.assignments`, what a bind writes), its required node affinity
  narrowed to the planned node (`gpuplace.controllers.pinning`: allowed while it is gated) and
  the queue gate removed. kube-apiserver takes all three in one update (a gated pod's
  affinity may change in the same update that removes its last gate), so the pod is
  either untouched or admitted: there is nothing to settle after a crash.
- **A gang** (`gang`): the gang controller's plan format (`gpuplace.gangs.committing`),
  written by the queue, in two steps. 1: every member gets the assignment annotations,
  the plan mark `gpuplace.io/gang-plan` and `gpuplace.io/gang-count`, its queue gate
  still on (a failed write rolls the plan back: marks and assignments cleared, holds
  released). 2: once every member carries the mark, each gets its affinity narrowed and
  the queue gate removed. The gang gate stays: the gang controller then settles the plan
  as its own (narrow, a no-op by then, and ungate together), and never touches a plan
  while a member still carries the queue gate.
- **Recovery** (`open_plans`, `settle`, every round): a plan found on queue-gated members
  rolls forward (step 2) when any of its members already lost the queue gate, or all are
  still there carrying the mark; otherwise it rolls back. So after a crash at any point a
  gang is wholly admitted or wholly waiting, never half.

The steps the gang controller takes too (a plan's annotations, reading it back,
narrowing, clearing) are `gpuplace.controllers.plans`. Owns no state beyond the plans it
is writing (`writing`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import assignments, keys, kube
from gpuplace.cluster.gang_marks import gated, plan_mark
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import evictions, plans
from gpuplace.controllers.writing import Writer, raise_first
from gpuplace.placement.ledger import Grant

log = logging.getLogger(__name__)

Patch = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Written:
    """What an admission's writes came to: `admitted` pods (queue gate removed now), or
    none and why."""

    admitted: tuple[PodRecord, ...] = ()
    why: str = ""


def _admitting(current: Mapping[str, Any]) -> bool:
    """Still the queue's to admit: gated by it and not bound."""
    return gated(current, keys.QUEUE_GATE) and not plans.bound(current)


class Admitter:
    """The writes of the module docstring for one controller."""

    def __init__(self, writer: Writer, sync: LedgerSync, *, clock: Callable[[], float]) -> None:
        self.writer = writer
        self.sync = sync
        self.plans = plans.Plans(writer, sync, clock)
        self.writing: set[str] = set()
        """Plan ids being written by this process (never settled meanwhile)."""

    def _annotations(self, grant: Grant) -> dict[str, str | None]:
        node = self.sync.ledger.inventory.get(grant.node)
        return dict(assignments.annotations_for(grant, node, self.plans.now()))

    def _failed(self, pods: Sequence[PodRecord], error: kube.ApiError | None) -> None:
        """Release the holds of `pods` unless a write may have landed (no answer, or a
        gateway's): then the hold stays until the informer shows the pod or it expires."""
        if error is not None and evictions.unknown_outcome(error):
            return
        for pod in pods:
            self.sync.unhold(pod.uid)

    # --- a pod alone -------------------------------------------------------------------

    async def pod(self, pod: PodRecord, grant: Grant) -> Written:
        """Admit one pod whose `grant` is held (module docstring)."""
        annotations = self._annotations(grant)

        def change(current: dict[str, Any]) -> Patch | None:
            if not _admitting(current):
                return None
            spec = plans.released(current, keys.QUEUE_GATE, grant.node)
            return {"metadata": {"annotations": annotations}, "spec": spec}

        try:
            body = await self.writer.write(pod, None, change)
        except kube.ApiError as error:
            self._failed([pod], error)
            return Written(why=f"{error.status} {error.reason}: {error.message}")
        if body is None:
            self._failed([pod], None)
            return Written(why="the pod went away")
        if gated(body, keys.QUEUE_GATE) or plans.bound(body):
            self._failed([pod], None)
            return Written(why="the pod changed meanwhile")
        return Written((pod,))

    # --- a gang ------------------------------------------------------------------------

    async def gang(
        self,
        members: Sequence[PodRecord],
        grants: Sequence[Grant],
        *,
        running: int = 0,
        run: str = "",
    ) -> Written:
        """Write a gang's plan (one held grant per member), then settle it. `running`:
        members of the gang already admitted (its `gang-count` counts them too); `run`:
        the run they started ("": this plan starts one; `gpuplace.cluster.gang_marks`)."""
        plan_id = plans.new_id()
        by_uid = {grant.pod_uid: grant for grant in grants}
        size = len(members)
        at = self.plans.now()  # one admission: every member is admitted at once
        self.writing.add(plan_id)
        try:

            async def mark(pod: PodRecord) -> dict[str, Any] | None:
                grant = by_uid[pod.uid]
                annotations = self.plans.annotations(
                    grant, plan_id, size, running + size, at, run=run
                )

                def change(current: dict[str, Any]) -> Patch | None:
                    if plans.marked(current, plan_id) or not _admitting(current):
                        return None
                    return {"metadata": {"annotations": annotations}}

                return await self.writer.write(pod, None, change)

            written = await self.writer.each(members, mark)
            bodies = {
                pod.uid: body
                for pod, body in zip(members, written, strict=True)
                if isinstance(body, dict) and plans.marked(body, plan_id) and _admitting(body)
            }
            if len(bodies) < size:
                errors = [r for r in written if isinstance(r, kube.ApiError)]
                present = [(pod, bodies[pod.uid]) for pod in members if pod.uid in bodies]
                with contextlib.suppress(kube.ApiError):
                    await self.roll_back(plan_id, present)
                self._failed(members, errors[0] if errors else None)
                why = errors[0].message if errors else "a member changed or went away"
                return Written(why=f"the plan could not be written: {why}")
            log.info("queue plan written", extra={"plan": plan_id, "members": size})
            return await self.settle(plan_id, members, size, bodies)
        finally:
            self.writing.discard(plan_id)

    def open_plans(self, pods: Mapping[str, PodRecord]) -> dict[str, list[PodRecord]]:
        """Plans on queue-gated live members (written before a crash, or by another
        replica), by plan id, with the members that carry them. O(pods)."""
        found: dict[str, list[PodRecord]] = {}
        for pod in pods.values():
            if (
                pod.controlled.plan is not None
                and pod.controlled.queue_gated
                and pod.live
                and pod.controlled.plan.id not in self.writing
            ):
                found.setdefault(pod.controlled.plan.id, [])
        for pod in pods.values():
            if pod.controlled.plan is not None and pod.controlled.plan.id in found:
                found[pod.controlled.plan.id].append(pod)
        return found

    async def settle(
        self,
        plan_id: str,
        members: Sequence[PodRecord],
        size: int | None = None,
        known: Mapping[str, dict[str, Any]] | None = None,
    ) -> Written:
        """Roll a plan forward or back (module docstring). `known`: members' bodies just
        written (not read again). Raises `kube.ApiError` (the next round settles it)."""
        if size is None:
            size = max(
                pod.controlled.plan.members for pod in members if pod.controlled.plan is not None
            )
        present = await self.plans.present(plan_id, members, known)
        started = any(not gated(body, keys.QUEUE_GATE) for _, body in present)
        if not started and len(present) < size:
            await self.roll_back(plan_id, present)
            return Written(why=f"{size - len(present)} of its {size} members went away")
        waiting = [(pod, body) for pod, body in present if _admitting(body)]

        async def release(item: tuple[PodRecord, dict[str, Any]]) -> dict[str, Any] | None:
            pod, body = item
            mark = plan_mark(body)
            assert mark is not None

            def change(current: dict[str, Any]) -> Patch | None:
                if not plans.marked(current, plan_id) or not _admitting(current):
                    return None
                return {"spec": plans.released(current, keys.QUEUE_GATE, mark.node)}

            return await self.writer.write(pod, body, change)

        raise_first(await self.writer.each(waiting, release))
        return Written(tuple(pod for pod, _ in waiting))

    async def roll_back(self, plan_id: str, present: Sequence[tuple[PodRecord, Any]]) -> None:
        """Clear the plan from the members still queue-gated and carrying it, and release
        their holds. Raises `kube.ApiError`."""
        await self.plans.clear(plan_id, present, _admitting)
        log.info("queue plan rolled back", extra={"plan": plan_id, "present": len(present)})
