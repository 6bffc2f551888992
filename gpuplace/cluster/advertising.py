"""Advertising gpuplace's extended resources on managed nodes' status, and the NVLink
domain label node affinity reads.

An enabled node offers `gpuplace.io/gpu-percent` = 100 × GPUs and
`gpuplace.io/gpu-memory` = its total GPU MiB in `status.capacity` and
`status.allocatable` (so the stock scheduler's NodeResourcesFit and ResourceQuota
count GPU shares with no code of ours); a node that leaves gpuplace loses them.
It also keeps the node label `gpuplace.io/nvlink-domain-size` (GPUs in the node's
largest NVLink domain), which the webhook's node affinity for required-topology pods
reads. The `Advertiser` writes a merge patch (nodes/status, nodes) only when what the
informer shows differs from that, at most once per `min_interval` per node (a kubelet
that keeps overwriting would otherwise make us write in a loop), and retries failures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster import kube, nodes

log = logging.getLogger(__name__)


class Advertiser:
    """Keeps managed nodes' extended resources right; feed it with `observe`."""

    def __init__(
        self,
        api: kube.Kube,
        *,
        registry: CollectorRegistry | None = None,
        min_interval: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.min_interval = min_interval
        self._clock = clock
        self._pending: dict[str, nodes.NodeRecord] = {}
        self._last: dict[str, float] = {}
        self._wake = asyncio.Event()
        self.patches = Counter(
            "gpuplace_node_patches_total",
            "Node patches keeping gpuplace's resources and labels right, by result.",
            ["result"],
            registry=registry,
        )

    def observe(self, record: nodes.NodeRecord) -> None:
        """A node changed: queue a patch when its advertisement is not what it should be."""
        if nodes.status_patch(record) is None and nodes.label_patch(record) is None:
            self._pending.pop(record.name, None)
        else:
            self._pending[record.name] = record
            self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def run(self) -> None:
        """Patch what `observe` queued, forever (until cancelled)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            wait = await self.flush()
            if wait is not None:
                asyncio.get_running_loop().call_later(wait, self._wake.set)

    async def flush(self) -> float | None:
        """Patch every due node; returns seconds until the next one is due (None: none)."""
        now = self._clock()
        next_due: float | None = None
        for name, record in list(self._pending.items()):
            status = nodes.status_patch(record)
            labels = nodes.label_patch(record)
            if status is None and labels is None:
                self._pending.pop(name, None)
                continue
            due = self._last.get(name, -self.min_interval) + self.min_interval
            if due > now:
                next_due = due - now if next_due is None else min(next_due, due - now)
                continue
            self._last[name] = now
            try:
                if status is not None:
                    await self.api.patch_node_status(name, status)
                if labels is not None:
                    await self.api.patch_node(name, labels)
            except kube.ApiError as error:
                if error.not_found:
                    self._pending.pop(name, None)
                    self.patches.labels("gone").inc()
                    continue
                self.patches.labels("error").inc()
                log.warning(
                    "node patch failed",
                    extra={"node": name, "status": error.status, "error": error.message},
                )
                next_due = (
                    self.min_interval if next_due is None else min(next_due, self.min_interval)
                )
                continue
            if self._pending.get(name) is record:
                del self._pending[name]
            self.patches.labels("ok").inc()
            log.info(
                "advertised gpuplace resources",
                extra={"node": name, "status": status, "labels": labels},
            )
        return next_due
