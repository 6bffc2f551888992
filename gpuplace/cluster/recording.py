"""Kubernetes Events about pods, as `kubectl describe pod` shows them.

`Recorder.emit` never blocks and never fails its caller: events are queued (bounded;
the oldest are dropped when the API is slow) and written by `run`. Like client-go's
event correlator, a repeat of the same (pod, reason, message) within `window`
seconds bumps the existing Event's `count` and `lastTimestamp` instead of creating
another. Messages are cut to the API's 1,024 characters.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster import kube

log = logging.getLogger(__name__)

MAX_MESSAGE = 1024
COMPONENT = "gpuplace"
MEMORY = 4096
"""Distinct (pod, reason, message) remembered for counting repeats."""

NORMAL = "Normal"
WARNING = "Warning"

# Event reasons written by more than one room (the extender's preempt verb, the gang
# controller's evictions) or read by another (`gpuplace explain`)
PREEMPTION = "GpuPreemption"
"""On a preemptor (a pod, or each member of a gang) naming its victims."""
PREEMPTED = "GpuPreempted"
"""On a victim naming the GPUs freed and for whom."""
GANG_PREEMPTION_REFUSED = "GangPreemptionRefused"
"""On each member of a gang whose eviction of a victim the API refused."""


@dataclass(frozen=True, slots=True)
class Subject:
    """The object an Event is about."""

    namespace: str
    name: str
    uid: str
    kind: str = "Pod"
    api_version: str = "v1"


@dataclass(frozen=True, slots=True)
class _Pending:
    subject: Subject
    type: str
    reason: str
    message: str
    at: float


def _timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Recorder:
    """Writes Events in the background; see the module docstring."""

    def __init__(
        self,
        api: kube.Kube,
        *,
        registry: CollectorRegistry | None = None,
        window: float = 600.0,
        queue_size: int = 1000,
        instance: str | None = None,
        clock: Callable[[], float] = time.time,
        reporting: str = "gpuplace.io/sidecar",
    ) -> None:
        self.api = api
        self.reporting = reporting
        """The Events' `reportingComponent` (the node agent's: `gpuplace.io/node-agent`)."""
        self.window = window
        self.instance = instance or socket.gethostname()
        self._clock = clock
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=queue_size)
        self._seen: OrderedDict[tuple[str, str, str], tuple[str, int, float]] = OrderedDict()
        self.events = Counter(
            "gpuplace_events_total",
            "Kubernetes Events written about pods, by reason and result.",
            ["reason", "result"],
            registry=registry,
        )

    def emit(self, subject: Subject, kind: str, reason: str, message: str) -> None:
        """Queue an Event (`kind` Normal or Warning, `reason` CamelCase). Never blocks."""
        pending = _Pending(subject, kind, reason, message[:MAX_MESSAGE], self._clock())
        try:
            self._queue.put_nowait(pending)
        except asyncio.QueueFull:
            self._queue.get_nowait()
            self._queue.task_done()  # the dropped one counts as done (`drain` joins)
            self._queue.put_nowait(pending)
            self.events.labels(reason, "dropped").inc()

    async def run(self) -> None:
        while True:
            pending = await self._queue.get()
            try:
                await self.write(pending)
            finally:
                self._queue.task_done()

    @property
    def queued(self) -> int:
        """Events waiting to be written."""
        return self._queue.qsize()

    async def drain(self) -> None:
        """Write everything queued now, and wait for the one `run` is writing (tests,
        shutdown: an Event taken off the queue but not yet written counts too)."""
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            try:
                await self.write(pending)
            finally:
                self._queue.task_done()
        await self._queue.join()

    async def write(self, pending: _Pending) -> None:
        subject = pending.subject
        key = (subject.uid, pending.reason, pending.message)
        seen = self._seen.get(key)
        try:
            if seen is not None and pending.at - seen[2] <= self.window:
                name, count, first = seen
                await self.api.patch_event(
                    subject.namespace,
                    name,
                    {"count": count + 1, "lastTimestamp": _timestamp(pending.at)},
                )
                self._remember(key, (name, count + 1, first))
            else:
                name = f"{subject.name}.{int(pending.at * 1e9):x}"
                await self.api.create_event(subject.namespace, self._body(name, pending))
                self._remember(key, (name, 1, pending.at))
        except kube.ApiError as error:
            if error.not_found and seen is not None:
                self._seen.pop(key, None)
            self.events.labels(pending.reason, "error").inc()
            log.warning(
                "event not written",
                extra={"reason": pending.reason, "status": error.status, "error": error.message},
            )
            return
        self.events.labels(pending.reason, "ok").inc()

    def _remember(self, key: tuple[str, str, str], value: tuple[str, int, float]) -> None:
        self._seen[key] = value
        self._seen.move_to_end(key)
        while len(self._seen) > MEMORY:
            self._seen.popitem(last=False)

    def _body(self, name: str, pending: _Pending) -> dict[str, object]:
        subject = pending.subject
        stamp = _timestamp(pending.at)
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": subject.namespace},
            "involvedObject": {
                "apiVersion": subject.api_version,
                "kind": subject.kind,
                "namespace": subject.namespace,
                "name": subject.name,
                "uid": subject.uid,
            },
            "reason": pending.reason,
            "message": pending.message,
            "type": pending.type,
            "source": {"component": COMPONENT},
            "reportingComponent": self.reporting,
            "reportingInstance": self.instance,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
