"""The measured load of each GPU, as the sidecar's load-aware tie-break reads it: the
shape every reader of GPU use (the node agent's metrics or dcgm-exporter's, through
Prometheus) returns, and the protocol it implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class GpuLoad:
    """One GPU's measured use, averaged over the window asked for."""

    node: str
    gpu: int
    """The GPU's index on its node (NVML's, as in `gpuplace.io/gpus` and assignments)."""
    utilization: float
    """Share of time a kernel ran (0-1)."""
    memory_used_bytes: int


GpuLoads = dict[str, dict[int, GpuLoad]]
"""node name -> GPU index -> its load; a node or GPU absent was not measured."""


class LoadReader(Protocol):
    """Reads every measured GPU's load over the last `window_seconds`; raises
    `UsageUnavailable` when its source cannot answer."""

    async def gpu_loads(self, window_seconds: float) -> GpuLoads: ...


class UsageUnavailable(Exception):
    """The source of measurements (Prometheus) could not answer; the message says why
    (never a credential)."""
