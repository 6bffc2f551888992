"""`gpuplace simulate`: trace replay wiring — files in, decisions through the
engine (directly or through the extender's filter logic), figures
out. The replay itself is `gpuplace.placement.replay`; this module owns I/O and timing.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from gpuplace.cluster import keys
from gpuplace.placement import choosing, fragmentation, policies, replay, trace
from gpuplace.placement.choosing import Choice
from gpuplace.placement.inventory import Inventory, Node
from gpuplace.placement.ledger import Ledger
from gpuplace.placement.requests import GpuRequest

if TYPE_CHECKING:
    from gpuplace.cluster.syncing import LedgerSync
    from gpuplace.extender.workloads import PolicyHolder


def read_nodes(path: Path) -> list[Node]:
    with path.open(encoding="utf-8", newline="") as lines:
        return trace.parse_nodes(str(path), lines)


def read_pods(path: Path) -> list[trace.TracePod]:
    with path.open(encoding="utf-8", newline="") as lines:
        return trace.parse_pods(str(path), lines)


def node_rank(names: Sequence[str], seed: int) -> dict[str, int]:
    """A seeded random order of the nodes (the paper's simulator renames nodes with a
    random-permutation prefix and takes the first of equally scored nodes)."""
    order = list(names)
    random.Random(seed).shuffle(order)
    return {name: i for i, name in enumerate(order)}


def stable_rank(name: str) -> int:
    """A node's fixed place in line for tie-breaks when no seeded order is given."""
    return zlib.crc32(name.encode())


@dataclass(frozen=True, slots=True)
class RunFigures:
    pods: str
    policy: str
    seed: int
    via_extender: bool
    arrivals: int
    allocation_at_100: float
    allocation_at_130: float
    allocation_at_first_reject: float
    frag_rate_at_80: float
    frag_amount_at_100: float
    rejected: int
    rejected_gpu: int
    decision_p50_ms: float
    decision_p99_ms: float
    wall_seconds: float
    priorities: float = 0.0
    """Fraction of GPU pods drawn to high priority (0: no priorities, no preemption)."""
    preempt: bool = False
    high: int = 0
    high_rejected: int = 0
    preemptions: int = 0
    victims: int = 0
    victim_gpus: float = 0.0
    totals_blind: int = 0
    totals_wrong: int = 0
    via_planner: bool = False


Decide = Callable[[Ledger, GpuRequest, str], Choice | None]


def direct(chooser: choosing.Chooser, rng: random.Random) -> Decide:
    """The engine's choice; among equal scores the first in the policy's line of
    nodes (the seeded order), or a random one for policies without a line."""

    def decide(ledger: Ledger, request: GpuRequest, uid: str) -> Choice | None:
        return chooser.choose(request, rng)

    return decide


