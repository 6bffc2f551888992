"""Whether this replica is the one that decides: the gang and queue controllers' leader gate.

Several replicas run the sidecar, but only the kube-scheduler holding the Lease
`gpuplace/gpuplace-scheduler` schedules (docs/deploy.md). The gang and queue controllers
must act in that replica only, or two controllers with two ledgers would plan the same
gangs and admit the same workloads. One `LeaseFollower` gates both (the sidecar's).
Rather than a second election, it follows the scheduler's: kube-scheduler's leader
identity is `<hostname>_<uuid>`, and both containers of the pod share the hostname (the
pod name), so this replica leads while the Lease's `holderIdentity` starts with its
own hostname + "_" and `renewTime + leaseDurationSeconds` has not passed.

`LeaseFollower.run` reads the Lease every `interval` seconds through `gpuplace.cluster.kube`
(RBAC: `get` on that Lease, Role `gpuplace-read-scheduler-lease`); `LeaseFollower()`
answers from the last read. A failed read counts as not leading (the safe side: a gang
or a queued pod waits a little longer, it is never planned twice), except a single one in a row that
the API did not refuse (a timeout, a 5xx): the last read's Lease is kept for it, and
still only leads until its own `renewTime + leaseDurationSeconds`, as kube-scheduler's
other replicas cannot take the Lease before then. So one blip does not make the
controllers followers for a round, which would drop the fence of a preempting gang.
A read the API *refuses* (401, 403, or a 404 that lasts: no such Lease) is not quiet:
`gpuplace.cluster.refusals` logs it at ERROR, counts it and fails /readyz, and `blocked_reason`
says why no gang can start, for the controllers' Events on the pods that wait.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from gpuplace.cluster import kube, refusals

log = logging.getLogger(__name__)

LEASE_NAMESPACE = "gpuplace"
LEASE_NAME = "gpuplace-scheduler"


def leads(lease: Mapping[str, Any], identity: str, now: float) -> bool:
    """True when `lease` is held by `identity` (`identity` or `identity_<suffix>`) and
    has not expired at `now` (POSIX seconds)."""
    spec = lease.get("spec") or {}
    holder = str(spec.get("holderIdentity") or "")
    if not holder or not (holder == identity or holder.startswith(identity + "_")):
        return False
    renewed = str(spec.get("renewTime") or spec.get("acquireTime") or "")
    duration = spec.get("leaseDurationSeconds")
    if not renewed or not isinstance(duration, int):
        return False
    try:
        at = datetime.fromisoformat(renewed.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return False
    return now < at + duration


class LeaseFollower:
    """Follows kube-scheduler's Lease; see the module docstring."""

    def __init__(
        self,
        api: kube.Kube,
        *,
        namespace: str = LEASE_NAMESPACE,
        name: str = LEASE_NAME,
        identity: str | None = None,
        interval: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity or socket.gethostname()
        self.interval = interval
        self._clock = clock
        self._lease: Mapping[str, Any] = {}
        self._misses = 0
        """Failed reads in a row (refusals aside)."""

    def __call__(self) -> bool:
        return leads(self._lease, self.identity, self._clock())

    def blocked_reason(self) -> str | None:
        """Why this replica cannot know whether it leads: the API refuses the read of the
        Lease (401, 403, or a lasting 404; `gpuplace.cluster.refusals`), with what to fix; None
        otherwise."""
        error = self.api.refusals.current("get", refusals.LEASES)
        if error is None:
            return None
        lease = f"{self.namespace}/{self.name}"
        if error.code == 404:
            return (
                f"gpuplace cannot find kube-scheduler's Lease {lease} (404 NotFound): "
                "check --scheduler-lease against the scheduler's leaderElection, and that "
                "the gpuplace kube-scheduler runs"
            )
        if error.code == 401:
            return (
                f"gpuplace cannot read kube-scheduler's Lease {lease} (401 Unauthorized): "
                "the API server does not accept the gpuplace container's token, so no gang "
                "starts"
            )
        return (
            f"gpuplace cannot read kube-scheduler's Lease {lease} ({error.code} "
            f"{error.reason}), so it never leads and no gang starts: the ServiceAccount "
            f"gpuplace needs get on {refusals.LEASES} {self.name} in namespace "
            f"{self.namespace} (Role gpuplace-read-scheduler-lease in deploy/)"
        )

    async def read(self) -> None:
        """Read the Lease once; on failure forget it (not leading)."""
        lease: Mapping[str, Any] = {}
        try:
            lease = await self.api.read_lease(self.namespace, self.name)
            self._misses = 0
        except kube.ApiError as error:
            # refusals are logged at ERROR by gpuplace.cluster.refusals (via kube); this is the rest
            if error.status not in refusals.REFUSED:
                log.info(
                    "scheduler lease not read",
                    extra={"status": error.status, "reason": error.reason},
                )
                self._misses += 1
                if self._misses == 1:
                    # one blip (timeout, 5xx): keep the last answer, still bounded by its
                    # own renewTime + leaseDurationSeconds; a second miss forgets it
                    lease = self._lease
        was = self()
        self._lease = lease
        if self() != was:
            log.info("controller leadership changed", extra={"leading": self()})

    async def run(self) -> None:
        while True:
            await self.read()
            await asyncio.sleep(self.interval)
