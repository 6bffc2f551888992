"""`gpuplace explain NAMESPACE/POD`: why a pod is where it is, or why it is pending.

Reads the live state from the API (nodes, managed pods, ResourceClaims where the cluster
serves them, the pod, its Events), rebuilds the ledger exactly as the sidecar does, and
prints the policy's view node by node: which nodes fit (with the extender score kube-
scheduler would get) and, for the others, why not; then one summary line by reason kind.
For a pod in a GpuQueue it first says where the pod stands in its queue: admitted, or
its position and why it waits (quota, cohort, place, ...), from one admission round
decided on the same state as the queue controller decides it
(`gpuplace.queues.explaining`; GpuQueues and namespaces are read too).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpuplace import commands
from gpuplace.cluster import connecting, dra_claims, keys, kube, mirroring, pods
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.commands import queues as queues_command
from gpuplace.commands import usage as usage_command
from gpuplace.extender import explaining
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.queues import explaining as explaining_queues
from gpuplace.usage import report
from gpuplace.usage.gpu_loads import UsageUnavailable


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "explain",
        help=commands.HELP["explain"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("pod", metavar="NAMESPACE/POD", help="the pod (namespace/name)")
    usage_command.add_cluster_arguments(parser)
    queues_command.add_policy_arguments(parser)
    parser.add_argument("--all", action="store_true", help="show every node, not the first 40")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text")
    usage_command.add_prometheus_arguments(parser, required=False)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    namespace, _, name = str(args.pod).partition("/")
    if not name:
        namespace, name = "default", namespace
    if args.prometheus:
        try:
            usage_command.source_of(args)
        except UsageUnavailable as error:
            print(f"gpuplace explain: {error}", file=sys.stderr)
            return 2
    return usage_command.run_on_api("explain", _explain(args, namespace, name))


async def _explain(args: argparse.Namespace, namespace: str, name: str) -> int:
    client = await connecting.api_client(args.kubeconfig, context=args.context, in_cluster=False)
    api = kube.Kube(client)
    try:
        try:
            pod = await api.get_pod(namespace, name)
        except kube.ApiError as error:
            if error.not_found:
                print(f"gpuplace explain: pod {namespace}/{name} not found", file=sys.stderr)
                return 1
            raise
        sync = LedgerSync(
            agent_silence=args.agent_silence_seconds, require_agent=args.require_node_agent
        )
        unread = await mirroring.Mirror(api, sync, with_claims=True).load(claims_optional=True)
        events = await api.pod_events(namespace, name)
        wait: explaining_queues.PodWait | None = None
        if keys.QUEUE_LABEL in ((pod.get("metadata") or {}).get("labels") or {}):
            seen = await queues_command.snapshot(args, api)
            wait = explaining_queues.pod_wait(seen, str(pod["metadata"].get("uid") or ""))
        managed = await usage_command.managed_pods(api) if args.prometheus else []
    finally:
        await api.close()
    events.sort(key=lambda event: str(event.get("lastTimestamp") or event.get("eventTime") or ""))
    record = pods.record(pod)
    holder = PolicyHolder(sync, args.policy, refresh_seconds=0.0)
    conditions = (pod.get("status") or {}).get("conditions") or []
    gates = [
        str(gate.get("name"))
        for gate in (pod.get("spec") or {}).get("schedulingGates") or []
        if isinstance(gate, dict)
    ]
    explanation = explaining.explain(
        sync,
        holder,
        record,
        events=events,
        conditions=conditions,
        gates=gates,
        claims=dra_claims.claim_names(pod),
        claims_unread=unread,
    )
    used: report.Report | None = None
    unavailable = ""
    if args.prometheus:
        asked = usage_command.asked([*managed, pod])
        try:
            used = await usage_command.read(args, asked)
        except UsageUnavailable as error:
            unavailable = str(error)
    if args.output == "json":
        data: dict[str, Any] = json.loads(explanation.as_json())
        if wait is not None:
            data["queue"] = wait.as_dict()
        if args.prometheus:
            data["usage"] = _usage_json(used, namespace, name, unavailable)
        print(json.dumps(data, indent=2))
    else:
        if wait is not None:
            print(explaining_queues.render_pod(wait))
        print(explaining.render(explanation, limit=None if args.all else 40))
        if used is not None:
            print()
            print("\n".join(report.pod_section(used, namespace, name)))
    if unavailable:
        print(f"gpuplace explain: asked vs used: {unavailable}", file=sys.stderr)
        return 2
    return 0


def _usage_json(
    used: report.Report | None, namespace: str, name: str, unavailable: str
) -> dict[str, Any]:
    """The pod's part of the asked-vs-used report (or why there is none)."""
    if used is None:
        return {"error": unavailable}
    data = used.as_dict()

    def mine(item: dict[str, Any]) -> bool:
        return (item["namespace"], item["pod"]) == (namespace, name)

    return {
        "source": used.source,
        "window_seconds": used.window_seconds,
        "pods": [item for item in data["pods"] if mine(item)],
        "over": [item for item in data["over"] if mine(item)],
        "unjudged": [text for text in used.unjudged if text.startswith(f"{namespace}/{name}:")],
    }
