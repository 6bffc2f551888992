"""JSON-lines audit logs, the machinery every gpuplace audit log shares: sinks (a stream,
or a file rotated by size) and a writer thread.

Lines are written by a thread, never by the event loop: a slow disk or a full stdout pipe
must not stall the process (a synchronous write+flush per review halved the webhook's
throughput in its benchmark on a busy disk). `LineWriter.write` only serialises and
enqueues; the thread writes whatever has accumulated and flushes. When the queue is full
(the sink stalled for `MAX_QUEUED` lines) lines are dropped and counted rather than
blocking the caller. The conventions of a line (its `time` first, `now()`: UTC with
milliseconds and a `Z`; camelCase keys; values cut with `cut`; never secrets, env values
or object bodies) are the callers': the webhook's review lines and the node agent's
decision lines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TextIO

log = logging.getLogger(__name__)

MAX_QUEUED = 100_000
BATCH_SECONDS = 0.05
"""The writer thread wakes at most this often: one write per batch, not one per line."""


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


def open_sink(path: str, max_bytes: int = 0, backups: int = 0) -> Sink:
    """Where a process's audit lines go: stdout for `-`, else the file `path`, rotated at
    `max_bytes` keeping `backups` older files."""
    if path == "-":
        return StreamSink(sys.stdout)
    return RotatingFileSink(Path(path), max_bytes, backups)


def cut(value: str, limit: int) -> str:
    """`value` cut to `limit` characters, an ellipsis marking the cut."""
    return value if len(value) <= limit else value[:limit] + "…"


def now() -> str:
    """The current time as a line's `time`: RFC 3339 UTC with milliseconds and a `Z`."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


_STOP = object()


class LineWriter:
    """Serialises lines and hands them to a writer thread that owns `sink`; each audit log
    is one (`gpuplace.webhook.auditing.AuditLog`, `gpuplace.agent.auditing.AgentAudit`),
    with a `write` of its own that builds its lines and `put`s them."""

    def __init__(self, sink: Sink, *, batch_seconds: float = BATCH_SECONDS) -> None:
        self._sink = sink
        self._batch_seconds = batch_seconds
        self._queue: queue.Queue[object] = queue.Queue(MAX_QUEUED)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="gpuplace-audit", daemon=True)
        self._thread.start()

    def put(self, line: dict[str, Any]) -> None:
        """Queue one line (never blocks; counted in `dropped` when the queue is full)."""
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
