"""A plan written to the API crash-safe: the steps the gang and queue controllers share.

A plan is the set of pods carrying the same `gpuplace.io/gang-plan` mark
(`gpuplace.cluster.gang_marks.PlanMark`: its id, its size, the member's node). Its
commit lives in the API only, so a crash at any point leaves a gang wholly started or
wholly waiting, and every step is a `gpuplace.controllers.writing.Writer` step (UID and
resourceVersion preconditions, a no-op once the pod shows it), safe to repeat:

- **write** (`Plans.annotations`): a member's assignment annotations
  (`gpuplace.cluster.assignments`: what a bind writes, stamped `now()`, one process-wide
  clock that orders every grant), its plan mark and
  `gpuplace.io/gang-count` (the members its gang will run with);
- **read back** (`Plans.present`): the members as the API has them now (the bodies our
  own writes just returned, else fresh reads), those still carrying the plan;
- **narrow** (`narrowed`): a gated member's required node affinity pinned to its planned
  node (`gpuplace.controllers.pinning`, what kube-apiserver lets a gated pod tighten);
- **ungate** (`without_gate`): its scheduling gates less one; `released` is both in one
  write (the queue's admission of a pod alone, the planner's affinity pin);
- **roll back** (`Plans.clear`): the mark and the assignment cleared from the members
  still carrying the plan that the controller may still undo (`may`: unbound, its gate
  still on), and their holds in the ledger released.

When a plan rolls forward or back, and behind which gate it waits, is each controller's
rule (`gpuplace.gangs.committing`, `gpuplace.queues.committing`). Owns no state.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from gpuplace.cluster import assignments, keys
from gpuplace.cluster.gang_marks import PlanMark, gates, plan_mark
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import pinning
from gpuplace.controllers.api import Pod
from gpuplace.controllers.writing import Writer, raise_first
from gpuplace.placement.ledger import Grant

P = TypeVar("P", bound=Pod)
Patch = dict[str, Any]


def new_id() -> str:
    """A fresh plan id (12 hex digits)."""
    return secrets.token_hex(6)


def marked(body: Mapping[str, Any], plan_id: str) -> bool:
    """The pod carries plan `plan_id`'s mark."""
    mark = plan_mark(body)
    return mark is not None and mark.id == plan_id


def bound(body: Mapping[str, Any]) -> bool:
    return bool((body.get("spec") or {}).get("nodeName"))


def without_gate(current: Mapping[str, Any], gate: str) -> list[dict[str, Any]] | None:
    """The pod's scheduling gates less `gate`, as a merge patch's `spec.schedulingGates`
    (None: none left, which removes the field)."""
    return [g for g in gates(current) if g.get("name") != gate] or None


def narrowed(current: Mapping[str, Any], node: str) -> dict[str, Any] | None:
    """The pod's `spec.affinity` pinned to `node` (`gpuplace.controllers.pinning.narrowed`),
    None when it already is."""
    return pinning.narrowed((current.get("spec") or {}).get("affinity"), node)


def released(current: Mapping[str, Any], gate: str, node: str | None) -> dict[str, Any]:
    """The merge patch's `spec` of a gated pod's release in one write: `gate` removed and,
    for a `node`, its required node affinity pinned there (kube-apiserver takes both in
    one update: a gated pod's affinity may narrow in the update that removes its last
    gate)."""
    spec: dict[str, Any] = {"schedulingGates": without_gate(current, gate)}
    affinity = narrowed(current, node) if node is not None else None
    if affinity is not None:
        spec["affinity"] = affinity
    return spec


def cleared() -> dict[str, None]:
    """A merge-patch `metadata.annotations` value that undoes a plan on a member: its
    assignment, its mark and its `gang-count`."""
    undone: dict[str, None] = dict(assignments.cleared())
    undone[keys.GANG_PLAN] = None
    undone[keys.GANG_COUNT] = None
    return undone


class Plans:
    """The shared steps of the module docstring, over one controller's `writer` and the
    `sync` whose ledger holds its plans' grants; `clock`: POSIX seconds."""

    def __init__(self, writer: Writer, sync: LedgerSync, clock: Callable[[], float]) -> None:
        self.writer = writer
        self.sync = sync
        self.clock = clock

    def now(self) -> datetime:
        """The time a grant written now carries (`assigned-at`): `clock` to the
        microsecond, strictly after every grant this process stamped or its pods show
        (`sync.stamps`, the one clock of every writer of grants here: queue admissions,
        gang plans and starts, binds; `gpuplace.cluster.assignments.Stamps`). O(1)."""
        return self.sync.stamps.next(self.clock())

    def annotations(
        self, grant: Grant, plan_id: str, size: int, count: int, at: datetime, *, run: str = ""
    ) -> dict[str, str | None]:
        """What a member's plan write puts on it: the assignment of `grant` (UUIDs from
        its node), the mark of plan `plan_id` of `size` members on the grant's node in
        the gang's run `run` ("": the plan starts a run), and `gang-count` `count`."""
        inventory = self.sync.ledger.inventory
        written: dict[str, str | None] = dict(
            assignments.annotations_for(grant, inventory.get(grant.node), at)
        )
        written[keys.GANG_PLAN] = PlanMark(plan_id, size, grant.node, run).encode()
        written[keys.GANG_COUNT] = str(count)
        return written

    async def present(
        self,
        plan_id: str,
        members: Sequence[P],
        known: Mapping[str, dict[str, Any]] | None = None,
    ) -> list[tuple[P, dict[str, Any]]]:
        """The members still carrying plan `plan_id`, with their pods as the API has them:
        `known` (bodies our writes just returned) when it holds every member, else fresh
        reads. Raises `kube.ApiError`."""
        if known is not None and all(pod.uid in known for pod in members):
            fresh: list[Any] = [known[pod.uid] for pod in members]
        else:
            fresh = raise_first(await self.writer.each(members, self.writer.fetch))
        return [
            (pod, body)
            for pod, body in zip(members, fresh, strict=True)
            if body is not None and marked(body, plan_id)
        ]

    async def clear(
        self,
        plan_id: str,
        present: Sequence[tuple[P, dict[str, Any] | None]],
        may: Callable[[Mapping[str, Any]], bool],
    ) -> None:
        """Roll plan `plan_id` back on `present` (members with their last-read pods): clear
        it from each that still carries it and that `may(pod)` lets us undo, then release
        their holds. Raises `kube.ApiError` (the holds are then kept: the next round
        settles the plan again)."""

        async def clear(item: tuple[P, dict[str, Any] | None]) -> None:
            pod, body = item

            def change(current: dict[str, Any]) -> Patch | None:
                if not marked(current, plan_id) or not may(current):
                    return None
                return {"metadata": {"annotations": cleared()}}

            await self.writer.write(pod, body, change)

        raise_first(await self.writer.each(present, clear))
        for pod, _ in present:
            self.sync.unhold(pod.uid)
