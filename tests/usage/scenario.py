"""The usage tests' cluster: what its pods were granted and what they used.

History (backfilled, 21 samples a minute apart ending at `T_END`, so a 1 h window ending
there holds all 21 and the 95th percentile is exactly the 20th smallest value —
Prometheus' quantile_over_time interpolates at rank 0.95 × (21 − 1) = 19):

node agent's series (nodes h-a, h-b), all in namespace `default`:
- train   h-a GPU 0, 50 %, 40 GiB: memory 1..21 GiB (peak 21, p95 20), SM 0.30..0.50
          → uses over half its memory and compute: not named;
- idle    h-a GPU 1, whole, 24 GiB: memory 2.0..6.0 GiB by 0.2 (peak 6, p95 5.8),
          SM 0.01..0.21 (p95 0.20) → memory 8Gi (6 × 1.2 = 7.2 → 8), gpu-percent 25;
- short   h-b GPU 0, 20 %, 10 GiB: 5 samples only → not judged;
- ghost   h-b GPU 1, not in the API: 25 %, 16 GiB from the granted series, 1 GiB, SM
          0.01 → memory 2Gi, gpu-percent 5;
- rolled  h-c GPU 0, no grant: its agent restarted mid-window (a DaemonSet rollout), so
          two series told apart by `instance` only: memory 1..10 GiB and SM 0.01..0.10
          from the old agent, 11..21 GiB and 0.11..0.21 from the new one. Read whole:
          peak 21 GiB, p95 20 GiB (SM 0.20), 21 samples; read per series, the p95 would
          be the new part's (20.5 GiB) and the count 11;
- spiky   h-d GPU 0, not in the API: 25 %, 16 GiB granted; every scraped sample 2 GiB, but
          the agent's own peak series (`gpuplace_pod_gpu_memory_peak_bytes`, its samples
          between scrapes) once says 9 GiB → peak 9 GiB, memory 11Gi (10.8 → 11), never
          the 3Gi the scraped samples alone would suggest.

dcgm-exporter's (Hostname d-a), MiB and percent:
- GPU 0 held by train-d and infer-d (50 %, 20 GiB each), one copy of each reading per pod
  (as `--kubernetes-virtual-gpus` does): 10240..12240 MiB, GPU_UTIL 40..60 → shared,
  shown, never judged;
- GPU 1 held by solo-d (whole, 40 GiB): 2048..2248 MiB by 10, GPU_UTIL 90, SM_ACTIVE
  0.00..0.20 (p95 0.19, and it wins over GPU_UTIL) → memory 3Gi (2248 × 1.2 MiB = 2.63 GiB),
  gpu-percent 25 (19 × 1.2 = 22.8);
- GPU 2 held by unlabelled-d (whole, 40 GiB) with no pod label (dcgm-exporter not told of
  gpuplace.io/gpu): 30000 MiB, 70 % → from the GPU's series, not named.

Live (scraped each second from the fixture exporters): dcgm node live-0 (GPU 0 of pod
default/live-pod, 5120 MiB, 25 %, SM 0.2; GPU 1 idle, no pod), the agent's node live-1
(GPU 0 of default/live-agent, 3 GiB, 0.25).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from gpuplace.usage import names
from gpuplace.usage.report import Asked
from tests.usage.harness import Series

GIB = 1 << 30
MIB = 1 << 20
T_END = float(int(time.time()) // 3600 * 3600 - 4 * 3600)
"""The history's last sample: whole hours, 4 h back (promtool's advice: not the head's range)."""
TIMES = [T_END - 60 * k for k in range(20, -1, -1)]


def _agent_pod(
    pod: str,
    node: str,
    gpu: int,
    memory: list[float],
    sm: list[float],
    *,
    times: list[float],
    instance: str = "",
) -> list[Series]:
    labels = _pod_labels(pod, node, gpu)
    if instance:  # the scrape target's label (the agent's pod IP): not the pod's identity
        labels["instance"] = instance
    gpu_labels = {key: labels[key] for key in names.GPU_LABELS}
    return [
        (names.POD_MEMORY_USED, labels, list(zip(times, memory, strict=True))),
        (names.POD_SM_UTILIZATION, labels, list(zip(times, sm, strict=True))),
        (names.GPU_MEMORY_USED, gpu_labels, list(zip(times, memory, strict=True))),
        (names.GPU_UTILIZATION, gpu_labels, list(zip(times, sm, strict=True))),
        (names.GPU_MEMORY_TOTAL, gpu_labels, [(at, 80.0 * GIB) for at in times]),
    ]


