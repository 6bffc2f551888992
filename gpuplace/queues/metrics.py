"""The queue controller's metrics: per queue (label `queue`), never per pod.

Queue names are the admins' GpuQueue objects, so the label is bounded by them; a queue's
series go when the queue goes (`QueueMetrics.keep`). Quota figures carry the quota line
too (`resource`: gpus, gpu-compute, gpu-memory; `model`: a GPU model or `*`), in base
units: GPUs for `gpus` and `gpu-compute`, bytes for `gpu-memory`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuplace.controllers.metrics import ControllerMetrics, Series
from gpuplace.placement.queueing import quotas
from gpuplace.placement.queueing.admitting import QueueStatus
from gpuplace.placement.requests import WHOLE

MIB = 1024 * 1024


def base_units(resource: str, amount: int) -> float:
    """An engine amount (milli-GPU, or MiB for memory) in GPUs or bytes."""
    return float(amount * MIB) if resource == quotas.GPU_MEMORY else amount / WHOLE


class QueueMetrics(ControllerMetrics):
    """The kit's (`gpuplace.controllers.metrics`: leading, held nodes, round time) and the
    per-queue ones."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        super().__init__(
            registry,
            "queue",
            leading="1 while this replica's queue controller decides (its kube-scheduler leads).",
            held=Series(
                "held_nodes",
                "Nodes kept for a starving queued workload (a capacity hold; 0 when none).",
            ),
            decisions=Series(
                "round_duration_seconds",
                "Time of one admission round's decision (CPU, on the event loop).",
            ),
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
        )

        def gauge(name: str, text: str, labels: tuple[str, ...] = ("queue",)) -> Gauge:
            return Gauge(name, text, list(labels), registry=registry)

        line = ("queue", "resource", "model")
        self.admitted = gauge(
            "gpuplace_queue_admitted_workloads", "Workloads the queue admitted that run."
        )
        self.waiting = gauge(
            "gpuplace_queue_waiting_workloads", "Workloads waiting in the queue (a gang is one)."
        )
        self.waiting_pods = gauge("gpuplace_queue_waiting_pods", "Pods waiting in the queue.")
        self.share = gauge(
            "gpuplace_queue_weighted_share",
            "What the queue borrows over what its cohort lends, over its weight (its "
            "dominant quota line; 0 within its nominal quota).",
        )
        self.past_share = gauge(
            "gpuplace_queue_past_weighted_share",
            "The weighted share's decayed average over the past (fair sharing over time; 0 "
            "while it is off), added to the weighted share while the queue borrows.",
        )
        self.nominal = gauge(
            "gpuplace_queue_nominal", "Nominal quota per quota line (GPUs, or bytes).", line
        )
        self.used = gauge(
            "gpuplace_queue_used", "What the queue's workloads use per quota line.", line
        )
        self.borrowed = gauge(
            "gpuplace_queue_borrowed", "Use beyond the nominal quota, lent by the cohort.", line
        )
        self.lent = gauge(
            "gpuplace_queue_lent", "Nominal quota other queues of the cohort use.", line
        )
        self.admissions = Counter(
            "gpuplace_queue_admissions_total",
            "Workloads (or an elastic gang's added members) admitted, by queue.",
            ["queue"],
            registry=registry,
        )
        self.reclaims = Counter(
            "gpuplace_queue_reclaims_total",
            "Reclaims carried out for a waiting workload of the queue (its victims evicted).",
            ["queue"],
            registry=registry,
        )
        self.preempted = Counter(
            "gpuplace_queue_preempted_pods_total",
            "Pods of the queue evicted by a reclaim.",
            ["queue"],
            registry=registry,
        )
        self._lines: dict[str, set[tuple[str, str]]] = {}

    def show(self, status: QueueStatus, spec: quotas.QueueSpec, past: float = 0.0) -> None:
        """Set the queue's gauges from a round's status (`past`: its past share).
        O(quota lines)."""
        name = status.name
        self.past_share.labels(name).set(past)
        self.admitted.labels(name).set(status.admitted)
        self.waiting.labels(name).set(status.waiting)
        self.waiting_pods.labels(name).set(status.waiting_pods)
        self.share.labels(name).set(status.share)
        lines = set(spec.quotas)
        for gone in self._lines.get(name, set()) - lines:
            for family in (self.nominal, self.used, self.borrowed, self.lent):
                family.remove(name, *gone)
        self._lines[name] = lines
        for bucket, quota in spec.quotas.items():
            resource, model = bucket
            self.nominal.labels(name, resource, model).set(base_units(resource, quota.nominal))
            for family, amounts in (
                (self.used, status.used),
                (self.borrowed, status.borrowed),
                (self.lent, status.lent),
            ):
                family.labels(name, resource, model).set(
                    base_units(resource, amounts.get(bucket, 0))
                )

    def keep(self, names: Iterable[str]) -> None:
        """Drop the series of queues not among `names` (deleted GpuQueues)."""
        alive = set(names)
        for name in [name for name in self._lines if name not in alive]:
            for bucket in self._lines.pop(name):
                for family in (self.nominal, self.used, self.borrowed, self.lent):
                    family.remove(name, *bucket)
            for each in (
                self.admitted,
                self.waiting,
                self.waiting_pods,
                self.share,
                self.past_share,
            ):
                each.remove(name)
            for counter in (self.admissions, self.reclaims, self.preempted):
                with contextlib.suppress(KeyError):  # never counted
                    counter.remove(name)
