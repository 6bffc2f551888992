"""The demo's kube-scheduler: the stock scheduler's cycle for one pod, profile `gpuplace`.

What kube-scheduler does with a pod whose `schedulerName` is `gpuplace`, configured as
deploy/base/kube-scheduler-config.yaml says (extender on 127.0.0.1, filter and bind
verbs, no prioritize, `nodeCacheCapable`, `percentageOfNodesToScore: 100`):

1. its own filter plugins on every node: NodeUnschedulable, NodeAffinity (nodeSelector
   and required node affinity, `gpuplace.cluster.node_affinity.NodeAffinity`), NodeResourcesFit
   (requests, extended resources included, against allocatable minus the requests of
   the pods already on the node) — with kube-scheduler's own reason strings;
2. `POST /filter` with `{"Pod", "NodeNames", "Nodes": null}` for the nodes that passed;
3. one node left (the policy's best: the extender passes only that): it is chosen
   without scoring, as kube-scheduler does; several (a policy's tie): kube-scheduler's
   own score plugins would pick one, here drawn uniformly at random;
4. `POST /bind` (the extender creates the Binding itself); then an Event `Scheduled`;
5. no node: an Event `FailedScheduling` ("0/36 nodes are available: …") and the
   condition PodScheduled=False/Unschedulable, as `kubectl describe pod` shows them.

Like kube-scheduler with `leaderElect: true`, it holds the Lease
`gpuplace/gpuplace-scheduler` while it runs (`leading`): identity `<hostname>_<uuid>`,
renewed every 2 s; the sidecar's gang controller plans only while it is held.

Writes go straight into the local API's store (this process is the API server too).
Never used against a real cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import socket
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import aiohttp

from gpuplace.cluster import quantities
from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.dev.localapi import PODS, FakeApi
from gpuplace.dev.localapi.resources import LEASES
from gpuplace.dev.localapi.store import now

AFFINITY = "node(s) didn't match Pod's node affinity/selector"
UNSCHEDULABLE = "node(s) were unschedulable"
TOO_MANY_PODS = "Too many pods"


LEASE_SECONDS = 15
RENEW_SECONDS = 2.0


def _micro_time() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@contextlib.asynccontextmanager
async def leading(api: FakeApi, namespace: str, name: str) -> AsyncIterator[str]:
    """Hold kube-scheduler's leader-election Lease for the block (created or taken over at
    once: nobody else competes here), renewing it as client-go's leader election does.
    Yields the holder identity."""
    identity = f"{socket.gethostname()}_{uuid.uuid4()}"
    stamp = _micro_time()
    spec = {
        "holderIdentity": identity,
        "leaseDurationSeconds": LEASE_SECONDS,
        "acquireTime": stamp,
        "renewTime": stamp,
        "leaseTransitions": 0,
    }
    api.create(
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }
    )

    async def renew() -> None:
        while True:
            await asyncio.sleep(RENEW_SECONDS)
            api.patch(LEASES, name, {"spec": {"renewTime": _micro_time()}}, namespace)

    task = asyncio.create_task(renew(), name="gpuplace-demo-scheduler-lease")
    try:
        yield identity
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass(slots=True)
class Attempt:
    """One scheduling cycle's outcome."""

    node: str | None = None
    nodes: int = 0
    """Nodes in the cluster."""
    feasible: int = 0
    """Nodes that passed kube-scheduler's own filters."""
    passed: list[str] = field(default_factory=list)
    """Nodes that also passed the extender's filter: the policy's best."""
    fitting: int = 0
    """Nodes the pod fits: those kube-scheduler's filters passed that the extender did
    not fail (it passes only the best of them and fails none of the others)."""
    tied: int = 0
    """Nodes the extender passed (several: a tie, the pick among them is random)."""
    message: str = ""
    """FailedScheduling message, or the bind error."""


