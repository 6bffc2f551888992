"""The DRA claim controller: each pod the webhook sent to DRA nodes gets its ResourceClaim,
pinned to the GPUs gpuplace's engine planned ("plan, then pin" on DRA nodes), then its
gate goes.

A pod on the DRA path (`gpuplace.cluster.dra_claims`) names a claim by name and waits
behind the gate `gpuplace.io/dra-claim`. One asyncio task in the sidecar
(`ClaimController.run`, the controller kit's round loop, deciding only in the replica whose
kube-scheduler leads, like the gang and queue controllers), woken by every change of the
managed pods. Each round, for every live pod whose last gate left is that one (a gang
member or queued pod waits for its controller's plan; a pod another component gates, a
batch system, waits for it as the planner's pods do: the plan is made when the pod can
run), highest priority first, then the oldest (its index: `dra_pods`):

1. **plan** (synchronously, before anything is awaited, so each pod is planned on the
   ledger as the earlier ones left it): a gang's or queue's plan where the pod has one
   (its assignment annotations: the node and GPUs they chose), else the engine's choice
   for the pod alone (`gpuplace.placement.choosing.Chooser`, the policy in force, the
   same the extender's filter and the planner make) among the DRA nodes kube-scheduler
   would offer it (affinity, taints, fences), held in the ledger (owner
   `gpuplace.cluster.syncing.PLANNED`) until the claim's allocation replaces the hold.
   No room now: a pod alone preempts lower-priority pods where it may
   (`gpuplace.claims.preempting`: kube-scheduler never preempts for a claim), its claim
   pinned to the GPUs its victims free, or it stays gated while budgets forbid every
   plan; it stays gated too while a DRA node it could use is held for another workload
   (a gang's or queued workload's fence, another lone pod's preemption: an unpinned claim
   would let kube-scheduler's first fit take what that node is held for); else no pin
   (kube-scheduler's first fit, which says why it waits); `ClaimSettings.pin` `first-fit`
   never pins;
2. **create** its claim, unless the claim informer already has it (`create_claim`, the one
   place a pod's claim is written): `dra_claims.claim` from the pod's parsed request, a
   CEL selector on the planned GPUs' UUIDs on every alternative (annotation
   `gpuplace.io/pinned-gpus`), owned by the pod, its memory the ask plus the CUDA
   context of the GPUs it may land on (`dra_claims.context_mib`); AlreadyExists is read
   back: a claim of that name owned by this pod (a round that created it before a crash)
   is its claim, one owned by anything else is not, and the pod waits with an Event
   saying so (`GpuClaimBlocked`); a creation the API refuses (RBAC, validation) is said
   the same way and tried again next round;
3. **ungate**: for a plan of its own or a preemption's (not a gang's or queue's: they
   narrowed the pod's affinity already), the planned node nominated first
   (`status.nominatedNodeName`, so kube-scheduler filters that node first and alone, not
   every node for the one the pin passes; docs/dra.md), then the gate removed
   (`gpuplace.controllers.writing.Writer`: UID and resourceVersion preconditions, re-read
   on conflict, a no-op once it is gone). Other gates stay: their controllers remove them.

kube-scheduler's DRA allocator then allocates the claim exactly on the pinned GPUs
(re-checking their capacity) and binds the pod; when the claim informer sees the
allocation of a claim this controller's pod owns, the pod gets the Event `GpusAssigned`
naming its GPU, node and share, as the extender's bind writes it.

**A race** (the planned GPUs taken meanwhile by what the ledger did not see in time):
kube-scheduler finds no node (PodScheduled False, Unschedulable) and the claim stays
unallocated. Each round looks at the released, unbound pods whose pinned claim is in that
state: the engine plans again (its own hold set aside); other GPUs: the claim is deleted
(UID precondition; `GpuClaimReplanned`) and, the claim gone, made again next round on the
new plan (kube-scheduler waits for a claim a pod names to exist); the same GPUs or no room
now: it stays (room that frees later is seen by a later round); the same GPUs while
kube-scheduler has refused them for `ClaimSettings.remake_seconds`: the claim is deleted
and made again on them, once per pod (kube-scheduler, which refused a pin with room once
in a 600-pod burst, would otherwise try the pod again only after 5 minutes; a new claim
requeues it at once). A pod's claim deleted by anyone else is made again the same way.
A gang's or queue's member keeps its plan's node (its affinity names it, and cannot change
once ungated): the engine chooses again among that node's GPUs only, and its claim is made
again on those (the plan's node stays theirs to change). A lone preemptor whose pinned
GPUs have no room plans its preemption again: its victims still terminating give the same
pin (the claim stays), GPUs a race took once free a new plan with victims of its own (the
claim made again on it); so does a lone pod released with an unpinned claim that
kube-scheduler finds no room for (lower-priority pods may hold GPUs now). A round takes
waiting and released pods together, highest priority first.

What exists is read from the API (the claim, its pin, the gate, the pods being deleted);
kept only in memory: the holds, a member's GPUs re-pinned on its plan's node (after a
restart its claim is made on its plan again and re-pinned at the next refusal), when
kube-scheduler first refused a pin (a remade pin may be remade once more after a
restart), what `gpuplace.claims.preempting` keeps (victims evicted, back-off, targets),
and the node a preemption's pin nominates (a restart between the claim and the ungate
releases the pod without it; kube-scheduler then nominates it itself). Metrics:
`gpuplace_dra_claims_total{result}` (`created`, `existing`, `blocked`, `refused`,
`replanned`, `remade`), `gpuplace_claim_controller_leading`, and the preemption's
(`gpuplace.claims.preempting`).
O(pods on the DRA path + pods planned × (DRA nodes + the chooser's cost)) per round, plus
one preemption plan at most (`gpuplace.claims.preempting`), one API write per pod and step.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuplace.claims.preempting import PREEMPTION_BLOCKED, LonePreemptions, Wait
from gpuplace.cluster import dra_claims, keys, kube, nodes, recording
from gpuplace.cluster.claims import ClaimRecord
from gpuplace.cluster.gang_marks import gated
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import PLANNED, LedgerSync
from gpuplace.controllers import pinning, plans
from gpuplace.controllers.api import PodApi
from gpuplace.controllers.controller import Controller, Parts, Settings
from gpuplace.controllers.store import PodIndex
from gpuplace.placement import choosing
from gpuplace.placement.choosing import Choice, Chooser
from gpuplace.placement.inventory import Gpu, Inventory
from gpuplace.placement.ledger import LedgerError
from gpuplace.placement.requests import describe, share_text

log = logging.getLogger(__name__)

CREATED = "created"
EXISTING = "existing"
BLOCKED = "blocked"
REFUSED = "refused"
REPLANNED = "replanned"
REMADE = "remade"
RESULTS = (CREATED, EXISTING, BLOCKED, REFUSED, REPLANNED, REMADE)
"""`gpuplace_dra_claims_total{result}`: created now; found (made before, by this or
another replica); another object's claim of that name; the API refused the creation; a
pinned claim kube-scheduler could not allocate, deleted to be made again on a new plan; one
kube-scheduler refused on GPUs with room, deleted to be made again once on the same ones."""

PIN_ENGINE = "engine"
PIN_FIRST_FIT = "first-fit"
PINS = (PIN_ENGINE, PIN_FIRST_FIT)
"""`ClaimSettings.pin`: the engine's plan (the default), or none (kube-scheduler's first
fit over every DRA GPU, as before plan-then-pin; what `simulate --policy dra-first-fit`
models)."""

CLAIM_CREATED = "GpuClaimCreated"
CLAIM_BLOCKED = "GpuClaimBlocked"
CLAIM_REPLANNED = "GpuClaimReplanned"
GPUS_ASSIGNED = "GpusAssigned"
"""The Event reason the extender's bind writes too: what the pod was given."""


