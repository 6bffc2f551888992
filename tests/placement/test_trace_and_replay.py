"""The openb trace format, the paper's replay procedure, and a small golden replay."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import pytest

from gpuplace.placement import choosing, fragmentation, policies, replay, trace
from gpuplace.placement.inventory import Inventory
from gpuplace.placement.ledger import Ledger
from gpuplace.replay import simulation

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "gpuplace" / "data"
OPENB = REPO.parent / "shared" / "data" / "openb"


def test_malformed_fields_name_file_line_and_column() -> None:
    lines = [
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n",
        "p0,1000,512,1,500\n",
        "p1,lots,5,1,5\n",
    ]
    with pytest.raises(trace.TraceError) as caught:
        trace.parse_pods("pods.csv", lines)
    assert str(caught.value) == "pods.csv:3:2: cpu_milli must be an integer, got 'lots'"
    with pytest.raises(trace.TraceError, match=r"^nodes.csv:1:5: missing column 'model'"):
        trace.parse_nodes("nodes.csv", ["sn,cpu_milli,memory_mib,gpu\n"])
    with pytest.raises(trace.TraceError, match=r"^p.csv:2:5: a multi-GPU pod must ask for 1000"):
        trace.parse_pods(
            "p.csv", ["name,cpu_milli,memory_mib,num_gpu,gpu_milli\n", "x,1,1,2,500\n"]
        )
    with pytest.raises(trace.TraceError, match=r"^e.csv:1:1: empty file"):
        trace.parse_pods("e.csv", [])


def test_five_column_lists_and_clamped_shares() -> None:
    pods = trace.parse_pods(
        "m.csv",
        ["name,cpu_milli,memory_mib,num_gpu,gpu_milli\n", "a,100,10,1,1200\n", "b,1,1,0,0\n"],
    )
    assert pods[0].gpu_milli == 1000 and pods[0].gpu_spec == ""
    assert pods[1].request().count == 0


def test_gpu_memory_columns_and_memory_only_rows() -> None:
    header = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_memory_mib\n"
    pods = trace.parse_pods(
        "m.csv", [header, "m,1,1,1,0,8192\n", "s,1,1,1,500,4096\n", "w,1,1,2,1000,\n"]
    )
    assert [(p.memory_only, p.gpu_memory_mib) for p in pods] == [
        (True, 8192),
        (False, 4096),
        (False, 0),
    ]
    memory_only = pods[0].request()
    assert memory_only.memory_only and memory_only.memory_mib == 8192
    assert (pods[1].request().milli, pods[1].request().memory_mib) == (500, 4096)
    with pytest.raises(trace.TraceError, match=r"^m.csv:2:5: .*gpu_memory_mib > 0"):
        trace.parse_pods("m.csv", [header, "z,1,1,1,0,0\n"])
    with pytest.raises(trace.TraceError, match=r"^m.csv:2:5: .*on one GPU, gpu_memory_mib"):
        trace.parse_pods("m.csv", [header, "z,1,1,2,0,8192\n"])
    nodes = trace.parse_nodes(
        "n.csv", ["sn,cpu_milli,memory_mib,gpu,model,gpu_memory_mib\n", "n,1,1,2,T4,15360\n"]
    )
    assert [gpu.memory_mib for gpu in nodes[0].gpus] == [15360, 15360]
    bare = trace.parse_nodes("n.csv", ["sn,cpu_milli,memory_mib,gpu,model\n", "n,1,1,1,A10\n"])
    assert [gpu.memory_mib for gpu in trace.with_gpu_memory(bare, 24576)[0].gpus] == [24576]
    converted = trace.as_memory_only(
        [*pods, trace.TracePod("q", 1, 1, 1, 250, "")], gpu_memory_mib=16384
    )
    assert [(p.memory_only, p.gpu_memory_mib, p.gpu_milli) for p in converted] == [
        (True, 8192, 0),
        (True, 8192, 500),  # half a GPU: half of 16 GiB, its compute no longer asked
        (False, 0, 1000),
        (True, 4096, 250),
    ]
    assert converted[3].request().memory_only and converted[3].total_milli == 250


def test_arrival_order_tunes_to_130_percent_and_is_seeded() -> None:
    pods = [trace.TracePod(f"p{i}", 1000, 1024, 1, 500, "") for i in range(10)]
    order = replay.arrival_order(pods, capacity_milli=10_000, seed=1)
    assert sum(pod.total_milli for pod in order) == 13_000
    assert order == replay.arrival_order(pods, capacity_milli=10_000, seed=1)
    assert order != replay.arrival_order(pods, capacity_milli=10_000, seed=2)
    assert all(pod.name.startswith("p") for pod in order)
    dropped = replay.arrival_order(pods * 4, capacity_milli=1000, seed=1)
    assert sum(pod.total_milli for pod in dropped) <= 1300


def _golden(policy: str) -> str:
    nodes = simulation.read_nodes(BUNDLED / "nodes.csv")
    pods = simulation.read_pods(BUNDLED / "pods.csv")
    figures, result = simulation.run(
        nodes, pods, pods_name="pods.csv", policy_name=policy, seed=42, extender=False
    )
    lines = [
        json.dumps([a.seq, a.pod.name, a.node, list(a.gpus)], separators=(",", ":"))
        for a in result.arrivals
    ]
    assert figures.arrivals == len(result.arrivals)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def test_replay_is_deterministic_for_the_same_inputs_and_seed() -> None:
    assert _golden("default") == _golden("default")
    assert _golden("fgd") == _golden("fgd")


def test_replay_never_oversubscribes_and_figures_are_consistent() -> None:
    nodes = simulation.read_nodes(BUNDLED / "nodes.csv")
    pods = simulation.read_pods(BUNDLED / "pods.csv")
    workload = fragmentation.Workload.from_requests(pod.request() for pod in pods)
    order = replay.arrival_order(pods, sum(len(n.gpus) for n in nodes) * 1000, 7)
    book = Ledger(Inventory(nodes))
    chooser = choosing.Chooser(book, policies.make("best-fit"))
    rng = random.Random(0)
    result = replay.run(nodes, order, lambda _l, r, _u: chooser.choose(r, rng), workload, book)
    for state in book.states():
        assert all(0 <= left <= 1000 for left in state.free_milli)
        assert state.cpu >= 0 and state.memory >= 0
    assert result.allocated[-1] == book.allocated_milli()
    assert 0 < result.allocation_at(100) <= 100
    assert result.rejected == sum(1 for a in result.arrivals if a.node is None)


@pytest.mark.skipif(not OPENB.is_dir(), reason=f"openb trace not found at {OPENB}")
def test_openb_lists_all_parse() -> None:
    files = sorted(OPENB.glob("openb_pod_list_*.csv"))
    assert len(files) == 24
    for path in files:
        with path.open(newline="") as lines:
            assert trace.parse_pods(path.name, lines)
    with (OPENB / "openb_node_list_gpu_node.csv").open(newline="") as lines:
        nodes = trace.parse_nodes("gpu_node", lines)
    assert len(nodes) == 1213 and sum(len(n.gpus) for n in nodes) == 6212


GOLDEN = Path(__file__).with_name("golden_bundled_replay.json")


def test_small_golden_replay() -> None:
    """The bundled trace, every policy, seed 42: decisions digest and figures as recorded.

    A change of any decision shows here; if intended, regenerate with
    `GPUPLACE_REGOLD=1 pytest tests/placement -k golden` and say why in the commit."""
    nodes = simulation.read_nodes(BUNDLED / "nodes.csv")
    pods = simulation.read_pods(BUNDLED / "pods.csv")
    found: dict[str, dict[str, object]] = {}
    for name in policies.NAMES:
        figures, result = simulation.run(
            nodes, pods, pods_name="pods.csv", policy_name=name, seed=42, extender=False
        )
        digest = hashlib.sha256(
            "\n".join(
                f"{a.seq},{a.pod.name},{a.node},{','.join(map(str, a.gpus))}"
                for a in result.arrivals
            ).encode()
        ).hexdigest()
        found[name] = {
            "decisions_sha256": digest,
            "allocation_at_100": figures.allocation_at_100,
            "rejected": figures.rejected,
        }
    if os.environ.get("GPUPLACE_REGOLD"):
        GOLDEN.write_text(json.dumps(found, indent=2, sort_keys=True) + "\n")
    assert found == json.loads(GOLDEN.read_text())


def test_replay_with_priorities_preempts_without_oversubscribing() -> None:
    """A tenth of GPU pods high priority: with preemption every high pod the policy could
    not place evicts lower ones only (never a high one), nothing is oversubscribed, and
    the allocation counted is the ledger's."""
    nodes = simulation.read_nodes(BUNDLED / "nodes.csv")
    pods = simulation.read_pods(BUNDLED / "pods.csv")
    workload = fragmentation.Workload.from_requests(pod.request() for pod in pods)
    order = replay.arrival_order(pods, sum(len(n.gpus) for n in nodes) * 1000, 7)
    priorities = simulation.draw_priorities(order, 0.1, 7)
    assert priorities == simulation.draw_priorities(order, 0.1, 7)
    outcomes = []
    for preempt in (False, True):
        book = Ledger(Inventory(nodes))
        chooser = choosing.Chooser(book, policies.make("best-fit"))
        rng = random.Random(0)
        result = replay.run(
            nodes,
            order,
            lambda _l, r, _u: chooser.choose(r, rng),  # noqa: B023 (used within the loop)
            workload,
            book,
            priorities=priorities,
            preempt=preempt,
        )
        for state in book.states():
            assert all(0 <= left <= 1000 for left in state.free_milli)
            assert state.cpu >= 0 and state.memory >= 0
        assert result.allocated[-1] == book.allocated_milli()
        high = {f"{seq}/{pod.name}" for seq, pod in enumerate(order) if priorities[seq] > 0}
        placed_high = {f"{a.seq}/{a.pod.name}" for a in result.arrivals if a.node} & high
        assert placed_high <= {grant.pod_uid for grant in book}  # no high pod evicted
        outcomes.append(result)
    without, with_preemption = outcomes
    assert without.preemptions == 0 and without.victims == 0
    assert with_preemption.preemptions > 0
    assert with_preemption.high_rejected < without.high_rejected
    assert with_preemption.victims >= with_preemption.preemptions
