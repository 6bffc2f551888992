"""The gang controller: gated gang members start together, or none holds GPUs.

One asyncio task in the sidecar (`GangController.run`). Members are the pods with the
same `gpuplace.io/gang-name` in one namespace; the webhook created them with our
scheduling gate `gpuplace.io/gang`. Each round (`step`), woken by gang-pod changes,
ledger changes (pods and nodes coming and going) and timers:

1. **Finish or undo plans found in the API** (`_settle`): a plan is the set of members
   carrying the same `gang-plan` mark. It is *committed* once every member of it
   carries the mark (with its assignment annotations); from then on it only rolls
   forward. Rule, on fresh reads of the members: if any of them is already ungated,
   or all of them are still there, roll forward (narrow each gated member's node
   affinity to its node, then remove our gate from each); otherwise (a member is gone
   before any started, or the plan was never fully written) roll back (remove the
   mark and assignment from each, only while unbound). So after a crash at any point
   a gang ends up entirely ungated or entirely gated: never half.
2. **Who waits**: per gang, the live ungated members count as started; the oldest
   gated members fill the gang up to its size N (a replacement pod joins a started
   gang this way); members beyond N stay gated (Event `GangFull`). A gang waits while
   fewer than N members exist. A gang whose gated members still show a plan mark or a
   reservation (our own writes not yet seen by the informers) is left for the next
   round, so a half-seen plan is never mistaken for started members.
3. **Order**: waiting gangs by pod priority (highest of their members), then age (the
   oldest member's creation), then name. Gangs are planned one at a time: plan all
   members at once on the current ledger (`gpuplace.placement.gangs.plan`, all or nothing) and
   reserve them in memory (`LedgerSync.hold`) in one synchronous step, then write the
   plan (assignment annotations + `gang-plan` mark, one PATCH per member), then
   narrow and ungate. A gang that does not fit reserves nothing, so two gangs that each
   fit alone can never both hold part of what they need (no deadlock); smaller gangs
   behind it may still be placed (backfill).
4. **Anti-starvation**: the head gang (first in the order above) that has been
   complete but unplaceable for `starve_after_seconds` gets a capacity hold
   (`gpuplace.extender.gang_fences`): the nodes that would hold it once drained are kept free
   of *new* pods and of other gangs until it starts or times out. Holds no GPU.
5. **Preemption** (`gpuplace.extender.gang_preempting`): a complete gang that does not fit in
   free capacity, before its timeout, displaces pods of lower priority than its lowest
   member, all it needs or none (PodDisruptionBudget pre-check, then a fence on the
   plan's nodes, then the Eviction API); not while its earlier victims terminate. The
   fence is kept for it (over any starvation hold) until it starts or times out.
6. **Timeout** (`gang-timeout`, counted from the oldest member's creation): an Event
   `GangTimeout` and the condition `gpuplace.io/GangReady=False` (reason
   `GangIncomplete` or `GangUnschedulable`, with why) on each member; the gang keeps
   no reservation and no fence, stays gated, and is tried again whenever the ledger
   changes (capacity frees); if it then fits it starts and the condition turns True.

A failed attempt is not retried until the ledger, the fence, the policy or the
members change. Every write carries the pod's UID (and resourceVersion where a stale
read could do harm) as preconditions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpuplace.cluster import assignments, keys, kube, recording
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender import gang_affinity
from gpuplace.extender.gang_api import PodApi
from gpuplace.extender.gang_fences import Fence, Fences
from gpuplace.extender.gang_members import GangKey, GangPod, PlanMark, gated, gates, plan_mark
from gpuplace.extender.gang_preempting import GangPreemptions
from gpuplace.extender.gang_store import GangStore
from gpuplace.placement import gangs
from gpuplace.placement.choosing import Policy
from gpuplace.placement.ledger import Grant, LedgerError

log = logging.getLogger(__name__)

T = TypeVar("T")

PLACED = "GangPlaced"
WAITING = "GangWaiting"
INCOMPLETE = "GangIncomplete"
UNSCHEDULABLE = "GangUnschedulable"
TIMEOUT = "GangTimeout"
FULL = "GangFull"
ROLLED_BACK = "GangPlanRolledBack"
HELD = "GangCapacityHeld"
INVALID = "GangMemberInvalid"
BLOCKED = "GangControllerBlocked"


@dataclass(frozen=True, slots=True)
class GangSettings:
    starve_after_seconds: float = 120.0
    """A complete gang at the head of the queue that has not fit for this long gets a
    capacity hold (see the module docstring)."""
    hold_seconds: float = 300.0
    """In-memory reservation while the plan is being written (the written assignment
    annotations take over as soon as the informer sees them)."""
    concurrency: int = 16
    """API writes in flight at once for one gang."""
    poll_seconds: float = 5.0
    """Longest sleep between rounds when nothing wakes the controller."""
    settle_seconds: float = 0.05
    """Wait after a wake-up so that bursts of events make one round."""
    write_attempts: int = 5
    """Attempts of one write that hits 409 Conflict (re-read in between)."""
    preempt: bool = True
    """A complete gang that does not fit may evict pods of lower priority (needs
    `fences`; see `gpuplace.extender.gang_preempting`)."""
    preempt_retry_seconds: float = 10.0
    """After a refused eviction, or a plan that found no victims, the wait before the gang
    plans a preemption again."""


class GangMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.waiting = Gauge(
            "gpuplace_gangs_waiting",
            "Gangs with gated members not yet placed (incomplete or waiting for room), "
            "whether or not this replica leads.",
            registry=registry,
        )
        self.gated = Gauge(
            "gpuplace_gang_members_gated",
            "Live gang members still held by gpuplace's scheduling gate, whether or not "
            "this replica leads.",
            registry=registry,
        )
        self.leading = Gauge(
            "gpuplace_gang_controller_leading",
            "1 while this replica's gang controller decides (its kube-scheduler holds "
            "the Lease), else 0.",
            registry=registry,
        )
        self.wait = Histogram(
            "gpuplace_gang_wait_seconds",
            "From a gang's oldest member's creation to its ungating.",
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400),
            registry=registry,
        )
        self.placements = Counter(
            "gpuplace_gang_placements_total",
            "Gangs placed and ungated.",
            registry=registry,
        )
        self.timeouts = Counter(
            "gpuplace_gang_timeouts_total",
            "Gangs whose gang-timeout passed before they started, by reason.",
            ["reason"],
            registry=registry,
        )
        self.rollbacks = Counter(
            "gpuplace_gang_rollbacks_total",
            "Gang plans undone before any member started (member deleted, write failed).",
            registry=registry,
        )
        self.plan_seconds = Histogram(
            "gpuplace_gang_plan_duration_seconds",
            "Time to plan one gang (all members, CPU only).",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        self.fenced = Gauge(
            "gpuplace_gang_fenced_nodes",
            "Nodes held for a starving gang (other pods are kept off them).",
            registry=registry,
        )


@dataclass(slots=True)
class Wait:
    """A gang that waits: the members that would form it now."""

    key: GangKey
    members: list[GangPod]
    size: int
    need: int
    priority: int
    since: float
    deadline: float
    timeout: float

    @property
    def complete(self) -> bool:
        return len(self.members) == self.need

    def order(self) -> tuple[int, float, GangKey]:
        return (-self.priority, self.since, self.key)


@dataclass(frozen=True, slots=True)
class Committed:
    """A plan this process wrote completely (it rolls forward from here)."""

    key: GangKey
    members: tuple[GangPod, ...]
    since: float


@dataclass(slots=True)
class _Told:
    """Events already emitted, per pod UID (each once per episode)."""

    tags: dict[str, set[str]] = field(default_factory=dict)

    def first(self, uid: str, tag: str) -> bool:
        seen = self.tags.setdefault(uid, set())
        if tag in seen:
            return False
        seen.add(tag)
        return True

    def keep(self, uids: Iterable[str]) -> None:
        alive = set(uids)
        for uid in [uid for uid in self.tags if uid not in alive]:
            del self.tags[uid]


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds >= 3600:
        return f"{seconds / 3600:g}h"
    if seconds >= 60:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


class GangController:
    """See the module docstring. Collaborators are passed in so the sidecar wires them:

    - `api`: `PodApi` (get, patch, patch status), e.g. `gang_api.KubePods(kube)`;
    - `store`: the `GangStore` fed by `gang_store.informer`;
    - `sync`: the `LedgerSync` shared with the extender (its ledger, holds, listeners);
    - `policy`: the policy in force, e.g. `lambda: holder.current().policy`;
    - `lock`: the lock the extender takes around decide-and-reserve, if it has one;
    - `fences`: the capacity holds the extender's filter consults;
    - `recorder`, `registry`, `clock` (POSIX seconds);
    - `active`: whether this replica is the decision-maker now (only the replica whose
      kube-scheduler holds the Lease may plan: `gang_leader.LeaseFollower`).
    """

    def __init__(
        self,
        api: PodApi,
        store: GangStore,
        sync: LedgerSync,
        policy: Callable[[], Policy],
        *,
        recorder: recording.Recorder | None = None,
        registry: CollectorRegistry | None = None,
        lock: asyncio.Lock | None = None,
        fences: Fences | None = None,
        settings: GangSettings | None = None,
        clock: Callable[[], float] = time.time,
        active: Callable[[], bool] | None = None,
        blocked: Callable[[], str | None] | None = None,
    ) -> None:
        self.api = api
        self.store = store
        self.sync = sync
        self.policy = policy
        self.recorder = recorder
        self.lock = lock
        self.fences = fences
        self.settings = settings or GangSettings()
        self.clock = clock
        self.active = active
        """Whether this replica decides now (`gang_leader.LeaseFollower`); None: always."""
        self.blocked = blocked
        """Why this replica cannot tell whether it decides (the API refused the Lease
        read), e.g. `LeaseFollower.blocked_reason`: said in an Event on waiting members."""
        self.metrics = GangMetrics(registry)
        self.preemptions = (
            GangPreemptions(
                api,
                sync,
                fences,
                recorder=recorder,
                registry=registry,
                retry_seconds=self.settings.preempt_retry_seconds,
            )
            if fences is not None and self.settings.preempt
            else None
        )
        """Preemption for waiting gangs (None without fences or with `preempt` off)."""
        self.rounds = 0
        """Completed rounds (tests wait on it)."""
        self._wake = asyncio.Event()
        self._committed: dict[str, Committed] = {}
        self._tried: dict[GangKey, tuple[object, ...]] = {}
        self._shortfalls: dict[GangKey, gangs.Shortfall] = {}
        self._timed_out: dict[GangKey, float] = {}
        self._told = _Told()
        self._conditions: dict[str, tuple[str, str]] = {}
        self._next = float("inf")
        store.listeners.append(self._poke)
        sync.pod_listeners.append(self._poke)
        sync.node_listeners.append(self._poke)

    # --- running ---------------------------------------------------------------------

    def _poke(self, *_: object) -> None:
        self._wake.set()

    def wake(self) -> None:
        """Run a round soon (e.g. after the extender released GPUs)."""
        self._wake.set()

    async def run(self) -> None:
        """Recover, then run rounds until cancelled. Never raises on API failures."""
        await self.store.synced.wait()
        await self.sync.ready.wait()
        while True:
            try:
                leading = self.active is None or self.active()
                self.metrics.leading.set(1 if leading else 0)
                self._count_gated()
                if leading:
                    await self.step()
                else:
                    self._follow()
            except kube.ApiError as error:
                log.warning(
                    "gang round failed, retrying",
                    extra={"status": error.status, "reason": error.reason},
                )
            delay = min(self.settings.poll_seconds, max(self._next - self.clock(), 0.0))
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
            # that races with the event, and the task would never stop
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.settings.settle_seconds)

    def _count_gated(self) -> None:
        """The gated-member gauge, from the store (any replica). O(gang pods)."""
        self.metrics.gated.set(len(self._held()))

    def _held(self) -> list[GangPod]:
        return [pod for pod in self.store.pods.values() if pod.gang and pod.live and pod.gated]

    def _follow(self) -> None:
        """A round while another replica decides (or none can): drop our capacity hold,
        count the waiting gangs anyway, and tell their members if gpuplace is blocked."""
        if self.fences is not None and self.fences.release() is not None:
            self.metrics.fenced.set(0)
        if self.preemptions is not None:
            self.preemptions.keep_only(())
        held = self._held()
        self.metrics.waiting.set(len({pod.key for pod in held}))
        reason = self.blocked() if self.blocked is not None else None
        if reason is not None:
            for pod in held:
                if self._told.first(pod.uid, reason):
                    self._emit(pod, recording.WARNING, BLOCKED, reason)
        self._forget_gone()

    async def step(self) -> None:
        """One round: settle plans in the API, then try waiting gangs in order."""
        now = self.clock()
        self._next = float("inf")
        for key, plan_id in self._open_plans():
            await self._settle(key, plan_id)
        waits = self._waits(now)
        self.metrics.waiting.set(len(waits))
        waits.sort(key=Wait.order)
        if self.preemptions is not None:
            self.preemptions.new_round()
        self._update_fence(waits, now)
        for wait in waits:
            if not wait.complete:
                await self._incomplete(wait, now)
                continue
            await self._attempt(wait, now)
        self._forget_gone()
        self.rounds += 1

    def _forget_gone(self) -> None:
        """Drop memos of pods and gangs the API no longer has (bounded memory)."""
        self._told.keep(self.store.pods)
        for uid in [uid for uid in self._conditions if uid not in self.store.pods]:
            del self._conditions[uid]
        known = self.store.gangs().keys()
        for memo in (self._tried, self._shortfalls, self._timed_out):
            for key in [key for key in memo if key not in known]:
                del memo[key]

    def _alarm(self, at: float, now: float) -> None:
        """Wake up at `at` (only a future time counts)."""
        if at > now:
            self._next = min(self._next, at)

    # --- plans in the API ------------------------------------------------------------

    def _open_plans(self) -> list[tuple[GangKey, str]]:
        found: dict[str, GangKey] = {
            plan_id: committed.key for plan_id, committed in self._committed.items()
        }
        for pod in self.store.pods.values():
            if pod.plan is not None and pod.gated and pod.live and pod.gang:
                found.setdefault(pod.plan.id, pod.key)
        return [(key, plan_id) for plan_id, key in found.items()]

    async def _fetch(self, pod: GangPod) -> dict[str, Any] | None:
        """The pod as the API has it now; None when it is gone or was replaced."""
        try:
            fresh = await self.api.get_pod(pod.namespace, pod.name)
        except kube.ApiError as error:
            if error.not_found:
                return None
            raise
        if (fresh.get("metadata") or {}).get("uid") != pod.uid:
            return None
        return fresh

    async def _each(self, items: Sequence[T], work: Callable[[T], Awaitable[Any]]) -> list[Any]:
        """`work` on every item, at most `concurrency` at once; results (or the
        exceptions raised) in order."""
        limit = asyncio.Semaphore(self.settings.concurrency)

        async def one(item: T) -> Any:
            async with limit:
                return await work(item)

        return list(await asyncio.gather(*(one(item) for item in items), return_exceptions=True))

    async def _settle(
        self, key: GangKey, plan_id: str, known: dict[str, dict[str, Any]] | None = None
    ) -> None:
        """Roll a plan found in the API forward or back (rule in the module docstring).
        `known`: members' bodies just returned by our own writes (not read again)."""
        committed = self._committed.get(plan_id)
        if committed is not None:
            members = list(committed.members)
            size = len(members)
        else:
            members = [
                pod
                for pod in self.store.members(key)
                if pod.plan is not None and pod.plan.id == plan_id
            ]
            if not members:
                return
            size = max(pod.plan.members for pod in members if pod.plan is not None)
        if known is not None and all(pod.uid in known for pod in members):
            fresh: list[Any] = [known[pod.uid] for pod in members]
        else:
            fresh = _raise_first(await self._each(members, self._fetch))
        present = [
            (pod, body)
            for pod, body in zip(members, fresh, strict=True)
            if body is not None and _marked(body, plan_id)
        ]
        started = any(not gated(body) for _, body in present)
        if not started and len(present) < size:
            await self._roll_back(key, plan_id, present, size)
            return
        waiting = [(pod, body) for pod, body in present if gated(body)]
        narrowed = _raise_first(
            await self._each(waiting, lambda item: self._narrow(item[0], item[1], plan_id))
        )
        if not started and any(body is None for body in narrowed):
            still = [
                (pod, body)
                for (pod, _), body in zip(waiting, narrowed, strict=True)
                if body is not None
            ]
            await self._roll_back(key, plan_id, still, size)
            return
        ready = [
            (pod, body)
            for (pod, _), body in zip(waiting, narrowed, strict=True)
            if body is not None
        ]
        stamp = assignments.rfc3339(datetime.fromtimestamp(self.clock(), UTC))
        _raise_first(await self._each(ready, lambda item: self._ungate(item[0], item[1], stamp)))
        self._committed.pop(plan_id, None)
        if ready:
            self._placed(key, plan_id, [pod for pod, _ in present], [body for _, body in present])
            await self._each([pod for pod, _ in ready], self._ready)

    async def _write(
        self,
        pod: GangPod,
        body: dict[str, Any] | None,
        change: Callable[[dict[str, Any]], dict[str, Any] | None],
        *,
        status: bool = False,
    ) -> dict[str, Any] | None:
        """Apply `change(body)` (a merge patch, or None when nothing is left to do) with
        UID and resourceVersion preconditions, re-reading on 409. Returns the pod after
        it, or None when the pod is gone."""
        for _ in range(self.settings.write_attempts):
            if body is None:
                body = await self._fetch(pod)
                if body is None:
                    return None
            patch = change(body)
            if patch is None:
                return body
            metadata = patch.setdefault("metadata", {})
            metadata["uid"] = pod.uid
            metadata["resourceVersion"] = (body.get("metadata") or {}).get("resourceVersion")
            try:
                if status:
                    return await self.api.patch_pod_status(pod.namespace, pod.name, patch)
                return await self.api.patch_pod(pod.namespace, pod.name, patch)
            except kube.ApiError as error:
                if error.not_found:
                    return None
                if not error.conflict:
                    raise
                body = None
        raise kube.ApiError(409, "Conflict", f"pod {pod} kept changing; will retry")

    async def _narrow(
        self, pod: GangPod, body: dict[str, Any], plan_id: str
    ) -> dict[str, Any] | None:
        def change(current: dict[str, Any]) -> dict[str, Any] | None:
            mark = plan_mark(current)
            if not gated(current) or mark is None or mark.id != plan_id:
                return None
            affinity = gang_affinity.narrowed(
                (current.get("spec") or {}).get("affinity"), mark.node
            )
            return None if affinity is None else {"spec": {"affinity": affinity}}

        return await self._write(pod, body, change)

    async def _ungate(self, pod: GangPod, body: dict[str, Any], stamp: str) -> None:
        def change(current: dict[str, Any]) -> dict[str, Any] | None:
            if not gated(current):
                return None
            rest = [gate for gate in gates(current) if gate.get("name") != keys.GANG_GATE]
            return {
                "metadata": {"annotations": {keys.ASSIGNED_AT: stamp}},
                "spec": {"schedulingGates": rest or None},
            }

        await self._write(pod, body, change)

    async def _clear(self, pod: GangPod, body: dict[str, Any] | None, plan_id: str) -> None:
        def change(current: dict[str, Any]) -> dict[str, Any] | None:
            if not _marked(current, plan_id) or (current.get("spec") or {}).get("nodeName"):
                return None
            cleared: dict[str, Any] = dict(assignments.cleared())
            cleared[keys.GANG_PLAN] = None
            return {"metadata": {"annotations": cleared}}

        await self._write(pod, body, change)

    async def _roll_back(
        self,
        key: GangKey,
        plan_id: str,
        present: list[tuple[GangPod, dict[str, Any]]],
        size: int,
        why: str = "",
    ) -> None:
        if not present:
            self._committed.pop(plan_id, None)
            return
        _raise_first(await self._each(present, lambda item: self._clear(item[0], item[1], plan_id)))
        for pod, _ in present:
            self.sync.unhold(pod.uid)
        self._committed.pop(plan_id, None)
        self._tried.pop(key, None)
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
            self._emit(pod, recording.WARNING, ROLLED_BACK, message)

    def _placed(
        self,
        key: GangKey,
        plan_id: str,
        members: list[GangPod],
        bodies: list[dict[str, Any]],
    ) -> None:
        now = self.clock()
        since = min((pod.created for pod in members if pod.created), default=now)
        self.metrics.placements.inc()
        self.metrics.wait.observe(max(now - since, 0.0))
        if self.fences is not None and self.fences.owner == key:
            self.fences.release()
            self.metrics.fenced.set(0)
        if self.preemptions is not None:
            self.preemptions.forget(key)
        self._shortfalls.pop(key, None)
        self._tried.pop(key, None)
        self._timed_out.pop(key, None)
        per_node: dict[str, int] = {}
        for body in bodies:
            mark = plan_mark(body)
            if mark is not None:
                per_node[mark.node] = per_node.get(mark.node, 0) + 1
        layout = ", ".join(f"{node} ×{count}" for node, count in per_node.items())
        log.info(
            "gang placed",
            extra={"gang": "/".join(key), "plan": plan_id, "members": len(members)},
        )
        for pod, body in zip(members, bodies, strict=True):
            mark = plan_mark(body)
            annotations = (body.get("metadata") or {}).get("annotations") or {}
            gpus = annotations.get(keys.ASSIGNED_GPUS, "")
            mine = f"; this member: node {mark.node}, GPUs {gpus}" if mark is not None else ""
            self._emit(
                pod,
                recording.NORMAL,
                PLACED,
                f"gang {key[1]} placed: {len(members)} members on {len(per_node)} "
                f"node{'s' if len(per_node) != 1 else ''} ({layout}){mine}",
            )

    async def _ready(self, pod: GangPod) -> None:
        """Turn a GangReady=False condition (written at timeout) True."""
        if pod.condition is None and pod.uid not in self._conditions:
            return
        await self._condition(pod, "True", PLACED, "all members of the gang are placed")

    # --- who waits -------------------------------------------------------------------

    def _waits(self, now: float) -> list[Wait]:
        ledger = self.sync.ledger
        waits = []
        for key, pods in self.store.gangs().items():
            live = [pod for pod in pods if pod.live]
            if not live:
                continue
            if any(pod.gated and (pod.plan is not None or pod.uid in ledger) for pod in live):
                # a plan is being written, finished or undone and our view of it is
                # not settled yet (informers lag our own writes): decide next round
                continue
            candidates = sorted((pod for pod in live if pod.gated), key=GangPod.order)
            if not candidates:
                continue
            invalid = [pod for pod in candidates if pod.request is None]
            for pod in invalid:
                if self._told.first(pod.uid, INVALID):
                    self._emit(
                        pod,
                        recording.WARNING,
                        INVALID,
                        f"this pod cannot join gang {key[1]}: {pod.problem or 'no GPU request'}",
                    )
            candidates = [pod for pod in candidates if pod.request is not None]
            if not candidates:
                continue
            started = len(live) - len(candidates) - len(invalid)
            leader = min(live, key=GangPod.order)
            size = leader.size
            need = size - started
            members, extras = candidates[: max(need, 0)], candidates[max(need, 0) :]
            for pod in extras:
                if self._told.first(pod.uid, FULL):
                    self._emit(
                        pod,
                        recording.WARNING,
                        FULL,
                        f"gang {key[1]} already has its {size} members; this pod stays "
                        "gated until one of them goes away",
                    )
            if not members:
                continue
            since = min(pod.created for pod in members) or now
            timeout = members[0].timeout
            waits.append(
                Wait(
                    key=key,
                    members=members,
                    size=size,
                    need=need,
                    priority=max(pod.priority for pod in members),
                    since=since,
                    deadline=since + timeout,
                    timeout=timeout,
                )
            )
        return waits

    async def _incomplete(self, wait: Wait, now: float) -> None:
        have = len(wait.members) + (wait.size - wait.need)
        for pod in wait.members:
            if self._told.first(pod.uid, f"{INCOMPLETE}@{wait.since}"):
                self._emit(
                    pod,
                    recording.NORMAL,
                    INCOMPLETE,
                    f"waiting for all members of gang {wait.key[1]}: {have} of {wait.size} "
                    "exist; no GPU is held until all do",
                )
        if now < wait.deadline:
            self._alarm(wait.deadline, now)
            return
        await self._timeout(
            wait,
            INCOMPLETE,
            f"gang {wait.key[1]}: only {have} of {wait.size} members exist after its "
            f"gang-timeout of {_duration(wait.timeout)}; it keeps waiting gated and "
            "starts when all exist and fit; no GPU is held meanwhile",
        )

    # --- planning --------------------------------------------------------------------

    def _members(self, wait: Wait) -> list[gangs.Member]:
        inventory = self.sync.ledger.inventory
        allowed: dict[gang_affinity.NodeFilter, frozenset[str] | None] = {}
        result = []
        for pod in wait.members:
            assert pod.request is not None
            if pod.filter not in allowed:
                allowed[pod.filter] = pod.filter.allowed(
                    (node.name, node.labels) for node in inventory
                )
            result.append(gangs.Member(pod.uid, pod.request, allowed[pod.filter], pod.tolerations))
        return result

    def _exclude(self, key: GangKey) -> frozenset[str]:
        if self.fences is None or self.fences.owner in (None, key):
            return frozenset()
        return self.fences.nodes

    def _signature(self, wait: Wait, policy: Policy) -> tuple[object, ...]:
        fence = self.fences.version if self.fences is not None else 0
        return (
            self.sync.ledger.generation,
            tuple(pod.uid for pod in wait.members),
            fence,
            id(policy),
        )

    def _plan_and_hold(
        self, wait: Wait, policy: Policy
    ) -> tuple[gangs.Plan, list[Grant]] | gangs.Shortfall:
        """Plan and reserve in one synchronous step (no await: nothing interleaves)."""
        members = self._members(wait)
        started = time.perf_counter()
        result = gangs.plan(self.sync.ledger, policy, members, exclude=self._exclude(wait.key))
        self.metrics.plan_seconds.observe(time.perf_counter() - started)
        if isinstance(result, gangs.Shortfall):
            return result
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
                await self._start(wait, plan, grants)
                return
            self._tried[wait.key] = signature
            self._shortfalls[wait.key] = outcome
            self._waiting(wait, outcome)
        shortfall = self._shortfalls.get(wait.key)
        if shortfall is None:
            return
        if now < wait.deadline:
            self._alarm(wait.deadline, now)
            if shortfall.ever and self.fences is not None:
                self._alarm(wait.since + self.settings.starve_after_seconds, now)
            if shortfall.ever:
                await self._preempt(wait, now)
            return
        await self._timeout(
            wait,
            UNSCHEDULABLE,
            f"gang {wait.key[1]} could not be placed within its gang-timeout of "
            f"{_duration(wait.timeout)}: {shortfall.reason}; it holds no GPUs and is tried "
            "again whenever capacity frees",
        )

    async def _preempt(self, wait: Wait, now: float) -> None:
        """Displace lower-priority pods for a complete gang that does not fit
        (`gpuplace.extender.gang_preempting`); the fence it sets is kept by `_update_fence`."""
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
            running=[p for p in self.store.members(wait.key) if p.live and not p.gated],
        )
        if again is not None:
            self._alarm(again, now)
        if self.fences.owner == wait.key:
            self.metrics.fenced.set(len(self.fences.nodes))

    def _waiting(self, wait: Wait, shortfall: gangs.Shortfall) -> None:
        for pod in wait.members:
            if not shortfall.ever:
                if self._told.first(pod.uid, f"{UNSCHEDULABLE}@{wait.since}"):
                    self._emit(
                        pod,
                        recording.WARNING,
                        UNSCHEDULABLE,
                        f"gang {wait.key[1]}: {shortfall.reason}; it will not start unless "
                        "nodes are added or its requests change",
                    )
            elif self._told.first(pod.uid, f"{WAITING}@{wait.since}"):
                self._emit(
                    pod,
                    recording.NORMAL,
                    WAITING,
                    f"all {wait.size} members of gang {wait.key[1]} exist; waiting for room: "
                    f"{shortfall.reason}",
                )

    async def _start(self, wait: Wait, plan: gangs.Plan, grants: list[Grant]) -> None:
        plan_id = secrets.token_hex(6)
        by_uid = {grant.pod_uid: grant for grant in grants}
        size = len(wait.members)
        at = datetime.fromtimestamp(self.clock(), UTC)
        inventory = self.sync.ledger.inventory

        bodies: dict[str, dict[str, Any]] = {}

        async def annotate(pod: GangPod) -> bool:
            grant = by_uid[pod.uid]
            mark = PlanMark(plan_id, size, grant.node)
            annotations = assignments.annotations_for(grant, inventory.get(grant.node), at)
            annotations[keys.GANG_PLAN] = mark.encode()
            try:
                metadata = {
                    "uid": pod.uid,
                    "resourceVersion": pod.resource_version,
                    "annotations": annotations,
                }
                body = await self.api.patch_pod(pod.namespace, pod.name, {"metadata": metadata})
            except kube.ApiError as error:
                log.info(
                    "gang plan not written",
                    extra={"pod": str(pod), "status": error.status, "reason": error.reason},
                )
                return False
            bodies[pod.uid] = body
            return gated(body) and plan_mark(body) == mark

        written = await self._each(wait.members, annotate)
        if not all(result is True for result in written):
            present = []
            for pod in wait.members:
                body = await self._fetch_quietly(pod)
                if body is not None:
                    present.append((pod, body))
            with contextlib.suppress(kube.ApiError):
                await self._roll_back(
                    wait.key, plan_id, present, size, "its plan could not be written"
                )
            for pod in wait.members:
                self.sync.unhold(pod.uid)
            return
        self._committed[plan_id] = Committed(wait.key, tuple(wait.members), wait.since)
        log.info(
            "gang plan written",
            extra={
                "gang": "/".join(wait.key),
                "plan": plan_id,
                "members": size,
                "nodes": len(plan.nodes),
            },
        )
        await self._settle(wait.key, plan_id, bodies)

    async def _fetch_quietly(self, pod: GangPod) -> dict[str, Any] | None:
        try:
            return await self._fetch(pod)
        except kube.ApiError:
            return None

    # --- timeouts, conditions, fences ------------------------------------------------

    async def _timeout(self, wait: Wait, reason: str, message: str) -> None:
        if self._timed_out.get(wait.key) != wait.since:
            self._timed_out[wait.key] = wait.since
            self.metrics.timeouts.labels(
                "incomplete" if reason == INCOMPLETE else "unplaceable"
            ).inc()
            log.info("gang timed out", extra={"gang": "/".join(wait.key), "reason": reason})
            if self.fences is not None and self.fences.owner == wait.key:
                self.fences.release()
                self.metrics.fenced.set(0)
            if self.preemptions is not None:
                self.preemptions.forget(wait.key)
        for pod in wait.members:
            if self._told.first(pod.uid, f"{TIMEOUT}@{wait.since}"):
                self._emit(pod, recording.WARNING, TIMEOUT, message)
        await self._each(wait.members, lambda pod: self._condition(pod, "False", reason, message))

    async def _condition(self, pod: GangPod, status: str, reason: str, message: str) -> None:
        """Set GangReady on one member (pods/status), unless it already says so."""
        if self._conditions.get(pod.uid) == (status, reason):
            return
        if pod.condition == (status, reason) and pod.uid not in self._conditions:
            self._conditions[pod.uid] = (status, reason)
            return
        stamp = assignments.rfc3339(datetime.fromtimestamp(self.clock(), UTC))

        def change(current: dict[str, Any]) -> dict[str, Any] | None:
            conditions = [
                item
                for item in (current.get("status") or {}).get("conditions") or []
                if isinstance(item, dict)
            ]
            mine = next((c for c in conditions if c.get("type") == keys.GANG_CONDITION), None)
            if mine is not None and (mine.get("status"), mine.get("reason")) == (status, reason):
                return None
            moved = mine is None or mine.get("status") != status
            entry = {
                "type": keys.GANG_CONDITION,
                "status": status,
                "reason": reason,
                "message": message[: recording.MAX_MESSAGE],
                "lastProbeTime": None,
                "lastTransitionTime": stamp
                if moved or mine is None
                else mine.get("lastTransitionTime", stamp),
            }
            others = [c for c in conditions if c.get("type") != keys.GANG_CONDITION]
            return {"status": {"conditions": [*others, entry]}}

        try:
            await self._write(pod, None, change, status=True)
        except kube.ApiError as error:
            log.warning(
                "gang condition not written",
                extra={"pod": str(pod), "status": error.status, "reason": error.reason},
            )
            return
        self._conditions[pod.uid] = (status, reason)

    def _update_fence(self, waits: list[Wait], now: float) -> None:
        if self.fences is None:
            return
        if self.preemptions is not None:
            complete = [wait for wait in waits if wait.complete and now < wait.deadline]
            self.preemptions.keep_only(wait.key for wait in complete)
            for wait in complete:  # in order: a preemption under way keeps its fence
                underway = self.preemptions.underway.get(wait.key)
                if underway is not None:
                    uids = frozenset(pod.uid for pod in wait.members)
                    self.fences.hold(Fence(wait.key, underway.nodes, uids, wait.since))
                    self.metrics.fenced.set(len(underway.nodes))
                    return
        head = None
        for wait in waits:
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
            if current is not None:
                self.fences.release()
                self.metrics.fenced.set(0)
            return
        uids = frozenset(pod.uid for pod in head.members)
        inventory = self.sync.ledger.inventory
        if (
            current is not None
            and current.owner == head.key
            and current.members == uids
            and all(name in inventory for name in current.nodes)
        ):
            return
        nodes = gangs.fence(self.sync.ledger, self._members(head))
        if not nodes:
            self.fences.release()
            self.metrics.fenced.set(0)
            return
        self.fences.hold(Fence(head.key, frozenset(nodes), uids, head.since))
        self.metrics.fenced.set(len(nodes))
        shown = ", ".join(nodes[:8]) + (f" and {len(nodes) - 8} more" if len(nodes) > 8 else "")
        log.info("gang capacity held", extra={"gang": "/".join(head.key), "nodes": len(nodes)})
        for pod in head.members:
            if self._told.first(pod.uid, f"{HELD}@{head.since}"):
                self._emit(
                    pod,
                    recording.NORMAL,
                    HELD,
                    f"gang {head.key[1]} has waited {_duration(now - head.since)} for room: "
                    f"nodes {shown} are held for it (no new pods go there) until it starts "
                    "or times out",
                )

    def _emit(self, pod: GangPod, kind: str, reason: str, message: str) -> None:
        if self.recorder is not None:
            self.recorder.emit(
                recording.Subject(pod.namespace, pod.name, pod.uid), kind, reason, message
            )


def _marked(body: dict[str, Any], plan_id: str) -> bool:
    mark = plan_mark(body)
    return mark is not None and mark.id == plan_id


def _raise_first(results: list[Any]) -> list[Any]:
    """Results of `_each`; the first exception among them is raised (after all ran)."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
