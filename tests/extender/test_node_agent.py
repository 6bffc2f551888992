"""The sidecar and the node agent's reports: no new GPU pod goes on a node whose agent
is silent past the bound, or on a GPU it marked unhealthy; filter's reasons and kept
answers say so; pods already there keep their grants."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpuplace.agent import publishing
from gpuplace.cluster import keys, metering, nodes, pods
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.extender import explaining
from gpuplace.extender.deciding import Decider
from gpuplace.extender.repeating import Answer, Repeats
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement import fit
from gpuplace.placement.choosing import Choice
from gpuplace.placement.ledger import Grant, Oversubscribed
from tests.extender.conftest import harness

NOW = 1_800_000_000.0
BOUND = 120.0


class Wall:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def agent_node(
    name: str, *, gpus: int = 2, beat: float | None = NOW, unhealthy: tuple[int, ...] = ()
) -> dict[str, Any]:
    body = objects.node(name, gpus=gpus)
    body["metadata"]["uid"] = f"uid-{name}"
    entries = [
        {
            "index": index,
            "uuid": f"GPU-{name}-{index}",
            "model": "A100-SXM4-80GB",
            "memoryMiB": 81920,
            "pci": None,
            "numa": None,
            "nvlink": None,
            "peers": None,
            "mig": False,
            "health": "unhealthy" if index in unhealthy else "healthy",
            "reasons": ["XID 79"] if index in unhealthy else [],
        }
        for index in range(gpus)
    ]
    annotations = body["metadata"]["annotations"]
    annotations[keys.NODE_GPUS] = json.dumps(entries)
    if beat is not None:
        annotations[keys.AGENT_HEARTBEAT] = publishing.heartbeat(beat)
    return body


def setup(*bodies: dict[str, Any], require_agent: bool = False) -> tuple[LedgerSync, Decider, Wall]:
    wall = Wall()
    sync = LedgerSync(agent_silence=BOUND, require_agent=require_agent, wall=wall)
    sync.replace_nodes(nodes.record(body) for body in bodies)
    return sync, Decider(sync, PolicyHolder(sync, "default")), wall


def gpu_pod(name: str, **options: Any) -> dict[str, Any]:
    body = objects.pod(name, **options)
    body["metadata"]["uid"] = f"uid-{name}"
    return body


def test_closed_reason_follows_the_heartbeat_and_the_bound() -> None:
    fresh = nodes.record(agent_node("a"))
    assert nodes.closed_reason(fresh, NOW + BOUND, silence=BOUND) == ""
    silent = nodes.closed_reason(fresh, NOW + BOUND + 1, silence=BOUND)
    assert silent == "node agent silent since 2027-01-15T08:00:00Z (more than 120s)"
    assert nodes.closed_reason(fresh, NOW + 10 * BOUND, silence=BOUND) == silent
    assert nodes.closed_reason(fresh, NOW + 10 * BOUND, silence=0) == ""
    never = nodes.record(agent_node("b", beat=None))
    assert nodes.closed_reason(never, NOW, silence=BOUND) == ""
    assert "requires one" in nodes.closed_reason(never, NOW, silence=BOUND, require_agent=True)
    body = agent_node("c")
    body["metadata"]["annotations"][keys.AGENT_HEARTBEAT] = "yesterday"
    assert "not an RFC 3339 time" in nodes.closed_reason(nodes.record(body), NOW, silence=BOUND)


def test_a_silent_agent_closes_its_node_to_new_pods_and_running_pods_keep_their_grants() -> None:
    sync, decider, wall = setup(agent_node("a"), agent_node("b"))
    held = Grant("uid-running", "a", (0,), 500, 1024)
    sync.ledger.reserve(held)
    pod = gpu_pod("new", percent=50)
    both = decider.filter(pod, ["a", "b"])
    assert both.fitting == 2 and not both.misfits
    assert both.passed == ["a"]  # the policy's best: the half-used GPU
    wall.now += BOUND + 1
    sync.put_node(nodes.record(agent_node("b", beat=wall.now)))  # b's agent beats on
    assert sync.check_agents() == ["a"]
    verdict = decider.filter(pod, ["a", "b"])
    assert verdict.passed == ["b"]
    assert "node agent silent since" in verdict.misfits["a"].message
    alone = decider.filter(pod, ["a"])  # no node passed: kube-scheduler reads why
    assert alone.passed == [] and alone.unresolvable == {"a": "gpuplace: node agent silent"}
    assert sync.ledger.get("uid-running") == held
    state = sync.ledger.state("a")
    assert state is not None and state.free_milli == [-500, 0]
    # the agent comes back: the node opens again with the running grant still counted
    sync.put_node(nodes.record(agent_node("a", beat=wall.now)))
    again = decider.filter(pod, ["a", "b"])
    assert again.fitting == 2 and not again.misfits and again.passed == ["a"]
    state = sync.ledger.state("a")
    assert state is not None and state.free_milli == [500, 1000]


def test_check_agents_closes_a_node_as_time_passes_without_any_event() -> None:
    sync, decider, wall = setup(agent_node("a"), agent_node("b", beat=NOW + 60))
    wall.now += BOUND + 1
    assert sync.check_agents() == ["a"]
    assert sync.check_agents() == []
    pod = gpu_pod("new", percent=50)
    assert decider.filter(pod, ["a", "b"]).passed == ["b"]
    wall.now += 60
    assert sync.check_agents() == ["b"]
    verdict = decider.filter(pod, ["a", "b"])
    assert verdict.passed == []
    assert verdict.misfits["b"].kind is fit.MisfitKind.AGENT_SILENT


def test_nodes_no_agent_reported_on_keep_todays_behaviour_unless_required() -> None:
    pod = gpu_pod("new", percent=50)
    sync, decider, wall = setup(agent_node("gfd-only", beat=None))
    wall.now += 10 * BOUND
    sync.check_agents()
    assert decider.filter(pod, ["gfd-only"]).passed == ["gfd-only"]
    sync, decider, _ = setup(agent_node("gfd-only", beat=None), require_agent=True)
    verdict = decider.filter(pod, ["gfd-only"])
    assert verdict.passed == []
    assert verdict.unresolvable == {"gfd-only": "gpuplace: node agent silent"}


def test_an_unhealthy_gpu_takes_no_new_grant_and_keeps_the_ones_it_has() -> None:
    sync, decider, _ = setup(agent_node("a", gpus=2))
    running = Grant("uid-running", "a", (0,), 300, 1024)
    sync.ledger.reserve(running)
    sync.put_node(nodes.record(agent_node("a", gpus=2, unhealthy=(0,))))
    assert sync.ledger.get("uid-running") == running
    share = gpu_pod("share", percent=50)
    verdict = decider.filter(share, ["a"])
    assert verdict.passed == ["a"]
    assert verdict.request is not None
    choice = decider.best_on("a", verdict.request)
    assert isinstance(choice, Choice)
    assert choice.gpus == (1,)
    pair = gpu_pod("pair", percent=None, count=2)
    verdict = decider.filter(pair, ["a"])
    assert verdict.unresolvable == {"a": "gpuplace: too few healthy GPUs"}
    assert verdict.misfits["a"].message == "1 healthy suitable GPUs, needs 2 (unhealthy: gpu 0)"
    # GPU 1 taken: a share now finds no healthy GPU with room, and says which is unhealthy
    sync.ledger.reserve(Grant("uid-whole", "a", (1,), 1000, 0))
    verdict = decider.filter(share, ["a"])
    assert verdict.misfits["a"].message.endswith("(unhealthy: gpu 0)")
    with pytest.raises(Oversubscribed):
        sync.ledger.reserve(Grant("uid-late", "a", (0,), 100, 0))
    registry = CollectorRegistry()
    registry.register(metering.LedgerCollector(sync))
    assert registry.get_sample_value("gpuplace_gpus_unhealthy") == 1
    assert registry.get_sample_value("gpuplace_nodes_closed") == 0


def test_kept_filter_answers_go_stale_when_a_node_closes_or_a_gpu_turns_unhealthy() -> None:
    sync, decider, wall = setup(agent_node("a", gpus=1), agent_node("b", gpus=1))
    repeats = Repeats(sync, registry=CollectorRegistry())
    sync.ledger.reserve(Grant("uid-x", "a", (0,), 1000, 0))
    sync.ledger.reserve(Grant("uid-y", "b", (0,), 1000, 0))
    pod = gpu_pod("waiting", percent=50)
    names = ["a", "b"]
    verdict = decider.filter(pod, names)
    assert verdict.passed == []
    assert verdict.request is not None
    repeats.keep(verdict.request, names, Answer(b"none", "none-fit"), every=False)
    assert repeats.find(verdict.request, names) is not None
    sync.put_node(nodes.record(agent_node("b", gpus=1, unhealthy=(0,))))
    assert repeats.find(verdict.request, names) is None
    repeats.keep(verdict.request, names, Answer(b"none", "none-fit"), every=False)
    wall.now += BOUND + 1
    sync.put_node(nodes.record(agent_node("b", gpus=1, unhealthy=(0,), beat=wall.now)))
    assert repeats.find(verdict.request, names) is not None  # a heartbeat alone changes nothing
    assert sync.check_agents() == ["a"]
    assert repeats.find(verdict.request, names) is None


async def test_the_running_sidecar_stops_placing_on_a_node_once_its_agent_falls_silent(
    server: localapi.Server,
) -> None:
    # the heartbeat has whole seconds: one a second ahead is fresh for 2-3 s
    server.api.create(agent_node("quiet", beat=time.time() + 1.0))
    async with harness(server, agent_silence_seconds=2.0) as running:
        await running.synced(lambda: "quiet" in running.sidecar.sync.ledger.inventory)
        pod = server.api.create(objects.pod("p", percent=50))
        answer = await running.filter(pod, ["quiet"])
        assert answer["NodeNames"] == ["quiet"]
        await running.synced(
            lambda: bool(running.sidecar.sync.ledger.inventory["quiet"].closed), timeout=8.0
        )
        answer = await running.filter(pod, ["quiet"])
        assert answer["NodeNames"] == []
        assert answer["FailedAndUnresolvableNodes"] == {"quiet": "gpuplace: node agent silent"}


def test_explain_says_which_nodes_are_closed_and_which_gpus_unhealthy() -> None:
    sync, _, wall = setup(agent_node("quiet"), agent_node("sick", unhealthy=(0, 1)))
    wall.now += BOUND + 1
    sync.put_node(nodes.record(agent_node("sick", unhealthy=(0, 1), beat=wall.now)))
    sync.check_agents()
    explanation = explaining.explain(
        sync, PolicyHolder(sync, "default"), pods.record(gpu_pod("waiting", percent=50))
    )
    text = explaining.render(explanation)
    assert "node agent silent since 2027-01-15T08:00:00Z (more than 120s)" in text
    assert "0 healthy suitable GPUs, needs 1 (unhealthy: gpu 0, 1)" in text
    assert explanation.summary == "0/2 nodes: 1 node agent silent, 1 too few healthy GPUs"
