"""One demo run: certificates, the local API with the bundled nodes, the real `gpuplace
serve` composition in this process, then every pod of the scenario through kube-apiserver's
admission and kube-scheduler's cycle (both played here), and what came of it.

Order of events, all on 127.0.0.1 with ephemeral ports:

1. a fresh CA and serving certificate (`gpuplace.certs.renewal.issue`, written as `gpuplace certs`
   writes files) into a temporary directory;
2. `gpuplace.dev.localapi` serves the nodes of `gpuplace/dev/data/demo-nodes.json`, enforcing
   the RBAC that deploy/ ships (bearer tokens; skipped, with a warning, where deploy/ is
   not next to the package: an installed wheel); the sidecar's kubeconfig presents the
   gpuplace ServiceAccount, the explanations' an admin (they are a user's command);
3. `gpuplace.wiring.composing.compose` builds the process exactly as `gpuplace serve
   --kubeconfig …` does (webhook on TLS, extender sidecar with its informers, gang
   controller, ops site); it runs until the end of the demo; `/readyz` is awaited, and
   the sidecar's node status advertisements;
4. each pod: admission (`admitting.ApiServer`), then, if it is schedulable, one
   scheduling cycle (`scheduling.Scheduler`); a gang that just became complete is
   given time for the gang controller to plan and ungate it, and its members are then
   scheduled; every decision is the real webhook's and the real extender's;
5. the pending and waiting pods are explained as `gpuplace explain` does (a fresh
   ledger from the API, the pod's Events); the process is stopped (audit log flushed),
   and the outcome returned for `reporting` and `plotting`.

The process's settings ignore GPUPLACE_* environment variables: the demo never talks to
anything but its own local API.

The same seed gives the same placements on any machine, loaded or not: nothing a decision
depends on may hang on timing. So the typical workload is rebuilt whenever a pod arrived
(`workload_refresh_seconds=0`; production rebuilds at most every 60 s, on a clock), no
warmer scores ahead (on 36 nodes it saves nothing, and its staged rebuilds would reach
the verbs at a time that depends on the machine's speed), and each scheduling cycle
starts once the sidecar's informers hold every managed pod as the API does.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import random
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from gpuplace.certs import files as cert_files
from gpuplace.certs import issuing, renewal
from gpuplace.cluster import connecting, keys, kube, mirroring, nodes, pods
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev import localapi
from gpuplace.dev.demo import scenario, scheduling
from gpuplace.dev.demo.admitting import Admitted, ApiServer
from gpuplace.dev.demo.scheduling import Attempt, Scheduler
from gpuplace.dev.localapi import NODES, PODS, FakeApi
from gpuplace.extender import explaining
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement.ledger import Ledger
from gpuplace.wiring import composing
from gpuplace.wiring.settings import Settings
from gpuplace.wiring.sidecar import Sidecar

log = logging.getLogger(__name__)

NAMESPACES = ("gpuplace", "research", "serving", "platform")
READY_SECONDS = 15.0
GANG_SECONDS = 15.0


class DemoSettings(Settings):
    """`gpuplace serve`'s settings from the given values and the defaults only: no
    environment variables (a GPUPLACE_KUBECONFIG must not send the demo elsewhere)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def demo_nodes() -> list[dict[str, Any]]:
    """The bundled cluster: `kubectl get nodes -o json` of 36 nodes."""
    text = resources.files("gpuplace.dev").joinpath("data/demo-nodes.json").read_text("utf-8")
    items = json.loads(text)["items"]
    assert isinstance(items, list)
    return items


@dataclass(slots=True)
class PodResult:
    submission: scenario.Submission
    admitted: Admitted
    attempts: list[Attempt] = field(default_factory=list)
    final: dict[str, Any] | None = None
    """The pod as the API holds it at the end (None when refused)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    explanation: explaining.Explanation | None = None
    """`gpuplace explain` of a pod left pending or waiting."""

    @property
    def key(self) -> str:
        return self.submission.key

    @property
    def node(self) -> str | None:
        if self.final is None:
            return None
        node = (self.final.get("spec") or {}).get("nodeName")
        return str(node) if node else None

    @property
    def gated(self) -> bool:
        return bool(self.final and (self.final.get("spec") or {}).get("schedulingGates"))


@dataclass(slots=True)
class Outcome:
    results: list[PodResult]
    ledger: Ledger
    """The sidecar's ledger at the end (who holds which share of which GPU)."""
    requests: list[Any]
    """The GPU requests of the managed pods (the typical workload's source)."""
    audit: list[dict[str, Any]]
    policy: str
    seed: int
    timings: dict[str, float] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)


