"""Releasing reservations whose pod never got bound.

Two kinds, both bounded in time:

- a *hold* (in memory only) past its deadline: released;
- an *annotated, unbound* pod (a gang plan's member whose bind never came, or a pod
  left by a version whose bind wrote the assignment before the Binding; a bind now
  writes both in one Binding) whose `assigned-at` is older than `ttl`: its
  assignment annotations are removed with a merge patch carrying the pod's
  resourceVersion, so a pod that got bound (or changed) meanwhile is left alone
  (409); the informer then sees the annotations gone and the ledger releases the
  grant. Until then, every scheduling attempt for that pod is offered only the
  reserved node, and the next bind there completes the Binding with it.

Gated pods are the gang controller's and pods with a bind in flight are skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster import assignments, kube, recording
from gpuplace.cluster.syncing import LedgerSync

log = logging.getLogger(__name__)


class Reaper:
    def __init__(
        self,
        api: kube.Kube,
        sync: LedgerSync,
        *,
        ttl: float,
        interval: float = 10.0,
        recorder: recording.Recorder | None = None,
        registry: CollectorRegistry | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.sync = sync
        self.ttl = ttl
        self.interval = interval
        self.recorder = recorder
        self.wall = wall
        """POSIX clock the assignment times are compared with."""
        self.released = Counter(
            "gpuplace_reservations_expired_total",
            "Reservations released because their pod was not bound in time, by kind.",
            ["kind"],
            registry=registry,
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.sweep()

    async def sweep(self) -> int:
        """One pass; returns how many reservations it released or asked the API to drop."""
        done = 0
        for hold in self.sync.expired_holds():
            if self.sync.unhold(hold.grant.pod_uid) is not None:
                done += 1
                self.released.labels("hold").inc()
                log.info("hold expired", extra={"uid": hold.grant.pod_uid, "owner": hold.owner})
        for record in self.sync.stale(self.wall() - self.ttl):
            grant = record.grant
            assert grant is not None
            patch = {
                "metadata": {
                    "resourceVersion": record.resource_version,
                    "annotations": assignments.cleared(),
                }
            }
            try:
                await self.api.patch_pod(record.namespace, record.name, patch)
            except kube.ApiError as error:
                if not (error.conflict or error.not_found):
                    log.warning(
                        "stale reservation not released",
                        extra={"pod": str(record), "status": error.status},
                    )
                continue
            done += 1
            self.released.labels("annotation").inc()
            log.info(
                "stale reservation released",
                extra={"pod": str(record), "node": grant.node, "gpus": list(grant.gpus)},
            )
            if self.recorder is not None:
                gpus = ",".join(str(index) for index in grant.gpus)
                self.recorder.emit(
                    recording.Subject(record.namespace, record.name, record.uid),
                    recording.WARNING,
                    "GpuReservationExpired",
                    f"GPUs {gpus} of node {grant.node} were reserved for this pod but it was "
                    f"not bound within {self.ttl:g}s; released them, it will be placed again",
                )
        return done
