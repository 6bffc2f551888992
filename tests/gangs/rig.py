"""The rig of the gang tests: a fake API server, the real sidecar (informers, ledger,
extender verbs) and the gang controller wired to it by `gpuplace.wiring.gangs.build`, as
the sidecar wires it (with a test clock, fast rounds and the leadership gate the test
chooses), plus builders and invariant checks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import assignments, grammar, keys
from gpuplace.cluster.gang_marks import gated, plan_mark
from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.controllers.store import PodIndex
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.gangs.controller import GangController, GangSettings
from gpuplace.placement.fences import Fences
from gpuplace.placement.gangs import GangKey
from gpuplace.placement.inventory import Inventory
from gpuplace.placement.ledger import Ledger
from gpuplace.placement.requests import WHOLE
from gpuplace.wiring import gangs as wiring
from tests.extender.conftest import Harness, NoLongerFits, Unschedulable, harness


@dataclass
class Clock:
    """Wall time plus an offset the test moves forward."""

    offset: float = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@dataclass
class Rig:
    h: Harness
    store: PodIndex[GangKey]
    controller: GangController
    fences: Fences
    clock: Clock
    registry: CollectorRegistry
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def api(self) -> localapi.FakeApi:
        return self.h.api

    def pods(self, namespace: str = "default") -> list[dict[str, Any]]:
        return self.api.objects("pods", namespace)

    def gang_pods(self, gang: str, namespace: str = "default") -> list[dict[str, Any]]:
        return [
            pod
            for pod in self.pods(namespace)
            if (pod["metadata"].get("labels") or {}).get(keys.GANG_LABEL) == gang
        ]

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value

    async def rounds(self, count: int = 2, timeout: float = 10.0) -> None:
        """Let the controller complete `count` more rounds."""
        target = self.controller.rounds + count
        self.controller.wake()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.controller.rounds < target:
            if loop.time() > deadline:
                raise AssertionError("the gang controller made no progress")
            self.controller.wake()
            await asyncio.sleep(0.01)

    async def quiet(self, timeout: float = 10.0) -> None:
        """Wait until informers caught up with the API and the controller has nothing
        open: every gang pod in the store matches the API and no plan is half done."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await self.rounds(1, timeout)
            api_rv = {
                pod["metadata"]["uid"]: pod["metadata"]["resourceVersion"]
                for pod in self.pods_everywhere()
                if keys.GANG_LABEL in (pod["metadata"].get("labels") or {})
            }
            store_rv = {uid: pod.resource_version for uid, pod in self.store.pods.items()}
            managed = {
                pod["metadata"]["uid"]: pod["metadata"]["resourceVersion"]
                for pod in self.pods_everywhere()
                if (pod["metadata"].get("labels") or {}).get(keys.MANAGED) == "true"
            }
            sync_rv = {
                uid: record.resource_version for uid, record in self.h.sidecar.sync.pods.items()
            }
            if api_rv == store_rv and managed == sync_rv and not self.controller.commits.committed:
                await self.rounds(1, timeout)
                if all(
                    pod["metadata"]["resourceVersion"] == api_rv.get(pod["metadata"]["uid"])
                    for pod in self.pods_everywhere()
                    if pod["metadata"]["uid"] in api_rv
                ):
                    return
            if loop.time() > deadline:
                raise AssertionError("the system did not settle")
            await asyncio.sleep(0.02)

    def pods_everywhere(self) -> list[dict[str, Any]]:
        return self.api.objects("pods")

    async def schedule_ungated(self) -> list[str]:
        """kube-scheduler's part: schedule every managed pod that is neither gated nor
        bound, through the extender's verbs. Returns the names it could not place."""
        left = []
        for pod in self.pods_everywhere():
            spec = pod.get("spec") or {}
            labels = pod["metadata"].get("labels") or {}
            if labels.get(keys.MANAGED) != "true" or spec.get("nodeName"):
                continue
            if spec.get("schedulingGates"):
                continue
            try:
                node = await self.h.schedule(pod)
            except (Unschedulable, NoLongerFits):
                # NoLongerFits: the gang controller reserved the node's GPUs between this
                # pod's filter and its bind (it reacts to the binds before it); the bind
                # is refused and kube-scheduler would try the pod again, as the next
                # schedule_ungated does.
                left.append(pod["metadata"]["name"])
                continue
            assert _affinity_allows(self.api, pod, node), f"{node} violates a pod's affinity"
        return left