def _requests(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """The pod's effective requests: sum over containers, max with each init container."""
    spec = pod.get("spec") or {}
    total: dict[str, Decimal] = {}
    for container in spec.get("containers") or []:
        for name, value in ((container.get("resources") or {}).get("requests") or {}).items():
            total[name] = total.get(name, Decimal(0)) + quantities.parse(value)
    for container in spec.get("initContainers") or []:
        for name, value in ((container.get("resources") or {}).get("requests") or {}).items():
            total[name] = max(total.get(name, Decimal(0)), quantities.parse(value))
    return total


def _fit_reasons(
    requests: Mapping[str, Decimal], allocatable: Mapping[str, Any], used: Mapping[str, Decimal]
) -> list[str]:
    reasons: list[str] = []
    if used.get("pods", Decimal(0)) + 1 > quantities.parse(allocatable.get("pods", "0")):
        reasons.append(TOO_MANY_PODS)
    for name, wanted in sorted(requests.items()):
        if wanted <= 0:
            continue
        have = quantities.parse(allocatable.get(name, "0"))
        if used.get(name, Decimal(0)) + wanted > have:
            reasons.append(f"Insufficient {name}")
    return reasons


def failed_message(total: int, reasons: Mapping[str, list[str]]) -> str:
    """kube-scheduler's FitError text: '0/N nodes are available: 3 Insufficient cpu, …'."""
    counts: Counter[str] = Counter()
    for node_reasons in reasons.values():
        for reason in dict.fromkeys(node_reasons):
            counts[reason] += 1
    parts = sorted(f"{count} {reason}" for reason, count in counts.items())
    return f"0/{total} nodes are available: {', '.join(parts)}."


class Scheduler:
    """kube-scheduler with the gpuplace profile; see the module docstring."""

    def __init__(
        self,
        api: FakeApi,
        session: aiohttp.ClientSession,
        extender_url: str,
        rng: random.Random,
        *,
        profile: str = "gpuplace",
    ) -> None:
        self.api = api
        self.session = session
        self.extender_url = extender_url.rstrip("/")
        self.rng = rng
        self.profile = profile

    def schedulable(self, pod: Mapping[str, Any]) -> bool:
        """Whether kube-scheduler's queue holds this pod for the profile."""
        spec = pod.get("spec") or {}
        phase = (pod.get("status") or {}).get("phase")
        return (
            spec.get("schedulerName") == self.profile
            and not spec.get("nodeName")
            and not spec.get("schedulingGates")
            and phase in (None, "Pending")
        )

    async def _post(self, verb: str, body: dict[str, Any]) -> Any:
        async with self.session.post(f"{self.extender_url}/{verb}", json=body) as response:
            answer = await response.json(content_type=None)
            if response.status != 200:
                raise RuntimeError(f"extender {verb} answered HTTP {response.status}: {answer}")
            return answer

    def _own_filters(
        self, pod: Mapping[str, Any], nodes: list[dict[str, Any]]
    ) -> tuple[list[str], dict[str, list[str]]]:
        requests = _requests(pod)
        affinity = NodeAffinity.of(pod)
        used: dict[str, dict[str, Decimal]] = {}
        for other in self.api.objects(PODS):
            node_name = (other.get("spec") or {}).get("nodeName")
            if not node_name or (other.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            book = used.setdefault(node_name, {"pods": Decimal(0)})
            book["pods"] += 1
            for name, value in _requests(other).items():
                book[name] = book.get(name, Decimal(0)) + value
        feasible: list[str] = []
        failed: dict[str, list[str]] = {}
        for node in nodes:
            metadata = node.get("metadata") or {}
            name = str(metadata.get("name"))
            if (node.get("spec") or {}).get("unschedulable"):
                failed[name] = [UNSCHEDULABLE]
                continue
            if not affinity.matches(name, metadata.get("labels") or {}):
                failed[name] = [AFFINITY]
                continue
            allocatable = (node.get("status") or {}).get("allocatable") or {}
            reasons = _fit_reasons(requests, allocatable, used.get(name, {}))
            if reasons:
                failed[name] = reasons
            else:
                feasible.append(name)
        return feasible, failed

    async def schedule(self, namespace: str, name: str) -> Attempt:
        """One scheduling cycle for the pod (which must be `schedulable`)."""
        pod = self.api.get(PODS, name, namespace)
        nodes = sorted(self.api.objects("nodes"), key=lambda node: node["metadata"]["name"])
        attempt = Attempt(nodes=len(nodes))
        feasible, failed = self._own_filters(pod, nodes)
        attempt.feasible = len(feasible)
        passed = feasible
        if feasible:
            verdict = await self._post("filter", {"Pod": pod, "NodeNames": feasible, "Nodes": None})
            if verdict.get("Error"):
                return self._failed(pod, attempt, f"extender filter: {verdict['Error']}")
            passed = list(verdict.get("NodeNames") or [])
            for table in ("FailedNodes", "FailedAndUnresolvableNodes"):
                for node_name, reason in (verdict.get(table) or {}).items():
                    failed[node_name] = [str(reason)]
        attempt.passed = passed
        attempt.fitting = sum(1 for node in feasible if node not in failed)
        if not passed:
            return self._failed(pod, attempt, failed_message(len(nodes), failed))
        chosen = passed[0] if len(passed) == 1 else self.rng.choice(passed)
        attempt.tied = len(passed)
        metadata = pod["metadata"]
        answer = await self._post(
            "bind",
            {
                "PodName": metadata["name"],
                "PodNamespace": metadata["namespace"],
                "PodUID": metadata["uid"],
                "Node": chosen,
            },
        )
        if answer.get("Error"):
            return self._failed(pod, attempt, f"binding rejected: {answer['Error']}")
        attempt.node = chosen
        self._event(
            pod, "Normal", "Scheduled", f"Successfully assigned {namespace}/{name} to {chosen}"
        )
        return attempt

    def _failed(self, pod: dict[str, Any], attempt: Attempt, message: str) -> Attempt:
        attempt.message = message
        self._event(pod, "Warning", "FailedScheduling", message)
        metadata = pod["metadata"]
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastProbeTime": None,
            "lastTransitionTime": now(),
        }
        self.api.patch(
            PODS,
            metadata["name"],
            {"status": {"conditions": [condition]}},
            metadata["namespace"],
            subresource="status",
        )
        return attempt

    def _event(self, pod: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        metadata = pod["metadata"]
        stamp = now()
        self.api.create(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {
                    "name": f"{metadata['name']}.{secrets.token_hex(8)}",
                    "namespace": metadata["namespace"],
                },
                "involvedObject": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": metadata["name"],
                    "namespace": metadata["namespace"],
                    "uid": metadata["uid"],
                },
                "reason": reason,
                "message": message,
                "type": kind,
                "source": {"component": self.profile},
                "reportingComponent": self.profile,
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
            }
        )
