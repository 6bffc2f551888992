"""The gang controller: gated gang members start together, or none holds GPUs.

One asyncio task in the sidecar (`GangController.run`: the controller kit's leader-gated
round loop, `gpuplace.controllers.rounds`). Members are the pods with the
same `gpuplace.io/gang-name` in one namespace; the webhook created them with our
scheduling gate `gpuplace.io/gang`. Each round (`step`), woken by gang-pod changes,
ledger changes (pods and nodes coming and going) and timers:

1. **Finish or undo plans found in the API** (`gpuplace.gangs.committing`): a plan is
   committed once every member carries its mark, and from then on only rolls forward;
   otherwise it is rolled back. So after a crash at any point a gang ends up entirely
   ungated or entirely gated: never half.
2. **Who waits** (`gpuplace.gangs.waiting`): per gang, the members that would form it
   now; a gang whose plan our informers have not fully seen yet waits for the next round.
3. **Order**: waiting gangs by pod priority (highest of their members), then age (the
   oldest member's creation), then name. Gangs are planned one at a time: plan all
   members at once on the current ledger (`gpuplace.placement.gangs.plan`, all or
   nothing) and reserve them in memory (`LedgerSync.hold`) in one synchronous step, then
   commit the plan (write, narrow, ungate). A gang that does not fit reserves nothing,
   so two gangs that each fit alone can never both hold part of what they need (no
   deadlock); smaller gangs behind it may still be placed (backfill). An elastic gang
   (`gang-min`) that does not fit whole starts with the most members that fit from
   `gang-min` up; a running one grows by its waiting members, as many as fit, after
   every other gang had its try and only in a round where none of them lacked room
   (it never preempts and never times out: it runs).
4. **Anti-starvation**: the head gang (first in the order above) that has been
   complete but unplaceable for `starve_after_seconds` gets a capacity hold
   (`gpuplace.placement.fences`): the nodes that would hold it once drained are kept
   free of *new* pods and of other gangs until it starts or times out. Holds no GPU.
5. **Preemption** (`gpuplace.gangs.evicting`): a complete gang that does not fit in
   free capacity, before its timeout, displaces pods of lower priority than its lowest
   member, all it needs or none (PodDisruptionBudget pre-check, then a fence on the
   plan's nodes, then the Eviction API); not while its earlier victims terminate. The
   fence is kept for it (over any starvation hold) until it starts or times out.
6. **Timeout** (`gang-timeout`, counted from the oldest member's creation): an Event
   `GangTimeout` and the condition `gpuplace.io/GangReady=False` (reason
   `GangIncomplete` or `GangUnschedulable`, with why; `gpuplace.gangs.conditions`) on
   each member; the gang keeps no reservation and no fence, stays gated, and is tried
   again whenever the ledger changes (capacity frees); if it then fits it starts and
   the condition turns True.

A failed attempt is not retried until the ledger, the fence, the policy or the
members change. Every write carries the pod's UID (and resourceVersion where a stale
read could do harm) as preconditions (`gpuplace.controllers.writing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from gpuplace.cluster import assignments, recording
from gpuplace.cluster.gang_marks import plan_mark
from gpuplace.cluster.pods import PodRecord
from gpuplace.controllers import restarts, telling
from gpuplace.controllers.api import PodApi
from gpuplace.controllers.controller import Controller, Parts, Settings
from gpuplace.controllers.store import PodIndex
from gpuplace.gangs import events
from gpuplace.gangs.committing import Commits, Outcome, Placed, RolledBack
from gpuplace.gangs.conditions import Conditions
from gpuplace.gangs.evicting import GangPreemptions
from gpuplace.gangs.metrics import GangMetrics
from gpuplace.gangs.restarting import Held, Restarts
from gpuplace.gangs.waiting import Wait, planned, waits
from gpuplace.placement import elastic, gangs
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import GANG, Fence
from gpuplace.placement.gangs import GangKey
from gpuplace.placement.ledger import Grant, LedgerError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GangSettings(Settings):
    """The kit's `Settings` (polling, settling, holds, writes) with the gang controller's
    figures, and its own."""

    poll_seconds: float = 5.0
    settle_seconds: float = 0.05
    """Wait after a wake-up so that bursts of events make one round (rounds are not
    spaced further: one that finds nothing changed tries no plan)."""
    starve_after_seconds: float = 120.0
    """A complete gang at the head of the queue that has not fit for this long gets a
    capacity hold (see the module docstring)."""
    preempt: bool = True
    """A complete gang that does not fit may evict pods of lower priority (needs
    `fences`; see `gpuplace.gangs.evicting`)."""
    preempt_retry_seconds: float = 10.0
    """After a refused eviction, or a plan that found no victims, the wait before the gang
    plans a preemption again."""


class GangController(Controller[GangSettings, GangKey, PodApi]):
    """See the module docstring. Collaborators are passed in (`gpuplace.wiring.gangs`
    builds them for the sidecar and the tests alike): the kit's `parts`
    (`gpuplace.controllers.controller.Parts`: the pod API, the ledger sync, the policy,
    fences, recorder, clock and leader gate), the gang members (`store`,
    `gpuplace.controllers.store.gang_members(parts.sync)`), and its own: `lock`, the lock
    the extender takes around decide-and-reserve, if it has one; `registry`, where its
    metrics go.
    """

    def __init__(
        self,
        parts: Parts[PodApi],
        store: PodIndex[GangKey],
        *,
        registry: CollectorRegistry | None = None,
        lock: asyncio.Lock | None = None,
        settings: GangSettings | None = None,
    ) -> None:
        self.metrics = GangMetrics(registry)
        settings = settings or GangSettings()
        super().__init__("gang", parts, store, settings=settings, leading=self.metrics.leading)
        sync, clock, fences = parts.sync, parts.clock, parts.fences
        self.lock = lock
        self.commits = Commits(
            self.writer, store, sync, metrics=self.metrics, recorder=self.recorder, clock=clock
        )
        """Plans written and settled in the API (`gpuplace.gangs.committing`)."""
        self.conditions = Conditions(self.writer, clock)
        self.preemptions = (
            GangPreemptions(
                self.api,
                sync,
                fences,
                recorder=self.recorder,
                registry=registry,
                retry_seconds=self.settings.preempt_retry_seconds,
            )
            if fences is not None and self.settings.preempt
            else None
        )
        """Preemption for waiting gangs (None without fences or with `preempt` off)."""
        self.restarts = Restarts(
            self.api,
            self.conditions,
            recorder=self.recorder,
            told=self._told,
            clock=clock,
            registry=registry,
            retry_seconds=self.settings.preempt_retry_seconds,
        )
        """A gang's run that a member's failure ended (`gpuplace.gangs.restarting`)."""
        sync.pod_listeners.append(self.restarts.listen)
        self._tried: dict[GangKey, tuple[object, ...]] = {}
        self._shortfalls: dict[GangKey, gangs.Shortfall] = {}
        self._timed_out: dict[GangKey, float] = {}

    # --- running ---------------------------------------------------------------------

    async def run(self) -> None:
        """Recover, then run rounds until cancelled. Never raises on API failures."""
        await self.loop.run(self._lead, self._follow, ready=(self.store.synced, self.sync.ready))

    async def _lead(self) -> None:
        self._count_gated()
        await self.step()

    def _count_gated(self) -> None:
        """The gated-member gauge, from the store (any replica). O(gang pods)."""
        self.metrics.gated.set(len(self._held()))

    def _held(self) -> list[PodRecord]:
        return [
            pod
            for pod in self.store.pods.values()
            if pod.controlled.gang_name and pod.live and pod.controlled.gang_gated
        ]

    def _follow(self) -> None:
        """A round while another replica decides (or none can): drop our capacity hold,
        count the waiting gangs anyway, and tell their members if gpuplace is blocked."""
        self._count_gated()
        if self.fences is not None and self.fences.release() is not None:
            self.metrics.held.set(0)
        if self.preemptions is not None:
            self.preemptions.keep_only(())
        held = self._held()
        self.metrics.waiting.set(len({pod.gang_key for pod in held}))
        reason = self.blocked() if self.blocked is not None else None
        if reason is not None:
            for pod in held:
                if self._told.first(pod.uid, reason):
                    self._emit(pod, recording.WARNING, events.BLOCKED, reason)
        self._forget_gone()

    async def step(self) -> None:
        """One round: settle plans in the API, take broken runs down, then try waiting
        gangs in order."""
        now = self.clock()
        for key, plan_id in self.commits.open_plans():
            await self._told_of(await self.commits.settle(key, plan_id))
        held = await self.restarts.step(self.store.groups())
        again = self.restarts.retry_at()
        if again is not None:
            self.loop.alarm(again, now)
        self._tell_held(held.values())
        found = waits(
            self.store,
            self.sync.ledger,
            now,
            told=self._told,
            recorder=self.recorder,
            held=held.keys(),
        )
        self.metrics.waiting.set(len(found))
        found.sort(key=Wait.order)
        if self.preemptions is not None:
            self.preemptions.new_round()
        self._update_fence(found, now)
        crowded = False
        for wait in found:
            if wait.growing:
                continue
            if not wait.complete:
                await self._incomplete(wait, now)
                continue
            await self._attempt(wait, now)
            shortfall = self._shortfalls.get(wait.key)
            crowded = crowded or (shortfall is not None and shortfall.ever)
        # an elastic gang grows only in a round where no waiting gang lacked room: growth
        # never takes what a gang that waits to start needs
        for wait in found if not crowded else ():
            if wait.growing:
                await self._attempt(wait, now)
        self._forget_gone()

    def _tell_held(self, held: Iterable[Held]) -> None:
        """Tell the new members of a restarting gang why they wait (once per run)."""
        for gang in held:
            waiting = [
                pod
                for pod in self.store.members(gang.key)
                if pod.live and pod.controlled.plan is None and pod.controlled.gang_gated
            ]
            names = ", ".join(sorted(str(pod) for pod in gang.stopping)[:4])
            more = len(gang.stopping) - 4
            names += f" and {more} more" if more > 0 else ""
            for pod in waiting:
                if self._told.first(pod.uid, f"{events.RESTARTING}@{gang.cause}"):
                    self._emit(
                        pod,
                        recording.NORMAL,
                        events.RESTARTING,
                        f"gang {gang.key[1]} restarts ({gang.cause}): this member waits until "
                        f"the {len(gang.stopping)} member{'s' if len(gang.stopping) != 1 else ''}"
                        f" of its last run still holding GPUs ({names}) have stopped; then "
                        "its members start again as one gang",
                    )

    def _forget_gone(self) -> None:
        """Drop memos of pods and gangs the API no longer has (bounded memory)."""
        self._told.keep(self.store.pods)
        self.conditions.keep(self.store.pods)
        known = self.store.groups().keys()
        for memo in (self._tried, self._shortfalls, self._timed_out):
            for key in [key for key in memo if key not in known]:
                del memo[key]

    # --- what a settled plan tells ----------------------------------------------------

    async def _told_of(self, outcome: Outcome) -> None:
        """Act on a plan's commit: a rolled-back gang may be tried again at once; a placed
        one is recorded, told, and its GangReady condition turned True."""
        if isinstance(outcome, RolledBack):
            self._tried.pop(outcome.key, None)
        elif isinstance(outcome, Placed):
            self._placed(outcome)
            await self.writer.each(outcome.ready, self.conditions.ready)

    def _placed(self, placed: Placed) -> None:
        key = placed.key
        members = [pod for pod, _ in placed.present]
        now = self.clock()
        since = min((pod.created for pod in members if pod.created), default=now)
        self.metrics.placements.inc()
        self.metrics.wait.observe(max(now - since, 0.0))
        if self.fences is not None and self.fences.owner == key:
            self.fences.release()
            self.metrics.held.set(0)
        if self.preemptions is not None:
            self.preemptions.forget(key)
        self._shortfalls.pop(key, None)
        self._tried.pop(key, None)
        self._timed_out.pop(key, None)
        per_node: dict[str, int] = {}
        for _, body in placed.present:
            mark = plan_mark(body)
            if mark is not None:
                per_node[mark.node] = per_node.get(mark.node, 0) + 1
        layout = ", ".join(f"{node} ×{count}" for node, count in per_node.items())
        log.info(
            "gang placed",
            extra={"gang": "/".join(key), "plan": placed.plan_id, "members": len(members)},
        )
        for pod, body in placed.present:
            mark = plan_mark(body)
            gpus = assignments.gpus_text(body)
            mine = f"; this member: node {mark.node}, GPUs {gpus}" if mark is not None else ""
            self._emit(
                pod,
                recording.NORMAL,
                events.PLACED,
                f"gang {key[1]} placed: {len(members)} members on {len(per_node)} "
                f"node{'s' if len(per_node) != 1 else ''} ({layout}){mine}",
            )

    # --- incomplete gangs --------------------------------------------------------------

    async def _incomplete(self, wait: Wait, now: float) -> None:
        have = len(wait.members) + (wait.size - wait.need)
        for pod in wait.members:
            if self._told.first(pod.uid, f"{events.INCOMPLETE}@{wait.since}"):
                self._emit(
                    pod,
                    recording.NORMAL,
                    events.INCOMPLETE,
                    f"waiting for all members of gang {wait.key[1]}: {have} of {wait.size} "
                    "exist; no GPU is held until all do",
                )
        if now < wait.deadline:
            self.loop.alarm(wait.deadline, now)
            return
        await self._timeout(
            wait,
            events.INCOMPLETE,
            f"gang {wait.key[1]}: only {have} of {wait.size} members exist after its "
            f"gang-timeout of {telling.duration(wait.timeout)}; it keeps waiting gated and "
            "starts when all exist and fit; no GPU is held meanwhile",
        )

    # --- planning --------------------------------------------------------------------

    def _members(self, wait: Wait) -> list[gangs.Member]:
        return planned(wait, self.store, self.sync.ledger.inventory)

    def _exclude(self, key: GangKey) -> frozenset[str]:
        if self.fences is None or self.fences.current is None or self.fences.owner == key:
            return frozenset()
        return self.fences.nodes

    def _signature(self, wait: Wait, policy: Policy) -> tuple[object, ...]:
        fence = self.fences.version if self.fences is not None else 0
        return (
            self.sync.ledger.generation,
            self.sync.ledger.relabelled,
            tuple(pod.uid for pod in wait.members),
            fence,
            id(policy),
        )

    def _plan(
        self, wait: Wait, policy: Policy, members: list[gangs.Member]
    ) -> gangs.Plan | gangs.Shortfall:
        """Every member at once; for an elastic gang, else the most that fit from
        `wait.low` up (the oldest first; `gpuplace.placement.elastic`). O(log members)
        plans."""
        exclude = self._exclude(wait.key)
        whole = gangs.plan(self.sync.ledger, policy, members, exclude=exclude)
        if not isinstance(whole, gangs.Shortfall) or wait.low >= len(members):
            return whole
        found: dict[int, gangs.Plan] = {}

        def fits(count: int) -> bool:
            plan = gangs.plan(self.sync.ledger, policy, members[:count], exclude=exclude)
            if isinstance(plan, gangs.Shortfall):
                return False
            found[count] = plan
            return True

        count = elastic.largest(fits, wait.low, len(members) - 1)
        return whole if count is None else found[count]

    def _plan_and_hold(
        self, wait: Wait, policy: Policy
    ) -> tuple[gangs.Plan, list[Grant]] | gangs.Shortfall:
        """Plan and reserve in one synchronous step (no await: nothing interleaves)."""
        members = self._members(wait)
        started = time.perf_counter()
        result = self._plan(wait, policy, members)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        if isinstance(result, gangs.Shortfall):
            return result
        members = [member for member in members if member.uid in result.choices]
        grants = result.grants(members)
        owner = f"gang:{wait.key[0]}/{wait.key[1]}"
        held: list[str] = []
        try:
            for grant in grants:
                self.sync.hold(grant, seconds=self.settings.hold_seconds, owner=owner)
                held.append(grant.pod_uid)
        except LedgerError as error:
            for uid in held:
                self.sync.unhold(uid)
            return gangs.Shortfall(f"the ledger refused the plan: {error}", 0, len(members), True)
        return result, grants

    async def _attempt(self, wait: Wait, now: float) -> None:
        policy = self.policy()
        signature = self._signature(wait, policy)
        if self._tried.get(wait.key) != signature:
            lock = self.lock if self.lock is not None else contextlib.nullcontext()
            async with lock:
                outcome = self._plan_and_hold(wait, policy)
            if not isinstance(outcome, gangs.Shortfall):
                plan, grants = outcome
                planned = [pod for pod in wait.members if pod.uid in plan.choices]
                run = restarts.current_run(self.store.members(wait.key)) if wait.started else ""
                await self._told_of(
                    await self.commits.start(
                        wait.key,
                        planned,
                        wait.since,
                        grants,
                        len(plan.nodes),
                        running=wait.started,
                        run=run,
                    )
                )
                return
            self._tried[wait.key] = signature
            self._shortfalls[wait.key] = outcome
            self._waiting(wait, outcome)
        shortfall = self._shortfalls.get(wait.key)
        if shortfall is None or wait.growing:
            return
        if now < wait.deadline:
            self.loop.alarm(wait.deadline, now)
            if shortfall.ever and self.fences is not None:
                self.loop.alarm(wait.since + self.settings.starve_after_seconds, now)
            if shortfall.ever:
                await self._preempt(wait, now)
            return
        await self._timeout(
            wait,
            events.UNSCHEDULABLE,
            f"gang {wait.key[1]} could not be placed within its gang-timeout of "
            f"{telling.duration(wait.timeout)}: {shortfall.reason}; it holds no GPUs and is "
            "tried again whenever capacity frees",
        )

    async def _preempt(self, wait: Wait, now: float) -> None:
        """Displace lower-priority pods for a complete gang that does not fit
        (`gpuplace.gangs.evicting`); the fence it sets is kept by `_update_fence`."""
        if self.preemptions is None or self.fences is None:
            return
        again = await self.preemptions.attempt(
            wait.key,
            wait.members,
            self._members(wait),
            self.policy(),
            since=wait.since,
            now=now,
            exclude=self._exclude(wait.key),
            running=[
                p for p in self.store.members(wait.key) if p.live and not p.controlled.gang_gated
            ],
        )
        if again is not None:
            self.loop.alarm(again, now)
        if self.fences.owner == wait.key:
            self.metrics.held.set(len(self.fences.nodes))

    def _waiting(self, wait: Wait, shortfall: gangs.Shortfall) -> None:
        for pod in wait.members:
            if wait.growing:
                if self._told.first(pod.uid, f"{events.GROWING}@{wait.started}"):
                    self._emit(
                        pod,
                        recording.NORMAL,
                        events.GROWING,
                        f"elastic gang {wait.key[1]} runs with {wait.started} of its "
                        f"{wait.size} members (gang-min {wait.minimum}); this member starts "
                        f"when GPUs free: {shortfall.reason}",
                    )
            elif not shortfall.ever:
                if self._told.first(pod.uid, f"{events.UNSCHEDULABLE}@{wait.since}"):
                    self._emit(
                        pod,
                        recording.WARNING,
                        events.UNSCHEDULABLE,
                        f"gang {wait.key[1]}: {shortfall.reason}; it will not start unless "
                        "nodes are added or its requests change",
                    )
            elif self._told.first(pod.uid, f"{events.WAITING}@{wait.since}"):
                self._emit(
                    pod,
                    recording.NORMAL,
                    events.WAITING,
                    f"all {wait.size} members of gang {wait.key[1]} exist; waiting for room: "
                    f"{shortfall.reason}",
                )

    # --- timeouts, fences --------------------------------------------------------------

    async def _timeout(self, wait: Wait, reason: str, message: str) -> None:
        if self._timed_out.get(wait.key) != wait.since:
            self._timed_out[wait.key] = wait.since
            self.metrics.timeouts.labels(
                "incomplete" if reason == events.INCOMPLETE else "unplaceable"
            ).inc()
            log.info("gang timed out", extra={"gang": "/".join(wait.key), "reason": reason})
            if self.fences is not None and self.fences.owner == wait.key:
                self.fences.release()
                self.metrics.held.set(0)
            if self.preemptions is not None:
                self.preemptions.forget(wait.key)
        for pod in wait.members:
            if self._told.first(pod.uid, f"{events.TIMEOUT}@{wait.since}"):
                self._emit(pod, recording.WARNING, events.TIMEOUT, message)
        await self.writer.each(
            wait.members, lambda pod: self.conditions.set(pod, "False", reason, message)
        )

    def _update_fence(self, found: list[Wait], now: float) -> None:
        if self.fences is None:
            return
        found = [wait for wait in found if not wait.growing]
        if self.preemptions is not None:
            complete = [wait for wait in found if wait.complete and now < wait.deadline]
            self.preemptions.keep_only(wait.key for wait in complete)
            for wait in complete:  # in order: a preemption under way keeps its fence
                underway = self.preemptions.underway.get(wait.key)
                if underway is not None:
                    uids = frozenset(pod.uid for pod in wait.members)
                    self.fences.hold(Fence(wait.key, underway.nodes, uids, wait.since))
                    self.metrics.held.set(len(underway.nodes))
                    return
        head = None
        for wait in found:
            shortfall = self._shortfalls.get(wait.key)
            if (
                wait.complete
                and shortfall is not None
                and shortfall.ever
                and now - wait.since >= self.settings.starve_after_seconds
                and now < wait.deadline
            ):
                head = wait
                break
        current = self.fences.current
        if head is None:
            if current is not None and current.kind == GANG:
                self.fences.release()
                self.metrics.held.set(0)
            return
        uids = frozenset(pod.uid for pod in head.members)
        inventory = self.sync.ledger.inventory
        if (
            current is not None
            and current.kind == GANG
            and current.owner == head.key
            and current.members == uids
            and all(name in inventory for name in current.nodes)
        ):
            return
        nodes = gangs.fence(self.sync.ledger, self._members(head))
        if not nodes:
            if current is not None and current.kind == GANG:
                self.fences.release()
                self.metrics.held.set(0)
            return
        self.fences.hold(Fence(head.key, frozenset(nodes), uids, head.since))
        self.metrics.held.set(len(nodes))
        shown = ", ".join(nodes[:8]) + (f" and {len(nodes) - 8} more" if len(nodes) > 8 else "")
        log.info("gang capacity held", extra={"gang": "/".join(head.key), "nodes": len(nodes)})
        for pod in head.members:
            if self._told.first(pod.uid, f"{events.HELD}@{head.since}"):
                self._emit(
                    pod,
                    recording.NORMAL,
                    events.HELD,
                    f"gang {head.key[1]} has waited {telling.duration(now - head.since)} for "
                    f"room: nodes {shown} are held for it (no new pods go there) until it "
                    "starts or times out",
                )