def trace_pod(uid: str, request: GpuRequest) -> dict[str, Any]:
    """A trace pod as kube-scheduler would send it after our webhook: annotations
    (percent rounded up to whole percent), CPU and memory requests, a UID."""
    annotations: dict[str, str] = {}
    if request.memory_only:
        annotations[keys.GPU_MEMORY] = f"{request.memory_mib}Mi"
    elif request.count == 1 and request.milli < 1000:
        annotations[keys.GPU_PERCENT] = str(-(-request.milli // 10))
        if request.memory_mib:
            annotations[keys.GPU_MEMORY] = f"{request.memory_mib}Mi"
    elif request.count:
        annotations[keys.GPU_COUNT] = str(request.count)
    if request.count and request.models:
        annotations[keys.GPU_MODEL] = ",".join(sorted(request.models))
    container = {
        "name": "main",
        "resources": {
            "requests": {
                "cpu": f"{request.cpu_milli}m",
                "memory": f"{request.host_memory_mib}Mi",
            }
        },
    }
    return {
        "metadata": {"name": uid, "namespace": "replay", "uid": uid, "annotations": annotations},
        "spec": {"containers": [container]},
    }


def sidecar_policy(
    chooser: choosing.Chooser,
    pods: Sequence[trace.TracePod],
    policy_name: str,
    rng: random.Random,
) -> tuple[LedgerSync, PolicyHolder]:
    """A sidecar's ledger sync over the replay's ledger, having seen every pod of the list,
    and its policy holder: the policy the sidecar builds from that typical workload, with
    its own line of nodes (a stable hash of node names)."""
    from gpuplace.cluster.syncing import LedgerSync
    from gpuplace.extender.workloads import PolicyHolder

    sync = LedgerSync()
    sync.ledger = chooser.ledger
    for pod in pods:
        sync.requests.append(pod.request())
    sync.requests_version += 1
    return sync, PolicyHolder(sync, policy_name, rng=rng)


def via_extender(
    chooser: choosing.Chooser,
    pods: Sequence[trace.TracePod],
    policy_name: str,
    rng: random.Random,
) -> Decide:
    """What a real cluster gets: every GPU pod goes through the sidecar's own filter
    (`gpuplace.extender.deciding.Decider`, fed a pod as kube-scheduler sends it), which
    passes the policy's best node(s); then kube-scheduler's choice — that node, or for a
    tie one of them (its plugin scores, uniformly at random here) — then the GPUs the
    sidecar's bind picks on that node. The typical workload is what the sidecar builds from the
    pods it has seen (here: the pod list); the node line is the sidecar's (a stable hash
    of node names), not the seeded one. CPU-only pods are not gpuplace's in a real
    cluster; the replay places them with the same policy as in direct mode."""
    from gpuplace.extender.deciding import Decider

    sync, holder = sidecar_policy(chooser, pods, policy_name, rng)
    decider = Decider(sync, holder)
    names = list(chooser.ledger.inventory.names())

    def decide(ledger: Ledger, request: GpuRequest, uid: str) -> Choice | None:
        if request.count == 0:
            return chooser.choose(request, rng)
        pod = trace_pod(uid, request)
        verdict = decider.filter(pod, names)
        best = verdict.passed
        if not best:
            return None
        node = best[rng.randrange(len(best))] if len(best) > 1 else best[0]
        outcome = decider.best_on(node, verdict.request or request)
        decider.forget(uid)
        return outcome if isinstance(outcome, Choice) else None

    return decide


def via_planner(
    chooser: choosing.Chooser,
    pods: Sequence[trace.TracePod],
    policy_name: str,
    rng: random.Random,
) -> Decide:
    """Plan, then pin: every GPU pod is planned as the sidecar's planner plans it
    (`gpuplace.planning.choice.choose`, on the policy the sidecar builds from the pods it
    has seen, with its own line of nodes), and kube-scheduler binds it there (the nominated
    node fits: nothing moves between the plan and the bind in a replay). CPU-only pods are
    placed with the same policy, as in the other modes."""
    from gpuplace.planning import choice

    _, holder = sidecar_policy(chooser, pods, policy_name, rng)
    planner = choosing.Chooser(chooser.ledger, holder.current().policy)

    def decide(ledger: Ledger, request: GpuRequest, uid: str) -> Choice | None:
        if request.count == 0:
            return chooser.choose(request, rng)
        return choice.choose(planner, request, rng, None)

    return decide


HIGH_PRIORITY = 1000


def draw_priorities(order: Sequence[trace.TracePod], fraction: float, seed: int) -> list[int]:
    """The openb trace has no priorities: each GPU pod of the arrival order gets
    `HIGH_PRIORITY` with probability `fraction` (drawn from its own stream of `seed`,
    so the order and the policy's draws are those of a run without), others 0."""
    rng = random.Random(f"priorities-{seed}")
    return [HIGH_PRIORITY if pod.num_gpu and rng.random() < fraction else 0 for pod in order]


def run(
    nodes: Sequence[Node],
    pods: Sequence[trace.TracePod],
    *,
    pods_name: str,
    policy_name: str,
    seed: int,
    extender: bool,
    priorities: float = 0.0,
    preempt: bool = False,
    planner: bool = False,
) -> tuple[RunFigures, replay.Replay]:
    """One replay of `pods` on `nodes` with one policy and seed; with `priorities` > 0
    that fraction of GPU pods is high priority, and with `preempt` they evict lower ones
    when the policy finds no room (`gpuplace.placement.replay`)."""
    started = time.perf_counter()
    workload = fragmentation.Workload.from_requests(pod.request() for pod in pods)
    capacity = sum(len(node.gpus) for node in nodes) * 1000
    order = replay.arrival_order(pods, capacity, seed)
    rng = random.Random(seed)
    # Direct mode lines nodes up in a seeded order (the paper's simulator); through the
    # extender the line is the sidecar's own, for GPU and CPU-only pods alike.
    # dra-first-fit's line is the DRA allocator's pool order, in every mode.
    names = [node.name for node in nodes]
    if policy_name in policies.REPLAY_ONLY:
        if extender or planner:
            raise ValueError(f"{policy_name} is kube-scheduler's own allocator: decided directly")
        rank: dict[str, int] | None = policies.pool_order(names)
    else:
        rank = None if extender or planner else node_rank(names, seed)
    policy = policies.make(policy_name, workload=workload, rng=rng, rank=rank)
    ledger = Ledger(Inventory(nodes))
    chooser = choosing.Chooser(ledger, policy)
    if extender:
        decide = via_extender(chooser, pods, policy_name, rng)
    elif planner:
        decide = via_planner(chooser, pods, policy_name, rng)
    else:
        decide = direct(chooser, rng)
    timings: list[float] = []

    def timed(ledger: Ledger, request: GpuRequest, uid: str) -> Choice | None:
        start = time.perf_counter()
        choice = decide(ledger, request, uid)
        timings.append(time.perf_counter() - start)
        return choice

    drawn = draw_priorities(order, priorities, seed) if priorities > 0 else None
    result = replay.run(
        nodes, order, timed, workload, ledger, priorities=drawn, preempt=preempt and bool(drawn)
    )
    timings.sort()
    figures = RunFigures(
        pods=pods_name,
        policy=policy_name,
        seed=seed,
        via_extender=extender,
        via_planner=planner,
        arrivals=len(order),
        allocation_at_100=round(result.allocation_at(100), 2),
        allocation_at_130=round(result.allocation_at(130), 2),
        allocation_at_first_reject=round(result.allocation_at_first_reject(), 2),
        frag_rate_at_80=round(result.frag_rate_at(80), 2),
        # + 0.0: a sum of float deltas that is 0 may round to -0.0
        frag_amount_at_100=round(result.frag_amount_at(100), 2) + 0.0,
        rejected=result.rejected,
        rejected_gpu=result.rejected_gpu,
        decision_p50_ms=round(_quantile(timings, 0.50) * 1000, 3),
        decision_p99_ms=round(_quantile(timings, 0.99) * 1000, 3),
        wall_seconds=round(time.perf_counter() - started, 2),
        priorities=priorities,
        preempt=preempt and priorities > 0,
        high=result.high,
        high_rejected=result.high_rejected,
        preemptions=result.preemptions,
        victims=result.victims,
        victim_gpus=round(result.victim_milli / 1000, 2),
        totals_blind=result.totals_blind,
        totals_wrong=result.totals_wrong,
    )
    return figures, result


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))
    return sorted_values[index]


