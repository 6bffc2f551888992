"""What the node agent does about a pod over its grant (`gpuplace.agent.overgrant`): heard
with every usage sample, so a pod is caught within one sampling interval.

When a pod is first caught on a GPU in one way (`overgrant.Kind`), the agent

- writes a Warning Event `GpuOverGrant` on the pod (its message says what was held, what
  was granted and why MPS let it: the caps are per process),
- counts it (`gpuplace_agent_over_grant_total{kind}`) and shows it while it lasts
  (`gpuplace_pod_gpu_over_grant{node,gpu,uuid,namespace,pod,kind}` = 1),
- writes an audit line (`gpuplace.agent.auditing`, decision `reported` or `evicting`) and
  a process-log warning;

and when the catch ends, an audit line `cleared`. Where the operator chose it
(`--evict-over-grant`, off by default), the pod is evicted through the Eviction API (the
pod's UID as precondition), which respects its PodDisruptionBudgets: a refusal (429) is
an Event `GpuOverGrantEviction` and an audit line `evictionRefused`, and the eviction is
asked again at every sample while the pod stays over; once the API has taken it (or the
pod is gone) it is not asked again. Nothing here ever kills a process or deletes a pod
directly. O(findings) API calls per sample at most, none when no pod is over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuplace.agent import overgrant
from gpuplace.agent.auditing import AgentAudit
from gpuplace.agent.usage_sampling import Sample
from gpuplace.cluster import kube, recording
from gpuplace.placement.inventory import ClientContext
from gpuplace.usage import names

log = logging.getLogger(__name__)

OVER_GRANT = "GpuOverGrant"
"""Event reason on a pod caught over its grant."""
OVER_GRANT_EVICTION = "GpuOverGrantEviction"
"""Event reason on a pod whose eviction for it was refused or done."""
EVENT = "overGrant"
"""The audit lines' `event`."""
REASONS = {overgrant.Kind.MEMORY: "MemoryOverGrant", overgrant.Kind.CLIENTS: "SeveralMpsClients"}


class Evictor(Protocol):
    """What enforcing needs of `gpuplace.cluster.kube.Kube`."""

    async def evict_pod(self, namespace: str, name: str, *, uid: str) -> None: ...


class Events(Protocol):
    """What enforcing needs of `gpuplace.cluster.recording.Recorder`."""

    def emit(self, subject: recording.Subject, kind: str, reason: str, message: str) -> None: ...


