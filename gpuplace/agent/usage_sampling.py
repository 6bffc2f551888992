"""What the pods of this node use of its GPUs, and what they were granted: sampled every
`--usage-seconds` through NVML, exported as the Prometheus series `gpuplace.usage.names` names.

One sample (`Meter.measure`, in a worker thread: driver calls block):

1. per GPU, NVML's memory used and total and its device utilisation;
2. per GPU, the processes holding it: under MPS the MPS *clients*
   (`mps_processes`; `compute_processes` also lists the MPS server, which belongs to no
   pod, and the agent's own per-GPU daemons would put it in the agent's pod), otherwise
   `compute_processes` less the MPS servers the control daemons answer (`servers()`: an
   idle server stays up after its last client exits, with no client listed);
3. per process its pod: host PID → `/proc/<pid>/cgroup` (`gpuplace.agent.cgroups`, under
   `--proc-root`; host PIDs need `hostPID: true`) → pod UID → the pod among this node's
   pods (the device plugin's pod informer, `gpuplace.agent.plugin.PodView`). A process in the
   agent's own pod (`own`: the MPS servers its daemons start, whatever lists them) is
   charged to no pod and counted nowhere, like a server. A process in no pod
   known here is *unattributed*: counted in the GPU's totals and in
   `gpuplace_agent_usage_processes{attribution="none"}`, never in a pod's series;
4. per process its SM utilisation: the mean of NVML's per-process samples newer than the
   previous sample of that GPU (a process that ran no kernel since has none: 0). Where
   the driver answers no per-process samples (Not Supported, as on every captured
   reading), the pods' SM series of that GPU are absent, never estimated from the
   device's figure; so are they under MPS when the samples name the MPS server and none
   of its clients (the clients' shares are then unknown);
5. per pod granted a gpuplace share here (its assignment annotations,
   `gpuplace.cluster.assignments`; on a DRA node the claims it uses that the DRA plugin
   prepared, `claims`: by the pod's claim names, `gpuplace.cluster.dra_claims.claim_names`)
   and per granted GPU: the memory granted (the GPU's whole memory for a whole GPU, else
   the grant's MiB: for a claim, what it consumed less the GPU's CUDA context, which its
   MPS limit holds inside, so that what is granted reads the same on both paths; 0 for a
   share that asked for none, which MPS leaves unlimited) and the share (milli / 1000; 0
   for a memory-only share). A granted pod with no process on a GPU whose process list
   was read uses 0 bytes there (measured, not assumed).

`UsageCollector` builds the metric families at scrape time from the last sample, keeping
only pods still on this node and not finished, so a pod's series end when it leaves the
node or finishes (its grant released), at the next scrape, not at the next sample. A
sample older than `stale_after` (3 × `--usage-seconds`: an NVML call that never returns,
as on a GPU fallen off the bus, holds the loop) is not exported at all: no pod or GPU
series, `gpuplace_agent_usage_stale_scrapes_total` counts the scrapes, and
`gpuplace_agent_usage_sample_age_seconds` says how old the last sample is.
The memory peak (`names.POD_MEMORY_PEAK`) is the most memory a pod used on a GPU in the
samples of the last `peak_seconds` (kept by the sampler, at most that many seconds of
samples), computed at the scrape: a peak between two scrapes is not lost, and nothing is
reset by a scrape, so every Prometheus replica reads the same figure.

Cost of one sample: O(GPUs × processes) NVML calls and file reads (one cgroup read per
distinct PID, at most `cgroups.MAX_BYTES` each) + O(pods × GPUs per grant). Nothing here
raises on NVML's account: a failed call is recorded in `Sample.errors` (by call and NVML's
message), and what it would have said is absent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuplace.agent import allocating, cgroups, handover, preparing
from gpuplace.agent import nvml as nvml_seam
from gpuplace.cluster import assignments, dra_claims, mps_limits
from gpuplace.placement.inventory import ClientContext
from gpuplace.placement.requests import WHOLE
from gpuplace.usage import names

log = logging.getLogger(__name__)

T = TypeVar("T")

USAGE_SECONDS = 10.0
"""Default sample period: Prometheus' usual scrape interval is 15 s or more."""
PEAK_SECONDS = 60.0
"""Default window of the memory peak: at least a scrape interval, so no peak is lost."""
MIB = 1 << 20
FINISHED = ("Succeeded", "Failed")
MIRROR = "kubernetes.io/config.mirror"
"""A mirror pod's annotation holding its static pod's UID: the UID in the cgroup path."""