HEADER = (
    f"{'pods':<28} {'policy':<13} {'seed':>5} {'mode':<8} {'alloc@100':>9} {'alloc@130':>9} "
    f"{'@1st-rej':>8} {'frag%@80':>8} {'fragamt@100':>11} {'rejected':>8} "
    f"{'p50 ms':>7} {'p99 ms':>7}"
)


def mode_of(figures: RunFigures) -> str:
    """How a run decided: `direct`, through the extender's filter, or the planner's."""
    if figures.via_extender:
        return "extender"
    return "planner" if figures.via_planner else "direct"


def row(figures: RunFigures) -> str:
    mode = mode_of(figures)
    if figures.preempt:
        mode += "+pre"
    return (
        f"{figures.pods:<28} {figures.policy:<13} {figures.seed:>5} {mode:<8} "
        f"{figures.allocation_at_100:>8.2f}% {figures.allocation_at_130:>8.2f}% "
        f"{figures.allocation_at_first_reject:>7.2f}% {figures.frag_rate_at_80:>7.2f}% "
        f"{figures.frag_amount_at_100:>10.2f}% {figures.rejected:>8} "
        f"{figures.decision_p50_ms:>7.3f} {figures.decision_p99_ms:>7.3f}"
    )


PREEMPT_HEADER = (
    f"{'pods':<28} {'policy':<13} {'seed':>5} {'mode':<12} {'high':>6} {'high-rej':>8} "
    f"{'preempts':>8} {'victims':>7} {'victim-GPUs':>11} {'sched-blind':>11} {'sched-wrong':>11}"
)