Progress = Callable[[str], None]


def _write_certificates(directory: Path) -> Path:
    spec = issuing.Spec(
        dns_names=issuing.service_names("gpuplace-webhook", "gpuplace"),
        ip_addresses=(ipaddress.IPv4Address("127.0.0.1"),),
    )
    material = renewal.issue((), spec, datetime.now(UTC))
    cert_files.write(directory, material)
    return directory


def _settings(
    workdir: Path, tls: Path, kubeconfig: Path, policy: str, *, queues: bool = False
) -> DemoSettings:
    """With `queues` the queue controller runs too, its rounds as often as changes come
    (`queue_min_round_seconds=0`: production spaces them a second apart, on a clock)."""
    return DemoSettings(
        webhook_address="127.0.0.1",
        webhook_port=0,
        extender_address="127.0.0.1",
        extender_port=0,
        metrics_address="127.0.0.1",
        metrics_port=0,
        cert_file=tls / cert_files.TLS_CERT,
        key_file=tls / cert_files.TLS_KEY,
        audit_log=str(workdir / "audit.jsonl"),
        audit_log_max_bytes=0,
        kubeconfig=kubeconfig,
        inventory=None,
        policy=policy,
        gangs=True,
        log_level="WARNING",
        workload_refresh_seconds=0.0,
        warm_shapes=0,
        node_status_min_interval_seconds=0.0,
        gc_freeze_seconds=0.0,
        watch_timeout_seconds=60,
        queues=queues,
        queue_min_round_seconds=0.0 if queues else 1.0,
    )


async def until(
    check: Callable[[], bool], seconds: float, what: str, *, poll: float = 0.02
) -> None:
    """Wait until `check()` holds; TimeoutError naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the demo gave up waiting for {what} after {seconds:g}s")
        await asyncio.sleep(poll)


def _caught_up(api: FakeApi, sidecar: Sidecar) -> bool:
    """The sidecar's informers hold every managed pod at its current resourceVersion."""
    managed = {
        pod["metadata"]["uid"]: pod["metadata"]["resourceVersion"]
        for pod in api.objects(PODS)
        if (pod["metadata"].get("labels") or {}).get(keys.MANAGED) == "true"
    }
    seen = {uid: record.resource_version for uid, record in sidecar.sync.pods.items()}
    return managed == seen


def _advertised(api: FakeApi) -> bool:
    """The sidecar has written every gpuplace node's resources and NVLink label."""
    for node in api.objects(NODES):
        if not nodes.is_enabled(node):
            continue
        parsed = nodes.parse(node)
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        for key, value in nodes.advertisement(parsed).items():
            if allocatable.get(key) != value:
                return False
        if keys.NVLINK_DOMAIN_SIZE not in (node["metadata"].get("labels") or {}):
            return False
    return True


