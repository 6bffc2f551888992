"""The audit log's writer thread and sinks."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest

from gpuplace.runtime import jsonlines
from gpuplace.webhook import auditing


def _write(audit: auditing.AuditLog, uid: str) -> None:
    audit.write(
        endpoint="mutate",
        decision="allowed",
        reason="mutated",
        latency_seconds=0.0012,
        uid=uid,
        annotations={"gpuplace.io/gpu-percent": "50"},
    )


def test_lines_reach_the_sink_in_order_and_close_drains() -> None:
    stream = io.StringIO()
    audit = auditing.AuditLog(auditing.StreamSink(stream))
    for index in range(500):
        _write(audit, f"u{index}")
    audit.close()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["uid"] for line in lines] == [f"u{index}" for index in range(500)]
    assert lines[0]["latencyMs"] == 1.2 and lines[0]["decision"] == "allowed"


def test_rotating_file_sink(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    sink = auditing.RotatingFileSink(path, max_bytes=1000, backups=2)
    for index in range(60):
        sink.write(json.dumps({"n": index, "pad": "x" * 40}) + "\n")
    sink.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    for name in files:
        assert (tmp_path / name).stat().st_size <= 1000
    newest = [json.loads(line)["n"] for line in path.read_text().splitlines()]
    assert newest[-1] == 59
    # reopening continues the same file and counts its size
    again = auditing.RotatingFileSink(path, max_bytes=1000, backups=0)
    again.write("y" * 990 + "\n")
    again.close()
    assert path.read_text() == "y" * 990 + "\n"


class _Stalled:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.text = io.StringIO()

    def write(self, text: str) -> None:
        self.release.wait(5)
        self.text.write(text)

    def flush(self) -> None: ...

    def close(self) -> None: ...


def test_a_stalled_sink_drops_lines_instead_of_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonlines, "MAX_QUEUED", 10)
    sink = _Stalled()
    audit = auditing.AuditLog(sink)
    for index in range(50):
        _write(audit, str(index))  # returns at once although the sink is stuck
    assert audit.dropped >= 30
    sink.release.set()
    audit.close()
    written = sink.text.getvalue().splitlines()
    assert len(written) + audit.dropped == 50


class _Broken:
    def write(self, text: str) -> None:
        raise OSError("disk full")

    def flush(self) -> None: ...

    def close(self) -> None: ...


def test_a_failing_sink_counts_lost_lines() -> None:
    audit = auditing.AuditLog(_Broken())
    _write(audit, "a")
    audit.flush()
    assert audit.dropped == 1
    audit.close()