@dataclass(frozen=True, slots=True)
class GpuUse:
    """One GPU's totals; None where NVML could not say."""

    index: int
    uuid: str
    memory_used: int | None
    memory_total: int | None
    utilization: float | None
    """0-1."""


@dataclass(frozen=True, slots=True)
class PodUse:
    """One pod on one GPU: what it uses and what it was granted; None = not known or
    not granted (its series absent)."""

    uid: str
    namespace: str
    name: str
    index: int
    uuid: str
    memory_used: int | None = None
    sm: float | None = None
    """0-1: the sum of its processes' SM shares, at most 1."""
    memory_granted: int | None = None
    share_granted: float | None = None
    processes: int | None = None
    """Its processes holding the GPU in this sample (under MPS: its MPS clients); None when
    the GPU's process list could not be read."""
    milli_granted: int | None = None
    """The grant's milli-GPU on that GPU (None: not granted here)."""


@dataclass(frozen=True, slots=True)
class Sample:
    gpus: tuple[GpuUse, ...] = ()
    pods: tuple[PodUse, ...] = ()
    attributed: int = 0
    """Processes whose pod is known here."""
    unattributed: int = 0
    """Processes on a GPU in no pod known here (system services, pods already gone)."""
    errors: tuple[tuple[str, str], ...] = ()
    """(call, NVML's message) of every call that failed."""


@dataclass(slots=True)
class _Row:
    uid: str
    index: int
    uuid: str
    memory_used: int | None = 0
    sm: float | None = None
    memory_granted: int | None = None
    share_granted: float | None = None
    processes: int = 0
    milli_granted: int | None = None


@dataclass(slots=True)
class Meter:
    """Takes samples; keeps, per GPU, the newest per-process sample timestamp seen, so
    that each sample averages the samples since the previous one."""

    nvml: nvml_seam.Nvml
    node: str
    proc: cgroups.Proc = field(default_factory=cgroups.Proc)
    own: str | None = None
    """The agent's own pod UID: its processes (MPS servers) are never a pod's use."""
    servers: Callable[[], Collection[int]] = frozenset
    """The MPS servers' PIDs the control daemons answer now (called from the sampling
    thread)."""
    since: dict[str, int] = field(default_factory=dict)
    """GPU UUID → newest per-process sample timestamp seen (the driver's microseconds)."""
    claims: Callable[[], Iterable[preparing.Prepared]] = tuple
    """The claims the DRA plugin prepared on this node (none without DRA)."""
    contexts: Callable[[], Mapping[str, ClientContext]] = dict
    """GPU UUID → its MPS client context as published (a claim's memory holds it)."""

    def measure(self, pods: Iterable[Mapping[str, Any]]) -> Sample:
        """One sample; `pods`: this node's pods as the API returns them (a snapshot)."""
        asking = _Asking()
        ask, reading = asking.ask, self.nvml
        by_uid, mirrors = _pods_by_uid(pods)
        gpus: list[GpuUse] = []
        rows: dict[tuple[str, str], _Row] = {}
        pod_of: dict[int, str | None] = {}
        """PID → its pod's UID (None: in no pod known here), read once per sample."""
        attributed = unattributed = 0
        listed: set[str] = set()
        """GPUs whose process list was read (a granted pod absent there uses 0)."""
        sm_known: set[str] = set()
        for index in range(ask(reading.gpu_count) or 0):
            uuid = ask(reading.uuid, index)
            if uuid is None:
                continue
            utilization = ask(reading.utilization, index)
            gpus.append(
                GpuUse(
                    index,
                    uuid,
                    ask(reading.memory_used, index),
                    ask(reading.memory_total, index),
                    None if utilization is None else utilization / 100,
                )
            )
            found = self._processes(asking, index, uuid)
            if found is None:
                continue
            processes, busy, sm_answered = found
            listed.add(uuid)
            if sm_answered:
                sm_known.add(uuid)
            for process in processes:
                if process.pid not in pod_of:
                    uid = self.proc.pod_uid(process.pid)
                    pod_of[process.pid] = mirrors.get(uid, uid) if uid else None
                uid = pod_of[process.pid]
                if uid is not None and uid == self.own:
                    continue
                if uid is None or uid not in by_uid:
                    unattributed += 1
                    continue
                attributed += 1
                row = rows.setdefault((uid, uuid), _Row(uid, index, uuid))
                row.processes += 1
                if row.memory_used is not None:
                    used = process.used_bytes
                    row.memory_used = None if used is None else row.memory_used + used
                row.sm = (row.sm or 0.0) + busy.get(process.pid, 0.0)
        _granted(rows, by_uid, self.node, gpus)
        _claimed(
            rows, by_uid, self.node, gpus, claims=list(self.claims()), contexts=self.contexts()
        )
        made = [
            _pod_use(row, by_uid[row.uid], row.uuid in listed, row.uuid in sm_known)
            for row in rows.values()
        ]
        return Sample(tuple(gpus), tuple(made), attributed, unattributed, tuple(asking.errors))

    def _processes(
        self, asking: _Asking, index: int, uuid: str
    ) -> tuple[Sequence[nvml_seam.Process], dict[int, float], bool] | None:
        """GPU `index`'s pod-side processes (its MPS clients where it has any, else its
        compute processes but the known MPS servers), each PID's SM share since the last
        sample, and whether those shares are known; None when no process list could be
        read."""
        ask, reading = asking.ask, self.nvml
        clients = ask(reading.mps_processes, index) or []
        compute = ask(reading.compute_processes, index)
        servers = set(self.servers())
        if clients:
            processes: Sequence[nvml_seam.Process] = clients
            servers |= {process.pid for process in compute or []} - {p.pid for p in clients}
        elif compute is not None:
            processes = [process for process in compute if process.pid not in servers]
        else:
            return None
        since = self.since.get(uuid, 0)
        samples = ask(reading.process_utilization, index, since)
        busy = _sm_by_pid(samples or [])
        if samples:
            self.since[uuid] = max(since, *(sample.timestamp_us for sample in samples))
        # Under MPS a driver may charge the clients' kernels to the server: then what each
        # client ran is unknown.
        charged_to_server = bool(busy.keys() & servers) and not busy.keys() & {
            process.pid for process in processes
        }
        return processes, busy, samples is not None and not charged_to_server


