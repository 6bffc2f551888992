"""The API mirrored into a `LedgerSync`: the node informer, then the managed-pod informer.

Nodes sync first so that the pods' grants land on known nodes (`Ledger.put_node` is
O(grants); adding 10,000 nodes under 100,000 grants would be quadratic). `ready`
(the `LedgerSync.ready` event) is set once both informers have listed; `/readyz` and
every extender decision wait for it.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from gpuplace.cluster import keys, kube, nodes, pods, watching
from gpuplace.cluster.syncing import LedgerSync

log = logging.getLogger(__name__)

MANAGED_SELECTOR = f"{keys.MANAGED}=true"


class Mirror:
    """Node and managed-pod informers feeding one LedgerSync."""

    def __init__(
        self,
        api: kube.Kube,
        sync: LedgerSync,
        *,
        registry: CollectorRegistry | None = None,
        page_size: int = 500,
        watch_seconds: int = 300,
        backoff: watching.Backoff | None = None,
    ) -> None:
        self.sync = sync
        backoff = backoff or watching.Backoff()
        metrics = watching.InformerMetrics(registry) if registry is not None else None
        self.reader = pods.Reader()
        """The process's one reading of a pod (`pods.Reader`: parsed once, memoised); the
        extender's verbs read the pods kube-scheduler sends through it too."""
        self.nodes: watching.Informer[nodes.NodeRecord] = watching.Informer(
            api,
            "nodes",
            sync.nodes_handler,
            nodes.record,
            page_size=page_size,
            watch_seconds=watch_seconds,
            backoff=backoff,
            metrics=metrics,
        )
        self.pods: watching.Informer[pods.PodRecord] = watching.Informer(
            api,
            "pods",
            sync.pods_handler,
            self.reader.record,
            label_selector=MANAGED_SELECTOR,
            page_size=page_size,
            watch_seconds=watch_seconds,
            backoff=backoff,
            metrics=metrics,
        )

    def not_ready_reason(self) -> str | None:
        if not self.nodes.synced.is_set():
            return "node informer has not listed yet"
        if not self.pods.synced.is_set():
            return "pod informer has not listed yet"
        return None

    async def load(self) -> None:
        """List nodes, then pods, once (no watch): a snapshot for one-shot readers such as
        `gpuplace explain`. Raises `kube.ApiError`."""
        await self.nodes.relist()
        await self.pods.relist()
        self.sync.ready.set()

    async def run(self) -> None:
        """Run both informers until cancelled; sets `sync.ready` once both listed."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self.nodes.run(), name="gpuplace-informer-nodes")
            await self.nodes.synced.wait()
            group.create_task(self.pods.run(), name="gpuplace-informer-pods")
            await self.pods.synced.wait()
            self.sync.ready.set()
            log.info(
                "cluster state synced",
                extra={"nodes": len(self.sync.ledger.inventory), "grants": len(self.sync.ledger)},
            )
