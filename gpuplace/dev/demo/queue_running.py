"""The queues scene (`gpuplace demo --scene queues`): two teams share one 8-GPU node through
GpuQueues in one cohort, on the real queue controller.

The stage is the demo's (`running.staged`): the local API, now holding the node
`queue_scene.NODE`, the teams' namespaces and their GpuQueues, and the real `gpuplace
serve` with `--queues` (webhook, extender, gang and queue controllers). Each step of
`queue_scene.steps()` is what people do — submit pods through admission (the real webhook
puts them behind the queue gate) or see pods finish — and then the scene waits, as a
cluster would, for what the controllers decide, playing the parts a cluster has and the
demo does not:

- kube-scheduler (`scheduling.Scheduler`): binds every pod the controllers ungated,
  through the extender's verbs;
- the kubelet: a bound pod runs (phase Running), a finished one is Succeeded, an evicted
  one (deletion requested through the Eviction API) stops and is gone;
- the Job controller: a pod of team A's Job that was evicted is replaced by a new pod of
  the same template, which goes through admission and waits in the queue again.

What is admitted, when, on which GPUs, what a reclaim evicts and how an elastic gang
grows are the controllers' decisions; the scene only reads them back (the pods, their
Events, the GpuQueues' status). After a step it waits until the sidecar's informers and
the queue controller's have caught up with the API and two of the controller's rounds in a
row changed nothing. Each step begins in a new second of the clock: a queue orders its
waiting pods by age, and `metadata.creationTimestamp` counts seconds, so a later step's
pods are never as old as an earlier one's (admissions themselves are ordered to the
microsecond by `assigned-at`, which a reclaim's "most recently admitted first" reads).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from dataclasses import dataclass, field
from typing import Any

from gpuplace.cluster import keys
from gpuplace.dev.demo import queue_scene, running
from gpuplace.dev.demo.admitting import Admitted
from gpuplace.dev.demo.queue_scene import Step
from gpuplace.dev.demo.running import Stage
from gpuplace.dev.demo.scenario import Submission
from gpuplace.dev.localapi import PODS, FakeApi

QUEUES = "gpuplace.io/gpuqueues"
SETTLE_SECONDS = 20.0
"""Longest wait for the controllers after one step (they take well under a second)."""
REACTIONS = 6
"""Most rounds of the played parts (schedule, run, stop, replace) after one step."""


@dataclass(slots=True)
class Seen:
    """One step and what came of it."""

    step: Step
    admitted: list[Admitted] = field(default_factory=list)
    """What `kubectl apply` reported for each submission."""
    played: list[str] = field(default_factory=list)
    """What the played kube-scheduler, kubelet and Job controller did, in order."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """The Events written during the step (the played kube-scheduler's `Scheduled` aside),
    in the order the API stored them."""
    queues: list[dict[str, Any]] = field(default_factory=list)
    """The GpuQueues after the step, their status as the queue controller wrote it."""
    pods: list[dict[str, Any]] = field(default_factory=list)
    """The teams' pods after the step."""


@dataclass(slots=True)
class QueueOutcome:
    steps: list[Seen]
    node: dict[str, Any]
    audit: list[dict[str, Any]]
    policy: str
    seed: int
    timings: dict[str, float] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)


def scene_node() -> dict[str, Any]:
    """The bundled node `queue_scene.NODE`."""
    return next(n for n in running.demo_nodes() if n["metadata"]["name"] == queue_scene.NODE)


def team_pods(api: FakeApi) -> list[dict[str, Any]]:
    """The teams' pods, by namespace and name."""
    found = [
        pod for team in queue_scene.TEAMS for pod in api.objects(PODS, queue_scene.queue_name(team))
    ]
    return sorted(found, key=lambda pod: (pod["metadata"]["namespace"], pod["metadata"]["name"]))


def _key(pod: dict[str, Any]) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


def _owned_by_job(pod: dict[str, Any]) -> bool:
    return any(
        ref.get("kind") == "Job" and ref.get("uid") == queue_scene.JOB_UID
        for ref in pod["metadata"].get("ownerReferences") or []
    )


async def _next_second() -> None:
    """Sleep into the next second of the wall clock (and a little beyond)."""
    await asyncio.sleep(1.0 - time.time() % 1.0 + 0.02)


