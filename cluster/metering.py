"""Prometheus gauges of the ledger, computed when scraped (never on the decision path)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cluster.syncing import LedgerSync
from placement.ledger import GrantState
from placement.requests import WHOLE


class LedgerCollector(Collector):
    """gpuplace_ledger_* gauges from a LedgerSync. O(grants + nodes) per scrape."""

    def __init__(self, sync: LedgerSync) -> None:
        self.sync = sync

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
