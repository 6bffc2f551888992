"""How a planned pod is handed its node and released: the pins.

A pin is the write (or writes) that take a pod behind the planner's gate
`gpuplace.io/place` to kube-scheduler with the engine's choice, each a
`gpuplace.controllers.writing.Writer.write` (UID and resourceVersion preconditions, the
change recomputed from a fresh read on 409, a no-op once the pod shows it):

- `Nominate` (`--plan-pin nominate`): first `status.nominatedNodeName` = the
  planned node (pods/status), then the gate removed (the pod). kube-scheduler tries a
  nominated node before any other (KEP-1923: `evaluateNominatedNode`, every filter plugin
  and the extender's filter on that one node); when it passes, the pod is bound there with
  no other node filtered or scored. When it does not (filled meanwhile, by anything the
  engine does not see: CPU of pods gpuplace does not manage, ports, volumes, inter-pod
  affinity, a taint just added), kube-scheduler goes on to every node as for any pod, and
  the extender's filter drops the plan's hold and chooses again among what it is offered
  (`gpuplace.extender.deciding`). So a stale plan is planned again by the same engine in
  the same scheduling cycle, and no pod is ever held to a node it cannot use. Two writes.
- `Narrow` (`--plan-pin affinity`): ONE merge patch that removes the gate and appends
  `metadata.name In [node]` to each required node-affinity term
  (`gpuplace.controllers.pinning`, what kube-apiserver lets a gated pod tighten);
  kube-scheduler's NodeAffinity PreFilter then hands every filter that one node. The pin
  cannot be undone once the gate is gone (a pod's affinity is immutable then): a node
  that fills meanwhile with what the engine does not see leaves the pod pending until
  room frees there. One write.
- no node (`node` None: no room now, a request that cannot be read): the gate removed
  alone; the extender's filter decides as for any pod (and kube-scheduler may preempt).

`check` is called synchronously right before the write that hands the node over, with
nothing awaited in between; it raises `Stale` when the plan no longer holds in the
ledger (its hold dropped or overcommitted by a grant the informer brought in meanwhile):
nothing is written then and the pod is planned again.

The first write starts from the pod as the informer last delivered it (`known`: its UID,
resourceVersion, gates, nominated node and affinity), not a read: a stale
resourceVersion costs a 409 and one read. A DRA pod is not released here: the claim
controller plans it and pins its ResourceClaim (`gpuplace.claims`, docs/dra.md). Owns no
state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gpuplace.cluster import keys
from gpuplace.cluster.gang_marks import gated
from gpuplace.cluster.pods import PodRecord
from gpuplace.controllers import pinning, plans
from gpuplace.controllers.writing import Writer

GATE = keys.PLACE_GATE


class Stale(Exception):
    """The plan no longer holds in the ledger: nothing was written; plan again."""


Check = Callable[[], None]
"""Raises `Stale` when the plan being released no longer holds."""


class Pin(Protocol):
    result: str
    """What a release with a node is counted as (`gpuplace_plan_releases_total`)."""

    async def release(
        self, writer: Writer, pod: PodRecord, node: str | None, check: Check
    ) -> dict[str, Any] | None:
        """Release `pod` with `node` (None: with none). Returns the pod after the last
        write, or None when it went away. Raises `Stale`, `kube.ApiError`."""
        ...


def known(pod: PodRecord) -> dict[str, Any]:
    """The pod as the informer last delivered it, as far as a release reads it."""
    spec: dict[str, Any] = {"schedulingGates": [{"name": name} for name in pod.controlled.gates]}
    if pod.node_name:
        spec["nodeName"] = pod.node_name
    if pod.controlled.spec_affinity is not None:
        spec["affinity"] = pod.controlled.spec_affinity
    status = {"nominatedNodeName": pod.nominated} if pod.nominated else {}
    return {
        "metadata": {"uid": pod.uid, "resourceVersion": pod.resource_version},
        "spec": spec,
        "status": status,
    }


def _ours(current: Mapping[str, Any]) -> bool:
    """Still the planner's to release: behind its gate and not bound."""
    return gated(current, GATE) and not plans.bound(current)


def _ungate(current: dict[str, Any]) -> dict[str, Any] | None:
    if not gated(current, GATE):
        return None
    return {"spec": {"schedulingGates": plans.without_gate(current, GATE)}}


class Nominate:
    """The nominated node first, then the gate removed (module docstring)."""

    result = "nominated"

    async def release(
        self, writer: Writer, pod: PodRecord, node: str | None, check: Check
    ) -> dict[str, Any] | None:
        body: dict[str, Any] | None = known(pod)
        if node is not None:

            def ours(current: dict[str, Any]) -> bool:
                if not _ours(current):
                    return False
                check()
                return True

            body = await writer.write(pod, body, pinning.nominating(node, ours), status=True)
            if body is None:
                return None
        return await writer.write(pod, body, _ungate)


class Narrow:
    """The gate removed and the affinity pinned to the node, in one write (module
    docstring)."""

    result = "pinned"

    async def release(
        self, writer: Writer, pod: PodRecord, node: str | None, check: Check
    ) -> dict[str, Any] | None:
        def release(current: dict[str, Any]) -> dict[str, Any] | None:
            if not _ours(current):
                return None
            if node is not None:
                check()
            return {"spec": plans.released(current, GATE, node)}

        return await writer.write(pod, known(pod), release)


PINS: Mapping[str, Pin] = {"nominate": Nominate(), "affinity": Narrow()}
"""The pins by their `--plan-pin` name."""
