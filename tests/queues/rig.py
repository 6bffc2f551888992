"""The rig of the queue tests: the local API over HTTP with the shipped RBAC, the real
sidecar (informers, ledger, extender verbs), the GpuQueue and namespace informers
(`gpuplace.cluster.queue_directory`), the gang controller and the queue controller wired
as the sidecar wires them (`gpuplace.wiring.gangs`, `gpuplace.wiring.queues`) with fast
rounds, plus builders of queues and queued pods (as the webhook leaves them) and the
invariant checks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import assignments, grammar, keys, queue_directory
from gpuplace.cluster.gang_marks import gated, plan_mark
from gpuplace.cluster.queue_directory import QueueDirectory
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.gangs.controller import GangSettings
from gpuplace.placement.queueing import quotas
from gpuplace.placement.requests import WHOLE
from gpuplace.queues.controller import QueueController, QueueSettings
from gpuplace.wiring import gangs as gang_wiring
from gpuplace.wiring import queues as wiring
from tests.extender.conftest import Harness, NoLongerFits, Unschedulable, harness
from tests.gangs.rig import Clock, check_grants

FAST = QueueSettings(
    poll_seconds=0.3, settle_seconds=0.005, min_round_seconds=0.0, reclaim_retry_seconds=0.5
)


@dataclass
class Rig:
    h: Harness
    directory: QueueDirectory
    controller: QueueController
    registry: CollectorRegistry
    clock: Clock
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def api(self) -> localapi.FakeApi:
        return self.h.api

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.api.objects("pods", namespace)

    def pod(self, name: str, namespace: str = "team-a") -> dict[str, Any]:
        return self.api.get("pods", name, namespace)

    def admitted(self, namespace: str | None = None) -> list[str]:
        """Names of the queued pods whose queue gate is gone, sorted."""
        return sorted(
            pod["metadata"]["name"]
            for pod in self.pods(namespace)
            if keys.QUEUE_LABEL in (pod["metadata"].get("labels") or {})
            and not gated(pod, keys.QUEUE_GATE)
            and not pod["metadata"].get("deletionTimestamp")
        )

    def waiting(self, namespace: str | None = None) -> list[str]:
        return sorted(
            pod["metadata"]["name"]
            for pod in self.pods(namespace)
            if keys.QUEUE_LABEL in (pod["metadata"].get("labels") or {})
            and gated(pod, keys.QUEUE_GATE)
        )

    def status(self, queue: str) -> dict[str, Any]:
        return dict(self.api.get("gpuplace.io/gpuqueues", queue).get("status") or {})

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value

    async def rounds(self, count: int = 2, timeout: float = 30.0) -> None:
        """Let the controller complete `count` more rounds."""
        target = self.controller.rounds + count
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.controller.rounds < target:
            if loop.time() > deadline:
                raise AssertionError("the queue controller made no progress")
            self.controller.wake()
            await asyncio.sleep(0.01)

    async def quiet(self, timeout: float = 40.0) -> None:
        """Wait until the informers caught up with the API (queued pods, the ledger's
        pods, the queues), the gang controller started every gang its queue admitted, and
        two rounds in a row changed nothing in the API."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await self.rounds(1, timeout)
            before = self._versions()
            store = {uid: pod.resource_version for uid, pod in self.controller.store.pods.items()}
            queued = {
                pod["metadata"]["uid"]: pod["metadata"]["resourceVersion"]
                for pod in self.pods()
                if keys.QUEUE_LABEL in (pod["metadata"].get("labels") or {})
            }
            managed = {
                pod["metadata"]["uid"]: pod["metadata"]["resourceVersion"]
                for pod in self.pods()
                if (pod["metadata"].get("labels") or {}).get(keys.MANAGED) == "true"
            }
            synced = {
                uid: record.resource_version for uid, record in self.h.sidecar.sync.pods.items()
            }
            handed = [  # admitted by its queue, the gang controller has yet to start it
                pod
                for pod in self.pods()
                if plan_mark(pod) is not None
                and not gated(pod, keys.QUEUE_GATE)
                and gated(pod, keys.GANG_GATE)
            ]
            if store == queued and synced == managed and not handed:
                await self.rounds(2, timeout)
                if self._versions() == before:
                    return
            if loop.time() > deadline:
                raise AssertionError("the queue controller did not settle")
            await asyncio.sleep(0.02)

    def _versions(self) -> dict[str, str]:
        found = {pod["metadata"]["uid"]: pod["metadata"]["resourceVersion"] for pod in self.pods()}
        for queue in self.api.objects("gpuplace.io/gpuqueues"):
            found[queue["metadata"]["name"]] = queue["metadata"]["resourceVersion"]
        return found

    async def schedule(self) -> list[str]:
        """kube-scheduler's part: bind every managed pod that is neither gated nor bound
        through the extender's verbs, and start it (phase Running). Returns the names it
        could not place (none, when admission keeps its promise)."""
        left = []
        for pod in self.pods():
            spec = pod.get("spec") or {}
            labels = pod["metadata"].get("labels") or {}
            if labels.get(keys.MANAGED) != "true" or spec.get("nodeName"):
                continue
            if spec.get("schedulingGates") or pod["metadata"].get("deletionTimestamp"):
                continue
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            try:
                await self.h.schedule(pod)
            except (Unschedulable, NoLongerFits):
                left.append(pod["metadata"]["name"])
                continue
            except AssertionError as error:
                if "not found" in str(error) or "no longer exists" in str(error):
                    continue  # evicted (a reclaim) between the list and the bind
                raise
            metadata = pod["metadata"]
            self.api.set_phase(metadata["namespace"], metadata["name"], "Running")
        return left

    def finish(self, name: str, namespace: str = "team-a") -> None:
        """The pod ran to completion."""
        self.api.set_phase(namespace, name, "Succeeded")

    def check(self) -> None:
        """The invariants: no GPU granted twice; every admitted pod holds a grant; no
        queue uses beyond nominal + borrowing limit, no cohort beyond its nominals."""
        pods = self.pods()
        check_grants(self.api.objects("nodes"), pods)
        specs = {spec.name: spec for spec in self.directory.specs()}
        used: dict[str, int] = {}
        for pod in pods:
            labels = pod["metadata"].get("labels") or {}
            queue = labels.get(keys.QUEUE_LABEL)
            if queue is None or gated(pod, keys.QUEUE_GATE):
                continue
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            grant = assignments.grant_of(pod, grammar.request_for(pod))
            assert grant is not None, f"{pod['metadata']['name']} admitted without a grant"
            used[queue] = used.get(queue, 0) + WHOLE * len(grant.gpus)
        cohorts: dict[str, tuple[int, int]] = {}
        for name, amount in used.items():
            spec = specs[name]
            line = spec.quotas.get((quotas.GPUS, quotas.ANY_MODEL))
            if line is None:
                continue
            limit = line.nominal + (
                line.borrowing_limit if line.borrowing_limit is not None else 10**9
            )
            assert amount <= limit, f"queue {name} uses {amount} > {limit}"
            if spec.cohort:
                have, nominal = cohorts.get(spec.cohort, (0, 0))
                cohorts[spec.cohort] = (have + amount, nominal)
        for spec in specs.values():
            line = spec.quotas.get((quotas.GPUS, quotas.ANY_MODEL))
            if spec.cohort and line is not None and spec.cohort in cohorts:
                have, nominal = cohorts[spec.cohort]
                cohorts[spec.cohort] = (have, nominal + line.nominal)
        for cohort, (have, nominal) in cohorts.items():
            assert have <= nominal, f"cohort {cohort} uses {have} > {nominal}"


