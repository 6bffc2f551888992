"""Asked vs used: what each pod was granted next to what it really used over a window,
per pod per GPU, per GPU and per node, and the pods that over-ask with a request to
write instead. Pure: no I/O, no clock.

Asked comes from the pods' assignment annotations (`gpuplace.cluster.assignments`: node, GPUs,
milli-GPU and MiB per GPU); for a pod the API did not list, from the node agent's
granted series. Used comes from a reader (`gpuplace.usage.readings`).

The over-ask rule (`Rule`, every number a flag of `gpuplace usage`), judged per pod:

- judged only when every GPU of the pod was measured with at least `min_samples`
  samples in the window, and the figures are the pod's own: a GPU reading that several
  pods share (dcgm-exporter's, on a shared GPU) is shown but never judged;
- memory: the pod asked for memory and its peak over the window, on every GPU, stayed
  below `threshold` (0.5) of it. Suggested: peak × `headroom` (1.2) rounded up to the
  next GiB, at least 1 GiB; never below the peak;
- compute: the pod holds a share or whole GPU (one GPU) and its p95 SM utilisation stayed
  below `threshold` of its share. Suggested gpu-percent: p95 × `headroom` rounded up to
  the next 5, at least 5; never below the p95;
- a suggestion not below what the pod asked is no suggestion: the pod is not named.

Only a pod that held its GPUs during the window counts (as a row, in the per-GPU sums
and as a holder that makes a GPU shared): bound to its node, not started after the
window, not ended (finished or deleted) before it (`Asked.outside`). A Job's finished
pod, kept by the API, or a reserved pod not yet bound must not make a dcgm GPU look
shared, so that the pod really running there goes unjudged. A pod that ended inside the
window counts, its rows marked `ended`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from gpuplace.cluster import assignments, keys
from gpuplace.cluster.pods import TERMINAL_PHASES
from gpuplace.placement.ledger import GrantState
from gpuplace.usage.readings import GpuUse, PodGpuUse, Usage

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Rule:
    """When a pod over-asks, and what to suggest."""

    threshold: float = 0.5
    """Named when used (memory peak, compute p95) stays below this share of the grant."""
    headroom: float = 1.2
    """Suggestion = used × headroom, rounded up (at least 1: never below what was used)."""
    min_samples: int = 20
    """Fewer samples than this in the window: not judged."""
    percent_step: int = 5
    """gpu-percent suggestions are multiples of this."""

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], not {self.threshold}")
        if not math.isfinite(self.headroom) or self.headroom < 1:
            raise ValueError(f"headroom must be at least 1, not {self.headroom}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples must be at least 1, not {self.min_samples}")
        if not 1 <= self.percent_step <= 100:
            raise ValueError(f"percent_step must be from 1 to 100, not {self.percent_step}")


@dataclass(frozen=True, slots=True)
class Asked:
    """What one pod was granted, per GPU."""

    namespace: str
    pod: str
    node: str
    gpus: tuple[int, ...]
    milli: int
    """milli-GPU per GPU (1000 whole, 0 memory only)."""
    memory_mib: int
    """MiB per GPU; 0 = none asked."""
    source: str = "annotations"
    """"annotations" or "series" (the node agent's granted series)."""
    bound: bool = True
    """Bound to the assigned node (spec.nodeName): only then did it hold the GPUs."""
    started: float | None = None
    """POSIX time the kubelet started it (status.startTime); None: not known."""
    ended: float | None = None
    """POSIX time it stopped holding its GPUs (finished: its containers' last
    `finishedAt`; being deleted: its deletionTimestamp); None: still running."""

    def outside(self, start: float, end: float) -> str:
        """Why it held no GPU during the window [start, end] ("" when it did): unbound,
        started after the window or ended before it. Only pods that held their GPUs in
        the window count as holders (a finished Job's pod must not make a GPU look
        shared, nor add to what the GPU was asked)."""
        if not self.bound:
            return "not bound to its node"
        if self.started is not None and self.started > end:
            return "started after the window"
        if self.ended is not None and self.ended < start:
            return "ended before the window"
        return ""


def asked_of(pod: Mapping[str, Any]) -> Asked | None:
    """The grant a pod's assignment annotations record (None: none, or unreadable), with
    when the pod held it (bound, started, ended)."""
    try:
        grant = assignments.grant_of(pod)
    except assignments.AssignmentError:
        return None
    if grant is None:
        return None
    metadata = pod.get("metadata") or {}
    started, ended = lifetime(pod)
    return Asked(
        namespace=str(metadata.get("namespace") or "default"),
        pod=str(metadata.get("name") or ""),
        node=grant.node,
        gpus=grant.gpus,
        milli=grant.milli,
        memory_mib=grant.memory_mib,
        bound=grant.state is GrantState.CONFIRMED,
        started=started,
        ended=ended,
    )


def _moment(value: object) -> float | None:
    """An RFC 3339 time of the API as POSIX seconds (None: absent or unreadable)."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def lifetime(pod: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(started, ended) of a pod, POSIX seconds: status.startTime; for a Succeeded or
    Failed pod the last `finishedAt` of its containers (else the last condition change,
    else its start, else long ago), for a pod being deleted its deletionTimestamp (its
    containers are stopped by then); ended None: still running. O(containers)."""
    status = pod.get("status") or {}
    started = _moment(status.get("startTime"))
    if status.get("phase") in TERMINAL_PHASES:
        finished = [
            _moment(((item.get("state") or {}).get("terminated") or {}).get("finishedAt"))
            for item in status.get("containerStatuses") or []
        ]
        conditions = status.get("conditions") or []
        changed = [_moment(item.get("lastTransitionTime")) for item in conditions]
        for moments in (finished, changed):
            known = [moment for moment in moments if moment is not None]
            if known:
                return started, max(known)
        return started, started if started is not None else 0.0
    return started, _moment((pod.get("metadata") or {}).get("deletionTimestamp"))


@dataclass(frozen=True, slots=True)
class PodRow:
    namespace: str
    pod: str
    node: str
    gpu: int
    asked_percent: int | None
    """gpu-percent granted on this GPU (100 whole, 0 memory only); None: unknown."""
    asked_memory_bytes: int | None
    """Memory granted on this GPU; None: none asked (or unknown)."""
    memory_peak_bytes: int | None
    memory_p95_bytes: int | None
    util_peak: float | None
    util_p95: float | None
    samples: int
    shared: bool
    """The figures are the whole GPU's and other pods hold it too: not the pod's own."""
    gpu_reading: bool
    """The figures are the whole GPU's (dcgm-exporter), whether shared or not."""
    ended: bool = False
    """The pod stopped holding the GPU inside the window (finished or deleted)."""

    @property
    def measured(self) -> bool:
        return self.memory_peak_bytes is not None


@dataclass(frozen=True, slots=True)
class GpuRow:
    node: str
    gpu: int
    pods: int
    asked_percent: int
    asked_memory_bytes: int
    memory_total_bytes: int | None
    memory_peak_bytes: int | None
    memory_p95_bytes: int | None
    util_peak: float | None
    util_p95: float | None


@dataclass(frozen=True, slots=True)
class NodeRow:
    node: str
    gpus: int
    pods: int
    asked_percent: int
    asked_memory_bytes: int
    memory_total_bytes: int | None
    """Sum over the GPUs whose total is known; None: none is."""
    memory_peak_bytes: int
    """Sum of the GPUs' own peaks (not the peak of the sum)."""


@dataclass(frozen=True, slots=True)
class OverAsk:
    namespace: str
    pod: str
    what: str
    """"memory" or "compute"."""
    asked: int
    """Bytes (memory) or gpu-percent (compute), per GPU."""
    used: int | float
    """Memory peak in bytes, or compute p95 in percent of the GPU."""
    suggested: int
    """Bytes (a whole number of GiB) or gpu-percent."""
    annotation: str
    value: str

    @property
    def line(self) -> str:
        return f'{self.annotation}: "{self.value}"'


@dataclass(slots=True)
class Report:
    source: str
    window_seconds: float
    at: float
    rule: Rule
    pods: list[PodRow] = field(default_factory=list)
    gpus: list[GpuRow] = field(default_factory=list)
    nodes: list[NodeRow] = field(default_factory=list)
    over: list[OverAsk] = field(default_factory=list)
    unjudged: list[str] = field(default_factory=list)
    """"namespace/pod: why" for pods with a grant that were not judged."""
    outside: list[str] = field(default_factory=list)
    """"namespace/pod: why" for pods with a grant that held no GPU during the window
    (unbound, finished before it...): neither shown nor counted as holders."""

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for row, item in zip(self.over, data["over"], strict=True):
            item["line"] = row.line
        return data

    def as_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def of_pod(self, namespace: str, pod: str) -> tuple[list[PodRow], list[OverAsk]]:
        rows = [row for row in self.pods if (row.namespace, row.pod) == (namespace, pod)]
        over = [item for item in self.over if (item.namespace, item.pod) == (namespace, pod)]
        return rows, over


def _asked_from_series(rows: Sequence[PodGpuUse]) -> Asked | None:
    """A grant read from the node agent's granted series (same node, the pod's GPUs).

    The agent exports a whole GPU's granted memory as the GPU's total: a whole GPU asked
    no memory of its own (as its annotations say), so none is read from the series."""
    first = rows[0]
    if first.granted_share is None and first.granted_memory_bytes is None:
        return None
    milli = min(round((first.granted_share or 0.0) * 1000), 1000)
    return Asked(
        namespace=first.namespace,
        pod=first.pod,
        node=first.node,
        gpus=tuple(sorted(row.gpu for row in rows)),
        milli=milli,
        memory_mib=0 if milli == 1000 else (first.granted_memory_bytes or 0) // MIB,
        source="series",
    )


def suggest_memory(peak_bytes: int, rule: Rule) -> int:
    """peak × headroom rounded up to a whole GiB (at least 1 GiB), never below the peak."""
    gib = max(1, math.ceil(peak_bytes * rule.headroom / GIB))
    while gib * GIB < peak_bytes:  # float rounding must never undercut the peak
        gib += 1
    return gib * GIB


def suggest_percent(p95_ratio: float, rule: Rule) -> int:
    """p95 × headroom in percent, rounded up to the next `percent_step`, at least one step,
    never below the p95 (values over 100 % are clamped to 100)."""
    step = rule.percent_step
    percent = max(step, math.ceil(p95_ratio * 100 * rule.headroom / step - 1e-9) * step)
    while percent < p95_ratio * 100:
        percent += step
    return min(percent, 100)


def build(
    usage: Usage, asked: Iterable[Asked], rule: Rule | None = None, *, namespace: str | None = None
) -> Report:
    """Join grants with use. O(P·G + S log S) for P pods of up to G GPUs each and S rows.

    With `namespace`, only its pods are reported, and only the GPUs they hold (whose asked
    totals then cover that namespace's pods; their use is still the whole GPU's); pods of
    other namespaces still count as holders of a shared GPU."""
    rule = rule or Rule()
    report = Report(
        source=usage.source, window_seconds=usage.window_seconds, at=usage.at, rule=rule
    )
    grants: dict[tuple[str, str], Asked] = {}
    start = usage.at - usage.window_seconds
    for item in asked:
        why = item.outside(start, usage.at)
        if not why:
            grants[(item.namespace, item.pod)] = item
        elif namespace is None or item.namespace == namespace:
            report.outside.append(f"{item.namespace}/{item.pod}: {why}")
    uses: dict[tuple[str, str, str, int], PodGpuUse] = {}
    by_pod: dict[tuple[str, str], list[PodGpuUse]] = {}
    for read in usage.pods:
        uses[(read.namespace, read.pod, read.node, read.gpu)] = read
        by_pod.setdefault((read.namespace, read.pod), []).append(read)
    for key, pod_uses in by_pod.items():
        if key not in grants:
            from_series = _asked_from_series(pod_uses)
            if from_series is not None:
                grants[key] = from_series
    gpus = {(gpu.node, gpu.gpu): gpu for gpu in usage.gpus}
    holders: dict[tuple[str, int], set[tuple[str, str]]] = {}
    for item in grants.values():
        for index in item.gpus:
            holders.setdefault((item.node, index), set()).add((item.namespace, item.pod))
    for labelled in usage.pods:
        if labelled.gpu_reading:
            holders.setdefault((labelled.node, labelled.gpu), set()).add(
                (labelled.namespace, labelled.pod)
            )

    for key in sorted(grants):
        item = grants[key]
        if namespace is not None and item.namespace != namespace:
            continue
        rows: list[PodRow] = []
        for index in item.gpus:
            use: PodGpuUse | None = uses.get((item.namespace, item.pod, item.node, index))
            gpu = gpus.get((item.node, index))
            reading = use.gpu_reading if use is not None else usage.source == "dcgm"
            if use is None and reading and gpu is not None:
                use = _from_gpu(item, gpu)
            shared = reading and len(holders.get((item.node, index), ())) > 1
            rows.append(
                PodRow(
                    namespace=item.namespace,
                    pod=item.pod,
                    node=item.node,
                    gpu=index,
                    asked_percent=item.milli // 10,
                    asked_memory_bytes=item.memory_mib * MIB if item.memory_mib else None,
                    memory_peak_bytes=use.memory_peak_bytes if use is not None else None,
                    memory_p95_bytes=use.memory_p95_bytes if use is not None else None,
                    util_peak=use.util_peak if use is not None else None,
                    util_p95=use.util_p95 if use is not None else None,
                    samples=use.samples if use is not None else 0,
                    shared=shared,
                    gpu_reading=reading,
                    ended=item.ended is not None and item.ended <= usage.at,
                )
            )
        report.pods.extend(rows)
        _judge(report, item, rows, rule)
    if namespace is not None:
        held = {(row.node, row.gpu) for row in report.pods}
        gpus = {key: gpu for key, gpu in gpus.items() if key in held}
    _totals(report, gpus)
    return report


def _from_gpu(item: Asked, gpu: GpuUse) -> PodGpuUse:
    """A pod's figures on one GPU from the GPU's own series (dcgm-exporter did not label
    the GPU with the pod, e.g. its resource name list lacks gpuplace.io/gpu)."""
    return PodGpuUse(
        namespace=item.namespace,
        pod=item.pod,
        node=gpu.node,
        gpu=gpu.gpu,
        memory_peak_bytes=gpu.memory_peak_bytes,
        memory_p95_bytes=gpu.memory_p95_bytes,
        util_peak=gpu.util_peak,
        util_p95=gpu.util_p95,
        samples=gpu.samples,
        gpu_reading=True,
    )


def _judge(report: Report, item: Asked, rows: Sequence[PodRow], rule: Rule) -> None:
    name = f"{item.namespace}/{item.pod}"
    if not rows or any(not row.measured for row in rows):
        report.unjudged.append(f"{name}: not measured on every GPU it holds")
        return
    if any(row.shared for row in rows):
        report.unjudged.append(
            f"{name}: its GPU is shared and the source reports the whole GPU's use"
        )
        return
    samples = min(row.samples for row in rows)
    if samples < rule.min_samples:
        report.unjudged.append(
            f"{name}: {samples} samples in the window, fewer than {rule.min_samples}"
        )
        return
    if item.memory_mib > 0:
        asked = item.memory_mib * MIB
        peak = max(row.memory_peak_bytes or 0 for row in rows)
        if peak < rule.threshold * asked:
            suggested = suggest_memory(peak, rule)
            if suggested < asked:
                report.over.append(
                    OverAsk(
                        namespace=item.namespace,
                        pod=item.pod,
                        what="memory",
                        asked=asked,
                        used=peak,
                        suggested=suggested,
                        annotation=keys.GPU_MEMORY,
                        value=f"{suggested // GIB}Gi",
                    )
                )
    p95 = rows[0].util_p95
    # threshold × milli / 1000, in that order, as the rule is written (and tested):
    # threshold × (milli / 1000) rounds differently and named a pod at the threshold
    if (
        len(rows) == 1
        and item.milli > 0
        and p95 is not None
        and p95 < rule.threshold * item.milli / 1000
    ):
        percent = suggest_percent(p95, rule)
        if percent < item.milli // 10:
            report.over.append(
                OverAsk(
                    namespace=item.namespace,
                    pod=item.pod,
                    what="compute",
                    asked=item.milli // 10,
                    used=round(p95 * 100, 2),
                    suggested=percent,
                    annotation=keys.GPU_PERCENT,
                    value=str(percent),
                )
            )


def _totals(report: Report, gpus: Mapping[tuple[str, int], GpuUse]) -> None:
    per_gpu: dict[tuple[str, int], list[PodRow]] = {key: [] for key in gpus}
    for row in report.pods:
        per_gpu.setdefault((row.node, row.gpu), []).append(row)
    for key in sorted(per_gpu):
        on_gpu = per_gpu[key]
        gpu = gpus.get(key)
        report.gpus.append(
            GpuRow(
                node=key[0],
                gpu=key[1],
                pods=len(on_gpu),
                asked_percent=sum(row.asked_percent or 0 for row in on_gpu),
                asked_memory_bytes=sum(row.asked_memory_bytes or 0 for row in on_gpu),
                memory_total_bytes=gpu.memory_total_bytes if gpu is not None else None,
                memory_peak_bytes=gpu.memory_peak_bytes if gpu is not None else None,
                memory_p95_bytes=gpu.memory_p95_bytes if gpu is not None else None,
                util_peak=gpu.util_peak if gpu is not None else None,
                util_p95=gpu.util_p95 if gpu is not None else None,
            )
        )
    per_node: dict[str, list[GpuRow]] = {}
    for gpu_row in report.gpus:
        per_node.setdefault(gpu_row.node, []).append(gpu_row)
    for node in sorted(per_node):
        of_node = per_node[node]
        report.nodes.append(
            NodeRow(
                node=node,
                gpus=len(of_node),
                pods=len({(pod.namespace, pod.pod) for pod in report.pods if pod.node == node}),
                asked_percent=sum(row.asked_percent for row in of_node),
                asked_memory_bytes=sum(row.asked_memory_bytes for row in of_node),
                memory_total_bytes=(
                    sum(row.memory_total_bytes or 0 for row in of_node)
                    if any(row.memory_total_bytes is not None for row in of_node)
                    else None
                ),
                memory_peak_bytes=sum(row.memory_peak_bytes or 0 for row in of_node),
            )
        )


# -- text ------------------------------------------------------------------------------------


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.1f}Gi"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    return [
        "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in (header, *rows)
    ]