def _pod_labels(pod: str, node: str, gpu: int) -> dict[str, str]:
    return {
        "node": node,
        "gpu": str(gpu),
        "uuid": f"GPU-{node}-{gpu}",
        "namespace": "default",
        "pod": pod,
    }


def _granted(pod: str, node: str, gpu: int, memory: float, share: float) -> list[Series]:
    labels = _pod_labels(pod, node, gpu)
    return [
        (names.POD_MEMORY_GRANTED, labels, [(at, memory) for at in TIMES]),
        (names.POD_SHARE_GRANTED, labels, [(at, share) for at in TIMES]),
    ]


def _dcgm(
    gpu: int, pods: list[str], used_mib: list[float], util: list[float], sm: list[float] | None
) -> list[Series]:
    series: list[Series] = []
    for pod in pods or [""]:
        labels = {
            "gpu": str(gpu),
            "UUID": f"GPU-d-a-{gpu}",
            "pci_bus_id": f"00000000:{gpu + 7:02X}:00.0",
            "device": f"nvidia{gpu}",
            "modelName": "NVIDIA A100-SXM4-80GB",
            "Hostname": "d-a",
        }
        if pod:
            labels |= {"container": "main", "namespace": "default", "pod": pod}
        series.append((names.DCGM_FB_USED, labels, list(zip(TIMES, used_mib, strict=True))))
        free = [81920 - value for value in used_mib]
        series.append((names.DCGM_FB_FREE, labels, list(zip(TIMES, free, strict=True))))
        series.append((names.DCGM_GPU_UTIL, labels, list(zip(TIMES, util, strict=True))))
        if sm is not None:
            series.append((names.DCGM_SM_ACTIVE, labels, list(zip(TIMES, sm, strict=True))))
    return series


def _peak(pod: str, node: str, gpu: int, memory: list[float]) -> list[Series]:
    labels = _pod_labels(pod, node, gpu)
    return [(names.POD_MEMORY_PEAK, labels, list(zip(TIMES, memory, strict=True)))]


def history() -> list[Series]:
    ramp = range(21)
    short_times = TIMES[-5:]
    return [
        *_agent_pod(
            "train",
            "h-a",
            0,
            [(i + 1) * GIB for i in ramp],
            [0.30 + i / 100 for i in ramp],
            times=TIMES,
        ),
        *_granted("train", "h-a", 0, 40 * GIB, 0.5),
        *_agent_pod(
            "idle",
            "h-a",
            1,
            [2 * GIB + i * 0.2 * GIB for i in ramp],
            [(i + 1) / 100 for i in ramp],
            times=TIMES,
        ),
        *_granted("idle", "h-a", 1, 24 * GIB, 1.0),
        *_agent_pod("short", "h-b", 0, [1.0 * GIB] * 5, [0.1] * 5, times=short_times),
        *_agent_pod("ghost", "h-b", 1, [1.0 * GIB] * 21, [0.01] * 21, times=TIMES),
        *_agent_pod(
            "rolled",
            "h-c",
            0,
            [(i + 1) * GIB for i in range(10)],
            [(i + 1) / 100 for i in range(10)],
            times=TIMES[:10],
            instance="10.0.0.7:9090",
        ),
        *_agent_pod(
            "rolled",
            "h-c",
            0,
            [(i + 11) * GIB for i in range(11)],
            [(i + 11) / 100 for i in range(11)],
            times=TIMES[10:],
            instance="10.0.0.8:9090",
        ),
        *_granted("ghost", "h-b", 1, 16 * GIB, 0.25),
        *_agent_pod("spiky", "h-d", 0, [2.0 * GIB] * 21, [0.2] * 21, times=TIMES),
        *_peak("spiky", "h-d", 0, [2.0 * GIB] * 10 + [9.0 * GIB] + [2.0 * GIB] * 10),
        *_granted("spiky", "h-d", 0, 16 * GIB, 0.25),
        *_dcgm(
            0, ["train-d", "infer-d"], [10240 + 100 * i for i in ramp], [40 + i for i in ramp], None
        ),
        *_dcgm(1, ["solo-d"], [2048 + 10 * i for i in ramp], [90] * 21, [i / 100 for i in ramp]),
        *_dcgm(2, [], [30000] * 21, [70] * 21, None),
    ]


