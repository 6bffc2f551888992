"""The gang controller's Prometheus metrics (docs/gangs.md, "Metrics"): the kit's
(`gpuplace.controllers.metrics`: leading, fenced nodes, plan time) and its own; those of a
preempting gang are `gpuplace.gangs.evicting`'s."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpuplace.controllers.metrics import ControllerMetrics, Series


class GangMetrics(ControllerMetrics):
    def __init__(self, registry: CollectorRegistry | None) -> None:
        super().__init__(
            registry,
            "gang",
            leading="1 while this replica's gang controller decides (its kube-scheduler "
            "holds the Lease), else 0.",
            held=Series(
                "fenced_nodes", "Nodes held for a starving gang (other pods are kept off them)."
            ),
            decisions=Series(
                "plan_duration_seconds", "Time to plan one gang (all members, CPU only)."
            ),
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.waiting = Gauge(
            "gpuplace_gangs_waiting",
            "Gangs with gated members not yet placed (incomplete or waiting for room), "
            "whether or not this replica leads.",
            registry=registry,
        )
        self.gated = Gauge(
            "gpuplace_gang_members_gated",
            "Live gang members still held by gpuplace's scheduling gate, whether or not "
            "this replica leads.",
            registry=registry,
        )
        self.wait = Histogram(
            "gpuplace_gang_wait_seconds",
            "From a gang's oldest member's creation to its ungating.",
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400),
            registry=registry,
        )
        self.placements = Counter(
            "gpuplace_gang_placements_total",
            "Gangs placed and ungated.",
            registry=registry,
        )
        self.timeouts = Counter(
            "gpuplace_gang_timeouts_total",
            "Gangs whose gang-timeout passed before they started, by reason.",
            ["reason"],
            registry=registry,
        )
        self.rollbacks = Counter(
            "gpuplace_gang_rollbacks_total",
            "Gang plans undone before any member started (member deleted, write failed).",
            registry=registry,
        )
