"""`gpuplace explain` against the fake API server: the table and the summary people read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpuplace import cli
from gpuplace.cluster import assignments, keys, mps_limits, pods, quantities
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.extender import explaining
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement import choosing, policies
from gpuplace.placement.ledger import Grant
from gpuplace.placement.requests import Topology
from tests.placement import clusters


def place(
    api: localapi.FakeApi,
    name: str,
    node: str,
    gpus: tuple[int, ...],
    percent: int,
    *,
    memory: str | None = None,
) -> None:
    """What the sidecar's bind leaves behind: the assignment, then the Binding. Percent 0
    with `memory`: a memory-only share."""
    pod = api.create(objects.pod(name, percent=percent or None, memory=memory))
    mib = quantities.to_mib(memory)[0] if memory else 0
    grant = Grant(pod["metadata"]["uid"], node, gpus, percent * 10, mib)
    notes = assignments.annotations_for(grant, None, datetime(2026, 1, 1, tzinfo=UTC))
    api.patch("pods", name, {"metadata": {"annotations": notes}}, "default")
    api.bind("default", name, node)


@pytest.fixture
def cluster() -> Iterator[localapi.ThreadedServer]:
    with localapi.serve_in_thread() as server:

        def build() -> None:
            api = server.api
            api.create(objects.node("a100-0", gpus=2))
            api.create(objects.node("a100-1", gpus=2))
            api.create(objects.node("t4-0", gpus=1, model="Tesla-T4", gpu_memory_mib=15360))
            place(api, "busy-0", "a100-0", (0,), 80)
            place(api, "busy-1", "a100-0", (1,), 80)
            place(api, "busy-2", "a100-1", (0,), 90)
            place(api, "busy-3", "a100-1", (1,), 60)
            api.create(objects.pod("waiting", percent=50, memory="20Gi"))
            api.create(objects.pod("small", percent=30))

        server.call(build)
        yield server


def explain(cluster: localapi.ThreadedServer, tmp_path: Path, *args: str) -> int:
    config = cluster.server.kubeconfig(tmp_path / "kubeconfig")
    return cli.main(["explain", *args, "--kubeconfig", str(config)])


def test_pending_pod_node_by_node(
    cluster: localapi.ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert explain(cluster, tmp_path, "default/waiting") == 0
    out = capsys.readouterr().out
    assert "Pending: no GPUs assigned yet." in out
    header = next(line for line in out.splitlines() if line.startswith("NODE"))
    assert header.split() == [
        "NODE", "MODEL", "GPUS", "FREE", "%", "FREE", "MiB", "VERDICT", "SCORE", "WHY"
    ]  # fmt: skip
    assert "a100-1  NVIDIA-A100-SXM4-80GB  2     10/40" in out
    assert "gpu 1: 40% free, needs 50%" in out
    # the T4's 15 GiB (GPU Feature Discovery) less the 1 GiB margin; a 50 % share takes its
    # ask and its CUDA context (the cautious default of an unmeasured model): issue 43
    context = mps_limits.UNMEASURED.context.mib(500)
    assert f"GPUs have {15360 - 1024} MiB, needs {20480 + context} MiB" in out
    assert "0/3 nodes: 2 no GPU with enough share free, 1 GPU memory too small" in out
    assert "it waits until GPUs free up" in out


def test_fitting_and_bound_pods(
    cluster: localapi.ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert explain(cluster, tmp_path, "default/small", "-o", "json") == 0
    small = json.loads(capsys.readouterr().out)
    verdicts = {row["node"]: (row["verdict"], row["score"]) for row in small["rows"]}
    assert verdicts["t4-0"][0] == "fits"
    assert verdicts["a100-1"] == ("fits", 10)  # packs onto the 40% left, keeps the T4 whole
    assert small["summary"].startswith("2/3 nodes: 1 no GPU with enough share free")
    assert explain(cluster, tmp_path, "default/busy-2") == 0
    out = capsys.readouterr().out
    assert "Running on node a100-1 with GPU 0 (90% each)." in out
    assert "\na100-1" in out and "  here  " in out


def test_unknown_pod_is_an_error(
    cluster: localapi.ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert explain(cluster, tmp_path, "default/nope") == 1
    assert "pod default/nope not found" in capsys.readouterr().err


def test_memory_only_pods_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with localapi.serve_in_thread() as server:

        def build() -> None:
            api = server.api
            api.create(objects.node("a", gpus=2))
            api.create(objects.node("b", gpus=1))
            api.create(objects.node("t4-0", gpus=1, model="Tesla-T4", gpu_memory_mib=15360))
            place(api, "share-a", "a", (0,), 50)
            place(api, "share-b", "b", (0,), 20)
            place(api, "mem-0", "a", (1,), 0, memory="70Gi")
            api.create(objects.pod("notebook", percent=None, memory="20Gi"))
            api.create(objects.pod("tiny", percent=None, memory="4Gi"))

        server.call(build)
        assert explain(server, tmp_path, "default/notebook") == 0
        out = capsys.readouterr().out
        # GPU 1 of a holds memory-only shares: no compute open to others ("mem").
        assert "a     NVIDIA-A100-SXM4-80GB  2     50/mem" in out
        # what the engine packs on these GPU Feature Discovery nodes (no node agent): 80 GiB
        # less the 1 GiB margin; a memory-only share takes its ask and its CUDA context at
        # 100 % of threads, the cautious default of an unmeasured model (issue 43)
        context = mps_limits.UNMEASURED.context.mib(0)
        free = 81920 - 1024 - (71680 + context)
        assert f"gpu 1: {free} MiB free, needs {20480 + context} MiB (20480 asked + " in out
        assert "every GPU holds compute shares or a whole-GPU grant" in out
        assert f"GPUs have {15360 - 1024} MiB, needs {20480 + context} MiB" in out
        assert "80896/" in out  # the FREE MiB column: a's GPU 0 holds no memory
        assert (
            "0/3 nodes: 1 GPU memory too small, 1 no GPU free of compute shares, "
            "1 no GPU with enough memory free"
        ) in out
        assert explain(server, tmp_path, "default/tiny", "-o", "json") == 0
        tiny = json.loads(capsys.readouterr().out)
        rows = {row["node"]: row for row in tiny["rows"]}
        assert rows["a"]["verdict"] == "fits" and rows["a"]["why"].endswith("would take GPU 1")
        assert explain(server, tmp_path, "default/mem-0") == 0
        running = capsys.readouterr().out
        assert "Running on node a with GPU 1 (memory only, 71680 MiB each)." in running
        # what its grant takes, and what the GPU packs and why (issue 43)
        assert (
            f"On GPU 1 it takes {71680 + context} MiB: its 71680 MiB and {context} MiB for its "
            "CUDA context, which MPS counts inside the limit of each of its processes "
            f"(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={71680 + context}M); the GPU packs 80896 MiB "
            "(GPU Feature Discovery's memory less 1024 MiB: no node agent publishes it)."
        ) in running


def test_pending_preemption_is_shown_on_both_sides(
    cluster: localapi.ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kube-scheduler nominated a100-1 for `waiting` and marked busy-3 there as its victim
    (the fake API deletes at once, so no pod is seen terminating: see the next test)."""

    def preempting() -> None:
        api = cluster.server.api
        api.patch(
            "pods",
            "waiting",
            {"status": {"nominatedNodeName": "a100-1"}},
            "default",
            subresource="status",
        )
        condition = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "PreemptionByScheduler",
            "message": "gpuplace: preempting to accommodate a higher priority pod",
        }
        api.patch(
            "pods",
            "busy-3",
            {"status": {"conditions": [condition]}},
            "default",
            subresource="status",
        )

    cluster.call(preempting)
    assert explain(cluster, tmp_path, "default/waiting") == 0
    out = capsys.readouterr().out
    assert "Nominated to node a100-1 by kube-scheduler's preemption, or by gpuplace's" in out
    assert explain(cluster, tmp_path, "default/busy-3") == 0
    out = capsys.readouterr().out
    assert "Being preempted: gpuplace: preempting to accommodate" in out