class ClaimApi(PodApi, Protocol):
    """What the controller calls: a pod's reads and writes and a ResourceClaim's."""

    async def create_resource_claim(
        self, namespace: str, body: Mapping[str, Any]
    ) -> dict[str, Any]: ...

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def delete_resource_claim(self, namespace: str, name: str, *, uid: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ClaimSettings(Settings):
    """The kit's settings: a claim is one write, so rounds settle briefly and are not
    spaced."""

    poll_seconds: float = 5.0
    settle_seconds: float = 0.05
    pin: str = PIN_ENGINE
    """Where a pod's claim lands (`PINS`)."""
    remake_seconds: float = 10.0
    """How long kube-scheduler may refuse a pinned claim whose GPUs the engine still finds
    room on before the claim is made again once, on the same GPUs (module docstring)."""
    preempt_retry_seconds: float = 10.0
    """A lone pod's preemption after a refused eviction, a plan budgets blocked or one that
    found nothing: not planned again sooner (`gpuplace.claims.preempting`)."""


class ClaimMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.leading = Gauge(
            "gpuplace_claim_controller_leading",
            "1 while this replica's DRA claim controller decides (its kube-scheduler leads).",
            registry=registry,
        )
        self.claims = Counter(
            "gpuplace_dra_claims",
            "ResourceClaims of pods on the DRA path, by result: created, existing (made "
            "before), blocked (the name is another object's claim), refused (by the API), "
            "replanned (a pinned claim that could not be allocated, deleted to be made on a "
            "new plan), remade (one kube-scheduler refused on GPUs with room, made again "
            "once on the same ones so that it tries the pod again).",
            ["result"],
            registry=registry,
        )
        for result in RESULTS:
            self.claims.labels(result)


def dra_pods(sync: LedgerSync) -> PodIndex[None]:
    """The managed pods on the DRA path (those naming gpuplace's claim), from the one pod
    informer."""
    return PodIndex(sync, lambda record: bool(record.claim))


def dra_gpus(inventory: Inventory) -> list[Gpu]:
    """The GPUs of the DRA nodes (label `gpuplace.io/dra=true`). O(GPUs)."""
    return [gpu for node in inventory if nodes.is_dra(node) for gpu in node.gpus]


def assigned_message(claim: ClaimRecord) -> str:
    """`GpusAssigned` for a claim kube-scheduler allocated: its GPUs, node and share."""
    gpus = ",".join(str(held.gpu) for held in claim.held)
    first = claim.held[0]
    memory = f", {first.memory_mib} MiB" if first.memory_mib else ""
    plural = "s" if len(claim.held) > 1 else ""
    return (
        f"kube-scheduler's DRA allocator gave it GPU{plural} {gpus} of node {claim.node} "
        f"({share_text(first.milli)}{memory} each, its MPS memory limit) through "
        f"ResourceClaim {claim.namespace}/{claim.name}"
    )


class ClaimController(Controller[ClaimSettings, None, ClaimApi]):
    """See the module docstring. `parts`: the kit's (`api` with ResourceClaims);
    `store`: `dra_pods(parts.sync)`."""

    def __init__(
        self,
        parts: Parts[ClaimApi],
        store: PodIndex[None],
        *,
        registry: CollectorRegistry | None = None,
        settings: ClaimSettings | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.metrics = ClaimMetrics(registry)
        settings = settings or ClaimSettings()
        if settings.pin not in PINS:
            raise ValueError(f"unknown pin {settings.pin!r}: one of {', '.join(PINS)}")
        self.preemptions = LonePreemptions(
            parts.api,
            parts.sync,
            recorder=parts.recorder,
            registry=registry,
            retry_seconds=settings.preempt_retry_seconds,
        )
        """A lone pod's preemption (`gpuplace.claims.preempting`)."""
        self._nominate: dict[str, str] = {}
        """Pod UID -> the node a preemption pinned its claim on, to nominate."""
        self.rng = rng or random.Random()
        """The tie-break among GPUs the policy scores alike and has no line for."""
        self._chooser: Chooser | None = None
        self._repinned: dict[str, tuple[str, tuple[int, ...]]] = {}
        """Gang or queue member's pod UID -> (its plan's node, the GPUs there its claim is
        made on instead of their plan's, taken meanwhile)."""
        self._refused_since: dict[str, float] = {}
        """Pod UID -> when a round first found kube-scheduler refusing its pinned claim
        while the engine still chose those GPUs."""
        super().__init__(
            "claim",
            parts,
            store,
            settings=settings,
            leading=self.metrics.leading,
        )
        parts.sync.claim_listeners.append(self._claim_changed)

    async def run(self) -> None:
        """Run rounds until cancelled; never raises on API failures."""
        await self.loop.run(self.step, self._follow, ready=(self.store.synced,))

    def _follow(self) -> None:
        """Another replica decides; when this one cannot tell who does (the Lease cannot
        be read), the waiting pods hear why, once."""
        reason = self.blocked() if self.blocked is not None else None
        if reason is None:
            return
        for record in self.store.pods.values():
            if record.claim_gated and record.live and self._told.first(record.uid, "blocked"):
                self._emit(
                    record,
                    recording.WARNING,
                    CLAIM_BLOCKED,
                    f"gpuplace does not create its ResourceClaim {record.claim} yet: {reason}",
                )

    async def step(self) -> None:
        """One round (module docstring): the pods behind the gate, highest priority then
        the oldest first (each planned on the ledger as the earlier ones left it), then
        the released pods whose claim is gone or whose pinned claim cannot be allocated."""
        live = [record for record in self.store.pods.values() if record.live]
        waiting = [
            record for record in live if record.claim_gated and not _waits_for_others(record)
        ]
        self._told.keep(self.store.pods)
        self._chooser = None
        inventory = self.sync.ledger.inventory
        dra_nodes = [node.name for node in inventory if nodes.is_dra(node)]
        self.preemptions.new_round(self.store.pods, dra_nodes, self.clock())
        stranded = [record for record in live if self._stranded(record)]
        uids = {record.uid for record in stranded}
        self._refused_since = {u: t for u, t in self._refused_since.items() if u in uids}
        self._repinned = {u: pin for u, pin in self._repinned.items() if u in self.store.pods}
        self._nominate.clear()
        ordered = sorted([*waiting, *stranded], key=_first)
        for result in await self.writer.each(ordered, self._start):
            if isinstance(result, kube.ApiError):
                log.warning(
                    "claim round step failed; retrying",
                    extra={"status": result.status, "reason": result.reason},
                )
            elif isinstance(result, BaseException):
                raise result

    def _stranded(self, record: PodRecord) -> bool:
        """A released, unbound pod whose claim is not there (deleted: made again), or whose
        pinned claim kube-scheduler found no room for (planned anew), or a lone pod whose
        unpinned claim (no room, no victims then) kube-scheduler found no room for (it
        may preempt now)."""
        if record.claim_gated or record.bound or record.request is None:
            return False
        found = self.sync.claim(record.namespace, record.claim)
        if found is None:
            return True
        return bool(
            (found.pinned or self._lone(record))
            and found.owner == record.uid
            and not found.allocated
            and not found.deleting
            and record.unschedulable
        )

    async def _start(self, record: PodRecord) -> None:
        """Create `record`'s claim if it is not there (pinned where the engine or its gang
        or queue planned it), then remove its gate; a pinned claim that cannot be
        allocated is deleted when the engine now plans it elsewhere."""
        if record.request is None:
            if self._told.first(record.uid, "unreadable"):
                self._emit(
                    record,
                    recording.WARNING,
                    CLAIM_BLOCKED,
                    f"gpuplace cannot write its ResourceClaim {record.claim}: {record.problem}",
                )
            return
        found = self.sync.claim(record.namespace, record.claim)
        if found is not None and found.owner == record.uid and not record.claim_gated:
            await self._replan(record, found)
            return
        owner = found.owner if found is not None else await self._create(record)
        if owner is None:
            return
        if owner != record.uid:
            self.metrics.claims.labels(BLOCKED).inc()
            if self._told.first(record.uid, "foreign"):
                self._emit(
                    record,
                    recording.WARNING,
                    CLAIM_BLOCKED,
                    f"ResourceClaim {record.namespace}/{record.claim} exists and is not this "
                    "pod's (another object owns it): gpuplace does not give its GPUs to this "
                    "pod; delete the pod and create it again",
                )
            return
        if record.claim_gated:
            body = None
            held = self.sync.hold_of(record.uid)
            node = self._nominate.pop(record.uid, None)
            if node is None and held is not None and held.owner == PLANNED:
                node = held.grant.node
            if node is not None:
                try:
                    body = await self.writer.write(
                        record, None, pinning.nominating(node, _dra_gated), status=True
                    )
                except kube.ApiError as error:
                    # the nomination only spares kube-scheduler a search: never a reason
                    # to keep the pod gated (an RBAC without pods/status, a webhook down)
                    log.warning(
                        "nominating the planned node failed; releasing the pod without it",
                        extra={"pod": str(record), "status": error.status, "why": error.reason},
                    )
                else:
                    if body is None:
                        return
            await self.writer.write(record, body, _ungated)

    async def _create(self, record: PodRecord) -> str | None:
        """Plan `record` (synchronously, before anything is awaited) and create its claim
        on the plan; the plan's hold is dropped when no claim came of it. A lone pod the
        engine finds no room for preempts where it may (`_preempt`): its claim is then
        pinned to the GPUs its victims free, or it stays gated (None) while it must wait;
        one with no room while a DRA node it could use is held for another workload stays
        gated too (`_held_off`: unpinned, kube-scheduler's first fit could take the GPUs
        that node is held for)."""
        pinned = self._plan(record)
        if not pinned and self._lone(record):
            answer = await self._preempt(record)
            if isinstance(answer, Wait):
                return None
            if answer is not None:
                pinned = self._gpus(answer)
                if pinned:
                    self._nominate[record.uid] = answer.node
        if not pinned and (why := self._held_off(record)) is not None:
            if self._told.first(record.uid, f"held {why}"):
                waits = "it waits behind its gate" if record.claim_gated else "it waits"
                self._emit(
                    record,
                    recording.NORMAL,
                    CLAIM_BLOCKED,
                    f"gpuplace finds no room for it on the DRA nodes it may use but {why}: "
                    f"{waits} (its ResourceClaim is made once that node is free again or room "
                    "frees elsewhere)",
                )
            return None
        try:
            owner = await self.create_claim(record, pinned=pinned)
        except BaseException:
            self._unhold(record)
            raise
        if owner != record.uid:
            self._unhold(record)
        return owner

    async def _replan(self, record: PodRecord, claim: ClaimRecord) -> None:
        """`claim` is pinned and kube-scheduler found no node for the pod: the planned GPUs
        were taken meanwhile (by what the ledger did not see in time). The engine plans
        again; when it chooses other GPUs the claim is deleted (UID precondition) and made
        next round on the new plan; when it chooses the same ones (kube-scheduler's word
        is older than the ledger's) or finds no room, the claim stays. A gang's or queue's
        member keeps the node their plan chose (its affinity names that node, and cannot be
        changed now): the engine chooses again among that node's GPUs only, and the claim is
        made next round on those (`_repinned`); their plan's node is theirs to change. An
        unpinned claim (a lone pod, no room then) only gets a preemption's pin
        (`_preempted_again`)."""
        if not claim.pinned:
            await self._preempted_again(record, claim)
            return
        member = record.grant is not None
        held = None if member else self.sync.hold_of(record.uid)
        mine = held is not None and held.owner == PLANNED
        if mine:
            self.sync.unhold(record.uid)
        if record.grant is not None:
            chosen = self._choose(record, [record.grant.node])
        else:
            chosen = self._choose(record)
        if chosen is None and mine and held is not None:
            try:  # its own GPUs still have room (its node held meanwhile, say): it stays
                self.sync.hold(held.grant, seconds=self.settings.hold_seconds, owner=PLANNED)
            except LedgerError:
                pass
            else:
                return
        if chosen is None and self._lone(record):
            return await self._preempted_again(record, claim)
        remake = chosen is not None and set(chosen[1]) == set(claim.pinned) and self._remake(record)
        if not remake and (chosen is None or set(chosen[1]) == set(claim.pinned)):
            if mine and held is not None:
                with contextlib.suppress(LedgerError):  # taken meanwhile: plan anew next round
                    self.sync.hold(held.grant, seconds=self.settings.hold_seconds, owner=PLANNED)
            return
        if not await self._delete(record, claim):
            return
        if member and chosen is not None:
            self._repinned[record.uid] = (chosen[0].node, tuple(chosen[0].gpus))
        if remake:
            self.metrics.claims.labels(REMADE).inc()
            self._emit(
                record,
                recording.NORMAL,
                CLAIM_REPLANNED,
                f"kube-scheduler could not allocate ResourceClaim {record.namespace}/"
                f"{record.claim} though the GPUs gpuplace planned have room in its ledger: "
                "deleted, to be made again on them once, so that kube-scheduler tries the pod "
                "again now (it would wait up to 5 minutes)",
            )
            return
        self._replanned(
            record, "on other GPUs of the node its plan chose" if member else "on a new plan"
        )

    def _replanned(self, record: PodRecord, where: str) -> None:
        """Counted and told: its pinned claim was deleted, to be made again `where`."""
        self.metrics.claims.labels(REPLANNED).inc()
        self._emit(
            record,
            recording.NORMAL,
            CLAIM_REPLANNED,
            f"kube-scheduler could not allocate ResourceClaim {record.namespace}/"
            f"{record.claim} on the GPUs gpuplace planned (taken meanwhile): deleted, to be "
            f"made again {where}",
        )

    def _lone(self, record: PodRecord) -> bool:
        """A pod alone the engine pins (no gang's or queue's plan, nothing granted yet)."""
        return (
            self.settings.pin == PIN_ENGINE
            and record.grant is None
            and self.sync.ledger.get(record.uid) is None
            and self.preemptions.may_preempt(record)
        )

    async def _preempt(self, record: PodRecord) -> Choice | Wait | None:
        """A lone pod's preemption on the DRA nodes it may go to
        (`gpuplace.claims.preempting`): the GPUs to pin its claim to, `Wait`, or None (no
        victims make room: its claim is made unpinned, as for any pod without room)."""
        if not self.preemptions.worth(record):
            return None  # no bound pod of lower priority holds DRA GPUs: spare the O(nodes)
        inventory = self.sync.ledger.inventory
        names = [  # a pin needs UUIDs: never evict for GPUs that cannot be pinned
            name
            for name in self._candidates(record)
            if all(gpu.uuid for gpu in inventory[name].gpus)
        ]
        answer = await self.preemptions.attempt(record, names, self.policy(), now=self.clock())
        if isinstance(answer, Wait) and answer.why and self._told.first(record.uid, answer.why):
            self._emit(
                record,
                recording.WARNING,
                PREEMPTION_BLOCKED,
                "gpuplace finds no room for it but lower-priority pods it could preempt; "
                f"PodDisruptionBudgets forbid that now ({answer.why[:400]}): it waits and "
                f"tries again in {self.settings.preempt_retry_seconds:g}s",
            )
        return answer

    def _gpus(self, choice: Choice) -> list[Gpu]:
        """The GPUs `choice` names, when each has a UUID to pin (else none)."""
        node = self.sync.ledger.inventory.get(choice.node)
        if node is None:
            return []
        gpus = [node.gpus[i] for i in choice.gpus if i < len(node.gpus)]
        return gpus if len(gpus) == len(choice.gpus) and all(g.uuid for g in gpus) else []

    async def _preempted_again(self, record: PodRecord, claim: ClaimRecord) -> None:
        """A released lone pod whose pinned GPUs have no room: its preemption's victims
        still terminating give the same pin (the claim stays); GPUs taken once they were
        free (or no pin of a preemption yet) give a plan with victims of its own, and the
        claim is deleted to be made again on it (next round, by `_create`)."""
        answer = await self._preempt(record)
        if answer is None or isinstance(answer, Wait):
            return
        if {gpu.uuid for gpu in self._gpus(answer)} == set(claim.pinned):
            return
        if await self._delete(record, claim):
            self._replanned(record, "on the GPUs its preemption frees")

    async def _delete(self, record: PodRecord, claim: ClaimRecord) -> bool:
        """Delete `record`'s claim (UID precondition) to make it again; False when it is
        gone or replaced already (404, 409: the next round sees what is there)."""
        try:
            await self.api.delete_resource_claim(record.namespace, record.claim, uid=claim.uid)
        except kube.ApiError as error:
            if error.status not in (404, 409):
                raise
            return False
        return True

    def _remake(self, record: PodRecord) -> bool:
        """kube-scheduler has refused `record`'s pin for `remake_seconds` while the engine
        still finds room on those GPUs, and its claim was not made again for that before:
        make it again, once (a new claim requeues the pod in kube-scheduler at once)."""
        now = time.monotonic()
        since = self._refused_since.setdefault(record.uid, now)
        if now - since < self.settings.remake_seconds:
            return False
        return self._told.first(record.uid, REMADE)

    def _held_off(self, record: PodRecord) -> str | None:
        """Why a DRA node `record` could go to (affinity, taints) is kept from it now: held
        for a gang or queued workload (the fence), or for another lone pod's preemption
        (`LonePreemptions.held`); None when none is, or `record` has a plan of a gang's or
        queue's, or the engine does not pin. O(nodes)."""
        if self.settings.pin != PIN_ENGINE or record.grant is not None:
            return None
        targets = self.preemptions.held(record.uid)
        fence = self.fences
        if not targets and (fence is None or not fence.nodes):
            return None
        for name in self._usable(record):
            if name in targets:
                return f"node {name} is held for another pod's preemption"
            blocked = fence.blocks(record.uid, name) if fence is not None else None
            if blocked is not None:
                return blocked.removeprefix("gpuplace: ")
        return None

    def _candidates(self, record: PodRecord) -> list[str]:
        """The DRA nodes kube-scheduler would offer `record` (`_usable`) that no gang or
        queued workload holds (the fence) and no other lone pod's preemption frees GPUs on
        (`LonePreemptions.held`). O(nodes)."""
        fenced = self.fences.nodes if self.fences is not None else frozenset()
        fenced |= self.preemptions.held(record.uid)
        return [name for name in self._usable(record) if name not in fenced]

    def _usable(self, record: PodRecord) -> list[str]:
        """The DRA nodes `record`'s affinity and selector allow and that admit it (taints,
        cordon). O(nodes)."""
        inventory = self.sync.ledger.inventory
        controlled = record.controlled
        allowed = controlled.affinity.allowed((node.name, node.labels) for node in inventory)
        return [
            node.name
            for node in inventory
            if nodes.is_dra(node)
            and (allowed is None or node.name in allowed)
            and node.admits(controlled.tolerations)
        ]

    def _choose(
        self, record: PodRecord, names: list[str] | None = None
    ) -> tuple[choosing.Choice, list[str]] | None:
        """The engine's choice for `record` among `names` (default: its DRA nodes), and the
        chosen GPUs' UUIDs; None when none has room now (or a GPU has no UUID to pin). The
        chooser's cost (`Chooser.choose` with names: O(candidates))."""
        assert record.request is not None
        if names is None:
            names = self._candidates(record)
        if not names or record.request.count < 1:
            return None
        if self._chooser is None or self._chooser.policy is not self.policy():
            self._chooser = Chooser(self.sync.ledger, self.policy())
        chosen = self._chooser.choose(record.request, self.rng, names)
        if chosen is None:
            return None
        node = self.sync.ledger.inventory[chosen.node]
        uuids = [node.gpus[index].uuid for index in chosen.gpus]
        return (chosen, uuids) if all(uuids) else None

    def _plan(self, record: PodRecord) -> list[Gpu]:
        """The GPUs to pin `record`'s claim to: its gang's or queue's plan (its assignment
        annotations) where it has one, else the engine's choice now, held in the ledger
        (owner `PLANNED`) until the claim's allocation replaces it; none (first fit) with
        `pin` first-fit, or no room now (kube-scheduler then says why it waits).
        Synchronous."""
        if self.settings.pin != PIN_ENGINE:
            return []
        inventory = self.sync.ledger.inventory
        if record.grant is not None:
            node = inventory.get(record.grant.node)
            if node is None or not nodes.is_dra(node):
                return []
            indexes = record.grant.gpus
            repinned = self._repinned.get(record.uid)
            if repinned is not None and repinned[0] == node.name:
                indexes = repinned[1]  # their plan's node, GPUs a race left free there
            gpus = [node.gpus[i] for i in indexes if i < len(node.gpus)]
            return gpus if len(gpus) == len(record.grant.gpus) and all(g.uuid for g in gpus) else []
        self._unhold(record)  # a plan of ours that came to nothing: plan anew
        if self.sync.ledger.get(record.uid) is not None:
            return []
        chosen = self._choose(record)
        if chosen is None:
            return []
        assert record.request is not None
        grant = choosing.grant_for(record.uid, chosen[0], record.request)
        try:
            self.sync.hold(grant, seconds=self.settings.hold_seconds, owner=PLANNED)
        except LedgerError as error:  # cannot happen: nothing awaited since the choice
            log.warning("plan refused by the ledger", extra={"pod": str(record), "why": str(error)})
            return []
        node = inventory[chosen[0].node]
        return [node.gpus[index] for index in chosen[0].gpus]

    def _unhold(self, record: PodRecord) -> None:
        held = self.sync.hold_of(record.uid)
        if held is not None and held.owner == PLANNED:
            self.sync.unhold(record.uid)

    async def create_claim(self, record: PodRecord, *, pinned: Sequence[Gpu] = ()) -> str | None:
        """Create the claim of `record` (a pod on the DRA path whose request reads): the one
        place gpuplace writes a pod's ResourceClaim. `pinned`: the GPUs a planner chose
        (plan, then pin), the claim then asks exactly those (`dra_claims.devices`) and
        their context; none: any GPU that fits (kube-scheduler's first fit). The UID of the
        pod that owns the claim of that name now (this one's when created), or None when
        the API refused it (said in an Event). One API write (two on AlreadyExists)."""
        assert record.request is not None
        if any(not gpu.uuid for gpu in pinned):
            raise ValueError("a claim is pinned by the GPUs' UUIDs; a pinned GPU has none")
        gpus = list(pinned) or dra_gpus(self.sync.ledger.inventory)
        context = dra_claims.context_mib(record.request, gpus)
        body = dra_claims.claim(
            record.namespace,
            record.claim,
            pod=record.name,
            pod_uid=record.uid,
            request=record.request,
            context=context,
            pinned=[gpu.uuid for gpu in pinned],
        )
        try:
            await self.api.create_resource_claim(record.namespace, body)
        except kube.ApiError as error:
            if not error.already_exists:
                if error.status in (400, 401, 403, 404, 422):
                    self.metrics.claims.labels(REFUSED).inc()
                    if self._told.first(record.uid, f"refused {error.status}"):
                        self._emit(
                            record,
                            recording.WARNING,
                            CLAIM_BLOCKED,
                            f"the API refused to create its ResourceClaim {record.claim} "
                            f"({error.status} {error.reason}): {error.message[:400]}",
                        )
                    return None
                raise
            stored = await self.api.get_resource_claim(record.namespace, record.claim)
            self.metrics.claims.labels(EXISTING).inc()
            return dra_claims.owner(stored)[1]
        self.metrics.claims.labels(CREATED).inc()
        extra = (
            f", plus {context} MiB for its CUDA context (inside its MPS memory limit)"
            if context
            else ""
        )
        self._emit(
            record,
            recording.NORMAL,
            CLAIM_CREATED,
            f"created ResourceClaim {record.namespace}/{record.claim} for "
            f"{describe(record.request)}{extra}; {_where(pinned)}",
        )
        return record.uid

    def _claim_changed(self, old: ClaimRecord | None, new: ClaimRecord | None) -> None:
        """`GpusAssigned` on the pod when a claim made for it is first seen allocated."""
        if old is None or new is None or not new.managed or old.held or not new.held:
            return
        pod = self.sync.pods.get(new.owner)
        if pod is None or not self.loop.leads():
            return
        self._emit(pod, recording.NORMAL, GPUS_ASSIGNED, assigned_message(new))


def _where(pinned: Sequence[Gpu]) -> str:
    if not pinned:
        return "kube-scheduler's DRA allocator picks its GPU (first fit)"
    plural = "s" if len(pinned) > 1 else ""
    names = ",".join(gpu.uuid for gpu in pinned)
    return f"pinned to the GPU{plural} gpuplace planned ({names}), which kube-scheduler allocates"


def _waits_for_others(record: PodRecord) -> bool:
    """Another gate than the claim's is still on it: its gang's or queue's (they plan it
    first: its claim is made on their plan, once their gate is gone) or another
    component's (a batch system's: the plan is made when the pod can run, as the
    planner's is; a plan held for a pod that cannot be scheduled yet would keep its GPUs
    from pods that can)."""
    return record.controlled.gates != (keys.DRA_GATE,)


def _first(record: PodRecord) -> tuple[int, float, str, str]:
    """A round's order: highest priority, then the oldest."""
    return (-record.priority, record.created, record.namespace, record.name)


def _dra_gated(current: dict[str, Any]) -> bool:
    """The pod is still behind the DRA gate (the claim controller's to release)."""
    return gated(current, keys.DRA_GATE)


def _ungated(current: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch that removes the DRA gate (None: it is gone)."""
    if not gated(current, keys.DRA_GATE):
        return None
    return {"spec": {"schedulingGates": plans.without_gate(current, keys.DRA_GATE)}}
