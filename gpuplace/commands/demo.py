"""`gpuplace demo`: see gpuplace work end to end on this machine, no cluster needed.

It starts the real `gpuplace serve` on 127.0.0.1 (the admission webhook over TLS with a
freshly generated CA, the scheduler extender and its gang controller) against a small
in-memory Kubernetes API holding a bundled cluster of 36 nodes (A100 and H100 NVLink
servers, A100 PCIe pairs, L4 and T4 nodes, CPU-only nodes). It then plays
kube-apiserver and kube-scheduler itself, exactly as they would behave: each pod's
annotations go through AdmissionReview /mutate → JSONPatch → /validate, the pod is
stored, and the gpuplace scheduler profile calls the extender's /filter and /bind. The
pods: GPU shares, whole and multi-GPU jobs with NVLink, a gang (held at its scheduling
gate until complete, then planned and released together), pods the webhook refuses,
and one that stays pending and says why.

It prints a placement table, a utilisation and fragmentation summary, what users would
see (kubectl errors, Events, `gpuplace explain`) and the webhook's audit log, and writes
a PNG of per-GPU occupancy. Loopback only; nothing is left running; takes a few seconds.

With --scene queues (or all, after the above) it plays GpuQueues on the real queue
controller instead: two teams' queues in one cohort on one 8-GPU node, team A borrowing
team B's idle quota, team B's pods reclaiming it (the borrowed pods evicted through the
Eviction API, replaced by their Job and queued again), and an elastic gang that starts
with the members that fit and grows as GPUs free. It also plays the kubelet and the Job
controller there, and prints each step: Events, who holds which GPU, the GpuQueues'
status.
GPUPLACE_* environment variables are ignored. Exit code 0, 1 when it could not run, or 2
without matplotlib, which draws the PNG (`pip install 'gpuplace[demo]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from gpuplace import commands
from gpuplace.dev.demo import plotting, queue_reporting, queue_running, reporting, running
from gpuplace.dev.demo.progress import Progress
from gpuplace.placement import policies
from gpuplace.runtime import logs

DEFAULT_PLOT = Path("gpuplace-demo.png")
PODS = "pods"
QUEUES = "queues"
SCENES = (PODS, QUEUES, "all")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help=commands.HELP["demo"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seed of kube-scheduler's random pick among equally scored nodes and of the "
        "policy (default 1)",
    )
    parser.add_argument(
        "--policy",
        default="default",
        choices=policies.NAMES,
        help="the sidecar's placement policy (gpuplace serve --policy; default: default)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=DEFAULT_PLOT,
        metavar="FILE",
        help=f"where to write the per-GPU occupancy PNG (default ./{DEFAULT_PLOT})",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help="width of the text output in columns (default: the terminal's, at least 100)",
    )
    parser.add_argument(
        "--scene",
        choices=SCENES,
        default=PODS,
        help="pods: the pods above on the bundled cluster (the default); queues: two teams' "
        "GpuQueues sharing one 8-GPU node through a cohort, a reclaim and an elastic gang, "
        "on the real queue controller (no plot); all: both, one after the other",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show gpuplace serve's JSON log (INFO) on stderr",
    )
    parser.set_defaults(run=run)


class PlotError(Exception):
    """The PNG could not be written (its own message: the run itself went well)."""


def run(args: argparse.Namespace) -> int:
    if args.scene != QUEUES and commands.lacks("matplotlib", "demo", "demo"):
        return 2
    began = time.perf_counter()
    logs.configure("INFO" if args.verbose else "WARNING")
    progress = Progress(sys.stderr)
    width = args.width or max(shutil.get_terminal_size((140, 40)).columns, 100)
    sections: list[str] = []
    try:
        if args.scene != QUEUES:
            sections += _pods_scene(args, progress, width, began)
        if args.scene != PODS:
            demo = queue_running.QueueDemo(seed=args.seed, policy=args.policy, progress=progress)
            scene = asyncio.run(demo.run())
            progress.clear()
            sections += [
                queue_reporting.report(scene, width),
                f"Queues scene done in {scene.timings.get('total_seconds', 0.0):.1f} s; "
                "everything it started has stopped.",
            ]
    except PlotError as error:
        progress.clear()
        print(f"gpuplace demo: {error}", file=sys.stderr)
        return 1
    except (OSError, TimeoutError, RuntimeError) as error:
        progress.clear()
        print(f"gpuplace demo: could not run: {error}", file=sys.stderr)
        return 1
    print("\n\n".join(sections))
    return 0


def _pods_scene(
    args: argparse.Namespace, progress: Progress, width: int, began: float
) -> list[str]:
    """The pods scene's run, plot and sections. Raises PlotError, OSError, TimeoutError,
    RuntimeError."""
    demo = running.Demo(seed=args.seed, policy=args.policy, progress=progress)
    outcome = asyncio.run(demo.run())
    progress("drawing the per-GPU occupancy plot")
    plot = args.plot.expanduser().resolve()
    uids = {
        str(result.final["metadata"]["uid"]): result.key
        for result in outcome.results
        if result.final is not None
    }
    gang_uids = frozenset(
        str(result.final["metadata"]["uid"])
        for result in outcome.results
        if result.final is not None and "gpuplace.io/gang-name" in result.submission.annotations
    )
    try:
        plotting.plot(
            plot,
            outcome.ledger,
            uids,
            gang_pods=gang_uids,
            title=f"gpuplace demo: per-GPU occupancy after {len(outcome.results)} pods "
            f"(policy {outcome.policy}, seed {outcome.seed})",
        )
    except OSError as error:
        raise PlotError(f"cannot write the plot {plot}: {error}") from error
    progress.clear()
    return [
        reporting.header(outcome, running.demo_nodes()),
        reporting.table(outcome, width),
        reporting.refusals(outcome),
        reporting.not_running(outcome),
        reporting.summary(outcome),
        reporting.audit(outcome.audit, width),
        f"Plot: per-GPU occupancy written to {plot}",
        f"Done in {time.perf_counter() - began:.1f} s (gpuplace serve ready after "
        f"{outcome.timings.get('start_seconds', 0.0):.1f} s, {len(outcome.results)} pods "
        f"admitted and scheduled in {outcome.timings.get('pods_seconds', 0.0):.1f} s); "
        "everything it started has stopped.",
    ]
