"""The node's GPUs and the agent's heartbeat, published on its Node object.

Two annotations, one merge patch (`nodes` PATCH, the agent's only API write here):
- `gpuplace.io/gpus`: the discovery as a JSON list, one object per GPU, in the format
  the sidecar already read (`index`, `uuid`, `numa`, `nvlink` domain) extended with
  `model`, `memoryMiB` (NVML's total), `packableMiB` (what a client can get with MPS
  running, the figure the engine packs: `gpuplace.agent.capacity`), `reservedMiB` (the
  driver's), `mpsServerMiB`, `mpsContextMiB` (`{"base", "perPercent"}`: what each MPS
  client's CUDA context takes inside its limit, `mps_limits`), `pci`, `peers`, `mig`,
  `health` ("healthy" | "unhealthy") and `reasons`; null where NVML could not say (never a
  guess);
- `gpuplace.io/agent-heartbeat`: the RFC 3339 UTC time of the write.

`Publisher.publish_once` reads NVML (in a worker thread: driver calls block), drains
the XID events, and patches only when the GPUs' annotation changed or the heartbeat is
due (`heartbeat_seconds`, default 30: at 10,000 nodes about 330 node writes a second
cluster-wide, each one a Node watch event for every node informer; a longer heartbeat
with a matching sidecar `--agent-silence-seconds` lowers that). `run` repeats it every
`discover_seconds` until cancelled; an API failure is logged and counted, and the next
pass tries again (the annotation is written whole, so nothing is lost between).

Owns no decision: it never closes a node or a GPU to pods itself; the sidecar reads the
annotations (`gpuplace.cluster.nodes`). Listeners (`on_change`) hear each new discovery, e.g.
the device plugin re-sending ListAndWatch when a GPU's health changes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuplace.agent import capacity, discovery
from gpuplace.agent import nvml as nvml_seam
from gpuplace.cluster import keys, kube
from gpuplace.placement.inventory import ClientContext

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 30.0
"""Default heartbeat period; the sidecar's default silence bound is four of them."""
DISCOVER_SECONDS = 5.0
"""Default period of NVML reads (health, XIDs): how soon a GPU going bad is published."""


class NodePatcher(Protocol):
    """What publishing needs of `gpuplace.cluster.kube.Kube`."""

    async def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]: ...


def entry(gpu: discovery.Gpu) -> dict[str, Any]:
    """One GPU as the annotation holds it."""
    context = gpu.context
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "model": gpu.model,
        "memoryMiB": gpu.memory_mib,
        "packableMiB": gpu.packable_mib,
        "reservedMiB": gpu.reserved_mib,
        "mpsServerMiB": gpu.mps_server_mib,
        "mpsContextMiB": {"base": context.base_mib, "perPercent": context.per_percent_mib},
        "pci": gpu.pci_bus_id,
        "numa": gpu.numa,
        "nvlink": gpu.nvlink_domain,
        "peers": None if gpu.nvlink_peers is None else list(gpu.nvlink_peers),
        "mig": gpu.mig,
        "health": gpu.health.word,
        "reasons": list(gpu.health.reasons),
    }


def annotation(found: discovery.Discovery) -> str:
    """The `gpuplace.io/gpus` value: compact JSON, keys in a fixed order, so that equal
    discoveries give equal strings. O(GPUs)."""
    return json.dumps([entry(gpu) for gpu in found.gpus], separators=(",", ":"))


def heartbeat(now: float) -> str:
    """`now` (seconds since the epoch) as the heartbeat annotation's RFC 3339 UTC time."""
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def patch(gpus: str, beat: str) -> dict[str, Any]:
    """The node merge patch writing both annotations."""
    return {"metadata": {"annotations": {keys.NODE_GPUS: gpus, keys.AGENT_HEARTBEAT: beat}}}


