"""The openb trace format (Alibaba cluster-trace-gpu-v2023), parsed from lines.

Node lists: `sn,cpu_milli,memory_mib,gpu,model`. Pod lists:
`name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...]` (the multigpu lists
stop after gpu_milli). Columns are found by header name, so their order and any
extra columns do not matter.

gpuplace's own optional column `gpu_memory_mib` (openb has none): on a node list the
memory of each GPU, on a pod list the GPU memory asked per GPU. A pod with `num_gpu`
1, `gpu_milli` 0 and `gpu_memory_mib` > 0 is a memory-only share (no compute
reserved). `as_memory_only` turns a list's shares into memory-only shares instead.

The openb pod lists also carry `qos`, `creation_time`, `scheduled_time` and
`deletion_time` (seconds from the trace start): `parse_timed_pods` reads them for the
event-driven replay (`gpuplace.placement.queueing.timeline`); `parse_pods` ignores them.

Pure: the caller reads the file and passes its lines; errors name the file, line
and column (1-based) of the offending field.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from gpuplace.placement.inventory import Gpu, Node
from gpuplace.placement.requests import WHOLE, GpuRequest

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
TRACE_MAX_PODS = 1_000_000
"""Pod slots of a trace node: the simulator's nodes allow 1001; the trace never reaches it."""


class TraceError(ValueError):
    """One malformed field: `str()` is the single error line a user sees."""

    def __init__(self, file: str, line: int, column: int, message: str) -> None:
        super().__init__(f"{file}:{line}:{column}: {message}")
        self.file = file
        self.line = line
        self.column = column


