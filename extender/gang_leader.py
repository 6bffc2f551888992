"""Whether this replica is the one that decides: the gang controller's leadership gate.

Several replicas run the sidecar, but only the kube-scheduler holding the Lease
`gpuplace/gpuplace-scheduler` schedules (docs/deploy.md). The gang controller must act
in that replica only, or two controllers with two ledgers would plan the same gangs.
Rather than a second election, it follows the scheduler's: kube-scheduler's leader
identity is `<hostname>_<uuid>`, and both containers of the pod share the hostname (the
pod name), so this replica leads while the Lease's `holderIdentity` starts with its
own hostname + "_" and `renewTime + leaseDurationSeconds` has not passed.

`LeaseFollower.run` reads the Lease every `interval` seconds (RBAC: `get` on that
Lease, which the sidecar's Role already grants); `LeaseFollower()` answers from the
last read. A failed read counts as not leading (the safe side: a gang waits a little
longer, it is never planned twice).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from cluster import kube

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
        self._coordination: Any = client.CoordinationV1Api(api.api_client)
        self._lease: Mapping[str, Any] = {}

    def __call__(self) -> bool:
        return leads(self._lease, self.identity, self._clock())

    async def read(self) -> None:
        """Read the Lease once; on failure forget it (not leading)."""
        try:
            response = await self._coordination.read_namespaced_lease(
                self.name,
                self.namespace,
                _preload_content=False,
                _request_timeout=self.api.timeout,
            )
            try:
                body = await response.read()
            finally:
                response.release()
            lease = json.loads(body) if response.status < 400 else {}
        except (ApiException, aiohttp.ClientError, OSError, TimeoutError, ValueError) as error:
            log.info("scheduler lease not read", extra={"error": type(error).__name__})
            lease = {}
        was = self()
        self._lease = lease if isinstance(lease, dict) else {}
        if self() != was:
            log.info("gang controller leadership changed", extra={"leading": self()})

    async def run(self) -> None:
        while True:
            await self.read()
            await asyncio.sleep(self.interval)