@contextlib.asynccontextmanager
async def rig(
    server: localapi.Server,
    *,
    settings: QueueSettings = FAST,
    clock: Clock | None = None,
    active: Callable[[], bool] | None = None,
    gangs: bool = True,
    **overrides: Any,
) -> AsyncIterator[Rig]:
    clock = clock or Clock()
    async with harness(server, **overrides) as h:
        registry = CollectorRegistry()
        directory = QueueDirectory()
        work = [
            informer.run()
            for informer in queue_directory.informers(
                h.sidecar.api, directory, page_size=50, watch_seconds=30
            )
        ]
        policy = lambda: h.sidecar.holder.current().policy  # noqa: E731
        if gangs:
            built = gang_wiring.build(
                h.sidecar.api,
                h.sidecar.sync,
                policy,
                fences=h.sidecar.fences,
                recorder=h.sidecar.recorder,
                registry=registry,
                settings=GangSettings(poll_seconds=0.2, settle_seconds=0.005),
                clock=clock,
                active=active,
            )
            work.extend(built.work())
        queues = wiring.build(
            h.sidecar.api,
            h.sidecar.sync,
            policy,
            directory=directory,
            fences=h.sidecar.fences,
            recorder=h.sidecar.recorder,
            registry=registry,
            settings=settings,
            clock=clock,
            active=active,
        )
        work.extend(queues.work())
        made = Rig(h, directory, queues.controller, registry, clock)
        made.tasks = [asyncio.create_task(item) for item in work]
        try:
            await h.synced(
                lambda: (
                    queues.store.synced.is_set()
                    and directory.synced()
                    and h.sidecar.sync.ready.is_set()
                ),
                timeout=30.0,  # the whole suite loads the machine
            )
            yield made
        finally:
            for task in made.tasks:
                task.cancel()
            await asyncio.gather(*made.tasks, return_exceptions=True)


