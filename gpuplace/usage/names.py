"""The metric and label names of GPU use: the node agent's own (it exports them, this
room reads them back from Prometheus) and NVIDIA dcgm-exporter's (read only). One place,
so that exporter, reader, docs and the Grafana dashboard cannot drift apart.

Every per-pod series carries `namespace` and `pod` (and `node`, `gpu`, `uuid`); the agent
removes a pod's series when the pod leaves its node, so a series ends with its pod.
"""

from __future__ import annotations

from typing import Final

# -- the node agent's (gpuplace) metrics ------------------------------------------------
POD_MEMORY_USED: Final = "gpuplace_pod_gpu_memory_used_bytes"
"""Device memory a pod's processes hold on one GPU (NVML; under MPS, the MPS clients)."""
POD_SM_UTILIZATION: Final = "gpuplace_pod_gpu_sm_utilization_ratio"
"""Share of one GPU's SMs a pod's processes kept busy over the last sample (0-1)."""
POD_MEMORY_PEAK: Final = "gpuplace_pod_gpu_memory_peak_bytes"
"""The most of `POD_MEMORY_USED` over the agent's samples of the last `--usage-peak-seconds`
(a peak between two scrapes is not lost)."""
POD_MEMORY_GRANTED: Final = "gpuplace_pod_gpu_memory_granted_bytes"
"""Device memory gpuplace granted the pod on that GPU (its assignment)."""
POD_SHARE_GRANTED: Final = "gpuplace_pod_gpu_share_granted_ratio"
"""Compute share gpuplace granted the pod on that GPU (gpu-percent / 100; 1 whole)."""
POD_PROCESSES: Final = "gpuplace_pod_gpu_processes"
"""A pod's processes holding one GPU (under MPS, its MPS clients: each has the share's limits
of its own, so more than one exceeds the grant)."""
POD_OVER_GRANT: Final = "gpuplace_pod_gpu_over_grant"
"""1 while the agent finds a pod over its grant on one GPU, by `kind` (memory, clients)."""
GPU_MEMORY_USED: Final = "gpuplace_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL: Final = "gpuplace_gpu_memory_total_bytes"
GPU_MEMORY_PACKABLE: Final = "gpuplace_gpu_memory_packable_bytes"
"""What a client can get of the GPU with MPS running (NVML's total less the driver's
reservation and the MPS server's memory): the figure the engine packs."""
GPU_UTILIZATION: Final = "gpuplace_gpu_utilization_ratio"
"""NVML's device utilisation (share of time a kernel ran), 0-1."""

POD_LABELS: Final = ("node", "gpu", "uuid", "namespace", "pod")
GPU_LABELS: Final = ("node", "gpu", "uuid")

# -- NVIDIA dcgm-exporter's metrics (default counters file) -----------------------------
DCGM_FB_USED: Final = "DCGM_FI_DEV_FB_USED"
"""Framebuffer memory used, MiB."""
DCGM_FB_FREE: Final = "DCGM_FI_DEV_FB_FREE"
"""Framebuffer memory free, MiB."""
DCGM_GPU_UTIL: Final = "DCGM_FI_DEV_GPU_UTIL"
"""GPU utilisation, percent 0-100."""
DCGM_SM_ACTIVE: Final = "DCGM_FI_PROF_SM_ACTIVE"
"""SM activity ratio 0-1 (profiling counter; absent where profiling metrics are off)."""
DCGM_GPU: Final = "gpu"
DCGM_UUID: Final = "UUID"
DCGM_HOSTNAME: Final = "Hostname"
DCGM_MODEL: Final = "modelName"
DCGM_POD: Final = ("pod", "exported_pod")
"""dcgm-exporter's pod label; `exported_pod` once a scrape config's own `pod` target label
took the name (Prometheus' honor_labels: false)."""
DCGM_NAMESPACE: Final = ("namespace", "exported_namespace")
