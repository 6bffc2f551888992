"""The webhook's own audit log: one JSON line per review.

A line holds who asked what and what was decided — time, endpoint, uid, operation,
namespace, pod name (or generateName), user, dryRun, the pod's `gpuplace.io/` annotations
(keys and values cut to `MAX_VALUE_CHARS`), the GpuQueue it waits in (also when its
namespace's label chose it), decision, reason, message, the patch's paths
(never its values), warnings and latency. Never env values, tokens, or pod bodies.

The lines go through `gpuplace.runtime.jsonlines` (a writer thread, never the event loop;
full queue: dropped and counted, never a stalled review). Sinks: a stream (stdout) or a
file rotated by size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuplace.runtime.jsonlines import LineWriter, RotatingFileSink, Sink, StreamSink, cut, now

__all__ = ["AuditLog", "RotatingFileSink", "Sink", "StreamSink"]

MAX_VALUE_CHARS = 100
MAX_MESSAGE_CHARS = 1000


class AuditLog(LineWriter):
    """Formats review lines for its writer thread (`LineWriter`), which owns the sink."""

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
            "time": now(),
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
            cut(key, MAX_VALUE_CHARS): cut(value, MAX_VALUE_CHARS)
            for key, value in (annotations or {}).items()
        }
        if gpu_queue:
            line["queue"] = cut(gpu_queue, MAX_VALUE_CHARS)
        line["decision"] = decision
        line["reason"] = reason
        if message:
            line["message"] = cut(message, MAX_MESSAGE_CHARS)
        if patch:
            line["patch"] = list(patch)
        if warnings:
            line["warnings"] = list(warnings)
        line["latencyMs"] = round(latency_seconds * 1000, 3)
        self.put(line)
