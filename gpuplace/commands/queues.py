"""`gpuplace queues`: every GpuQueue's quota and what it uses, borrows, lends and waits for.

Reads the live state from the API with your own credentials (nodes, managed pods,
GpuQueues, namespaces) and decides one admission round on it as the queue controller
does (`gpuplace.queues.explaining`), without writing anything: per queue and quota line
the nominal quota, what its admitted workloads use, what it borrows beyond its nominal
and lends to its cohort; its admitted and waiting workloads (waiting pods in brackets)
and its weighted fair share (what it borrows over what its cohort lends, divided by its
weight; 0 inside its nominal). `gpuplace explain NAMESPACE/POD` says where one waiting
pod stands and why.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from gpuplace import commands
from gpuplace.cluster import connecting, kube, nodes
from gpuplace.commands import usage as usage_command
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement import policies
from gpuplace.queues import explaining


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "queues",
        help=commands.HELP["queues"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    usage_command.add_cluster_arguments(parser)
    add_policy_arguments(parser)
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.set_defaults(run=run)


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """The sidecar's settings a round depends on (this and `explain`)."""
    parser.add_argument(
        "--policy", default="default", choices=policies.NAMES, help="the sidecar's --policy"
    )
    parser.add_argument(
        "--agent-silence-seconds",
        type=float,
        default=nodes.DEFAULT_AGENT_SILENCE,
        help="the sidecar's --agent-silence-seconds: nodes whose node agent is silent this "
        "long are shown closed to new GPU pods",
    )
    parser.add_argument(
        "--require-node-agent", action="store_true", help="the sidecar's --require-node-agent"
    )


def run(args: argparse.Namespace) -> int:
    return usage_command.run_on_api("queues", _queues(args))


async def snapshot(args: argparse.Namespace, api: kube.Kube) -> explaining.Seen:
    """One round on the API's state with the sidecar's settings in `args`."""
    return await explaining.snapshot(
        api,
        lambda sync: PolicyHolder(sync, args.policy, refresh_seconds=0.0).current().policy,
        agent_silence=args.agent_silence_seconds,
        require_agent=args.require_node_agent,
    )


async def _queues(args: argparse.Namespace) -> int:
    client = await connecting.api_client(args.kubeconfig, context=args.context, in_cluster=False)
    api = kube.Kube(client)
    try:
        seen = await snapshot(args, api)
    finally:
        await api.close()
    found = explaining.rows(seen)
    if args.output == "json":
        print(json.dumps({"queues": [asdict(row) for row in found]}, indent=2))
    else:
        print(explaining.render_rows(found))
    return 0