AGENT_ASKED = [
    Asked("default", "train", "h-a", (0,), 500, 40 * 1024),
    Asked("default", "idle", "h-a", (1,), 1000, 24 * 1024),
    Asked("default", "short", "h-b", (0,), 200, 10 * 1024),
]
DCGM_ASKED = [
    Asked("default", "train-d", "d-a", (0,), 500, 20 * 1024),
    Asked("default", "infer-d", "d-a", (0,), 500, 20 * 1024),
    Asked("default", "solo-d", "d-a", (1,), 1000, 40 * 1024),
    Asked("default", "unlabelled-d", "d-a", (2,), 1000, 40 * 1024),
]

# -- live exporters ----------------------------------------------------------------------------

_DCGM_HELP = {
    names.DCGM_FB_FREE: "Framebuffer memory free (in MiB).",
    names.DCGM_FB_USED: "Framebuffer memory used (in MiB).",
    names.DCGM_GPU_UTIL: "GPU utilization (in %).",
    names.DCGM_SM_ACTIVE: "The ratio of cycles an SM has at least 1 warp assigned.",
}
_LIVE_DCGM = {
    0: ({"container": "main", "namespace": "default", "pod": "live-pod"}, 5120, 76800, 25, 0.2),
    1: ({"container": "", "namespace": "", "pod": ""}, 0, 81920, 0, 0.0),
}


def dcgm_text() -> str:
    """What dcgm-exporter serves at /metrics (its label order and HELP/TYPE lines)."""
    lines = []
    for index, name in enumerate(_DCGM_HELP):
        lines.append(f"# HELP {name} {_DCGM_HELP[name]}")
        lines.append(f"# TYPE {name} gauge")
        for gpu, (pod, used, free, util, sm) in _LIVE_DCGM.items():
            value = (free, used, util, sm)[index]
            labels = (
                f'gpu="{gpu}",UUID="GPU-live-0-{gpu}",pci_bus_id="00000000:{gpu + 7:02X}:00.0",'
                f'device="nvidia{gpu}",modelName="NVIDIA A100-SXM4-80GB",Hostname="live-0",'
                f'DCGM_FI_DRIVER_VERSION="535.129.03",container="{pod["container"]}",'
                f'namespace="{pod["namespace"]}",pod="{pod["pod"]}"'
            )
            lines.append(f"{name}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


def agent_text() -> str:
    """The node agent's exposition of its usage series (prometheus_client's format)."""
    registry = CollectorRegistry()
    pod_labels = {"node": "live-1", "gpu": "0", "uuid": "GPU-live-1-0"}
    per_pod = {**pod_labels, "namespace": "default", "pod": "live-agent"}
    for name, value in (
        (names.POD_MEMORY_USED, 3.0 * GIB),
        (names.POD_SM_UTILIZATION, 0.125),
        (names.POD_MEMORY_GRANTED, 8.0 * GIB),
        (names.POD_SHARE_GRANTED, 0.25),
    ):
        Gauge(name, name, names.POD_LABELS, registry=registry).labels(**per_pod).set(value)
    for name, value in (
        (names.GPU_MEMORY_USED, 3.0 * GIB),
        (names.GPU_MEMORY_TOTAL, 80.0 * GIB),
        (names.GPU_UTILIZATION, 0.25),
    ):
        Gauge(name, name, names.GPU_LABELS, registry=registry).labels(**pod_labels).set(value)
    return generate_latest(registry).decode()
