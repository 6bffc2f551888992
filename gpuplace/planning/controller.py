"""The planner: every gpuplace pod that is neither a gang member nor queued is placed by the
engine before kube-scheduler sees it, and handed its node ("plan, then pin").

The webhook puts the scheduling gate `gpuplace.io/place` on such a pod at CREATE
(`gpuplace.webhook.mutating`); gang members and queued pods have their own controllers,
which plan and pin already (`gpuplace.gangs`, `gpuplace.queues`). One asyncio task in
the sidecar (`PlanController.run`: the controller kit's leader-gated round loop,
`gpuplace.controllers.rounds`, woken by every pod and node change of the ledger). Each
round (`step`):

1. **Who**: the live, unbound pods behind the gate whose gate is the last one left
   (another component's gate, e.g. a batch system's, goes first: the plan is made when
   the pod can run), and that no release of this process is writing or has written;
   highest priority first, then the oldest.
2. **Plan**, synchronously for all of them (no await: nothing interleaves), each on the
   ledger as the earlier ones left it: the engine's choice for the pod alone
   (`gpuplace.placement.choosing.Chooser.choose`, the policy in force, the same choice
   the extender's filter would make; `gpuplace.planning.choice`) among the nodes
   kube-scheduler would offer it — its
   node affinity and selector allow them, they admit it (taints, cordon:
   `Node.admits`), no gang or queued workload holds them (fences) — and its grant held
   in the ledger (`LedgerSync.hold`, owner `gpuplace.cluster.syncing.PLANNED`), so
   nothing else takes those GPUs meanwhile. A pod with no room now, or whose request
   cannot be read, is released with no node: the extender's filter then decides as for
   any pod (it says why, and kube-scheduler may preempt for it).
3. **Release** (`gpuplace.planning.pins`), each pod its own background write, at most
   `concurrency` at once, so the next round plans while earlier releases are written:
   the node handed over (`Nominate`: `status.nominatedNodeName`, kube-scheduler's first
   try; or `Narrow`: the affinity pinned) and the gate removed. Right before the write
   that hands the node over, the plan is checked against the ledger as it is then; a plan
   gone stale (its hold dropped, or a grant the informer brought in overcommits its GPUs)
   writes nothing and is planned again next round. A write the API refuses releases the
   hold (tried again next round); one with no answer keeps it (it may have landed; the
   hold expires otherwise).

The hold stays until kube-scheduler's bind takes it (`gpuplace.extender.binding`: the
bind writes the Binding with the assignment, as for any pod) or the reaper drops it at
its deadline. A crash loses only holds: a released pod is bound by the extender's filter
and bind as any pod, on its nominated node when that still fits. Gates are never added
back: a pod released stays released.

Complexity per round: O(pods planned × the chooser's cost) on the event loop the
extender's verbs share (the chooser: O(changed nodes + distinct node states) for a pod
every node may take, O(its nodes) else), + O(nodes) per distinct (affinity,
tolerations) among them.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from gpuplace.cluster import keys, kube, recording
from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import PLANNED, LedgerSync
from gpuplace.controllers import evictions
from gpuplace.controllers.api import PodApi
from gpuplace.controllers.controller import Controller, Parts, Settings
from gpuplace.controllers.store import PodIndex
from gpuplace.placement import choosing
from gpuplace.placement.choosing import Chooser, Policy
from gpuplace.placement.ledger import Grant, LedgerError
from gpuplace.placement.taints import Toleration
from gpuplace.planning import choice, events, pins
from gpuplace.planning.metrics import PlanMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PlanSettings(Settings):
    """The kit's `Settings` with the planner's figures."""

    poll_seconds: float = 5.0
    settle_seconds: float = 0.01
    """A burst of pods makes few rounds; each pod waits at most this long to be planned
    once the informer delivered it."""
    concurrency: int = 32
    """Releases written at once (each one or two API writes)."""
    pin: str = "nominate"
    """How the node is handed over: `nominate` or `affinity` (`gpuplace.planning.pins`)."""


def planned_pods(sync: LedgerSync) -> PodIndex[None]:
    """The planner's pods: behind its gate `gpuplace.io/place`."""
    return PodIndex(sync, lambda record: record.controlled.place_gated)


