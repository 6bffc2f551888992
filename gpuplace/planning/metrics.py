"""The planner's Prometheus metrics (docs/placement.md, "Plan, then pin"): the kit's
(`gpuplace.controllers.metrics`: leading, the grants it holds, its rounds' CPU time) and
its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpuplace.controllers.metrics import ControllerMetrics, Series

RESULTS = ("nominated", "pinned", "unplanned", "stale", "failed", "gone")
"""`gpuplace_plan_releases_total` results: released with its node handed over as
kube-scheduler's first try (`nominated`) or as its only node (`pinned`); released with no
node (`unplanned`: no room now, or a request that cannot be read: the extender's filter
decides as for any pod); a plan found stale before its write (`stale`: planned again);
a write the API refused or did not answer (`failed`: tried again); the pod went away
(`gone`)."""


class PlanMetrics(ControllerMetrics):
    def __init__(self, registry: CollectorRegistry | None) -> None:
        super().__init__(
            registry,
            "plan",
            leading="1 while this replica's planner decides (its kube-scheduler holds the "
            "Lease), else 0.",
            held=Series(
                "held_grants",
                "Grants the planner holds in memory for pods it released and "
                "kube-scheduler has not bound yet (or planned and not released yet).",
            ),
            decisions=Series(
                "round_duration_seconds",
                "Time to plan one round: every pod behind the planner's gate (CPU only).",
            ),
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.gated = Gauge(
            "gpuplace_plan_pods_gated",
            "Live pods behind the planner's gate gpuplace.io/place, whether or not this "
            "replica leads (a few at most, each for a moment, while one leads).",
            registry=registry,
        )
        self.releases = Counter(
            "gpuplace_plan_releases_total",
            "Pods the planner released, or tried to, by result (nominated, pinned, "
            "unplanned, stale, failed, gone).",
            ["result"],
            registry=registry,
        )
        for result in RESULTS:
            self.releases.labels(result)
        self.wait = Histogram(
            "gpuplace_plan_wait_seconds",
            "From the moment the planner could plan a pod (its gate the last one left) to "
            "its release written.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
