"""Several CUDA processes in one pod (issue 43, point 3): replayed NVML of the two captured
MPS clients (`nvml-mps-clients.json`), both written into one pod's cgroup in a temporary
proc root, caught in the first sample that sees them: an Event on the pod, a metric and
an audit line through the real API client against the local API server (as the node
agent's own ServiceAccount, under the shipped RBAC), and an eviction through the Eviction
API only where the operator chose it, its PodDisruptionBudget respected."""

from __future__ import annotations

import copy
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpuplace.agent import auditing, cgroups, enforcing, nvml, overgrant, usage_sampling
from gpuplace.cluster import connecting, kube, mps_limits, recording
from gpuplace.dev import localapi
from gpuplace.runtime.jsonlines import StreamSink
from gpuplace.usage import names
from tests.agent.kubelet import gpu_fixture
from tests.agent.kubelet import pod as granted_pod

NODE = "h100-0"
H100 = "GPU-73fa5a53-ad78-0389-6c40-cf23e8e3170c"
MIB = 1 << 20
CONTEXTS = {H100: mps_limits.MODELS["NVIDIA-H100-80GB-HBM3"].context}
CLIENTS = (629, 630)
"""The captured MPS clients: 2,244 and 1,168 MiB (2 and 1 GiB held, their contexts)."""


def reading() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(gpu_fixture("nvml-mps-clients.json").read_text())
    return loaded


def in_pod(proc: Path, pid: int, uid: str) -> None:
    """Process `pid` in pod `uid`'s cgroup, as the kit's kubelet writes it (cgroupfs, v1)."""
    (proc / str(pid)).mkdir(exist_ok=True)
    (proc / str(pid) / "cgroup").write_text(
        f"12:memory:/kubepods/burstable/pod{uid}/{'b' * 64}\n"
        f"1:name=systemd:/kubepods/burstable/pod{uid}/{'b' * 64}\n"
    )


def running(
    server: localapi.Server, name: str, milli: int = 250, memory_mib: int = 2048, **labels: str
) -> str:
    """A share granted on the H100, bound and running; its UID (the API's)."""
    made = granted_pod(name, [0], [H100], milli=milli, memory_mib=memory_mib, node=NODE)
    made["metadata"].pop("uid")
    made["metadata"]["labels"].update(labels)
    uid: str = server.api.create(made)["metadata"]["uid"]
    ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    server.api.patch("pods", name, {"status": ready}, "research", subresource="status")
    return uid


@pytest.fixture
async def server() -> AsyncIterator[localapi.Server]:
    async with localapi.serve(localapi.FakeApi()) as running:
        yield running


@pytest.fixture
async def api(server: localapi.Server) -> AsyncIterator[kube.Kube]:
    client = connecting.client_for(server.configuration(localapi.NODE_AGENT))
    api = kube.Kube(client, timeout=5.0)
    yield api
    await api.close()


class Agent:
    """The agent's sampler and enforcer over the replayed reading and a proc root."""

    def __init__(self, api: kube.Kube, proc: Path, source: dict[str, Any], *, evict: bool):
        self.registry = CollectorRegistry()
        self.replay = nvml.Replay(source)
        self.pods: list[dict[str, Any]] = []
        self.sampler = usage_sampling.Sampler(
            usage_sampling.Meter(self.replay, NODE, cgroups.Proc(proc)),
            lambda: list(self.pods),
            registry=self.registry,
        )
        self.stream = io.StringIO()
        self.audit = auditing.AgentAudit(StreamSink(self.stream), NODE, batch_seconds=0.0)
        self.recorder = recording.Recorder(api, reporting="gpuplace.io/node-agent")
        self.enforcer = enforcing.Enforcer(
            api,
            self.recorder,
            self.audit,
            NODE,
            contexts=lambda: CONTEXTS,
            evict=evict,
            registry=self.registry,
        )
        self.registry.register(self.enforcer)
        self.sampler.listeners.append(self.enforcer.on_sample)
        by_uid = lambda: {p["metadata"]["uid"]: p for p in self.pods}  # noqa: E731
        self.registry.register(
            usage_sampling.UsageCollector(NODE, self.sampler, usage_sampling.live_in(by_uid, NODE))
        )

    async def sample(self, server: localapi.Server) -> usage_sampling.Sample:
        self.pods = server.api.objects("pods", "research")
        taken = await self.sampler.sample_once()
        await self.recorder.drain()
        self.audit.flush()
        return taken

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def events(server: localapi.Server, reason: str) -> list[dict[str, Any]]:
    return [e for e in server.api.objects("events", "research") if e["reason"] == reason]