class QueueDemo(running.Scene):
    """The run; see the module docstring."""

    async def run(self) -> QueueOutcome:
        started = time.perf_counter()
        namespaces = [queue_scene.namespace(team) for team in queue_scene.TEAMS]
        async with running.staged(
            [scene_node()],
            namespaces,
            policy=self.policy,
            seed=self.seed,
            rng=self.rng,
            progress=self.progress,
            queues=True,
        ) as stage:
            self.timings["start_seconds"] = time.perf_counter() - started
            directory = stage.sidecar.directory
            assert directory is not None
            for team in queue_scene.TEAMS:
                stage.api.create(queue_scene.gpuqueue(team))
            await running.until(
                lambda: directory.synced() and len(directory.specs()) == len(queue_scene.TEAMS),
                running.READY_SECONDS,
                "the GpuQueues",
            )
            began = time.perf_counter()
            seen = []
            script = queue_scene.steps()
            for number, step in enumerate(script, 1):
                self.progress(f"[{number}/{len(script)}] {step.title}")
                seen.append(await self._play(stage, step))
            self.timings["steps_seconds"] = time.perf_counter() - began
            ports = stage.ports()
        self.timings["total_seconds"] = time.perf_counter() - started
        return QueueOutcome(
            seen, scene_node(), stage.audit, self.policy, self.seed, self.timings, ports
        )

    async def _play(self, stage: Stage, step: Step) -> Seen:
        api = stage.api
        seen = Seen(step)
        await _next_second()
        mark = api.store.resource_version
        for submission in step.submit:
            seen.admitted.append(await stage.apiserver.create(submission))
        for key in step.finish:
            namespace, _, name = key.partition("/")
            api.set_phase(namespace, name, "Succeeded")
            seen.played.append(f"kubelet: {key} completed (Succeeded)")
        for _ in range(REACTIONS):
            await _settle(stage)
            if not await self._react(stage, seen):
                break
        if stage.sidecar.recorder is not None:
            await asyncio.wait_for(stage.sidecar.recorder.drain(), 5.0)
        seen.events = [
            event
            for team in queue_scene.TEAMS
            for event in api.objects("events", queue_scene.queue_name(team))
            if int(event["metadata"]["resourceVersion"]) > mark
            and event.get("reason") != "Scheduled"
        ]
        seen.events.sort(key=lambda event: int(event["metadata"]["resourceVersion"]))
        seen.queues = copy.deepcopy(
            sorted(api.objects(QUEUES), key=lambda q: q["metadata"]["name"])
        )
        seen.pods = copy.deepcopy(team_pods(api))
        return seen

    async def _react(self, stage: Stage, seen: Seen) -> bool:
        """The played parts, once over the pods: True when any of them acted."""
        api = stage.api
        acted = False
        for pod in team_pods(api):
            metadata = pod["metadata"]
            key = _key(pod)
            if metadata.get("deletionTimestamp"):
                api.delete(PODS, metadata["name"], metadata["namespace"])
                seen.played.append(f"kubelet: {key} stopped (evicted) and is gone")
                acted = True
                if _owned_by_job(pod):
                    again = await stage.apiserver.create(
                        Submission(queue_scene.replacement(pod), queue_scene.ALICE)
                    )
                    seen.admitted.append(again)
                    seen.played.append(
                        f"Job controller: {again.submission.key} replaces {key}"
                        + ("" if again.pod is not None else f", refused: {again.error}")
                    )
                continue
            if not stage.scheduler.schedulable(pod):
                continue
            attempt = await stage.scheduler.schedule(metadata["namespace"], metadata["name"])
            if attempt.node is None:
                seen.played.append(f"kube-scheduler: {key} not placed: {attempt.message}")
                continue
            bound = api.get(PODS, metadata["name"], metadata["namespace"])
            gpus = (bound["metadata"].get("annotations") or {}).get(keys.ASSIGNED_GPUS, "?")
            api.set_phase(metadata["namespace"], metadata["name"], "Running")
            seen.played.append(
                f"kube-scheduler: {key} bound to {attempt.node} (GPUs {gpus}); kubelet: running"
            )
            acted = True
        return acted


async def _settle(stage: Stage) -> None:
    """Wait until the informers hold the API's pods and two queue rounds in a row (with
    the gang controller's work between them) left the API as it was. The queue
    controller is woken for each round (rounds otherwise wait for a change, or their
    poll): the demo waits for its decisions, it does not make them."""
    queues = stage.sidecar.queues
    assert queues is not None
    controller = queues.controller
    api = stage.api
    deadline = time.monotonic() + SETTLE_SECONDS

    async def rounds(count: int) -> None:
        target = controller.rounds + count
        while controller.rounds < target:
            if time.monotonic() > deadline:
                raise TimeoutError("the demo gave up waiting for the queue controller's rounds")
            controller.wake()
            await asyncio.sleep(0.01)

    def store_caught_up() -> bool:
        """The queue controller's informer holds every queued pod as the API does."""
        queued = {
            pod["metadata"]["uid"]: pod["metadata"]["resourceVersion"]
            for pod in api.objects(PODS)
            if keys.QUEUE_LABEL in (pod["metadata"].get("labels") or {})
        }
        held = {uid: pod.resource_version for uid, pod in controller.store.pods.items()}
        return queued == held

    while True:
        await rounds(1)
        before = _versions(api)
        if stage.caught_up() and store_caught_up():
            await rounds(2)
            await asyncio.sleep(0.05)
            if _versions(api) == before:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the demo gave up waiting for the queue controller after {SETTLE_SECONDS:g}s"
            )
        await asyncio.sleep(0.02)


def _versions(api: FakeApi) -> str:
    """The resourceVersions of the pods and GpuQueues (what the controllers write)."""
    found = {
        f"{pod['metadata']['namespace']}/{pod['metadata']['name']}": pod["metadata"][
            "resourceVersion"
        ]
        for pod in api.objects(PODS)
    }
    found |= {q["metadata"]["name"]: q["metadata"]["resourceVersion"] for q in api.objects(QUEUES)}
    return json.dumps(found, sort_keys=True)