# --- builders --------------------------------------------------------------------------


def nodes(api: localapi.FakeApi, count: int, gpus: int = 4, **kwargs: Any) -> None:
    for i in range(count):
        api.create(objects.node(f"gpu-{i}", gpus=gpus, **kwargs))


def namespace(api: localapi.FakeApi, name: str, **labels: str) -> None:
    api.create(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
    )


def gpuqueue(
    name: str,
    nominal: str,
    *,
    cohort: str | None = None,
    borrowing: str | None = None,
    lending: str | None = None,
    team: str | None = None,
    reclaim: str | None = None,
    weight: str | None = None,
) -> dict[str, Any]:
    """A GpuQueue of whole GPUs (`gpus` on every model) for the namespaces labelled
    `team=<team>` (default: the name's last letter, `team-a` -> `a`)."""
    line: dict[str, Any] = {"name": "gpus", "nominal": nominal}
    if borrowing is not None:
        line["borrowingLimit"] = borrowing
    if lending is not None:
        line["lendingLimit"] = lending
    spec: dict[str, Any] = {
        "namespaceSelector": {"matchLabels": {"team": team or name[-1]}},
        "resources": [line],
    }
    if cohort is not None:
        spec["cohort"] = cohort
    if reclaim is not None:
        spec["preemption"] = {"reclaimWithinCohort": reclaim}
    if weight is not None:
        spec["weight"] = weight
    return {
        "apiVersion": "gpuplace.io/v1alpha1",
        "kind": "GpuQueue",
        "metadata": {"name": name},
        "spec": spec,
    }


def queued(
    name: str,
    queue: str,
    *,
    namespace: str | None = None,
    count: int = 1,
    percent: int | None = None,
    priority: int | None = None,
    gang: str | None = None,
    size: int = 0,
    minimum: int = 0,
    owner: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A queued GPU pod as the webhook leaves it: the queue label and gate (a gang
    member's gang annotations, label and gate too)."""
    annotations: dict[str, str] = {}
    labels = {keys.QUEUE_LABEL: queue}
    gates = [keys.QUEUE_GATE]
    if gang is not None:
        annotations[keys.GANG_NAME] = gang
        annotations[keys.GANG_SIZE] = str(size)
        if minimum:
            annotations[keys.GANG_MIN] = str(minimum)
        labels[keys.GANG_LABEL] = gang
        gates.append(keys.GANG_GATE)
    pod = objects.pod(
        name,
        namespace or f"team-{queue[-1]}",
        percent=percent,
        count=count if percent is None else None,
        annotations=annotations,
        labels=labels,
        gates=gates,
    )
    if priority is not None:
        pod["spec"]["priority"] = priority
    if owner is not None:
        pod["metadata"]["ownerReferences"] = [owner]
    return pod


def two_teams(api: localapi.FakeApi, **kwargs: Any) -> None:
    """docs/queues.md's worked example: team-a and team-b, 4 GPUs each, cohort research."""
    namespace(api, "team-a", team="a")
    namespace(api, "team-b", team="b")
    api.create(gpuqueue("team-a", "4", cohort="research", **kwargs))
    api.create(gpuqueue("team-b", "4", cohort="research", **kwargs))


async def events(r: Rig, namespace: str, reason: str | None = None) -> list[str]:
    """Reasons (or, with `reason`, messages) of the Events in `namespace` so far."""
    if r.h.sidecar.recorder is not None:
        await r.h.sidecar.recorder.drain()
    found = r.api.objects("events", namespace)
    if reason is None:
        return [event["reason"] for event in found]
    return [event["message"] for event in found if event["reason"] == reason]