async def test_two_processes_of_one_pod_are_caught_in_the_first_sample(
    server: localapi.Server, api: kube.Kube, tmp_path: Path
) -> None:
    uid = running(server, "train")  # 25 %, 2 GiB: each client's limit 2317 MiB
    for pid in CLIENTS:
        in_pod(tmp_path, pid, uid)
    agent = Agent(api, tmp_path, reading(), evict=False)
    sample = await agent.sample(server)
    (use,) = sample.pods
    assert (use.processes, use.memory_used) == (2, 2353004544 + 1224736768)  # 3,412 MiB
    found = {finding.kind: finding for finding in agent.enforcer.caught.values()}
    assert set(found) == {overgrant.Kind.MEMORY, overgrant.Kind.CLIENTS}
    assert found[overgrant.Kind.MEMORY].allowed_bytes == (2048 + 269 + 64) * MIB
    # an Event on the pod, from the node agent
    (event,) = [e for e in events(server, enforcing.OVER_GRANT) if "hold 3412 MiB" in e["message"]]
    assert event["type"] == "Warning" and event["involvedObject"]["uid"] == uid
    assert event["reportingComponent"] == "gpuplace.io/node-agent"
    assert "more than its grant of 2048 MiB with one CUDA context (2317 MiB" in event["message"]
    assert "does not evict (--evict-over-grant is off)" in event["message"]
    (clients,) = [
        e for e in events(server, enforcing.OVER_GRANT) if "2 MPS clients" in e["message"]
    ]
    assert "2 MPS clients of this pod on GPU 0" in clients["message"]
    assert "compute cannot be read per pod under MPS" in clients["message"]
    # a metric
    for kind in ("memory", "clients"):
        labels = {"node": NODE, "gpu": "0", "uuid": H100, "namespace": "research", "pod": "train"}
        assert agent.metric(names.POD_OVER_GRANT, **labels, kind=kind) == 1.0
        assert agent.metric("gpuplace_agent_over_grant_total", kind=kind) == 1.0
    labels = {"node": NODE, "gpu": "0", "uuid": H100, "namespace": "research", "pod": "train"}
    assert agent.metric(names.POD_PROCESSES, **labels) == 2.0  # its MPS clients, counted
    # an audit line each, as the webhook writes them
    lines = agent.lines()
    assert [(line["kind"], line["decision"]) for line in lines] == [
        ("memory", "reported"),
        ("clients", "reported"),
    ]
    memory = lines[0]
    assert list(memory)[:7] == ["time", "component", "node", "event", "uid", "namespace", "name"]
    assert memory["time"].endswith("Z") and memory["component"] == "node-agent"
    assert (memory["uid"], memory["name"], memory["gpu"], memory["uuid"]) == (uid, "train", 0, H100)
    assert (memory["processes"], memory["usedBytes"]) == (2, 3577741312)
    assert (memory["reason"], memory["event"]) == ("MemoryOverGrant", "overGrant")
    # nothing evicted: the operator did not choose it
    assert server.api.get("pods", "train", "research")["metadata"].get("deletionTimestamp") is None
    # the next sample repeats nothing while the catch lasts
    await agent.sample(server)
    assert len(agent.lines()) == 2 and len(events(server, enforcing.OVER_GRANT)) == 2


async def test_one_client_within_its_limit_and_whole_gpus_are_never_caught(
    server: localapi.Server, api: kube.Kube, tmp_path: Path
) -> None:
    big = running(server, "big", milli=300, memory_mib=8192)
    small = running(server, "small", milli=200, memory_mib=1024)
    in_pod(tmp_path, 629, big)  # 2,244 MiB of 8 GiB: well inside
    in_pod(tmp_path, 630, small)  # 1,168 MiB: its 1 GiB and its context (1024 + 244 allowed)
    agent = Agent(api, tmp_path, reading(), evict=True)
    await agent.sample(server)
    assert agent.enforcer.caught == {}
    assert events(server, enforcing.OVER_GRANT) == [] and agent.lines() == []
    whole = running(server, "whole", milli=1000, memory_mib=0)
    for pid in CLIENTS:
        in_pod(tmp_path, pid, whole)  # a whole GPU is the pod's: any number of processes
    await agent.sample(server)
    assert agent.enforcer.caught == {}


