"""The DRA node agent's ResourceSlice: its node's GPUs published as DRA devices.

`gpu_devices(discovery)` is the pure part: each GPU NVML can name (UUID and memory read)
as a `gpuplace.cluster.dra.GpuDevice`, unhealthy ones included (their devices carry the
NoSchedule taint `gpu.gpuplace.io/unhealthy`); a GPU without a UUID or memory cannot be
allocated by capacity and is left out.

`SlicePublisher` keeps the one slice of `gpuplace.cluster.dra.slice_name(node)` equal to
what the agent knows, and nothing else of its driver on its node: it is the handler of an
informer of the node's ResourceSlices (field selector `spec.nodeName=<node>`; other
drivers' slices there are ignored), and after every change, its own (`set_gpus`) or the
API's, it compares what is stored with what it wants (`dra.same_devices`: quantities by
value, taint times aside) and writes only when they differ: create, or replace with the
stored resourceVersion as precondition and the pool generation one higher, or delete a
stale slice of its driver (by UID). That is also how a sidecar's silence taint goes once
the agent speaks again, and how a slice the kubelet wiped (it deletes a driver's slices
30 s after the plugin unregisters) comes back. A conflict (409) waits for the informer's
next event; any other failure is retried with backoff. Nothing is written before the
informer's first list, nor before the first discovery. O(GPUs) per pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuplace.agent import discovery
from gpuplace.cluster import dra, kube, watching

log = logging.getLogger(__name__)


BACKOFF = watching.Backoff(first=0.2, cap=10.0)
"""Between failed writes (not conflicts: those wait for the informer)."""


def gpu_devices(found: discovery.Discovery | None) -> list[dra.GpuDevice]:
    """The GPUs the slice publishes (see the module docstring). O(GPUs)."""
    if found is None:
        return []
    return [
        dra.GpuDevice(
            index=gpu.index,
            uuid=gpu.uuid,
            memory_mib=gpu.memory_mib,
            model=gpu.model,
            numa=gpu.numa,
            nvlink_domain=gpu.nvlink_domain,
            mig=gpu.mig,
            healthy=gpu.health.healthy,
            packable_mib=gpu.packable_mib,
        )
        for gpu in found.gpus
        if gpu.uuid is not None and gpu.memory_mib is not None
    ]


class SliceApi(Protocol):
    """What the publisher needs of `gpuplace.cluster.kube.Kube`."""

    async def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]: ...

    async def replace_resource_slice(
        self, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]: ...

    async def delete_resource_slice(self, name: str, *, uid: str) -> None: ...


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = obj.get("spec")
    return spec if isinstance(spec, Mapping) else {}


class SlicePublisher:
    """See the module docstring; a `gpuplace.cluster.watching.Handler` of the node's slices."""

    def __init__(
        self,
        api: SliceApi,
        node: str,
        node_uid: str = "",
        *,
        registry: CollectorRegistry | None = None,
        backoff: watching.Backoff = BACKOFF,
    ) -> None:
        self.api = api
        self.node = node
        self.node_uid = node_uid
        self.name = dra.slice_name(node)
        self.gpus: tuple[dra.GpuDevice, ...] | None = None
        """What to publish; None before the first discovery."""
        self.stored: dict[str, dict[str, Any]] = {}
        """This driver's slices of the node, by name, as the informer last saw them."""
        self.synced = False
        self.published = asyncio.Event()
        """Set while the stored slice is what the agent wants."""
        self._backoff = backoff
        self._kick = asyncio.Event()
        self.writes = Counter(
            "gpuplace_agent_slice_writes_total",
            "ResourceSlice writes by the DRA node agent, by verb and result.",
            ["verb", "result"],
            registry=registry,
        )
        self.devices = Gauge(
            "gpuplace_agent_slice_devices",
            "Devices in the DRA node agent's ResourceSlice, by health.",
            ["health"],
            registry=registry,
        )

    # --- what the agent knows -------------------------------------------------------------

    def set_gpus(self, gpus: Sequence[dra.GpuDevice]) -> None:
        fresh = tuple(gpus)
        if fresh != self.gpus:
            self.gpus = fresh
            healthy = sum(1 for gpu in fresh if gpu.healthy)
            self.devices.labels("healthy").set(healthy)
            self.devices.labels("unhealthy").set(len(fresh) - healthy)
            self._changed()

    def desired(self, generation: int = 1) -> dict[str, Any] | None:
        if self.gpus is None:
            return None
        body = dra.resource_slice(self.node, self.node_uid, self.gpus, generation)
        if not self.node_uid:
            del body["metadata"]["ownerReferences"]
        return body

    # --- the informer's handler -------------------------------------------------------

    def _ours(self, obj: Mapping[str, Any]) -> bool:
        spec = _spec(obj)
        return spec.get("driver") == dra.DRIVER and spec.get("nodeName") == self.node

    def replace(self, objects: list[dict[str, Any]]) -> None:
        self.stored = {_name(obj): obj for obj in objects if self._ours(obj)}
        self.synced = True
        self._changed()

    def upsert(self, obj: dict[str, Any]) -> None:
        if self._ours(obj):
            self.stored[_name(obj)] = obj
        else:
            self.stored.pop(_name(obj), None)
        self._changed()

    def delete(self, obj: dict[str, Any]) -> None:
        self.stored.pop(_name(obj), None)
        self._changed()

    def _changed(self) -> None:
        self.published.clear()
        self._kick.set()

    # --- writing ------------------------------------------------------------------------

    def _current(self) -> bool:
        """Whether the stored slice is what the agent wants, and nothing else is stored."""
        wanted = self.desired()
        stored = self.stored.get(self.name)
        if wanted is None or stored is None or set(self.stored) != {self.name}:
            return False
        owners = (stored.get("metadata") or {}).get("ownerReferences") or []
        return dra.same_devices(_spec(stored), wanted["spec"]) and (
            not self.node_uid or owners == wanted["metadata"]["ownerReferences"]
        )

    async def reconcile(self) -> None:
        """One pass: the writes that make the stored slices what the agent wants. Raises
        `kube.ApiError`."""
        if not self.synced or self.gpus is None:
            return
        for name, obj in list(self.stored.items()):
            if name != self.name:
                uid = str((obj.get("metadata") or {}).get("uid") or "")
                await self._write("delete", self.api.delete_resource_slice(name, uid=uid))
                self.stored.pop(name, None)
        if self._current():
            self.published.set()
            return
        stored = self.stored.get(self.name)
        if stored is None:
            body = self.desired()
            assert body is not None
            self.stored[self.name] = await self._write(
                "create", self.api.create_resource_slice(body)
            )
        else:
            body = self.desired(dra.generation(_spec(stored)) + 1)
            assert body is not None
            body["metadata"]["resourceVersion"] = (stored.get("metadata") or {}).get(
                "resourceVersion"
            )
            self.stored[self.name] = await self._write(
                "update", self.api.replace_resource_slice(self.name, body)
            )
        log.info(
            "resource slice published",
            extra={"node": self.node, "slice": self.name, "gpus": len(self.gpus)},
        )
        self.published.set()

    async def _write(self, verb: str, call: Any) -> Any:
        try:
            written = await call
        except kube.ApiError as error:
            self.writes.labels(verb, "conflict" if error.conflict else "error").inc()
            raise
        self.writes.labels(verb, "ok").inc()
        return written

    async def run(self) -> None:
        """Reconcile after every change until cancelled; see the module docstring."""
        attempt = 0
        while True:
            await self._kick.wait()
            self._kick.clear()
            try:
                await self.reconcile()
                attempt = 0
            except kube.ApiError as error:
                if error.conflict:  # a newer version, or AlreadyExists
                    log.info(
                        "resource slice changed meanwhile: waiting for the informer",
                        extra={"node": self.node, "error": str(error)[:200]},
                    )
                    continue  # the informer brings the stored version, and a new pass
                attempt += 1
                log.warning(
                    "resource slice not written, retrying",
                    extra={"node": self.node, "error": str(error)[:300]},
                )
                await asyncio.sleep(self._backoff.delay(attempt))
                self._kick.set()


def slice_informer(
    api: kube.Kube,
    node: str,
    publisher: SlicePublisher,
    metrics: watching.InformerMetrics | None = None,
) -> watching.Informer[dict[str, Any]]:
    """The informer of this node's ResourceSlices (list + watch, `spec.nodeName=<node>`)."""
    return watching.Informer(
        api,
        "resourceslices",
        publisher,
        lambda obj: obj,
        field_selector=f"spec.nodeName={node}",
        metrics=metrics,
    )
