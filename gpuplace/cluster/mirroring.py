"""The API mirrored into a `LedgerSync`: the node informer, then the managed-pod informer,
then (on the DRA path, `claims`) the informer of every namespace's ResourceClaims
(`gpuplace.cluster.claims`: what each holds of gpuplace's GPUs).

Nodes sync first so that the pods' grants land on known nodes (`Ledger.put_node` is
O(grants); adding 10,000 nodes under 100,000 grants would be quadratic). `ready`
(the `LedgerSync.ready` event) is set once every informer has listed; `/readyz` and
every extender decision wait for it.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from gpuplace.cluster import claims, keys, kube, nodes, pods, watching
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
        with_claims: bool = False,
    ) -> None:
        """`with_claims`: also mirror ResourceClaims (`--dra-claims` other than off)."""
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
        self.claims: watching.Informer[claims.ClaimRecord] | None = None
        """The ResourceClaim informer (None: not on the DRA path)."""
        if with_claims:
            self.claims = watching.Informer(
                api,
                "resourceclaims",
                sync.claims_handler,
                claims.record,
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
        if self.claims is not None and not self.claims.synced.is_set():
            return "ResourceClaim informer has not listed yet"
        return None

    async def load(self, *, claims_optional: bool = False) -> str:
        """List nodes, then pods (then claims), once (no watch): a snapshot for one-shot
        readers such as `gpuplace explain`. Raises `kube.ApiError`; with `claims_optional`
        a claim list the API refuses (no DRA API, no RBAC for it) is not an error: returns
        why it was not read ("" when it was, or was not asked for)."""
        await self.nodes.relist()
        await self.pods.relist()
        missing = ""
        if self.claims is not None:
            try:
                await self.claims.relist()
            except kube.ApiError as error:
                if not claims_optional:
                    raise
                missing = f"ResourceClaims not read ({error.status} {error.reason})"
        self.sync.ready.set()
        return missing

    async def run(self) -> None:
        """Run both informers until cancelled; sets `sync.ready` once both listed."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self.nodes.run(), name="gpuplace-informer-nodes")
            await self.nodes.synced.wait()
            group.create_task(self.pods.run(), name="gpuplace-informer-pods")
            await self.pods.synced.wait()
            if self.claims is not None:
                group.create_task(self.claims.run(), name="gpuplace-informer-resourceclaims")
                await self.claims.synced.wait()
            self.sync.ready.set()
            log.info(
                "cluster state synced",
                extra={
                    "nodes": len(self.sync.ledger.inventory),
                    "grants": len(self.sync.ledger),
                    "claims": len(self.sync.claims),
                },
            )