def pod_lines(rows: Sequence[PodRow]) -> list[str]:
    header = (
        "POD",
        "NODE",
        "GPU",
        "ASKED %",
        "ASKED MEM",
        "MEM PEAK",
        "MEM P95",
        "SM PEAK",
        "SM P95",
        "SAMPLES",
        "NOTE",
    )
    return _table(
        header,
        [
            (
                f"{row.namespace}/{row.pod}",
                row.node,
                str(row.gpu),
                "-" if row.asked_percent is None else f"{row.asked_percent}%",
                gib(row.asked_memory_bytes) if row.asked_memory_bytes else "-",
                gib(row.memory_peak_bytes),
                gib(row.memory_p95_bytes),
                pct(row.util_peak),
                pct(row.util_p95),
                str(row.samples),
                _note(row),
            )
            for row in rows
        ],
    )


def _note(row: PodRow) -> str:
    notes = []
    if row.shared:
        notes.append("shared GPU: the GPU's use")
    elif not row.measured:
        notes.append("not measured")
    if row.ended:
        notes.append("ended in the window")
    return "; ".join(notes)


def over_lines(over: Sequence[OverAsk]) -> list[str]:
    lines = []
    for item in over:
        if item.what == "memory":
            text = f"peak {gib(int(item.used))} of {gib(item.asked)} asked"
        else:
            text = f"p95 {item.used:g}% of {item.asked}% asked"
        lines.append(f"  {item.namespace}/{item.pod}  {item.what}: {text}; write {item.line}")
    return lines


