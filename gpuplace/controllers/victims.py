"""Who may be evicted for a waiting workload, and the eviction plan that passes the budgets.

Both controllers that preempt for pods kube-scheduler cannot preempt for — the gang
controller for a waiting gang (`gpuplace.gangs.evicting`) and the claim controller for a
lone pod on the DRA path (`gpuplace.claims.preempting`: kube-scheduler answers
"Preemption is not helpful" for a pod with a ResourceClaim and never asks the
extender) — plan the same way, as kube-scheduler's DefaultPreemption decides for one pod:

- the workload's priority is its *lowest* member's `spec.priority` (`priority_of`); one
  with a member whose `spec.preemptionPolicy` is `Never` never preempts (`never_preempts`);
- victims are bound, unfinished pods gpuplace granted GPUs to, of strictly lower
  priority; a running gang is one unit across all its nodes (`victim_units`, with an
  elastic gang's extra members one by one as well);
- a pod already being deleted is never a victim again: its unit gets the priority
  `GOING`, so the plan counts on its GPUs first, and while pods of lower priority
  terminate on the plan's nodes the workload waits for them instead of evicting
  (`Terminating`, kube-scheduler's own rule for a preemptor whose nominated node has
  terminating victims); read from the pods, so a restart or a lost lease changes nothing;
- `plan`: the victims that make room for every member (`gpuplace.placement.victim_choice.for_gang`,
  a lone pod being a gang of one), PodDisruptionBudgets checked for all of them together
  (`gpuplace.controllers.evictions.budget_refusals`); a unit with a victim the API
  server would refuse is excluded and the plan made again without it, at most `PASSES`
  times.

Owns no state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from gpuplace.cluster import claims, disruptions, pods
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import evictions
from gpuplace.placement import gangs, victim_choice
from gpuplace.placement.choosing import Policy

NEVER = "Never"
PASSES = 8
"""Plans one attempt makes at most, each without the units a budget refused before."""
GOING = -(1 << 31)
"""The priority `victim_units` gives a unit already being deleted (below any int32)."""


@dataclass(frozen=True, slots=True)
class Changed:
    """A victim went or was replaced while the plan read it: plan again next round (the
    ledger changes with it)."""


CHANGED = Changed()


@dataclass(frozen=True, slots=True)
class Terminating:
    """A plan that counts on pods of lower priority already being deleted on its nodes."""

    nodes: frozenset[str]
    uids: frozenset[str]
    eviction: victim_choice.GangEviction
    """The plan that counts on them (where the members go once they are gone)."""


def priority_of(members: Iterable[PodRecord]) -> int:
    """A workload's priority for preemption: its lowest member's."""
    return min(member.priority for member in members)


def never_preempts(members: Iterable[PodRecord]) -> bool:
    return any(member.controlled.preemption_policy == NEVER for member in members)


def victim_units(
    sync: LedgerSync, below: int, spare: Iterable[str] = ()
) -> list[victim_choice.Unit]:
    """Every unit that may be evicted for a workload of priority `below`: bound,
    unfinished pods holding a grant, of lower priority; a running gang whole (all its
    live members lower; the unit is its members holding a grant, never a gated one) or
    not at all, and each extra member of a running elastic gang alone as well, when it is
    of lower priority (`gpuplace.placement.victim_choice.extras`: units that share pods
    are alternatives). `spare`: UIDs never to evict. A unit whose pods are all being
    deleted already (`deletionTimestamp`) gets the priority `GOING` (the cheapest victim,
    `going`): its GPUs are on their way back, so the plan counts on them first and the
    caller waits for them rather than evicting anything. O(pods + grants)."""
    records = sync.pods
    spared = set(spare)
    by_gang: dict[tuple[str, str], list[PodRecord]] = {}
    for each in records.values():
        if each.gang and not each.terminal:
            by_gang.setdefault((each.namespace, each.gang), []).append(each)
    units: list[victim_choice.Unit] = []
    seen: set[str] = set()
    for grant in sync.ledger:
        record = records.get(grant.pod_uid)
        if record is None or record.uid in seen or record.terminal or not record.bound:
            continue
        if record.node_name != grant.node:
            continue
        members = (
            by_gang.get((record.namespace, record.gang), [record]) if record.gang else [record]
        )
        seen.update(member.uid for member in members)

        def unit(of: list[PodRecord]) -> victim_choice.Unit:
            # only members holding GPUs go: a gated one holds nothing, and evicting a
            # Pending pod deletes it at once
            holding = [m for m in of if sync.ledger.get(m.uid) is not None]
            held = tuple(g for m in holding if (g := sync.ledger.get(m.uid)) is not None)
            going = all(m.deleting for m in holding)
            priorities = tuple(GOING if going else m.priority for m in holding)
            return victim_choice.Unit(tuple(m.uid for m in holding), held, priorities)

        started = [unit([m]) for m in pods.started(members) if sync.ledger.get(m.uid)]
        spares = [
            extra
            for extra in victim_choice.extras(started, record.minimum)
            if extra.priorities[0] < below and extra.uids[0] not in spared
        ]
        units.extend(spares)
        if any(m.priority >= below or m.uid in spared for m in members):
            continue
        units.append(victim_choice.whole(unit(members), spares))
    return units


def going(unit: victim_choice.Unit) -> bool:
    """The unit's pods are already being deleted (`victim_units`)."""
    return all(p == GOING for p in unit.priorities)


