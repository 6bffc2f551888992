"""A silent DRA node agent's devices get a NoSchedule taint: the sidecar's writer.

A node agent that stops its heartbeat (hung, cut off from the API, its node down) can no
longer say that its GPUs are unfit, and kube-scheduler's DRA allocator would go on
allocating its devices. On Kubernetes v1.36 the device taints of the ResourceSlice itself
carry the verdict (`DRADeviceTaints`, beta and on; `DeviceTaintRule`, the separate object,
is behind the `DRADeviceTaintRules` gate, off, and its API version not served by default),
and only someone other than the agent can write them while it is silent: the sidecar,
which already judges heartbeats (`gpuplace.cluster.nodes.closed_reason`, the bound
`--agent-silence-seconds`).

`SilenceTaints.check(records)`: for each node with a heartbeat that is now too old (or
unreadable), once per silence, read its ResourceSlice (`gpuplace.cluster.dra.slice_name`)
and, when it exists and is not tainted yet, write it back with `gpu.gpuplace.io/agent-silent`
(NoSchedule) on every device, conditional on the resourceVersion read (a 409 is tried
again at the next check). A node without a slice (a device-plugin node) costs one GET per
silence. Nothing is written when the agent speaks again: its own next write of its slice
(`gpuplace.agent.slices`) drops the taint, as it publishes only what it knows. Pods
already running keep their devices (NoSchedule, not NoExecute). O(nodes) per check, API
calls only for nodes that fell silent since the last one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster import dra, kube, nodes

log = logging.getLogger(__name__)


class SliceApi(Protocol):
    """What the writer needs of `gpuplace.cluster.kube.Kube`."""

    async def get_resource_slice(self, name: str) -> dict[str, Any]: ...

    async def replace_resource_slice(
        self, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]: ...


class SilenceTaints:
    """See the module docstring."""

    def __init__(
        self,
        api: SliceApi,
        *,
        silence: float,
        wall: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.api = api
        self.silence = silence
        self._wall = wall
        self.handled: set[str] = set()
        """Nodes silent now whose slice is tainted, or that have none."""
        self.writes = Counter(
            "gpuplace_slice_silence_taints_total",
            "Silence taints written on DRA node agents' ResourceSlices, by result "
            "(tainted, no-slice, conflict, error).",
            ["result"],
            registry=registry,
        )

    def _silent(self, record: nodes.NodeRecord, now: float) -> bool:
        return record.heartbeat is not None and bool(
            nodes.closed_reason(record, now, silence=self.silence)
        )

    async def check(self, records: Iterable[nodes.NodeRecord]) -> list[str]:
        """Taint the slices of the nodes that fell silent; returns the nodes tainted now."""
        if self.silence <= 0:
            return []
        now = self._wall()
        silent = {record.name for record in records if self._silent(record, now)}
        self.handled &= silent
        tainted = []
        for node in sorted(silent - self.handled):
            try:
                if await self._taint(node, now):
                    tainted.append(node)
                self.handled.add(node)
            except kube.ApiError as error:
                self.writes.labels("conflict" if error.conflict else "error").inc()
                log.warning(
                    "silence taint not written, trying again",
                    extra={"node": node, "error": str(error)[:300]},
                )
        return tainted

    async def _taint(self, node: str, now: float) -> bool:
        name = dra.slice_name(node)
        try:
            stored = await self.api.get_resource_slice(name)
        except kube.ApiError as error:
            if error.not_found:
                self.writes.labels("no-slice").inc()
                return False
            raise
        if dra.silenced(stored):
            return False
        moment = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        await self.api.replace_resource_slice(name, dra.with_silence(stored, moment))
        self.writes.labels("tainted").inc()
        log.warning(
            "node agent silent: its devices are tainted NoSchedule",
            extra={"node": node, "slice": name, "taint": dra.SILENT_TAINT},
        )
        return True