def render(report: Report) -> str:
    lines = [
        f"Asked vs used over {report.window_seconds:g} s ({report.source} metrics); "
        f"memory per GPU, SM utilisation in % of the GPU.",
        "",
        *pod_lines(report.pods),
        "",
        "Per GPU:",
        *_table(
            (
                "NODE",
                "GPU",
                "PODS",
                "ASKED %",
                "ASKED MEM",
                "MEM TOTAL",
                "MEM PEAK",
                "MEM P95",
                "UTIL PEAK",
                "UTIL P95",
            ),
            [
                (
                    row.node,
                    str(row.gpu),
                    str(row.pods),
                    f"{row.asked_percent}%",
                    gib(row.asked_memory_bytes),
                    gib(row.memory_total_bytes),
                    gib(row.memory_peak_bytes),
                    gib(row.memory_p95_bytes),
                    pct(row.util_peak),
                    pct(row.util_p95),
                )
                for row in report.gpus
            ],
        ),
        "",
        "Per node (memory peak: the sum of its GPUs' peaks):",
        *_table(
            ("NODE", "GPUS", "PODS", "ASKED %", "ASKED MEM", "MEM TOTAL", "MEM PEAK"),
            [
                (
                    row.node,
                    str(row.gpus),
                    str(row.pods),
                    f"{row.asked_percent}%",
                    gib(row.asked_memory_bytes),
                    gib(row.memory_total_bytes),
                    gib(row.memory_peak_bytes),
                )
                for row in report.nodes
            ],
        ),
        "",
    ]
    rule = report.rule
    if report.over:
        lines.append(
            f"Over-asking (used below {rule.threshold:g} of the grant; suggestion: used × "
            f"{rule.headroom:g}, rounded up):"
        )
        lines.extend(over_lines(report.over))
    else:
        lines.append("Over-asking: none.")
    if report.unjudged:
        lines.append("Not judged:")
        lines.extend(f"  {text}" for text in report.unjudged)
    if report.outside:
        lines.append(
            f"{len(report.outside)} pod(s) with a grant held no GPU during the window "
            "(not bound, or finished before it): not shown (-o json lists them)."
        )
    return "\n".join(lines)


def pod_section(report: Report, namespace: str, pod: str) -> list[str]:
    """`gpuplace explain`'s asked-vs-used section for one pod."""
    rows, over = report.of_pod(namespace, pod)
    head = f"Asked vs used over {report.window_seconds:g} s ({report.source} metrics):"
    if not rows:
        name = f"{namespace}/{pod}: "
        why = next((text for text in report.outside if text.startswith(name)), "")
        if why:
            return [head, f"  held no GPU during the window: {why.removeprefix(name)}."]
        return [head, "  no gpuplace grant recorded on this pod: nothing to compare."]
    lines = [head, *(f"  {line}" for line in pod_lines(rows))]
    name = f"{namespace}/{pod}: "
    lines.extend(
        f"  not judged: {text.removeprefix(name)}"
        for text in report.unjudged
        if text.startswith(name)
    )
    if over:
        lines.append("  over-asking:")
        lines.extend(f"  {line}" for line in over_lines(over))
    elif not any(text.startswith(name) for text in report.unjudged):
        lines.append("  uses what it asked for (not over-asking).")
    return lines