class _Eligible:
    """Per (affinity, tolerations): the inventory's nodes kube-scheduler would offer a pod
    with them, less the fenced ones; None when that is every node (the chooser then picks
    among its groups of equal nodes, not node by node). One pass over the nodes per
    distinct key, per round."""

    def __init__(self, controller: PlanController) -> None:
        inventory = controller.sync.ledger.inventory
        self._nodes = list(inventory)
        self._fenced = controller.fences.nodes if controller.fences is not None else frozenset()
        self._memo: dict[tuple[NodeAffinity, tuple[Toleration, ...]], list[str] | None] = {}

    def __call__(self, pod: PodRecord) -> list[str] | None:
        key = (pod.controlled.affinity, pod.controlled.tolerations)
        if key not in self._memo:
            affinity, tolerations = key
            allowed = affinity.allowed((node.name, node.labels) for node in self._nodes)
            names = [
                node.name
                for node in self._nodes
                if (allowed is None or node.name in allowed)
                and node.name not in self._fenced
                and node.admits(tolerations)
            ]
            self._memo[key] = None if len(names) == len(self._nodes) else names
        return self._memo[key]


class PlanController(Controller[PlanSettings, None, PodApi]):
    """See the module docstring. Collaborators are passed in (`gpuplace.wiring.planning`
    builds them for the sidecar and the tests alike): the kit's `parts`, the pods behind
    the gate (`store`, `planned_pods(parts.sync)`), and its own: `registry`, where its
    metrics go; `rng`, the tie-break among nodes the policy scores alike when it has no
    line of its own (kube-scheduler's own scoring picks among them on the extender path)."""

    def __init__(
        self,
        parts: Parts[PodApi],
        store: PodIndex[None],
        *,
        registry: CollectorRegistry | None = None,
        settings: PlanSettings | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.metrics = PlanMetrics(registry)
        settings = settings or PlanSettings()
        super().__init__("plan", parts, store, settings=settings, leading=self.metrics.leading)
        if settings.pin not in pins.PINS:
            raise ValueError(f"unknown pin {settings.pin!r}: one of {', '.join(pins.PINS)}")
        self.pin = pins.PINS[settings.pin]
        self.rng = rng or random.Random()
        self._chooser: Chooser | None = None
        self._limit = asyncio.Semaphore(settings.concurrency)
        self._writing: dict[str, asyncio.Task[None]] = {}
        """Releases being written, by pod UID."""
        self._released: set[str] = set()
        """Pods whose release landed and that the informer still shows gated."""
        self._ready_since: dict[str, float] = {}
        """When each pod could first be planned (its gate the last one left)."""

    # --- running ---------------------------------------------------------------------

    async def run(self) -> None:
        """Run rounds until cancelled (then wait for the releases being written). Never
        raises on API failures."""
        try:
            await self.loop.run(self._lead, self._follow, ready=(self.store.synced,))
        finally:
            writing = list(self._writing.values())
            for task in writing:
                task.cancel()
            await asyncio.gather(*writing, return_exceptions=True)

    def _gated(self) -> list[PodRecord]:
        return [pod for pod in self.store.pods.values() if pod.live and not pod.bound]

    async def _lead(self) -> None:
        await self.step()

    def _follow(self) -> None:
        """A round while another replica decides: count the pods that wait. When no replica
        can tell whether it decides (the Lease read is refused, `blocked`), nobody would
        plan them: they are released with no node instead (the extender's filter places
        them as any pod, without the plan's saving), and told why."""
        held = self._gated()
        self.metrics.gated.set(len(held))
        reason = self.blocked() if self.blocked is not None else None
        if reason is not None:
            for pod in self._plannable(held, self.clock()):
                if self._told.first(pod.uid, events.BLOCKED):
                    message = (
                        f"{reason}; released without a plan: kube-scheduler and gpuplace's "
                        "filter place it as any pod"
                    )
                    self._emit(pod, recording.WARNING, events.BLOCKED, message)
                self._start(pod, None)
        self._forget()

    def _plannable(self, gated: list[PodRecord], now: float) -> list[PodRecord]:
        """The pods a round may plan: the planner's gate their last, no release of ours
        being written or written (module docstring)."""
        ready = [
            pod
            for pod in gated
            if pod.controlled.gates == (keys.PLACE_GATE,)
            and pod.uid not in self._writing
            and pod.uid not in self._released
        ]
        for pod in ready:
            self._ready_since.setdefault(pod.uid, now)
        return ready

    def _start(self, pod: PodRecord, grant: Grant | None) -> None:
        self._writing[pod.uid] = asyncio.create_task(
            self._release(pod, grant), name="gpuplace-plan-release"
        )

    async def step(self) -> None:
        """One round: plan every pod that can be planned, then start their releases."""
        gated = self._gated()
        self.metrics.gated.set(len(gated))
        ready = self._plannable(gated, self.clock())
        self._forget()
        if not ready:
            return
        ready.sort(key=lambda pod: (-pod.priority, pod.created, pod.namespace, pod.name))
        started = time.perf_counter()
        planned = self._plan(ready)
        self.loop.decided()
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        for pod, grant in planned:
            self._start(pod, grant)
        self._count_held()

    # --- planning ----------------------------------------------------------------------

    def _chooser_for(self, policy: Policy) -> Chooser:
        if self._chooser is None or self._chooser.policy is not policy:
            self._chooser = Chooser(self.sync.ledger, policy)
        return self._chooser

    def _plan(self, pods: Iterable[PodRecord]) -> list[tuple[PodRecord, Grant | None]]:
        """Each pod's grant, held (None: released with no node). Synchronous."""
        chooser = self._chooser_for(self.policy())
        eligible = _Eligible(self)
        planned: list[tuple[PodRecord, Grant | None]] = []
        for pod in pods:
            request = pod.request
            grant = None
            held = self.sync.hold_of(pod.uid)
            if held is not None and held.owner == PLANNED:
                self.sync.unhold(pod.uid)  # a stale or failed plan of ours: plan anew
            plannable = request is not None and request.count > 0 and not pod.problem
            # a grant of its own already (an assignment someone wrote): the bind keeps it
            if request is not None and plannable and self.sync.ledger.get(pod.uid) is None:
                chosen = choice.choose(chooser, request, self.rng, eligible(pod))
                if chosen is not None:
                    grant = choosing.grant_for(pod.uid, chosen, request)
                    try:
                        self.sync.hold(grant, seconds=self.settings.hold_seconds, owner=PLANNED)
                    except LedgerError as error:  # cannot happen: nothing awaited since
                        log.warning(
                            "plan refused by the ledger", extra={"pod": str(pod), "why": str(error)}
                        )
                        grant = None
            planned.append((pod, grant))
        return planned

    # --- releasing ---------------------------------------------------------------------

    def _check(self, grant: Grant) -> pins.Check:
        def check() -> None:
            hold = self.sync.hold_of(grant.pod_uid)
            if hold is None or hold.grant != grant or self.sync.ledger.overcommitted(grant):
                raise pins.Stale()

        return check

    async def _release(self, pod: PodRecord, grant: Grant | None) -> None:
        try:
            result = await self._write(pod, grant)
            if result == "refused":
                # the hand-over is refused (RBAC: pods/status patch): release with no node
                # rather than keep every GPU pod gated; the refusal is logged and counted
                self.metrics.releases.labels("failed").inc()
                result = await self._write(pod, None)
        finally:
            self._writing.pop(pod.uid, None)
        self.metrics.releases.labels(result).inc()
        self._count_held()
        if result in ("stale", "failed"):
            self.loop.wake()

    async def _write(self, pod: PodRecord, grant: Grant | None) -> str:
        """One release's writes; what came of them (`metrics.RESULTS`, or `refused`: the
        API forbids handing the node over)."""
        try:
            async with self._limit:
                node = grant.node if grant is not None else None
                check = self._check(grant) if grant is not None else _no_check
                body = await self.pin.release(self.writer, pod, node, check)
        except pins.Stale:
            self._unhold(grant)
            log.info("plan went stale before its release", extra={"pod": str(pod)})
            return "stale"
        except kube.ApiError as error:
            if not evictions.unknown_outcome(error):
                self._unhold(grant)
            if error.status == 403 and grant is not None:
                return "refused"
            log.warning(
                "plan release failed, retrying",
                extra={"pod": str(pod), "status": error.status, "reason": error.reason},
            )
            return "failed"
        except asyncio.CancelledError:
            self._unhold(grant)
            raise
        if body is None:
            self._unhold(grant)
            return "gone"
        self._released.add(pod.uid)
        since = self._ready_since.pop(pod.uid, None)
        if since is not None:
            self.metrics.wait.observe(max(self.clock() - since, 0.0))
        return self.pin.result if grant is not None else "unplanned"

    def _unhold(self, grant: Grant | None) -> None:
        if grant is None:
            return
        held = self.sync.hold_of(grant.pod_uid)
        if held is not None and held.owner == PLANNED and held.grant == grant:
            self.sync.unhold(grant.pod_uid)

    def _count_held(self) -> None:
        self.metrics.held.set(sum(1 for hold in self.sync.holds() if hold.owner == PLANNED))

    def _forget(self) -> None:
        """Drop memos of pods no longer behind the gate (bounded memory)."""
        kept = self.store.pods
        self._released.intersection_update(kept)
        for uid in [uid for uid in self._ready_since if uid not in kept]:
            del self._ready_since[uid]
        self._told.keep(kept)


def _no_check() -> None:
    """A release with no node has no plan to go stale."""
