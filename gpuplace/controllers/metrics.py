"""The Prometheus metrics every controller of the kit keeps, named for it.

`ControllerMetrics(registry, "gang", ...)` makes `gpuplace_gang_controller_leading` (1
while this replica decides, whether or not anything waits), a gauge of the nodes it holds
for a starving workload (its fence, 0 when none) and a histogram of its decisions' CPU
time on the event loop the extender's verbs share; each controller's own metrics extend
it (`gpuplace.gangs.metrics`, `gpuplace.queues.metrics`; docs/gangs.md and
docs/queues.md, "Metrics").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, Histogram


@dataclass(frozen=True, slots=True)
class Series:
    """A metric's name after `gpuplace_<controller>_`, and its help."""

    name: str
    help: str


class ControllerMetrics:
    """See the module docstring."""

    def __init__(
        self,
        registry: CollectorRegistry | None,
        controller: str,
        *,
        leading: str,
        held: Series,
        decisions: Series,
        buckets: Sequence[float],
    ) -> None:
        prefix = f"gpuplace_{controller}_"
        self.leading = Gauge(f"{prefix}controller_leading", leading, registry=registry)
        self.held = Gauge(prefix + held.name, held.help, registry=registry)
        self.decision_seconds = Histogram(
            prefix + decisions.name, decisions.help, buckets=tuple(buckets), registry=registry
        )
