"""The webhook's own audit log: one JSON line per review.

A line holds who asked what and what was decided — time, endpoint, uid, operation,
namespace, pod name (or generateName), user, dryRun, the pod's `gpuplace.io/` annotations
(keys and values cut to `MAX_VALUE_CHARS`), the GpuQueue it waits in (also when its
namespace's label chose it), decision, reason, message, the patch's paths
(never its values), warnings and latency. Never env values, tokens, or pod bodies.

Lines are written by a thread, never by the event loop: a slow disk or a full stdout pipe
must not stall admission (a synchronous write+flush per review halved the throughput of
the benchmark on a busy disk). `AuditLog.write` only formats and enqueues; the thread
writes whatever has accumulated and flushes. When the queue is full (the sink stalled
for `MAX_QUEUED` lines) lines are dropped and counted rather than blocking a review.
Sinks: a stream (stdout) or a file rotated by size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TextIO

log = logging.getLogger(__name__)

MAX_VALUE_CHARS = 100
MAX_MESSAGE_CHARS = 1000
MAX_QUEUED = 100_000
BATCH_SECONDS = 0.05
"""The writer thread wakes at most this often: one write per batch, not one per review."""


class Sink(Protocol):
    def write(self, text: str) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class StreamSink:
    """Writes to a stream it does not own (stdout); `close` only flushes."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def close(self) -> None:
        self.flush()


class RotatingFileSink:
    """Appends to `path`; past `max_bytes` (0 = never) it becomes `path.1`, `path.1` becomes
    `path.2` … up to `backups` files (0 = truncate instead). The size is tracked, not
    stat()ed per line."""

    def __init__(self, path: Path, max_bytes: int = 0, backups: int = 0) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._file = path.open("a", encoding="utf-8")
        self._size = self._file.tell()

    def write(self, text: str) -> None:
        size = len(text.encode("utf-8"))
        if self.max_bytes and self._size and self._size + size > self.max_bytes:
            self._rotate()
        self._file.write(text)
        self._size += size

    def _rotate(self) -> None:
        self._file.close()
        if self.backups:
            for index in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{index}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
            self._file = self.path.open("a", encoding="utf-8")
        else:
            self._file = self.path.open("w", encoding="utf-8")
        self._size = 0

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _cut(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[:limit] + "…"


_STOP = object()


class AuditLog:
    """Formats audit lines and hands them to a writer thread that owns `sink`."""

    def __init__(self, sink: Sink, *, batch_seconds: float = BATCH_SECONDS) -> None:
        self._sink = sink
        self._batch_seconds = batch_seconds
        self._queue: queue.Queue[object] = queue.Queue(MAX_QUEUED)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="gpuplace-audit", daemon=True)
        self._thread.start()

    def write(
        self,
        *,
        endpoint: str,
        decision: str,
        reason: str,
        latency_seconds: float,
        uid: str = "",
        operation: str = "",
        kind: str = "",
        namespace: str = "",
        name: str = "",
        generate_name: str = "",
        user: str = "",
        dry_run: bool = False,
        annotations: Mapping[str, str] | None = None,
        message: str = "",
        patch: Sequence[str] = (),
        warnings: Sequence[str] = (),
        gpu_queue: str = "",
    ) -> None:
        line: dict[str, Any] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "endpoint": endpoint,
            "uid": uid,
            "operation": operation,
            "namespace": namespace,
            "name": name,
        }
        if generate_name and not name:
            line["generateName"] = generate_name
        if kind and kind != "Pod":
            line["kind"] = kind
        line["user"] = user
        line["dryRun"] = dry_run
        line["annotations"] = {
            _cut(key, MAX_VALUE_CHARS): _cut(value, MAX_VALUE_CHARS)
            for key, value in (annotations or {}).items()
        }
        if gpu_queue:
            line["queue"] = _cut(gpu_queue, MAX_VALUE_CHARS)
        line["decision"] = decision
        line["reason"] = reason
        if message:
            line["message"] = _cut(message, MAX_MESSAGE_CHARS)
        if patch:
            line["patch"] = list(patch)
        if warnings:
            line["warnings"] = list(warnings)
        line["latencyMs"] = round(latency_seconds * 1000, 3)
        try:
            self._queue.put_nowait(json.dumps(line, ensure_ascii=False))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < 1000:
                    batch.append(self._queue.get_nowait())
            lines = [item for item in batch if isinstance(item, str)]
            try:
                if lines:
                    self._sink.write("\n".join(lines) + "\n")
                    self._sink.flush()
            except (OSError, ValueError) as error:
                self.dropped += len(lines)
                log.warning("audit lines lost", extra={"lines": len(lines), "error": str(error)})
            for _ in batch:
                self._queue.task_done()
            if any(item is _STOP for item in batch):
                return
            time.sleep(self._batch_seconds)

    def flush(self) -> None:
        """Wait until every line written so far reached the sink."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, stop the thread, close the sink."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._sink.close()