def _affinity_allows(api: localapi.FakeApi, pod: dict[str, Any], node: str) -> bool:
    labels = api.get("nodes", node)["metadata"].get("labels") or {}
    return NodeAffinity.of(pod).matches(node, labels)


@contextlib.asynccontextmanager
async def rig(
    server: localapi.Server,
    *,
    clock: Clock | None = None,
    settings: GangSettings | None = None,
    active: Callable[[], bool] | None = None,
    **overrides: Any,
) -> AsyncIterator[Rig]:
    clock = clock or Clock()
    async with harness(server, **overrides) as h:
        registry = CollectorRegistry()
        gangs = wiring.build(
            h.sidecar.api,
            h.sidecar.sync,
            lambda: h.sidecar.holder.current().policy,
            fences=h.sidecar.fences,  # the extender's filter consults these, as wired
            recorder=h.sidecar.recorder,
            registry=registry,
            settings=settings or GangSettings(poll_seconds=0.2, settle_seconds=0.005),
            clock=clock,
            active=active,
        )
        built = Rig(h, gangs.store, gangs.controller, h.sidecar.fences, clock, registry)
        built.tasks = [asyncio.create_task(work) for work in gangs.work()]
        try:
            await h.synced(lambda: gangs.store.synced.is_set() and h.sidecar.sync.ready.is_set())
            yield built
        finally:
            for task in built.tasks:
                task.cancel()
            await asyncio.gather(*built.tasks, return_exceptions=True)


async def events(r: Rig, reason: str | None = None) -> list[str]:
    """Reasons (or, with `reason`, messages) of the Events written so far."""
    if r.h.sidecar.recorder is not None:
        await r.h.sidecar.recorder.drain()
    found = r.api.objects("events", "default")
    if reason is None:
        return [event["reason"] for event in found]
    return [event["message"] for event in found if event["reason"] == reason]


def condition(pod: dict[str, Any]) -> dict[str, Any] | None:
    for item in (pod.get("status") or {}).get("conditions") or []:
        if item.get("type") == keys.GANG_CONDITION:
            return dict(item)
    return None


def nodes(api: localapi.FakeApi, count: int, gpus: int = 4, **kwargs: Any) -> None:
    for i in range(count):
        api.create(objects.node(f"gpu-{i}", gpus=gpus, **kwargs))


def member(
    name: str,
    gang: str,
    size: int,
    *,
    count: int = 2,
    percent: int | None = None,
    timeout: str | None = None,
    priority: int | None = None,
    namespace: str = "default",
    extra: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A gang member as the webhook leaves it: gang annotations (and `annotations`),
    label and gate."""
    annotations = {keys.GANG_NAME: gang, keys.GANG_SIZE: str(size), **(annotations or {})}
    if timeout is not None:
        annotations[keys.GANG_TIMEOUT] = timeout
    pod = objects.pod(
        name,
        namespace,
        percent=percent,
        count=count if percent is None else None,
        annotations=annotations,
        labels={keys.GANG_LABEL: gang},
        gates=[keys.GANG_GATE],
    )
    if priority is not None:
        pod["spec"]["priority"] = priority
    for key, value in (extra or {}).items():
        pod["spec"][key] = value
    return pod


def other(name: str, *, count: int = 1, namespace: str = "default") -> dict[str, Any]:
    """A managed pod outside any gang, asking for whole GPUs."""
    return objects.pod(name, namespace, percent=None, count=count)


def check_plans(pods: list[dict[str, Any]]) -> None:
    """No plan is half ungated; nothing is ungated by us without a plan."""
    by_plan: dict[str, list[bool]] = {}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if keys.GANG_LABEL not in labels:
            continue
        mark = plan_mark(pod)
        if mark is None:
            assert gated(pod), f"{pod['metadata']['name']} was ungated without a plan"
            assert not assignments.assigned(pod) or (pod.get("spec") or {}).get("nodeName")
            continue
        by_plan.setdefault(mark.id, []).append(gated(pod))
    for plan_id, states in by_plan.items():
        assert all(states) or not any(states), f"plan {plan_id} is half ungated: {states}"


def check_grants(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
    """The grants the API records never oversubscribe a GPU (no GPU granted twice)."""
    from gpuplace.cluster import nodes as node_parsing

    book = Ledger(Inventory(node_parsing.parse(n) for n in nodes if node_parsing.is_enabled(n)))
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        grant = assignments.grant_of(pod, grammar.request_for(pod))
        if grant is not None:
            book.reserve(grant)  # raises Oversubscribed / Conflict on a double grant
    for state in book.states():
        assert all(0 <= milli <= WHOLE for milli in state.free_milli)
