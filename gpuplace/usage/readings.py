"""What a reader of GPU use brings back for one window: per pod per GPU and per GPU, the
peak and the 95th percentile of memory and utilisation, and how many samples each held.
Values only (frozen dataclasses); the readers (`gpuplace.usage.prometheus`) fill them, the report
(`gpuplace.usage.report`) joins them with what pods asked for. Must never do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PodGpuUse:
    """One pod's use of one GPU over the window."""

    namespace: str
    pod: str
    node: str
    gpu: int
    memory_peak_bytes: int
    memory_p95_bytes: int
    util_peak: float | None
    """Share of the GPU's SMs kept busy (0-1), highest sample; None: not measured."""
    util_p95: float | None
    samples: int
    """Memory samples in the window (the fewest of the series read)."""
    granted_memory_bytes: int | None = None
    """What the source says was granted (the node agent's series); None: it does not say."""
    granted_share: float | None = None
    """Granted compute share of the GPU (0-1; 1 whole); None: the source does not say."""
    gpu_reading: bool = False
    """True: the figures are the whole GPU's, labelled with the pod that holds it
    (dcgm-exporter), not the pod's own (the node agent's per-process figures)."""


@dataclass(frozen=True, slots=True)
class GpuUse:
    """One GPU's use over the window (every process on it, gpuplace's or not)."""

    node: str
    gpu: int
    memory_peak_bytes: int
    memory_p95_bytes: int
    memory_total_bytes: int | None
    util_peak: float | None
    util_p95: float | None
    samples: int


@dataclass(frozen=True, slots=True)
class Usage:
    """Everything one read brought back."""

    source: str
    """"gpuplace" (the node agent's series) or "dcgm" (dcgm-exporter's)."""
    window_seconds: float
    at: float
    """POSIX time the window ends."""
    pods: tuple[PodGpuUse, ...]
    gpus: tuple[GpuUse, ...]
