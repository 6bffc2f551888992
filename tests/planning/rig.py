"""The rig of the planner's tests: a fake API server, the real sidecar (informers, ledger,
extender verbs) and the planner wired to it by `gpuplace.wiring.planning.build`, as the
sidecar wires it (fast rounds, the leadership gate the test chooses), and kube-scheduler's
part as v1.36 plays it: a nominated node first (every filter and the extender's on that
node alone), then every node the pod's affinity allows."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import keys
from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.planning.controller import PlanController, PlanSettings
from gpuplace.wiring import planning as wiring
from tests.cluster.conftest import eventually
from tests.extender.conftest import Harness, harness


@dataclass
class Rig:
    h: Harness
    controller: PlanController
    registry: CollectorRegistry
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def api(self) -> localapi.FakeApi:
        return self.h.api

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any]:
        return self.api.get("pods", name, namespace)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value

    def releases(self, result: str) -> float:
        return self.metric("gpuplace_plan_releases_total", {"result": result})

    async def rounds(self, count: int = 2, timeout: float = 10.0) -> None:
        """Let the planner complete `count` more rounds."""
        target = self.controller.rounds + count
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.controller.rounds < target:
            if loop.time() > deadline:
                raise AssertionError("the planner made no progress")
            self.controller.wake()
            await asyncio.sleep(0.01)

    async def released(self, name: str, timeout: float = 5.0) -> dict[str, Any]:
        """Until the planner removed its gate from pod `name`; the pod then."""
        await eventually(lambda: not planner_gated(self.pod(name)), timeout)
        return self.pod(name)

    def create(self, pod: dict[str, Any]) -> dict[str, Any]:
        return self.api.create(pod)

    async def schedule(self, name: str, rng: random.Random | None = None) -> str:
        """kube-scheduler with the shipped profile: the pod's nominated node first (its
        own filters pass it when `refuse` does not name it), else every node its
        affinity allows; filter, bind. Returns the node."""
        return await schedule(self.h, self.pod(name), rng=rng)


refused: set[str] = set()
"""Nodes kube-scheduler's own filters refuse in `schedule` (what the engine does not see:
CPU of unmanaged pods, ports, volumes); tests set and clear it."""


async def schedule(h: Harness, pod: dict[str, Any], *, rng: random.Random | None = None) -> str:
    """See `Rig.schedule`."""
    rng = rng or random.Random(0)
    affinity = NodeAffinity.of(pod)
    names = sorted(
        node["metadata"]["name"]
        for node in h.api.objects("nodes")
        if node["metadata"]["name"] not in refused
        and affinity.matches(node["metadata"]["name"], node["metadata"].get("labels") or {})
    )
    nominated = str((pod.get("status") or {}).get("nominatedNodeName") or "")
    if nominated in names:
        verdict = await h.filter(pod, [nominated])
        if verdict["NodeNames"]:
            error = await h.bind(pod, nominated)
            assert not error, error
            return nominated
    return await h.schedule(pod, rng, names)


def planner_gated(pod: dict[str, Any]) -> bool:
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(gate.get("name") == keys.PLACE_GATE for gate in gates)


def share(
    name: str,
    percent: int = 25,
    *,
    gates: tuple[str, ...] = (keys.PLACE_GATE,),
    count: int | None = None,
    priority: int | None = None,
) -> dict[str, Any]:
    """A GPU pod as the webhook leaves it with `--plan-pin`: behind the planner's gate."""
    pod = objects.pod(
        name,
        percent=percent if count is None else None,
        count=count,
        memory="10Gi" if count is None else None,
        gates=list(gates),
    )
    if priority is not None:
        pod["spec"]["priority"] = priority
    return pod


def nodes(api: localapi.FakeApi, count: int, gpus: int = 2, **kwargs: Any) -> None:
    for i in range(count):
        api.create(objects.node(f"gpu-{i}", gpus=gpus, **kwargs))


@contextlib.asynccontextmanager
async def rig(
    server: localapi.Server,
    *,
    pin: str = "nominate",
    active: Callable[[], bool] | None = None,
    blocked: Callable[[], str | None] | None = None,
    **overrides: Any,
) -> AsyncIterator[Rig]:
    refused.clear()
    async with harness(server, **overrides) as h:
        registry = CollectorRegistry()
        built = wiring.build(
            h.sidecar.api,
            h.sidecar.sync,
            lambda: h.sidecar.holder.current().policy,
            fences=h.sidecar.fences,
            recorder=h.sidecar.recorder,
            registry=registry,
            settings=PlanSettings(pin=pin, poll_seconds=0.2, settle_seconds=0.005),
            active=active,
            blocked=blocked,
        )
        result = Rig(h, built.controller, registry)
        result.tasks = [asyncio.create_task(work) for work in built.work()]
        try:
            await h.synced(lambda: built.store.synced.is_set() and h.sidecar.sync.ready.is_set())
            yield result
        finally:
            for task in result.tasks:
                task.cancel()
            await asyncio.gather(*result.tasks, return_exceptions=True)
            refused.clear()