@contextlib.asynccontextmanager
async def _running(process: composing.Process) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(process.server.run(stop), name="gpuplace-demo-serve")
    started = asyncio.create_task(process.server.started.wait())
    try:
        done, _ = await asyncio.wait(
            {task, started}, timeout=READY_SECONDS, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            task.result()  # the start failed: raise why
        if started not in done:
            raise TimeoutError("gpuplace serve did not start")
        yield
    finally:
        started.cancel()
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


async def _ready(session: aiohttp.ClientSession, ops_port: int) -> None:
    url = f"http://127.0.0.1:{ops_port}/readyz"
    deadline = time.monotonic() + READY_SECONDS
    while True:
        async with session.get(url) as response:
            if response.status == 200:
                return
            reasons = await response.text()
        if time.monotonic() > deadline:
            raise TimeoutError(f"gpuplace serve did not become ready: {reasons}")
        await asyncio.sleep(0.05)


def _gang_of(pod: dict[str, Any]) -> tuple[str, str, int] | None:
    annotations = pod["metadata"].get("annotations") or {}
    name = annotations.get(keys.GANG_NAME)
    try:
        size = int(annotations.get(keys.GANG_SIZE, "0"))
    except ValueError:
        return None
    return (str(pod["metadata"]["namespace"]), str(name), size) if name else None


def _gated(pod: dict[str, Any]) -> bool:
    return bool((pod.get("spec") or {}).get("schedulingGates"))


async def _explain(
    kubeconfig: Path, policy: str, namespace: str, name: str
) -> explaining.Explanation:
    """What `gpuplace explain NAMESPACE/NAME` computes, from the API as it is now."""
    client = await connecting.api_client(kubeconfig, in_cluster=False)
    api = kube.Kube(client)
    try:
        pod = await api.get_pod(namespace, name)
        sync = LedgerSync()
        await mirroring.Mirror(api, sync).load()
        events = await api.pod_events(namespace, name)
    finally:
        await api.close()
    events.sort(key=lambda event: str(event.get("lastTimestamp") or event.get("eventTime") or ""))
    holder = PolicyHolder(sync, policy, refresh_seconds=0.0)
    conditions = (pod.get("status") or {}).get("conditions") or []
    return explaining.explain(sync, holder, pods.record(pod), events=events, conditions=conditions)


def _access() -> localapi.Access | None:
    """The shipped RBAC for the local API, or None (with a warning) without deploy/."""
    try:
        return localapi.Access.shipped()
    except localapi.ManifestsMissing as error:
        log.warning("the local API enforces no RBAC", extra={"why": str(error)})
        return None


@dataclass(slots=True)
class Stage:
    """A scene's stage: the local API with its nodes and namespaces, the real `gpuplace
    serve` running over it (ready, nodes advertised), and the played kube-apiserver and
    kube-scheduler; see `staged`."""

    api: FakeApi
    process: composing.Process
    sidecar: Sidecar
    apiserver: ApiServer
    scheduler: Scheduler
    user: Path
    """An admin's kubeconfig (what `gpuplace explain` runs with)."""
    audit: list[dict[str, Any]] = field(default_factory=list)
    """The webhook's audit log, read once the process stopped (after `staged`)."""

    def ports(self) -> dict[str, int]:
        return {name: self.process.server.port(name) for name in ("webhook", "extender", "ops")}

    def caught_up(self) -> bool:
        """The sidecar's informers hold every managed pod as the API does."""
        return _caught_up(self.api, self.sidecar)


@contextlib.asynccontextmanager
async def staged(
    nodes: list[dict[str, Any]],
    namespaces: Iterable[dict[str, Any]],
    *,
    policy: str,
    seed: int,
    rng: random.Random,
    progress: Progress,
    queues: bool = False,
) -> AsyncIterator[Stage]:
    """Steps 1 to 3 of the module docstring for `nodes` and `namespaces` (Namespace
    objects), the process with the queue controller where `queues`; stopped on exit, its
    audit log then in `Stage.audit`. `rng` is the played kube-scheduler's pick."""
    with tempfile.TemporaryDirectory(prefix="gpuplace-demo-") as temporary:
        workdir = Path(temporary)
        progress("generating a CA and the webhook's serving certificate")
        tls = _write_certificates(workdir / "tls")
        async with localapi.serve(FakeApi(access=_access())) as api_server:
            api = api_server.api
            for namespace in namespaces:
                api.create(namespace)
            for node in nodes:
                api.create(node)
            kubeconfig = api_server.kubeconfig(workdir / "kubeconfig", localapi.GPUPLACE)
            user = api_server.kubeconfig(workdir / "user-kubeconfig", localapi.ADMIN)
            config = _settings(workdir, tls, kubeconfig, policy, queues=queues)
            lease_namespace, _, lease_name = config.scheduler_lease.partition("/")
            parts = "webhook, extender, gang controller" + (", queue controller" if queues else "")
            progress(f"starting gpuplace serve ({parts})")
            registry = CollectorRegistry()
            process = await composing.compose(config, registry, rng=random.Random(seed))
            assert process.sidecar is not None
            async with (
                scheduling.leading(api, lease_namespace, lease_name),
                _running(process),
                aiohttp.ClientSession() as session,
            ):
                await _ready(session, process.server.port("ops"))
                await until(lambda: _advertised(api), READY_SECONDS, "node advertisements")
                server = process.server
                stage = Stage(
                    api,
                    process,
                    process.sidecar,
                    ApiServer(
                        api,
                        session,
                        f"https://127.0.0.1:{server.port('webhook')}",
                        str(tls / cert_files.CA_BUNDLE),
                    ),
                    Scheduler(api, session, f"http://127.0.0.1:{server.port('extender')}", rng),
                    user,
                )
                yield stage
        stage.audit = _read_audit(workdir / "audit.jsonl")


def namespace(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if labels:
        metadata["labels"] = dict(labels)
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata}


class Scene:
    """What every scene's run starts from: the seed (of the played kube-scheduler's pick,
    `rng`, and of the policy), the sidecar's policy, where progress goes, its timings."""

    def __init__(self, *, seed: int, policy: str, progress: Progress) -> None:
        self.seed = seed
        self.policy = policy
        self.progress = progress
        self.rng = random.Random(seed)
        self.timings: dict[str, float] = {}


class Demo(Scene):
    """The run; see the module docstring."""

    async def run(self) -> Outcome:
        started = time.perf_counter()
        async with staged(
            demo_nodes(),
            [namespace(name) for name in NAMESPACES],
            policy=self.policy,
            seed=self.seed,
            rng=self.rng,
            progress=self.progress,
        ) as stage:
            self.timings["start_seconds"] = time.perf_counter() - started
            results = await self._submit_all(stage)
            await self._settle(stage.api, stage.process)
            for result in results:
                await self._finish(stage.api, result, stage.user)
            ports = stage.ports()
            ledger = stage.sidecar.sync.ledger
            requests = [
                r.request for r in stage.sidecar.sync.pods.values() if r.request is not None
            ]
        self.timings["total_seconds"] = time.perf_counter() - started
        return Outcome(
            results, ledger, requests, stage.audit, self.policy, self.seed, self.timings, ports
        )

    async def _submit_all(self, stage: Stage) -> list[PodResult]:
        api, apiserver, scheduler, sidecar = (
            stage.api,
            stage.apiserver,
            stage.scheduler,
            stage.sidecar,
        )

        async def cycle(submission: scenario.Submission) -> Attempt:
            # kube-scheduler calls filter as soon as the pod is in its queue, whether or
            # not the sidecar's watch has delivered it yet; the demo waits for that first,
            # so that the typical workload each decision scores against is the same on a
            # fast machine and a loaded one (see the module docstring).
            await until(
                lambda: _caught_up(api, sidecar),
                READY_SECONDS,
                "the sidecar's informers",
                poll=0.002,
            )
            return await scheduler.schedule(submission.namespace, submission.name)

        submissions = scenario.submissions()
        results: list[PodResult] = []
        by_key: dict[str, PodResult] = {}
        waiting: list[PodResult] = []
        began = time.perf_counter()
        for number, submission in enumerate(submissions, 1):
            self.progress(f"[{number:2d}/{len(submissions)}] {submission.key}")
            admitted = await apiserver.create(submission)
            result = PodResult(submission, admitted)
            results.append(result)
            by_key[result.key] = result
            stored = admitted.pod
            if stored is None:
                continue
            if scheduler.schedulable(stored):
                result.attempts.append(await cycle(submission))
                continue
            if not _gated(stored):
                continue
            waiting.append(result)
            gang = _gang_of(stored)
            if gang is None:
                continue
            members = [r for r in waiting if r.admitted.pod and _gang_of(r.admitted.pod) == gang]
            if len(members) < gang[2]:
                continue
            self.progress(f"gang {gang[0]}/{gang[1]} complete: waiting for the gang controller")

            def ungated(members: list[PodResult] = members) -> bool:
                return not any(
                    _gated(api.get(PODS, r.submission.name, r.submission.namespace))
                    for r in members
                )

            gang_began = time.perf_counter()
            await until(ungated, GANG_SECONDS, f"gang {gang[1]} to be ungated")
            self.timings["gang_ungate_seconds"] = time.perf_counter() - gang_began
            for member in members:
                waiting.remove(member)
                current = api.get(PODS, member.submission.name, member.submission.namespace)
                if scheduler.schedulable(current):
                    self.progress(f"scheduling gang member {member.key}")
                    member.attempts.append(await cycle(member.submission))
        self.timings["pods_seconds"] = time.perf_counter() - began
        return results

    async def _settle(self, api: FakeApi, process: composing.Process) -> None:
        """Let the sidecar's informers catch up with the API and flush its Events."""
        sidecar = process.sidecar
        assert sidecar is not None
        self.progress("letting the sidecar catch up with the API")
        await until(lambda: _caught_up(api, sidecar), READY_SECONDS, "the sidecar's informers")
        if sidecar.recorder is not None:
            await asyncio.wait_for(sidecar.recorder.drain(), 5.0)

    async def _finish(self, api: FakeApi, result: PodResult, kubeconfig: Path) -> None:
        if result.admitted.refused:
            return
        sub = result.submission
        result.final = api.get(PODS, sub.name, sub.namespace)
        uid = result.final["metadata"]["uid"]
        result.events = sorted(
            (
                event
                for event in api.objects("events", sub.namespace)
                if (event.get("involvedObject") or {}).get("uid") == uid
            ),
            key=lambda event: int(event["metadata"]["resourceVersion"]),
        )
        if result.node is None:
            self.progress(f"explaining why {result.key} is not running")
            result.explanation = await _explain(kubeconfig, self.policy, sub.namespace, sub.name)


def _read_audit(path: Path) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    if not path.exists():
        return lines
    for line in path.read_text("utf-8").splitlines():
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict):
                lines.append(value)
    return lines