@dataclass(slots=True)
class _Asking:
    """NVML calls of one sample: a failure is recorded, and its answer is None."""

    errors: list[tuple[str, str]] = field(default_factory=list)

    def ask(self, call: Callable[..., T], *args: Any) -> T | None:
        try:
            return call(*args)
        except nvml_seam.NvmlError as error:
            self.errors.append((call.__name__, str(error)))
            return None


def _pod_use(row: _Row, pod: Mapping[str, Any], listed: bool, sm_known: bool) -> PodUse:
    metadata = pod.get("metadata") or {}
    return PodUse(
        uid=row.uid,
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        index=row.index,
        uuid=row.uuid,
        memory_used=row.memory_used if listed else None,
        sm=min(row.sm or 0.0, 1.0) if sm_known else None,
        memory_granted=row.memory_granted,
        share_granted=row.share_granted,
        processes=row.processes if listed else None,
        milli_granted=row.milli_granted,
    )


def _pods_by_uid(
    pods: Iterable[Mapping[str, Any]],
) -> tuple[dict[str, Mapping[str, Any]], dict[str, str]]:
    """Pods by UID, and static pods' UIDs (their cgroups') → their mirror pods' UIDs."""
    by_uid: dict[str, Mapping[str, Any]] = {}
    mirrors: dict[str, str] = {}
    for pod in pods:
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid") or "")
        if not uid:
            continue
        by_uid[uid] = pod
        mirror = (metadata.get("annotations") or {}).get(MIRROR)
        if mirror:
            mirrors[str(mirror)] = uid
    return by_uid, mirrors


def _sm_by_pid(samples: Sequence[nvml_seam.ProcessSample]) -> dict[int, float]:
    """Per PID, the mean SM share (0-1) of its samples; samples out of 0-100 (drivers
    have been seen to return garbage there) are left out."""
    sums: dict[int, tuple[int, int]] = {}
    for sample in samples:
        if 0 <= sample.sm_percent <= 100:
            total, count = sums.get(sample.pid, (0, 0))
            sums[sample.pid] = (total + sample.sm_percent, count + 1)
    return {pid: total / count / 100 for pid, (total, count) in sums.items()}


