"""The DRA claim controller: each pod the webhook sent to DRA nodes gets its ResourceClaim,
then its gate goes.

A pod on the DRA path (`gpuplace.cluster.dra_claims`) names a claim by name and waits
behind the gate `gpuplace.io/dra-claim`. One asyncio task in the sidecar
(`ClaimController.run`, the controller kit's round loop, deciding only in the replica whose
kube-scheduler leads, like the gang and queue controllers), woken by every change of the
managed pods. Each round, for every live pod still behind that gate (its index:
`dra_pods`):

1. **create** its claim, unless the claim informer already has it (`create_claim`, the one
   place a pod's claim is written; a planner passes the GPUs it chose to pin it):
   `dra_claims.claim` from the pod's parsed request, owned by the pod, its memory the ask
   plus the CUDA context of the DRA GPUs it may land on (`dra_claims.context_mib`);
   AlreadyExists is read back: a claim of that name owned by this pod (a round that
   created it before a crash) is its claim, one owned by anything else is not, and the
   pod waits with an Event saying so (`GpuClaimBlocked`); a creation the API refuses
   (RBAC, validation) is said the same way and tried again next round;
2. **ungate**: the gate removed (`gpuplace.controllers.writing.Writer`: UID and
   resourceVersion preconditions, re-read on conflict, a no-op once it is gone). Other
   gates (a gang's, a queue's) stay: their controllers remove them.

kube-scheduler's DRA allocator then allocates the claim (first fit) and binds the pod; when
the claim informer sees the allocation of a claim this controller's pod owns, the pod gets
the Event `GpusAssigned` naming its GPU, node and share, as the extender's bind writes it.
Nothing is kept only in memory: what exists is read from the API (the claim, the gate).
Metrics: `gpuplace_dra_claims_total{result}` (`created`, `existing`, `blocked`, `refused`),
`gpuplace_claim_controller_leading`. O(pods behind the gate) per round, one API write per
pod and step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuplace.cluster import dra_claims, keys, kube, nodes, recording
from gpuplace.cluster.claims import ClaimRecord
from gpuplace.cluster.gang_marks import gated
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import plans
from gpuplace.controllers.api import PodApi
from gpuplace.controllers.controller import Controller, Parts, Settings
from gpuplace.controllers.store import PodIndex
from gpuplace.placement.inventory import Gpu, Inventory
from gpuplace.placement.requests import describe, share_text

log = logging.getLogger(__name__)

CREATED = "created"
EXISTING = "existing"
BLOCKED = "blocked"
REFUSED = "refused"
RESULTS = (CREATED, EXISTING, BLOCKED, REFUSED)
"""`gpuplace_dra_claims_total{result}`: created now; found (made before, by this or
another replica); another object's claim of that name; the API refused the creation."""

CLAIM_CREATED = "GpuClaimCreated"
CLAIM_BLOCKED = "GpuClaimBlocked"
GPUS_ASSIGNED = "GpusAssigned"
"""The Event reason the extender's bind writes too: what the pod was given."""


class ClaimApi(PodApi, Protocol):
    """What the controller calls: a pod's reads and writes and a ResourceClaim's."""

    async def create_resource_claim(
        self, namespace: str, body: Mapping[str, Any]
    ) -> dict[str, Any]: ...

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ClaimSettings(Settings):
    """The kit's settings: a claim is one write, so rounds settle briefly and are not
    spaced."""

    poll_seconds: float = 5.0
    settle_seconds: float = 0.05


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
            "before), blocked (the name is another object's claim), refused (by the API).",
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
    ) -> None:
        self.metrics = ClaimMetrics(registry)
        super().__init__(
            "claim",
            parts,
            store,
            settings=settings or ClaimSettings(),
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
        """One round (module docstring)."""
        waiting = [
            record for record in self.store.pods.values() if record.claim_gated and record.live
        ]
        self._told.keep(self.store.pods)
        for result in await self.writer.each(waiting, self._start):
            if isinstance(result, kube.ApiError):
                log.warning(
                    "claim round step failed; retrying",
                    extra={"status": result.status, "reason": result.reason},
                )
            elif isinstance(result, BaseException):
                raise result

    async def _start(self, record: PodRecord) -> None:
        """Create `record`'s claim if it is not there, then remove its gate."""
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
        owner = found.owner if found is not None else await self.create_claim(record)
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
        await self.writer.write(record, None, _ungated)

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
            f"{describe(record.request)}{extra}; kube-scheduler's DRA allocator picks its GPU",
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


def _ungated(current: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch that removes the DRA gate (None: it is gone)."""
    if not gated(current, keys.DRA_GATE):
        return None
    return {"spec": {"schedulingGates": plans.without_gate(current, keys.DRA_GATE)}}