@dataclass(frozen=True, slots=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: str
    gpu_memory_mib: int = 0
    """GPU memory asked per GPU (MiB; 0 = none)."""
    memory_only: bool = False
    """A memory-only share: `gpu_memory_mib` on one GPU, no compute reserved. Its
    `gpu_milli` is only its size in the replay's figures (0 when the list wrote it so)."""

    @property
    def total_milli(self) -> int:
        return self.num_gpu * self.gpu_milli

    def request(self) -> GpuRequest:
        models = frozenset(m for m in self.gpu_spec.split("|") if m) if self.num_gpu else None
        return GpuRequest(
            milli=self.gpu_milli if self.num_gpu and not self.memory_only else 0,
            memory_mib=self.gpu_memory_mib if self.num_gpu else 0,
            count=self.num_gpu,
            models=models or frozenset(),
            cpu_milli=self.cpu_milli,
            host_memory_mib=self.memory_mib,
        )


TIME_COLUMNS = ("qos", "creation_time", "scheduled_time", "deletion_time")


@dataclass(frozen=True, slots=True)
class TimedPod:
    """A pod of an openb list with its life: created, started in production (None: it
    never was), deleted; and its QoS class, which the queue replay reads as its team."""

    pod: TracePod
    qos: str
    created: int
    scheduled: int | None
    deleted: int

    @property
    def runtime(self) -> int | None:
        """Seconds it ran in production (None: it never started). O(1)."""
        return None if self.scheduled is None else max(0, self.deleted - self.scheduled)


class _Rows:
    """csv rows with the header mapped to column numbers, for error positions."""

    def __init__(self, file: str, lines: Iterable[str], required: tuple[str, ...]) -> None:
        self.file = file
        self.reader = csv.reader(lines)
        try:
            header = next(self.reader)
        except StopIteration:
            raise TraceError(file, 1, 1, "empty file, expected a header line") from None
        except csv.Error as error:
            raise TraceError(file, 1, 1, f"not CSV: {error}") from None
        self.columns = {name.strip(): i for i, name in enumerate(header)}
        for name in required:
            if name not in self.columns:
                raise TraceError(
                    file,
                    1,
                    len(header) + 1,
                    f"missing column {name!r} (header: {','.join(header)})",
                )

    def __iter__(self) -> Iterator[tuple[int, list[str]]]:
        try:
            for row in self.reader:
                if row:
                    yield self.reader.line_num, row
        except csv.Error as error:
            raise TraceError(self.file, self.reader.line_num, 1, f"not CSV: {error}") from None

    def text(self, line: int, row: list[str], name: str, default: str | None = None) -> str:
        column = self.columns.get(name)
        if column is None or column >= len(row):
            if default is not None:
                return default
            raise TraceError(
                self.file, line, len(row) + 1, f"missing field {name!r}: row has {len(row)} fields"
            )
        return row[column].strip()

    def integer(self, line: int, row: list[str], name: str, low: int, high: int) -> int:
        raw = self.text(line, row, name)
        column = self.columns[name] + 1
        try:
            value = int(raw)
        except ValueError:
            raise TraceError(
                self.file, line, column, f"{name} must be an integer, got {raw!r}"
            ) from None
        if not low <= value <= high:
            raise TraceError(self.file, line, column, f"{name} must be {low}..{high}, got {value}")
        return value


def parse_nodes(file: str, lines: Iterable[str]) -> list[Node]:
    """Nodes of a node list, GPUs of each node all of its model. O(lines)."""
    rows = _Rows(file, lines, NODE_COLUMNS)
    nodes: list[Node] = []
    seen: set[str] = set()
    for line, row in rows:
        name = rows.text(line, row, "sn")
        if not name or name in seen:
            column = rows.columns["sn"] + 1
            raise TraceError(file, line, column, f"node name {name!r} empty or repeated")
        seen.add(name)
        cpu = rows.integer(line, row, "cpu_milli", 0, 10**9)
        memory = rows.integer(line, row, "memory_mib", 0, 10**12)
        count = rows.integer(line, row, "gpu", 0, 64)
        model = rows.text(line, row, "model", "")
        if count and not model:
            raise TraceError(file, line, rows.columns["model"] + 1, "a GPU node needs a model")
        gpu_memory = _optional_integer(rows, line, row, "gpu_memory_mib")
        gpus = tuple(Gpu(index=i, model=model, memory_mib=gpu_memory) for i in range(count))
        nodes.append(Node(name, cpu, memory, gpus, max_pods=TRACE_MAX_PODS))
    return nodes


def parse_pods(file: str, lines: Iterable[str]) -> list[TracePod]:
    """Pods of a pod list (`gpu_milli` clamped to 1000, as the paper's converter does)."""
    rows = _Rows(file, lines, POD_COLUMNS)
    return [_pod(rows, line, row) for line, row in rows]


def _pod(rows: _Rows, line: int, row: list[str]) -> TracePod:
    file = rows.file
    name = rows.text(line, row, "name")
    cpu = rows.integer(line, row, "cpu_milli", 0, 10**9)
    memory = rows.integer(line, row, "memory_mib", 0, 10**12)
    num_gpu = rows.integer(line, row, "num_gpu", 0, 64)
    gpu_milli = rows.integer(line, row, "gpu_milli", 0, 10**6)
    spec = rows.text(line, row, "gpu_spec", "")
    gpu_memory = _optional_integer(rows, line, row, "gpu_memory_mib") if num_gpu else 0
    memory_only = num_gpu == 1 and gpu_milli == 0 and gpu_memory > 0
    if num_gpu and gpu_milli == 0 and not memory_only:
        column = rows.columns["gpu_milli"] + 1
        raise TraceError(
            file,
            line,
            column,
            "a pod asking for GPUs needs gpu_milli > 0 (or, on one GPU, gpu_memory_mib > 0 "
            "for a memory-only share)",
        )
    gpu_milli = min(gpu_milli, WHOLE) if num_gpu else 0
    if num_gpu > 1 and gpu_milli != WHOLE:
        column = rows.columns["gpu_milli"] + 1
        raise TraceError(file, line, column, "a multi-GPU pod must ask for 1000 per GPU")
    return TracePod(name, cpu, memory, num_gpu, gpu_milli, spec, gpu_memory, memory_only)


def parse_timed_pods(file: str, lines: Iterable[str]) -> list[TimedPod]:
    """Pods of an openb pod list with their QoS and times (`TIME_COLUMNS`; an empty
    `scheduled_time` means the pod never started). O(lines)."""
    rows = _Rows(file, lines, (*POD_COLUMNS, *TIME_COLUMNS))
    found: list[TimedPod] = []
    for line, row in rows:
        pod = _pod(rows, line, row)
        qos = rows.text(line, row, "qos")
        created = rows.integer(line, row, "creation_time", 0, 10**12)
        deleted = rows.integer(line, row, "deletion_time", 0, 10**12)
        scheduled = (
            rows.integer(line, row, "scheduled_time", 0, 10**12)
            if rows.text(line, row, "scheduled_time", "")
            else None
        )
        if deleted < created:
            column = rows.columns["deletion_time"] + 1
            raise TraceError(rows.file, line, column, "deletion_time before creation_time")
        found.append(TimedPod(pod, qos, created, scheduled, deleted))
    return found


def _optional_integer(rows: _Rows, line: int, row: list[str], name: str) -> int:
    """An optional non-negative integer column: 0 when the list has no such column."""
    if name not in rows.columns or not rows.text(line, row, name, ""):
        return 0
    return rows.integer(line, row, name, 0, 10**12)


def with_gpu_memory(nodes: Iterable[Node], mib: int) -> list[Node]:
    """`nodes` with `mib` MiB on every GPU whose memory the list did not give. O(GPUs)."""
    return [
        replace(
            node,
            gpus=tuple(
                gpu if gpu.memory_mib else replace(gpu, memory_mib=mib) for gpu in node.gpus
            ),
        )
        for node in nodes
    ]


def as_memory_only(pods: Iterable[TracePod], gpu_memory_mib: int) -> list[TracePod]:
    """Every share (one GPU, less than a whole one) as a memory-only share of its
    fraction of a `gpu_memory_mib` GPU: `gpu_milli` 250 of 16384 MiB asks 4096 MiB.
    Its `gpu_milli` stays as its size in the replay's figures, so that runs compare
    with the plain list. O(pods)."""
    converted: list[TracePod] = []
    for pod in pods:
        if pod.num_gpu == 1 and 0 < pod.gpu_milli < WHOLE and not pod.memory_only:
            memory = max(-(-pod.gpu_milli * gpu_memory_mib // WHOLE), 1)
            converted.append(replace(pod, gpu_memory_mib=memory, memory_only=True))
        else:
            converted.append(pod)
    return converted


def scaled(nodes: Sequence[Node], gpus: int) -> list[Node]:
    """About `gpus` GPUs of `nodes` keeping their mix: per (model, GPUs per node) kind,
    the first nodes of the list in proportion to that kind's GPUs (a kind too small for
    one node at that scale is left out), in list order; CPU-only nodes are left out.
    Raises ValueError when nothing is left. O(nodes)."""
    if gpus <= 0:
        raise ValueError("a cluster needs at least one GPU")
    kinds: dict[tuple[str, int], list[Node]] = {}
    for node in nodes:
        if node.gpus:
            kinds.setdefault((node.model, len(node.gpus)), []).append(node)
    total = sum(len(node.gpus) for group in kinds.values() for node in group)
    kept: set[str] = set()
    for (_, size), group in kinds.items():
        share = gpus * size * len(group) / total if total else 0
        kept.update(node.name for node in group[: min(len(group), round(share / size))])
    chosen = [node for node in nodes if node.name in kept]
    if not chosen:
        raise ValueError(f"no node kind is large enough for a cluster of {gpus} GPUs")
    return chosen
