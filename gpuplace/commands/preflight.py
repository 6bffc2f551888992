"""`gpuplace preflight`: before (and after) turning the node agent on, the namespaces whose
pods its no-bypass admission policy would refuse when they are next created.

The policy (`gpuplace-no-gpu-bypass`, deploy/components/node-agent) refuses a new pod that
reaches a GPU by itself (env NVIDIA_VISIBLE_DEVICES or CUDA_MPS_*, the container
toolkit's device-list mount, a cdi.k8s.io/ annotation) everywhere but kube-system and the
namespaces labelled gpuplace.io/gpu-system=true. The GPU Operator's, DCGM's and GPU
Feature Discovery's pods do exactly that: unlabelled, their namespace loses each of them
at its next restart. This reads every namespace and pod with your own credentials (list
namespaces and pods, cluster-wide), judges each pod as the policy would judge a copy
(`gpuplace.cluster.gpu_bypass`), and prints each such namespace with its pods, why, and the
`kubectl label` that trusts it. Label only the cluster's own GPU stack: a pod there can
reach every GPU of its node.

Exit status: 0 when no namespace would lose pods, 1 when some would (listed), 2 when the
API cannot be read.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from dataclasses import asdict
from typing import Any

from gpuplace import commands
from gpuplace.cluster import connecting, gpu_bypass, keys, kube
from gpuplace.commands import usage as usage_command

POLICY = "gpuplace-no-gpu-bypass"
WIDTH = 90
"""Prose lines are wrapped at this width; the table is as wide as it needs."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "preflight",
        help=commands.HELP["preflight"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    usage_command.add_cluster_arguments(parser)
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return usage_command.run_on_api("preflight", _preflight(args))


async def _preflight(args: argparse.Namespace) -> int:
    client = await connecting.api_client(args.kubeconfig, context=args.context, in_cluster=False)
    api = kube.Kube(client)
    try:
        namespaces = await api.list_all("namespaces")
        pods = await api.list_all("pods")
    finally:
        await api.close()
    found = gpu_bypass.findings(namespaces, pods)
    spared = gpu_bypass.spared(namespaces)
    if args.output == "json":
        document: dict[str, Any] = {
            "refused": [asdict(finding) for finding in found],
            "spared": spared,
            "podsRead": len(pods),
        }
        print(json.dumps(document, indent=2))
    else:
        print(render(found, spared, len(pods), len(namespaces)))
    return 1 if found else 0


def render(found: list[gpu_bypass.Finding], spared: list[str], pods: int, namespaces: int) -> str:
    """The table and what to do, for people. O(findings × reasons)."""
    read = f"{pods} pods in {namespaces} namespaces read"
    not_judged = f"not judged: {', '.join(spared)}"
    if not found:
        return textwrap.fill(
            f"No namespace has pods the node agent's admission policy ({POLICY}) would "
            f"refuse ({read}; {not_judged}).",
            WIDTH,
        )
    rows = [("NAMESPACE", "PODS", "WHY", "E.G.")]
    for finding in found:
        for index, (reason, pod) in enumerate(finding.reasons.items()):
            first = index == 0
            rows.append(
                (
                    finding.namespace if first else "",
                    str(len(finding.pods)) if first else "",
                    reason,
                    pod,
                )
            )
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True))
        + "  "
        + row[3]
        for row in rows
    ]
    labels = "\n".join(
        f"  kubectl label namespace {finding.namespace} {keys.GPU_SYSTEM}=true --overwrite"
        for finding in found
    )
    before = textwrap.fill(
        f"The node agent's admission policy ({POLICY}) refuses pods like these when they are "
        "next created (a DaemonSet's pod restarted, a node added): they reach GPUs by "
        "themselves. If a namespace is the cluster's GPU stack (the GPU Operator, DCGM, GPU "
        "Feature Discovery), trust it before you turn the node agent on:",
        WIDTH,
    )
    after = textwrap.fill(
        "Otherwise its pods should ask gpuplace for GPUs (gpuplace.io/gpu-percent, gpu-memory "
        f"or gpu-count). ({read}; {not_judged}.)",
        WIDTH,
    )
    table = "\n".join(line.rstrip() for line in lines)
    return f"{table}\n\n{before}\n{labels}\n{after}"