def preempt_row(figures: RunFigures) -> str:
    """The priority figures of a run: high-priority GPU pods, those rejected, preemptions,
    pods evicted and their GPUs, and how many preemptions kube-scheduler alone would have
    got wrong on that node (no victim seen on totals, or victims that free no GPU)."""
    mode = mode_of(figures) + ("+pre" if figures.preempt else "")
    return (
        f"{figures.pods:<28} {figures.policy:<13} {figures.seed:>5} {mode:<12} "
        f"{figures.high:>6} {figures.high_rejected:>8} {figures.preemptions:>8} "
        f"{figures.victims:>7} {figures.victim_gpus:>11.2f} {figures.totals_blind:>11} "
        f"{figures.totals_wrong:>11}"
    )


def write_decisions(out: IO[str], result: replay.Replay) -> None:
    """One JSON line per arrival, in arrival order (for an independent checker)."""
    for arrival in result.arrivals:
        pod = arrival.pod
        line = {
            "seq": arrival.seq,
            "pod": pod.name,
            "cpu_milli": pod.cpu_milli,
            "memory_mib": pod.memory_mib,
            "num_gpu": pod.num_gpu,
            "gpu_milli": pod.gpu_milli,
            "gpu_spec": pod.gpu_spec,
            "gpu_memory_mib": pod.gpu_memory_mib,
            "memory_only": pod.memory_only,
            "node": arrival.node,
            "gpus": list(arrival.gpus),
        }
        out.write(json.dumps(line, separators=(",", ":")) + "\n")


def write_json(path: Path, runs: Sequence[RunFigures]) -> None:
    summary: dict[str, dict[str, float]] = {}
    for policy in dict.fromkeys(run.policy for run in runs):
        mine = [run for run in runs if run.policy == policy]
        summary[policy] = {
            "mean_allocation_at_100": round(
                statistics.fmean(run.allocation_at_100 for run in mine), 3
            ),
        }
    document = {"runs": [asdict(run) for run in runs], "summary": summary}
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def plot(path: Path, results: Sequence[tuple[RunFigures, replay.Replay]]) -> None:
    """Allocation ratio against arrived workload, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (whole, zoom) = plt.subplots(1, 2, figsize=(12, 5), dpi=110)
    low = 100.0
    for figures, result in results:
        arrived = [result.percent(a) for a in result.arrived]
        allocated = [result.percent(a) for a in result.allocated]
        mode = " via extender" if figures.via_extender else ""
        label = f"{figures.policy}{mode} (seed {figures.seed})"
        whole.plot(arrived, allocated, label=label)
        zoom.plot(arrived, allocated, label=label)
        low = min([low, *(a for x, a in zip(arrived, allocated, strict=True) if x >= 80)])
    whole.plot([0, 130], [0, 130], color="grey", linewidth=0.6, linestyle=":")
    whole.set_xlim(0, 130)
    whole.set_ylim(0, 100)
    zoom.set_xlim(80, 130)
    zoom.set_ylim(max(0.0, low - 1), 100)
    zoom.set_title("zoom: 80-130% arrived")
    for axes in (whole, zoom):
        axes.set_xlabel("arrived GPU request (% of GPU capacity)")
        axes.set_ylabel("GPU allocation (% of capacity)")
        axes.grid(True, linewidth=0.3)
    title = results[0][0].pods if results else ""
    whole.set_title(f"GPU allocation vs arrived workload: {title}")
    zoom.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
