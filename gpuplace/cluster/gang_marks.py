"""What gpuplace writes on a gang member, as it reads back from the API: the plan mark
and our scheduling gate.

The plan mark is the value of the `gpuplace.io/gang-plan` annotation, compact JSON:
`{"id": "3f9c0a1b2c4d", "members": 4, "node": "gpu-a100-7", "run": "3f9c0a1b2c4d"}` —
the plan it belongs to, how many members that plan placed, this member's node, and the
*run* of the gang it joins: the id of the plan that started the gang (a replacement or
an elastic gang's growth joins the run already going; a gang started again after a
member failed is a new run, `gpuplace.controllers.restarts`). A mark written before runs
existed has none: its run is its plan's id. The member's GPUs are
in the assignment annotations (`gpuplace.cluster.assignments`), written in the same
PATCH, so the ledger rebuilt after a restart holds them exactly as planned. The gate
`gpuplace.io/gang` holds a member back from kube-scheduler until its gang starts; a queued
member also carries `gpuplace.io/queue` until its queue admits it (docs/queues.md).

Written by the gang controller (`gpuplace.gangs`); read by it, by the demo's report and
by tests. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import keys


@dataclass(frozen=True, slots=True)
class PlanMark:
    """What the `gang-plan` annotation says: plan id, members in the plan, this node."""

    id: str
    members: int
    node: str
    run: str = ""
    """The run of the gang this plan belongs to ("": its own, `run_id`)."""

    @property
    def run_id(self) -> str:
        """The run: `run`, or this plan's id when it started the run."""
        return self.run or self.id

    def encode(self) -> str:
        return json.dumps(
            {"id": self.id, "members": self.members, "node": self.node, "run": self.run_id},
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, raw: object) -> PlanMark | None:
        """The mark, or None when absent or unreadable (an unreadable mark is no plan)."""
        if not isinstance(raw, str) or not raw:
            return None
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        plan_id, members, node = value.get("id"), value.get("members"), value.get("node")
        if not isinstance(plan_id, str) or not plan_id or not isinstance(node, str) or not node:
            return None
        if not isinstance(members, int) or isinstance(members, bool) or members < 1:
            return None
        run = value.get("run")
        run = run if isinstance(run, str) and run and run != plan_id else ""
        return cls(plan_id, members, node, run)


def plan_mark(pod: Mapping[str, Any]) -> PlanMark | None:
    """The pod's plan mark, if it carries a readable one."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return PlanMark.decode(annotations.get(keys.GANG_PLAN))


def gates(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The pod's `spec.schedulingGates` (ours and anyone else's)."""
    raw = (pod.get("spec") or {}).get("schedulingGates") or []
    return [gate for gate in raw if isinstance(gate, dict)]


def gated(pod: Mapping[str, Any], gate: str = keys.GANG_GATE) -> bool:
    """True while our gate `gate` (the gang's, or the queue's) is on the pod."""
    return any(item.get("name") == gate for item in gates(pod))


def queued(pod: Mapping[str, Any]) -> bool:
    """True for a pod the webhook queued (label `gpuplace.io/queue`): its queue admits it
    (removing the queue gate) before anything else may start it."""
    return bool(((pod.get("metadata") or {}).get("labels") or {}).get(keys.QUEUE_LABEL))