def _granted(
    rows: dict[tuple[str, str], _Row],
    by_uid: Mapping[str, Mapping[str, Any]],
    node: str,
    gpus: Sequence[GpuUse],
) -> None:
    """Adds each granted pod's grant on each of its GPUs to `rows`. O(pods × GPUs)."""
    on_node = [handover.NodeGpu(gpu.index, gpu.uuid) for gpu in gpus]
    by_uuid = {gpu.uuid: gpu for gpu in gpus}
    for uid, pod in by_uid.items():
        if not _live(pod, node) or dra_claims.named(pod):
            continue  # a pod on the DRA path holds what its claim does (a plan's annotations aside)
        try:
            grant = assignments.grant_of(pod)
        except assignments.AssignmentError:
            continue
        if grant is None or grant.node != node:
            continue
        uuids = allocating.granted_uuids(pod, grant.gpus, on_node)
        for uuid in uuids or ():
            gpu = by_uuid[uuid]
            row = rows.setdefault((uid, uuid), _Row(uid, gpu.index, uuid))
            whole = grant.milli == WHOLE
            row.memory_granted = gpu.memory_total if whole else grant.memory_mib * MIB
            row.share_granted = grant.milli / WHOLE
            row.milli_granted = grant.milli


def _claimed(
    rows: dict[tuple[str, str], _Row],
    by_uid: Mapping[str, Mapping[str, Any]],
    node: str,
    gpus: Sequence[GpuUse],
    *,
    claims: Sequence[preparing.Prepared],
    contexts: Mapping[str, ClientContext],
) -> None:
    """Adds each pod's grants through the claims it uses that were prepared here to
    `rows` (a claim two pods share: to each). O(pods × claims per pod + prepared)."""
    if not claims:
        return
    by_name = {(item.claim.namespace, item.claim.name): item for item in claims}
    by_uuid = {gpu.uuid: gpu for gpu in gpus}
    for uid, pod in by_uid.items():
        if not _live(pod, node):
            continue
        namespace = str((pod.get("metadata") or {}).get("namespace") or "")
        for name in dra_claims.claim_names(pod):
            item = by_name.get((namespace, name))
            for device in item.devices if item is not None else ():
                gpu = by_uuid.get(device.uuid)
                if gpu is None:
                    continue
                row = rows.setdefault((uid, device.uuid), _Row(uid, gpu.index, device.uuid))
                whole = device.milli >= WHOLE
                context = contexts.get(device.uuid, mps_limits.UNMEASURED.context)
                asked = max(device.memory_mib - context.mib(device.milli), 0)
                row.memory_granted = gpu.memory_total if whole else asked * MIB
                row.share_granted = min(device.milli, WHOLE) / WHOLE
                row.milli_granted = min(device.milli, WHOLE)


def _live(pod: Mapping[str, Any], node: str) -> bool:
    """Bound to `node` and not finished: its series are exported."""
    spec = pod.get("spec") or {}
    return spec.get("nodeName") == node and (pod.get("status") or {}).get("phase") not in FINISHED


# --- the loop --------------------------------------------------------------------------


class SamplerMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.errors = Counter(
            "gpuplace_agent_usage_errors_total",
            "NVML calls of the usage sampler that failed, by call and NVML's message "
            "(what they would have said is absent from that sample).",
            ["call", "error"],
            registry=registry,
        )
        self.duration = Histogram(
            "gpuplace_agent_usage_sample_duration_seconds",
            "Time to take one usage sample (NVML, /proc, the node's pods).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
            registry=registry,
        )
        self.stale = Counter(
            "gpuplace_agent_usage_stale_scrapes_total",
            "Scrapes that exported no pod or GPU series because the last usage sample was "
            "older than its bound (an NVML call that does not return holds the sampler).",
            registry=registry,
        )
        self.age = Gauge(
            "gpuplace_agent_usage_sample_age_seconds",
            "Seconds since the last usage sample began (none yet: 0).",
            registry=registry,
        )
        self.processes = Gauge(
            "gpuplace_agent_usage_processes",
            "GPU processes in the last sample, by attribution: pod (a pod of this node) "
            "or none (no pod known here: counted in GPU totals only).",
            ["attribution"],
            registry=registry,
        )


STALE_SAMPLES = 3
"""A sample older than this many periods is not exported."""


