"""`gpuplace simulate`: replay an openb-format trace with one or more policies."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from gpuplace import commands
from gpuplace.placement import policies, trace
from gpuplace.replay import simulation

DESCRIPTION = """\
Replay a GPU cluster trace the way the FGD paper (Weng et al., USENIX ATC '23) does:
pods arrive in a seeded random order, extra pods are drawn from the list until the
GPU request reaches 1.3x the cluster's GPU capacity, and each pod is placed once or
rejected. Prints, per run: GPU allocation at 100% and 130% arrived, allocation when
the first GPU pod is rejected, fragmentation rate at 80% and amount at 100% arrived,
pods rejected and decision time p50/p99. Without --nodes/--pods it replays a small
bundled cluster and workload.

Memory-only shares (gpuplace.io/gpu-memory alone): a pod list row with num_gpu 1,
gpu_milli 0 and a gpu_memory_mib column > 0 is one; node lists may give each GPU's
memory in a gpu_memory_mib column. --memory-only-shares MIB replays every share of
the list as a memory-only share instead (see docs/placement.md).

With --queues FILE (GpuQueue objects, docs/queues.md) it replays instead in time, event
by event: each GPU pod of an openb pod list (with qos, creation_time, scheduled_time and
deletion_time) arrives at its creation time, waits until admitted and placed, runs as long
as it ran in production, then leaves; once without queues (every waiting pod takes a place
when one fits) and once through the queues, each qos class (LS, BE, ...) being a team
whose pods go to the GpuQueue named after it in lower case. Prints JSON: per team its
share of the cluster against its entitlement while the teams together ask for more than
the cluster (Jain's index over the teams), waiting time p50/p99, preemptions, and the
allocation of both runs. --gpus N replays on about N GPUs of the node list, keeping its
mix (the openb cluster is far larger than the trace's load). See docs/performance.md.
"""


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help=commands.HELP["simulate"],
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=Path, help="node list CSV (default: bundled cluster)")
    parser.add_argument("--pods", type=Path, help="pod list CSV (default: bundled workload)")
    parser.add_argument(
        "--policy",
        default="default",
        help="policy, or several comma-separated: "
        f"{', '.join(policies.NAMES + policies.REPLAY_ONLY)} (default: default; "
        "dra-first-fit: kube-scheduler's DRA allocator on its own, the first device with "
        "room in pool, slice and device order, decided directly)",
    )
    parser.add_argument("--seed", type=int, default=42, help="seed of this run (default: 42)")
    parser.add_argument(
        "--via-extender",
        action="store_true",
        help="decide through the extender's filter, then choose like kube-scheduler "
        "(the node it passed; one of a tie uniformly at random)",
    )
    parser.add_argument(
        "--via-planner",
        action="store_true",
        help="decide as the sidecar's planner plans a pod (plan, then pin: its node handed "
        "to kube-scheduler, which binds it there)",
    )
    parser.add_argument(
        "--memory-only-shares",
        type=int,
        metavar="MIB",
        help="replay every share (num_gpu 1, gpu_milli < 1000) as a memory-only share of "
        "its fraction of a MIB-MiB GPU (gpu_milli 250 of 16384 asks 4096 MiB, no compute); "
        "GPUs of the node list without a gpu_memory_mib column get MIB MiB",
    )
    parser.add_argument(
        "--priorities",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="the trace has no priorities: give this fraction of GPU pods (seeded) a high "
        "priority, and run each policy twice, without and with preemption (high pods the "
        "policy cannot place evict lower ones as the extender's preempt verb answers); "
        "prints the preemption figures too (default: 0, no priorities)",
    )
    parser.add_argument(
        "--queues",
        type=Path,
        metavar="FILE",
        help="replay in time with the GpuQueues of FILE (YAML) and without queues, and print "
        "the fairness and allocation figures as JSON (needs --pods: an openb pod list)",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="with --queues: replay on about N GPUs of the node list, keeping its mix of models "
        "and node sizes (default: the whole node list)",
    )
    parser.add_argument(
        "--fair-sharing-half-life",
        type=float,
        metavar="SECONDS",
        help="with --queues: fair sharing over time, as `gpuplace serve "
        "--queue-fair-sharing-half-life-seconds` (default: off)",
    )
    parser.add_argument(
        "--hold-after",
        type=float,
        metavar="SECONDS",
        help="with --queues: capacity holds for starving queued workloads, as `gpuplace serve "
        "--queue-hold-after-seconds` (default: off)",
    )
    parser.add_argument("--decisions", type=Path, help="write one JSON line per arrival here")
    parser.add_argument(
        "--plot",
        type=Path,
        help="write allocation vs arrived (PNG) here (needs matplotlib: gpuplace[demo])",
    )
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.queues is not None:
        return run_queues(args)
    if args.gpus is not None:
        print("gpuplace simulate: --gpus goes with --queues", file=sys.stderr)
        return 2
    names = [name.strip() for name in str(args.policy).split(",") if name.strip()]
    unknown = [name for name in names if name not in policies.NAMES + policies.REPLAY_ONLY]
    if unknown or not names:
        print(
            f"gpuplace simulate: unknown policy {', '.join(unknown) or '(none)'}; "
            f"choose from {', '.join(policies.NAMES + policies.REPLAY_ONLY)}",
            file=sys.stderr,
        )
        return 2
    if args.via_extender and args.via_planner:
        print("gpuplace simulate: --via-extender or --via-planner, not both", file=sys.stderr)
        return 2
    if args.plot and commands.lacks("matplotlib", "simulate --plot", "demo"):
        return 2
    if args.decisions and (len(names) > 1 or args.priorities > 0):
        print(
            "gpuplace simulate: --decisions takes one policy per run, without --priorities",
            file=sys.stderr,
        )
        return 2
    bundled = resources.files("gpuplace") / "data"
    try:
        with (
            resources.as_file(bundled / "nodes.csv") as default_nodes,
            resources.as_file(bundled / "pods.csv") as default_pods,
        ):
            nodes_path = args.nodes or default_nodes
            pods_path = args.pods or default_pods
            nodes = simulation.read_nodes(nodes_path)
            pods = simulation.read_pods(pods_path)
    except trace.TraceError as error:
        print(f"gpuplace simulate: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"gpuplace simulate: {error.filename}: {error.strerror}", file=sys.stderr)
        return 1
    if args.memory_only_shares is not None:
        if args.memory_only_shares <= 0:
            print("gpuplace simulate: --memory-only-shares takes MiB > 0", file=sys.stderr)
            return 2
        nodes = trace.with_gpu_memory(nodes, args.memory_only_shares)
        pods = trace.as_memory_only(pods, args.memory_only_shares)
    if not any(node.gpus for node in nodes):
        print(f"gpuplace simulate: {nodes_path}: no GPU nodes", file=sys.stderr)
        return 1
    if not 0.0 <= args.priorities <= 1.0:
        print("gpuplace simulate: --priorities is a fraction, 0 to 1", file=sys.stderr)
        return 2
    print(f"{len(nodes)} nodes, {sum(len(n.gpus) for n in nodes)} GPUs; {len(pods)} pods")
    print(simulation.HEADER)
    results = []
    modes = (False, True) if args.priorities > 0 else (False,)
    for name in names:
        for preempt in modes:
            figures, result = simulation.run(
                nodes,
                pods,
                pods_name=pods_path.name,
                policy_name=name,
                seed=args.seed,
                # dra-first-fit is kube-scheduler's own choice: always decided directly
                extender=args.via_extender and name not in policies.REPLAY_ONLY,
                planner=args.via_planner and name not in policies.REPLAY_ONLY,
                priorities=args.priorities,
                preempt=preempt,
            )
            print(simulation.row(figures), flush=True)
            results.append((figures, result))
    if args.priorities > 0:
        print()
        print(simulation.PREEMPT_HEADER)
        for figures, _ in results:
            print(simulation.preempt_row(figures))
    if args.decisions:
        with args.decisions.open("w", encoding="utf-8") as out:
            simulation.write_decisions(out, results[0][1])
    if args.json:
        simulation.write_json(args.json, [figures for figures, _ in results])
    if args.plot:
        simulation.plot(args.plot, results)
    return 0


def run_queues(args: argparse.Namespace) -> int:
    """`--queues FILE`: the event-driven replay with and without queues, as JSON."""
    from gpuplace.replay import in_time

    if args.policy not in policies.NAMES:
        print(
            f"gpuplace simulate: --queues takes one policy of {', '.join(policies.NAMES)}",
            file=sys.stderr,
        )
        return 2
    others = [
        flag
        for flag, value in (
            ("--via-extender", args.via_extender),
            ("--via-planner", args.via_planner),
            ("--memory-only-shares", args.memory_only_shares is not None),
            ("--priorities", args.priorities > 0),
            ("--decisions", args.decisions),
            ("--plot", args.plot),
        )
        if value
    ]
    if others or args.pods is None:
        why = f"not with {', '.join(others)}" if others else "it needs --pods (an openb pod list)"
        print(f"gpuplace simulate: --queues: {why}", file=sys.stderr)
        return 2
    if args.gpus is not None and args.gpus <= 0:
        print("gpuplace simulate: --gpus takes a number of GPUs above 0", file=sys.stderr)
        return 2
    for flag, value in (
        ("--fair-sharing-half-life", args.fair_sharing_half_life),
        ("--hold-after", args.hold_after),
    ):
        if value is not None and not value > 0:
            print(f"gpuplace simulate: {flag} takes seconds above 0", file=sys.stderr)
            return 2
    bundled = resources.files("gpuplace") / "data"
    try:
        with resources.as_file(bundled / "nodes.csv") as default_nodes:
            nodes = simulation.read_nodes(args.nodes or default_nodes)
        pods = in_time.read_jobs(args.pods)
        queues = in_time.read_queues(args.queues)
        if args.gpus is not None:
            nodes = trace.scaled(nodes, args.gpus)
        document = in_time.replay(
            nodes,
            pods,
            queues,
            policy_name=args.policy,
            half_life=args.fair_sharing_half_life,
            hold_after=args.hold_after,
        )
    except (trace.TraceError, in_time.ReplayError, ValueError) as error:
        print(f"gpuplace simulate: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"gpuplace simulate: {error.filename}: {error.strerror}", file=sys.stderr)
        return 1
    text = in_time.dumps(document)
    sys.stdout.write(text)
    if args.json:
        args.json.write_text(text, encoding="utf-8")
    return 0