def test_victims_terminating_are_named() -> None:
    sync = LedgerSync()
    victim = replace(pods.record(objects.pod("low")), uid="v", node_name="n", deleting=True)
    waiting = replace(pods.record(objects.pod("high")), uid="h", nominated="n")
    sync.upsert_pod(victim)
    sync.upsert_pod(waiting)
    (line,) = explaining.preemption_lines(sync, waiting)
    assert line.startswith("Preemption under way: kube-scheduler nominated node n and is evicting")
    assert "default/low" in line


def test_a_gang_member_shows_its_gangs_pending_preemption() -> None:
    sync = LedgerSync()
    victim = replace(pods.record(objects.pod("low")), uid="v", node_name="n", deleting=True)
    member = replace(pods.record(objects.pod("w0")), uid="w", gated=True)
    sync.upsert_pod(victim)
    sync.upsert_pod(member)
    told = {
        "reason": "GpuPreemption",
        "message": "gang train preempts lower-priority pods to start: evicted default/low; "
        "nodes n are held for the gang until they have terminated",
    }
    (line,) = explaining.preemption_lines(sync, member, (), [told])
    assert line.startswith("Gang preemption pending: gang train preempts")
    assert line.endswith("Now: 1 of its victims still terminating (default/low).")
    sync.delete_pod(victim)
    (line,) = explaining.preemption_lines(sync, member, (), [told])
    assert line.endswith("Now: none of the pods it names is terminating any more.")
    assert explaining.preemption_lines(sync, replace(member, gated=False), (), [told]) == []
    evicted = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
    (line,) = explaining.preemption_lines(sync, victim, [evicted])
    assert line.startswith("Being evicted through the Eviction API")


def test_explain_shows_the_policy_score_and_the_nvlink_preference_apart() -> None:
    book = clusters.ledger(clusters.node("nvlink", 8, nvlink=(0,) * 8))
    policy = policies.make("best-fit")
    found = choosing.evaluate(book, clusters.whole(2, topology=Topology.PREFERRED), policy).choices
    state = book.state("nvlink")
    assert state is not None
    plain = policy.score(
        state, clusters.whole(2, topology=Topology.PREFERRED), found["nvlink"].gpus
    )
    assert explaining._scored(found["nvlink"]) == (f"one NVLink domain, policy score {plain:.6g}; ")


def test_a_pod_behind_the_planners_gate_says_what_it_waits_for() -> None:
    sync = LedgerSync()
    holder = PolicyHolder(sync, "best-fit")
    record = replace(pods.record(objects.pod("p")), uid="p", gated=True)
    alone = explaining.explain(sync, holder, record, gates=[keys.PLACE_GATE]).headline
    assert any(
        line.startswith("Pending behind the scheduling gate gpuplace.io/place") for line in alone
    )
    behind = explaining.explain(
        sync, holder, record, gates=["batch.example/admit", keys.PLACE_GATE]
    ).headline
    assert any("once batch.example/admit is removed" in line for line in behind)
