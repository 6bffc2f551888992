"""Prometheus gauges of the ledger, computed when scraped (never on the decision path).

Cluster-wide sums only, no per-node series (10,000 nodes would be 10,000 series a
scrape): what is allocated and free, how fragmented the free compute is against the
typical workload (`gpuplace.placement.fragmentation_totals`, kept current from the
ledger's change log), and the managed GPU pods not bound yet, by reason
(`gpuplace.cluster.syncing.PENDING_REASONS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpuplace.cluster.syncing import PENDING_REASONS, LedgerSync
from gpuplace.placement.fragmentation import Workload
from gpuplace.placement.fragmentation_totals import ClusterMeasure
from gpuplace.placement.ledger import GrantState
from gpuplace.placement.requests import WHOLE


class LedgerCollector(Collector):
    """gpuplace_ledger_* gauges and the rest of the module docstring from a LedgerSync.
    O(grants + nodes) per scrape, the fragmentation sums O(changed nodes) of it (see
    `gpuplace.placement.fragmentation_totals`). `workload`: the typical workload to measure
    fragmentation against (None: no fragmentation gauges)."""

    def __init__(self, sync: LedgerSync, workload: Callable[[], Workload] | None = None) -> None:
        self.sync = sync
        self.workload = workload
        self._measure = ClusterMeasure()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ledger = self.sync.ledger
        grants = GaugeMetricFamily(
            "gpuplace_ledger_grants", "Grants in the ledger, by state.", labels=["state"]
        )
        counts = dict.fromkeys(GrantState, 0)
        for grant in ledger:
            counts[grant.state] += 1
        for state, count in counts.items():
            grants.add_metric([state.value], count)
        yield grants
        yield GaugeMetricFamily(
            "gpuplace_ledger_holds",
            "Grants reserved in memory only (binds in flight, gang plans).",
            value=len(self.sync.holds()),
        )
        yield GaugeMetricFamily(
            "gpuplace_ledger_allocated_milligpus",
            "milli-GPU held by grants (1000 = one GPU).",
            value=ledger.allocated_milli(),
        )
        yield GaugeMetricFamily(
            "gpuplace_ledger_capacity_milligpus",
            "milli-GPU of all gpuplace nodes.",
            value=ledger.inventory.gpu_count() * WHOLE,
        )
        yield GaugeMetricFamily(
            "gpuplace_ledger_nodes", "Nodes managed by gpuplace.", value=len(ledger.inventory)
        )
        yield GaugeMetricFamily(
            "gpuplace_managed_pods", "Managed pods the informer knows.", value=len(self.sync.pods)
        )
        nodes = list(ledger.inventory)
        yield GaugeMetricFamily(
            "gpuplace_nodes_closed",
            "Managed nodes taking no new GPU pods: node agent silent (or required and absent).",
            value=sum(1 for node in nodes if node.closed),
        )
        yield GaugeMetricFamily(
            "gpuplace_gpus_unhealthy",
            "GPUs their node agent marked unhealthy: no new grant goes on them.",
            value=sum(1 for node in nodes for gpu in node.gpus if not gpu.healthy),
        )
        unreadable = sum(1 for record in self.sync.nodes.values() if record.problem)
        yield GaugeMetricFamily(
            "gpuplace_nodes_unreadable",
            "Enabled nodes whose GPU labels or annotation cannot be read.",
            value=unreadable,
        )
        pending = GaugeMetricFamily(
            "gpuplace_pending_pods",
            "Managed GPU pods not bound yet, by reason: gated (scheduling gates), unreadable "
            "(annotations), reserved (GPUs held, bind or gang plan in flight), "
            "unschedulable (kube-scheduler found no node), waiting (for kube-scheduler).",
            labels=["reason"],
        )
        for reason in PENDING_REASONS:
            pending.add_metric([reason], self.sync.unbound[reason])
        yield pending
        if self.workload is None:
            return
        totals = self._measure.totals(ledger, self.workload())
        yield GaugeMetricFamily(
            "gpuplace_ledger_free_milligpus",
            "milli-GPU idle and open to new grants (closed nodes, unhealthy GPUs excluded).",
            value=totals.free,
        )
        fragmentation = GaugeMetricFamily(
            "gpuplace_fragmentation_milligpus",
            "Idle milli-GPU the typical workload could not use, summed over nodes: fgd "
            "(FGD's measure, one pod of each type) or stranded (repeated pods, CPU counted).",
            labels=["measure"],
        )
        fragmentation.add_metric(["fgd"], totals.fgd)
        fragmentation.add_metric(["stranded"], totals.stranded)
        yield fragmentation