class Sampler:
    """`Meter.measure` every `seconds` over the pods `pods()` returns (called on the event
    loop: a snapshot), keeping the last sample for the collector while it is at most
    `stale_after` seconds old (default `STALE_SAMPLES` periods). Never raises out of
    `run`: a sample that fails is logged and counted, and the next one is tried."""

    def __init__(
        self,
        meter: Meter,
        pods: Callable[[], list[dict[str, Any]]],
        *,
        seconds: float = USAGE_SECONDS,
        stale_after: float | None = None,
        peak_seconds: float = PEAK_SECONDS,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.meter = meter
        self.pods = pods
        self.seconds = seconds
        self.stale_after = STALE_SAMPLES * seconds if stale_after is None else stale_after
        self.peak_seconds = peak_seconds
        self.last: Sample | None = None
        self.last_at: float | None = None
        """`time.monotonic()` when the last sample began."""
        self.recent: deque[tuple[float, Sample]] = deque()
        """(began, sample) of the samples of the last `peak_seconds`, oldest first."""
        self._said_stale = False
        self.listeners: list[Callable[[Sample], Awaitable[None]]] = []
        """Heard with each sample as it completes (over-grant detection: within one
        sampling interval); one that raises is logged and counted, never the sample's end."""
        self.metrics = SamplerMetrics(registry)
        self.metrics.age.set_function(self.age)

    def age(self) -> float:
        """Seconds since the last sample began; 0 before the first."""
        return 0.0 if self.last_at is None else time.monotonic() - self.last_at

    def fresh(self) -> Sample | None:
        """The last sample, or None when there is none or it is stale (counted; logged
        once each time the sampler falls behind)."""
        if self.last is None:
            return None
        age = self.age()
        if age <= self.stale_after:
            self._said_stale = False
            return self.last
        self.metrics.stale.inc()
        if not self._said_stale:
            self._said_stale = True
            log.warning(
                "usage sample stale, exporting none",
                extra={"age_seconds": round(age, 1), "bound_seconds": self.stale_after},
            )
        return None

    async def sample_once(self) -> Sample:
        snapshot = self.pods()
        began = time.monotonic()
        started = time.perf_counter()
        sample = await asyncio.to_thread(self.meter.measure, snapshot)
        self.metrics.duration.observe(time.perf_counter() - started)
        for call, error in sample.errors:
            self.metrics.errors.labels(call, error).inc()
        self.metrics.processes.labels("pod").set(sample.attributed)
        self.metrics.processes.labels("none").set(sample.unattributed)
        self.last, self.last_at = sample, began
        self.recent.append((began, sample))
        while self.recent[0][0] < began - self.peak_seconds:
            self.recent.popleft()
        for listener in self.listeners:
            try:
                await listener(sample)
            except Exception:  # a listener's bug must not stop sampling
                log.exception("usage sample listener failed")
                self.metrics.errors.labels("listener", "exception").inc()
        return sample

    def peaks(self) -> dict[tuple[str, str], int]:
        """(pod UID, GPU UUID) → the most memory the pod used there in the samples of the
        last `peak_seconds` that knew it. O(peak_seconds / seconds × rows)."""
        since = time.monotonic() - self.peak_seconds
        found: dict[tuple[str, str], int] = {}
        for began, sample in tuple(self.recent):
            if began < since:
                continue
            for use in sample.pods:
                if use.memory_used is not None:
                    key = (use.uid, use.uuid)
                    found[key] = max(found.get(key, 0), use.memory_used)
        return found

    async def run(self) -> None:
        while True:
            try:
                await self.sample_once()
            except Exception:  # a bug here must not end the agent (it serves Allocate)
                log.exception("usage sample failed")
                self.metrics.errors.labels("sample", "exception").inc()
            await asyncio.sleep(self.seconds)


# --- the exporter ----------------------------------------------------------------------


class UsageCollector(Collector):
    """The usage families, built at each scrape from `sampler.fresh()` (empty when the
    last sample is stale), keeping the rows of pods that `live(uid)` says are still on the
    node and not finished."""

    def __init__(
        self,
        node: str,
        sampler: Sampler,
        live: Callable[[str], bool],
        packable: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self.node = node
        self.sampler = sampler
        self.live = live
        self.packable = packable
        """GPU UUID → the bytes the engine packs there, as the agent last published them."""

    def describe(self) -> Iterable[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        sample = self.sampler.fresh()
        return list(self._families(sample, self.sampler.peaks() if sample else {}))

    def _families(
        self, sample: Sample | None, peaks: Mapping[tuple[str, str], int] | None = None
    ) -> Iterator[Metric]:
        peaks = peaks or {}
        pod_families = {
            names.POD_MEMORY_USED: "Device memory the pod's processes hold on the GPU "
            "(NVML; under MPS its MPS clients), bytes.",
            names.POD_MEMORY_PEAK: "The most device memory the pod's processes held on the "
            f"GPU in the samples of the last {self.sampler.peak_seconds:g} s, bytes.",
            names.POD_SM_UTILIZATION: "Share of the GPU's SMs the pod's processes kept "
            "busy since the previous sample (NVML per-process samples), 0-1; absent where "
            "the driver gives none.",
            names.POD_MEMORY_GRANTED: "Device memory gpuplace granted the pod on the GPU, "
            "bytes (a whole GPU: all of it).",
            names.POD_SHARE_GRANTED: "Compute share gpuplace granted the pod on the GPU "
            "(gpu-percent / 100; 1 whole; 0 memory-only).",
            names.POD_PROCESSES: "The pod's processes holding the GPU (NVML; under MPS its "
            "MPS clients, each with the share's limits of its own).",
        }
        families = {
            metric: GaugeMetricFamily(metric, text, labels=names.POD_LABELS)
            for metric, text in pod_families.items()
        }
        gpu_families = {
            names.GPU_MEMORY_USED: GaugeMetricFamily(
                names.GPU_MEMORY_USED,
                "Device memory used on the GPU (NVML), bytes.",
                labels=names.GPU_LABELS,
            ),
            names.GPU_MEMORY_TOTAL: GaugeMetricFamily(
                names.GPU_MEMORY_TOTAL,
                "Device memory of the GPU (NVML), bytes.",
                labels=names.GPU_LABELS,
            ),
            names.GPU_UTILIZATION: GaugeMetricFamily(
                names.GPU_UTILIZATION,
                "Share of the last sample period during which a kernel ran on the GPU (NVML), 0-1.",
                labels=names.GPU_LABELS,
            ),
            names.GPU_MEMORY_PACKABLE: GaugeMetricFamily(
                names.GPU_MEMORY_PACKABLE,
                "Device memory a client can get with MPS running: NVML's total less the "
                "driver's reservation and the MPS server's memory, the figure gpuplace packs, "
                "bytes.",
                labels=names.GPU_LABELS,
            ),
        }
        if sample is not None:
            packable = self.packable()
            for gpu in sample.gpus:
                labels = [self.node, str(gpu.index), gpu.uuid]
                for metric, value in (
                    (names.GPU_MEMORY_USED, gpu.memory_used),
                    (names.GPU_MEMORY_TOTAL, gpu.memory_total),
                    (names.GPU_UTILIZATION, gpu.utilization),
                    (names.GPU_MEMORY_PACKABLE, packable.get(gpu.uuid)),
                ):
                    if value is not None:
                        gpu_families[metric].add_metric(labels, float(value))
            for pod in sample.pods:
                if not self.live(pod.uid):
                    continue
                labels = [self.node, str(pod.index), pod.uuid, pod.namespace, pod.name]
                for metric, value in (
                    (names.POD_MEMORY_USED, pod.memory_used),
                    (names.POD_MEMORY_PEAK, peaks.get((pod.uid, pod.uuid))),
                    (names.POD_SM_UTILIZATION, pod.sm),
                    (names.POD_MEMORY_GRANTED, pod.memory_granted),
                    (names.POD_SHARE_GRANTED, pod.share_granted),
                    (names.POD_PROCESSES, pod.processes),
                ):
                    if value is not None:
                        families[metric].add_metric(labels, float(value))
        yield from families.values()
        yield from gpu_families.values()


def live_in(
    pods: Callable[[], Mapping[str, Mapping[str, Any]]], node: str
) -> Callable[[str], bool]:
    """`UsageCollector`'s `live` over the pods by UID that `pods()` returns now (e.g. a
    `PodView`'s, which a relist replaces whole): one lookup per row."""

    def live(uid: str) -> bool:
        pod = pods().get(uid)
        return pod is not None and _live(pod, node)

    return live