class Enforcer(Collector):
    """See the module docstring. `contexts()`: GPU UUID → MPS client context as the agent
    publishes it now. A `Collector` itself: register it to export the over-grant gauge."""

    def __init__(
        self,
        api: Evictor,
        events: Events,
        audit: AgentAudit | None,
        node: str,
        *,
        contexts: Callable[[], Mapping[str, ClientContext]],
        tolerance_mib: int = overgrant.TOLERANCE_MIB,
        evict: bool = False,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.api = api
        self.events = events
        self.audit = audit
        self.node = node
        self.contexts = contexts
        self.tolerance_mib = tolerance_mib
        self.evict = evict
        self.caught: dict[tuple[str, str, overgrant.Kind], overgrant.Finding] = {}
        """The catches of the last sample, by key."""
        self.evicted: set[str] = set()
        """Pod UIDs the Eviction API took (or that were gone): never asked again."""
        self.refused: set[str] = set()
        """Pod UIDs whose last eviction the API refused."""
        self.caught_total = Counter(
            "gpuplace_agent_over_grant_total",
            "Pods caught holding more of a GPU than their grant, by kind (memory: their "
            "processes' memory; clients: more than one MPS client), counted when caught.",
            ["kind"],
            registry=registry,
        )
        self.evictions = Counter(
            "gpuplace_agent_over_grant_evictions_total",
            "Evictions of pods over their grant through the Eviction API, by result "
            "(evicted, refused: a PodDisruptionBudget, gone, error).",
            ["result"],
            registry=registry,
        )

    async def on_sample(self, sample: Sample) -> None:
        """Act on one sample (a `Sampler` listener)."""
        findings = overgrant.find(sample, self.contexts(), tolerance_mib=self.tolerance_mib)
        now = {finding.key: finding for finding in findings}
        for key, finding in now.items():
            if key not in self.caught:
                self._caught(finding)
        for key, finding in self.caught.items():
            if key not in now:
                self._write(finding, "cleared", "no longer over its grant")
        self.caught = now
        present = {use.uid for use in sample.pods}
        self.evicted &= present
        self.refused &= present
        if self.evict:
            first: dict[str, overgrant.Finding] = {}
            for finding in findings:
                first.setdefault(finding.uid, finding)
            for finding in first.values():
                if finding.uid not in self.evicted:
                    await self._evict(finding)

    def _subject(self, finding: overgrant.Finding) -> recording.Subject:
        return recording.Subject(finding.namespace, finding.name, finding.uid)

    def _caught(self, finding: overgrant.Finding) -> None:
        self.caught_total.labels(finding.kind.value).inc()
        then = (
            "; evicting it (--evict-over-grant)"
            if self.evict
            else "; gpuplace reports it and does not evict (--evict-over-grant is off)"
        )
        self.events.emit(
            self._subject(finding), recording.WARNING, OVER_GRANT, finding.message + then
        )
        self._write(finding, "evicting" if self.evict else "reported", finding.message)
        log.warning(
            "pod over its grant",
            extra={
                "pod": str(finding),
                "gpu": finding.uuid,
                "kind": finding.kind.value,
                "processes": finding.processes,
                "used_bytes": finding.used_bytes,
                "allowed_bytes": finding.allowed_bytes,
            },
        )

    async def _evict(self, finding: overgrant.Finding) -> None:
        try:
            await self.api.evict_pod(finding.namespace, finding.name, uid=finding.uid)
        except kube.ApiError as error:
            if error.not_found or error.conflict:  # gone, or replaced by a pod of that name
                self.evicted.add(finding.uid)
                self.evictions.labels("gone").inc()
                return
            refused = error.status == 429
            self.evictions.labels("refused" if refused else "error").inc()
            why = (
                "its PodDisruptionBudget allows no disruption now; asked again at the next "
                "sample while it stays over its grant"
                if refused
                else f"the API answered {error.status} {error.reason}: {error.message}"
            )
            if refused:
                self.events.emit(
                    self._subject(finding),
                    recording.WARNING,
                    OVER_GRANT_EVICTION,
                    f"eviction for holding more than its grant refused: {why}",
                )
            if finding.uid not in self.refused or not refused:
                self._write(
                    finding,
                    "evictionRefused" if refused else "evictionFailed",
                    why,
                    reason="TooManyRequests" if refused else error.reason or str(error.status),
                )
            if refused:
                self.refused.add(finding.uid)
            else:
                log.warning(
                    "over-grant eviction failed",
                    extra={"pod": str(finding), "status": error.status, "error": error.message},
                )
            return
        self.evicted.add(finding.uid)
        self.refused.discard(finding.uid)
        self.evictions.labels("evicted").inc()
        self.events.emit(
            self._subject(finding),
            recording.WARNING,
            OVER_GRANT_EVICTION,
            f"evicted through the Eviction API for holding more than its grant: {finding.message}",
        )
        self._write(finding, "evicted", "evicted through the Eviction API")
        log.warning("pod evicted for holding more than its grant", extra={"pod": str(finding)})

    def _write(
        self, finding: overgrant.Finding, decision: str, message: str, *, reason: str = ""
    ) -> None:
        if self.audit is None:
            return
        self.audit.write(
            event=EVENT,
            decision=decision,
            reason=reason or REASONS[finding.kind],
            uid=finding.uid,
            namespace=finding.namespace,
            name=finding.name,
            message=message,
            details=_details(finding),
        )

    # --- the gauge ----------------------------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        return [self._family(())]

    def collect(self) -> Iterable[Metric]:
        return [self._family(self.caught.values())]

    def _family(self, findings: Iterable[overgrant.Finding]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            names.POD_OVER_GRANT,
            "1 while the pod holds more of the GPU than its grant in the last usage sample, by "
            "kind (memory: its processes' memory beyond the grant, one CUDA context and the "
            "tolerance; clients: more than one MPS client).",
            labels=(*names.POD_LABELS, "kind"),
        )
        for finding in findings:
            family.add_metric(
                [
                    self.node,
                    str(finding.index),
                    finding.uuid,
                    finding.namespace,
                    finding.name,
                    finding.kind.value,
                ],
                1.0,
            )
        return family


def _details(finding: overgrant.Finding) -> dict[str, Any]:
    return {
        "gpu": finding.index,
        "uuid": finding.uuid,
        "kind": finding.kind.value,
        "processes": finding.processes,
        "usedBytes": finding.used_bytes,
        "grantedBytes": finding.granted_bytes,
        "allowedBytes": finding.allowed_bytes,
    }
