"""API refusals of the calls gpuplace needs: logged, counted, and shown in /readyz.

A refusal is an answer that says gpuplace *lacks* something, not that the world moved on:

- 401 Unauthorized: the credentials are not accepted (expired or wrong token);
- 403 Forbidden: RBAC does not allow the call (an admission webhook's denial, whose
  message starts `admission webhook "..." denied the request`, is an answer about that
  object, not a missing permission, and is not counted);
- 404 Not Found, only where the call names something that must exist (`missing=True`
  in `gpuplace.cluster.kube`): a collection (the resource is not served) or the scheduler's Lease
  (wrong namespace or name, or no kube-scheduler running), and only once it has lasted
  `missing_grace` seconds (kube-scheduler creates its Lease within seconds of its first
  start: a sidecar that reads first must not cry wolf). A 404 on a pod or node that was
  deleted is ordinary and not counted.

`Refusals` keeps, per (verb, resource), the refusal in force. The first refusal of a
(verb, resource) — or a change of its code — is logged once at ERROR with verb, resource,
namespace, name, code and the API server's message (which names the user and the
missing permission, never a token); the next success is logged once at INFO. Every
refusal counts in `gpuplace_api_refusals_total{verb, resource, code}` (register the
object itself as a Prometheus collector).

The refusals in `BLOCKING` stop the sidecar doing its job, so while one is in force
`not_ready_reason` names it and `/readyz` fails (docs/deploy.md, "Readiness"); the
others only lose a side effect (Events, node labels and capacity, a gang's condition)
or one feature: a refused Lease read stops gangs, which the gang controller reports with
an Event on every waiting member, while every other GPU pod keeps being admitted and
bound (a failing /readyz would take the webhook out of its Service, and the validating
webhook, failing closed, would then refuse every GPU pod).

O(1) per call; memory O(distinct (verb, resource) pairs), a few dozen at most.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

LEASES = "leases.coordination.k8s.io"
"""The Lease resource as RBAC and kubectl name it (group-qualified)."""

BLOCKING: frozenset[tuple[str, str]] = frozenset(
    {
        ("list", "pods"),  # the ledger cannot be rebuilt
        ("watch", "pods"),  # ... nor kept current
        ("list", "nodes"),  # no inventory: filter has nothing to offer
        ("watch", "nodes"),
        ("get", "pods"),  # bind re-reads the pod; the gang controller re-reads members
        ("patch", "pods"),  # no assignment annotations, no ungating of gangs
        ("create", "pods/binding"),  # no pod of ours is ever bound
        ("list", "resourceclaims"),  # on the DRA path: grants through claims unseen,
        ("watch", "resourceclaims"),  # so GPUs they hold would be offered again
    }
)
"""(verb, resource) whose refusal makes the sidecar useless; see the module docstring."""

ADMISSION_DENIAL = "admission webhook "
"""How kube-apiserver begins the message of a webhook's denial (also a 403)."""

REFUSED = frozenset({401, 403})
"""Codes that are always a refusal; 404 only where the call says the object must exist."""


@dataclass(frozen=True, slots=True)
class Refusal:
    verb: str
    resource: str
    code: int
    reason: str
    message: str
    namespace: str | None
    name: str | None
    since: float


class Refusals(Collector):
    """The refusals in force and their counts; see the module docstring."""

    def __init__(
        self, *, missing_grace: float = 30.0, clock: Callable[[], float] = time.time
    ) -> None:
        self.missing_grace = missing_grace
        self._clock = clock
        self._now: dict[tuple[str, str], Refusal] = {}
        self._counts: dict[tuple[str, str, int], int] = {}
        self._missing_since: dict[tuple[str, str], float] = {}

    def answered(
        self,
        verb: str,
        resource: str,
        code: int,
        reason: str = "",
        message: str = "",
        *,
        namespace: str | None = None,
        name: str | None = None,
        missing: bool = False,
    ) -> None:
        """The API answered `verb` on `resource` with HTTP `code` (0: not reached).
        `missing`: a 404 means something gpuplace needs does not exist."""
        key = (verb, resource)
        now = self._clock()
        if code == 403 and message.startswith(ADMISSION_DENIAL):
            return
        if code == 404 and missing:
            since = self._missing_since.setdefault(key, now)
            if now - since < self.missing_grace:
                return
        else:
            self._missing_since.pop(key, None)
        if code in REFUSED or (code == 404 and missing):
            self._refused(Refusal(verb, resource, code, reason, message, namespace, name, now))
        elif 200 <= code < 400 or code in (404, 409, 410, 422):
            # an answer the caller handles: the call itself is allowed
            self._allowed(key)

    def _refused(self, refusal: Refusal) -> None:
        verb, resource, code = refusal.verb, refusal.resource, refusal.code
        key = (verb, resource)
        self._counts[(verb, resource, code)] = self._counts.get((verb, resource, code), 0) + 1
        before = self._now.get(key)
        if before is not None and before.code == code:
            return
        self._now[key] = refusal
        log.error(
            "the API refused a call gpuplace needs",
            extra={
                "verb": verb,
                "resource": resource,
                "namespace": refusal.namespace,
                "object": refusal.name,
                "code": code,
                "reason": refusal.reason,
                "detail": refusal.message,
                "blocks": key in BLOCKING,
            },
        )

    def _allowed(self, key: tuple[str, str]) -> None:
        gone = self._now.pop(key, None)
        if gone is not None:
            log.info(
                "the API allows a call gpuplace needs again",
                extra={
                    "verb": gone.verb,
                    "resource": gone.resource,
                    "refused_seconds": round(self._clock() - gone.since, 1),
                },
            )

    def current(self, verb: str, resource: str) -> Refusal | None:
        """The refusal of `verb` on `resource` in force, if any."""
        return self._now.get((verb, resource))

    def in_force(self) -> list[Refusal]:
        return list(self._now.values())

    def not_ready_reason(self) -> str | None:
        """Why the sidecar cannot do its job (a BLOCKING refusal in force), or None."""
        blocking = [r for key, r in sorted(self._now.items()) if key in BLOCKING]
        if not blocking:
            return None
        return "; ".join(describe(refusal) for refusal in blocking)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "gpuplace_api_refusals",
            "API answers that refused a call gpuplace needs (401, 403, and 404 where the "
            "object must exist), by verb, resource and HTTP code.",
            labels=["verb", "resource", "code"],
        )
        for (verb, resource, code), count in sorted(self._counts.items()):
            family.add_metric([verb, resource, str(code)], count)
        yield family


def describe(refusal: Refusal) -> str:
    """One line for /readyz and Events: what was refused, by what answer."""
    where = ""
    if refusal.namespace and refusal.name:
        where = f" {refusal.namespace}/{refusal.name}"
    elif refusal.name:
        where = f" {refusal.name}"
    elif refusal.namespace:
        where = f" in namespace {refusal.namespace}"
    return f"{refusal.verb} {refusal.resource}{where}: {refusal.code} {refusal.reason}".rstrip()