class Publisher:
    """Discovers the node's GPUs and keeps its annotations current; see the module
    docstring."""

    def __init__(
        self,
        api: NodePatcher,
        node: str,
        nvml: nvml_seam.Nvml,
        *,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        discover_seconds: float = DISCOVER_SECONDS,
        wall: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
        context: ClientContext | None = None,
    ) -> None:
        self.api = api
        self.node = node
        self.nvml = nvml
        self.heartbeat_seconds = heartbeat_seconds
        self.discover_seconds = discover_seconds
        self._wall = wall
        self.context = context
        """The operator's measured MPS client context for every GPU (None: each model's)."""
        self.memory = capacity.Readings()
        self.xids = discovery.XidLog()
        self.discovery: discovery.Discovery | None = None
        """The latest discovery (None before the first pass)."""
        self.published: str | None = None
        """The `gpuplace.io/gpus` value last written."""
        self.beat_at: float | None = None
        """Wall time of the last successful write."""
        self.last_error = ""
        """Why the last write failed ("" when it did not)."""
        self.on_change: list[Callable[[discovery.Discovery], None]] = []
        """Called with each discovery that differs from the one before."""
        self.writes = Counter(
            "gpuplace_agent_node_writes_total",
            "Node annotation writes by the node agent, by result (ok, error).",
            ["result"],
            registry=registry,
        )
        self.gpus = Gauge(
            "gpuplace_agent_gpus",
            "GPUs the node agent discovered, by health.",
            ["health"],
            registry=registry,
        )
        self.heartbeat_time = Gauge(
            "gpuplace_agent_heartbeat_timestamp_seconds",
            "Wall time of the last heartbeat the node agent wrote.",
            registry=registry,
        )

    def _read(self) -> discovery.Discovery:
        self.xids.poll(self.nvml)
        return discovery.discover(self.nvml, self.xids, readings=self.memory, context=self.context)

    async def publish_once(self) -> bool:
        """Discover; write the annotations if they changed or the heartbeat is due.
        True when written. Raises `kube.ApiError` (nothing is marked written then)."""
        found = await asyncio.to_thread(self._read)
        if found != self.discovery:
            self.discovery = found
            sick = len(found.unhealthy)
            self.gpus.labels("healthy").set(len(found.gpus) - sick)
            self.gpus.labels("unhealthy").set(sick)
            for listener in self.on_change:
                listener(found)
        value = annotation(found)
        now = self._wall()
        due = self.beat_at is None or now - self.beat_at >= self.heartbeat_seconds
        if value == self.published and not due:
            return False
        try:
            await self.api.patch_node(self.node, patch(value, heartbeat(now)))
        except kube.ApiError as error:
            self.writes.labels("error").inc()
            self.last_error = str(error)
            raise
        if value != self.published:
            log.info(
                "node GPUs published",
                extra={"node": self.node, "gpus": len(found.gpus), "unhealthy": found.unhealthy},
            )
        self.writes.labels("ok").inc()
        self.published, self.beat_at, self.last_error = value, now, ""
        self.heartbeat_time.set(now)
        return True

    async def run(self) -> None:
        """`publish_once` every `discover_seconds` until cancelled."""
        while True:
            try:
                await self.publish_once()
            except kube.ApiError as error:
                log.warning(
                    "node annotations not written", extra={"node": self.node, "error": str(error)}
                )
            await asyncio.sleep(self.discover_seconds)

    def heartbeat_age(self) -> float | None:
        """Seconds since the last successful write; None before the first. O(1)."""
        return None if self.beat_at is None else max(self._wall() - self.beat_at, 0.0)

    def healthy(self) -> bool:
        """Whether the heartbeat is current: written within two heartbeat periods. The
        agent's /readyz turns 503 when it is not (`gpuplace.commands.node_agent`), its
        /healthz does not: a liveness restart would end every share's MPS server and
        cannot mend an API server the agent cannot reach. The sidecar closes the node
        to new GPU pods at its own bound (`--agent-silence-seconds`). O(1)."""
        age = self.heartbeat_age()
        return age is not None and age < 2 * self.heartbeat_seconds
