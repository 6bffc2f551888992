"""The webhook's own audit log: one JSON line per review, written through a logging handler.

The handler is chosen by the process (stdout, or a size-rotated file); this module only
builds the line. A line holds who asked what and what was decided — time, endpoint, uid,
operation, namespace, pod name (or generateName), user, dryRun, the pod's `gpuplace.io/`
annotations (values cut to `MAX_VALUE_CHARS`), decision, reason, message, the patch's
paths (never its values), warnings and latency. Never env values, tokens, or pod bodies.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

MAX_VALUE_CHARS = 100
MAX_MESSAGE_CHARS = 1000


def _cut(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[:limit] + "…"


class AuditLog:
    """Writes audit lines to `handler` (it does the I/O, locking and any rotation)."""

    __slots__ = ("_handler",)

    def __init__(self, handler: logging.Handler) -> None:
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._handler = handler

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
        line["decision"] = decision
        line["reason"] = reason
        if message:
            line["message"] = _cut(message, MAX_MESSAGE_CHARS)
        if patch:
            line["patch"] = list(patch)
        if warnings:
            line["warnings"] = list(warnings)
        line["latencyMs"] = round(latency_seconds * 1000, 3)
        record = logging.LogRecord(
            "gpuplace.audit",
            logging.INFO,
            __file__,
            0,
            json.dumps(line, ensure_ascii=False),
            None,
            None,
        )
        record.created = time.time()
        self._handler.handle(record)

    def close(self) -> None:
        self._handler.close()