def test_the_tolerance_is_the_line() -> None:
    """Synthetic: the captured clients' memory set so that the pod holds exactly its
    grant, one context and the tolerance, then 1 MiB more."""
    limit = 2048 + 269
    for held, caught in (((limit + 64) * MIB, False), ((limit + 65) * MIB, True)):
        use = usage_sampling.PodUse(
            "u", "research", "train", 0, H100, held, None, 2048 * MIB, 0.25, 1, 250
        )
        sample = usage_sampling.Sample(pods=(use,))
        kinds = {f.kind for f in overgrant.find(sample, CONTEXTS, tolerance_mib=64)}
        assert (overgrant.Kind.MEMORY in kinds) is caught


async def test_eviction_where_chosen_respects_the_pods_disruption_budget(
    server: localapi.Server, api: kube.Kube, tmp_path: Path
) -> None:
    uid = running(server, "train", app="train")
    for pid in CLIENTS:
        in_pod(tmp_path, pid, uid)
    server.api.create(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "train", "namespace": "research"},
            "spec": {"selector": {"matchLabels": {"app": "train"}}, "minAvailable": 1},
        }
    )

    def allow(count: int) -> None:
        status = {
            "disruptionsAllowed": count,
            "currentHealthy": 1,
            "desiredHealthy": 1 - count,
            "expectedPods": 1,
            "observedGeneration": 1,
        }
        server.api.patch(
            "policy/poddisruptionbudgets",
            "train",
            {"status": status},
            "research",
            subresource="status",
        )

    allow(0)
    agent = Agent(api, tmp_path, reading(), evict=True)
    await agent.sample(server)
    refused = events(server, enforcing.OVER_GRANT_EVICTION)
    assert refused and "PodDisruptionBudget allows no disruption now" in refused[0]["message"]
    assert [line["decision"] for line in agent.lines()] == [
        "evicting",
        "evicting",
        "evictionRefused",
    ]
    assert agent.lines()[-1]["reason"] == "TooManyRequests"
    assert agent.metric("gpuplace_agent_over_grant_evictions_total", result="refused") == 1.0
    assert server.api.get("pods", "train", "research")["metadata"].get("deletionTimestamp") is None
    await agent.sample(server)  # asked again; the audit log says it once
    assert agent.metric("gpuplace_agent_over_grant_evictions_total", result="refused") == 2.0
    assert [line["decision"] for line in agent.lines()].count("evictionRefused") == 1
    allow(1)
    await agent.sample(server)
    assert agent.metric("gpuplace_agent_over_grant_evictions_total", result="evicted") == 1.0
    assert agent.lines()[-1]["decision"] == "evicted"
    gone = [p for p in server.api.objects("pods", "research") if p["metadata"]["name"] == "train"]
    assert gone == [] or gone[0]["metadata"].get("deletionTimestamp")
    evicted = events(server, enforcing.OVER_GRANT_EVICTION)
    assert any("evicted through the Eviction API" in e["message"] for e in evicted)


async def test_a_clean_sample_clears_the_catch(
    server: localapi.Server, api: kube.Kube, tmp_path: Path
) -> None:
    uid = running(server, "train")
    for pid in CLIENTS:
        in_pod(tmp_path, pid, uid)
    agent = Agent(api, tmp_path, reading(), evict=False)
    await agent.sample(server)
    quiet = copy.deepcopy(reading())  # synthetic: the second client has exited
    gpu = quiet["gpus"][0]
    gpu["mps_processes"] = [p for p in gpu["mps_processes"] if p["pid"] == 629]
    gpu["compute_processes"] = [p for p in gpu["compute_processes"] if p["pid"] != 630]
    agent.replay.replace(quiet)
    await agent.sample(server)
    assert agent.enforcer.caught == {}
    assert [line["decision"] for line in agent.lines()][-2:] == ["cleared", "cleared"]
    assert agent.metric(names.POD_OVER_GRANT, node=NODE, gpu="0", uuid=H100,
                        namespace="research", pod="train", kind="memory") is None  # fmt: skip