def terminating_on(sync: LedgerSync, nodes: Collection[str], priority: int) -> frozenset[str]:
    """UIDs of pods of lower priority than `priority` holding a grant on `nodes` that are
    being deleted, and of grants on `nodes` whose pod is gone while its ResourceClaim
    still holds the GPUs (until the garbage collector deletes it: on their way back too;
    a user's own claim, `claim:<UID>`, is not). O(grants)."""
    found = set()
    for grant in sync.ledger:
        if grant.node not in nodes:
            continue
        record = sync.pods.get(grant.pod_uid)
        if record is None:
            if not grant.pod_uid.startswith(claims.PREFIX):
                found.add(grant.pod_uid)
        elif record.deleting and not record.terminal and record.priority < priority:
            found.add(record.uid)
    return frozenset(found)


async def plan(
    api: evictions.EvictionApi,
    sync: LedgerSync,
    planned: Sequence[gangs.Member],
    policy: Policy,
    priority: int,
    *,
    exclude: Collection[str] = frozenset(),
    passes: int = PASSES,
    counted: Callable[[], None] = lambda: None,
    planned_on: Callable[[victim_choice.GangEviction], None] = lambda _: None,
) -> tuple[victim_choice.GangEviction, list[PodRecord]] | Terminating | Changed | str | None:
    """The eviction plan for `planned` (all members or none) that passes the budget
    pre-check (victims in name order), or the pods of lower priority already terminating
    on its nodes (wait for them), or `CHANGED` (a victim went meanwhile), or why budgets
    forbid every plan, or None (no plan at all). Each pass excludes at least one more
    unit; at most `passes` passes, `counted` called on each, `planned_on` on each plan
    with victims before anything is awaited (a caller keeps other placements off its
    nodes meanwhile). Raises `kube.ApiError` (the pre-check's reads).

    Work: one `victim_units` (O(pods + grants)), then per pass one
    `gpuplace.placement.victim_choice.for_gang` (its own docstring: O(grants) scratch
    ledgers plus a few gang plans, each O(members × nodes log nodes)) and a GET per new
    victim and a budget list per new namespace. So one call is O(passes × for_gang),
    synchronous on the event loop apart from the API reads: ~1.2 s per pass (and 0.6 s
    for `victim_units`) was measured at 10,000 nodes × 8 GPUs, hence the callers' caps
    (`passes`, plans per round, and the back-off of a plan that found nothing); the loop
    yields between passes, so one stretch without an await is one pass
    (`bench/gang_preempt_plan.py`)."""
    spared: set[str] = set()
    blocked = ""
    budgets: dict[str, list[disruptions.Budget]] = {}
    fresh: dict[str, disruptions.Victim | None] = {}
    every = victim_units(sync, priority)
    for done in range(passes):
        if done:
            await asyncio.sleep(0)  # let the extender's verbs in between passes
        units = [u for u in every if not spared.intersection(u.uids)]
        counted()
        eviction = victim_choice.for_gang(sync.ledger, policy, planned, units, exclude=exclude)
        if eviction is None or not eviction.units:
            return blocked or None
        planned_on(eviction)
        terminating = terminating_on(sync, set(eviction.nodes), priority)
        if terminating:
            return Terminating(frozenset(eviction.nodes), terminating, eviction)
        records = sorted(
            (sync.pods[uid] for uid in eviction.uids if uid in sync.pods),
            key=lambda record: record.key,
        )
        if len(records) != len(eviction.uids):
            return CHANGED  # a victim went meanwhile: the ledger changes, next round
        refused = await evictions.budget_refusals(api, records, fresh=fresh, budgets=budgets)
        if refused is None:
            return CHANGED
        if not refused:
            return eviction, records
        blocked = "; ".join(
            f"{record}: {refused[record.uid]}" for record in records if record.uid in refused
        )
        for unit in eviction.units:
            if any(uid in refused for uid in unit.uids):
                spared.update(unit.uids)
    return blocked  # `passes` plans, each refused by a budget: try again later
