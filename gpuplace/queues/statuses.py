"""What the queue controller writes into each GpuQueue's status (the status subresource).

`body(record, status)` is the status a queue should show after a round: admitted and
waiting workloads, waiting pods, the weighted share (per mille), per quota line what is
used, borrowed beyond nominal and lent to the cohort (quantities as the spec writes them:
`2500m` GPUs, `40Gi` of memory), `observedGeneration`, and one condition `Active`: True
while the queue admits, False with the reason `InvalidSpec` and why when gpuplace cannot
use its spec (an API server without the CRD's rules). With fair sharing over time, also
its past share (per mille) and when it was that (`pastShare`, `pastShareTime`): what a
restarted controller reads back (`remembered`); when fair sharing over time is turned
off, the write removes them. `changed(record, wanted)` says whether a write is needed (the
transition time and the past share's decay aside), so a quiet cluster writes nothing.
Pure: no I/O; the caller's clock stamps transitions.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from gpuplace.cluster.queue_directory import QueueRecord
from gpuplace.placement.queueing import quotas
from gpuplace.placement.queueing.admitting import QueueStatus
from gpuplace.placement.requests import WHOLE

PAST = "pastShare"
PAST_TIME = "pastShareTime"
ACTIVE = "Active"
READY = "Admitting"
INVALID = "InvalidSpec"


def quantity(resource: str, amount: int) -> str:
    """An engine amount as a Kubernetes quantity: milli-GPU as `3` or `2500m`, MiB as
    `40Gi` or `512Mi`."""
    if resource == quotas.GPU_MEMORY:
        return f"{amount // 1024}Gi" if amount % 1024 == 0 and amount else f"{amount}Mi"
    return str(amount // WHOLE) if amount % WHOLE == 0 else f"{amount}m"


def _condition(
    record: QueueRecord, status: str, reason: str, message: str, stamp: str
) -> dict[str, Any]:
    old = next(
        (
            c
            for c in record.status.get("conditions") or []
            if isinstance(c, Mapping) and c.get("type") == ACTIVE
        ),
        None,
    )
    since = stamp
    if old is not None and old.get("status") == status and old.get("lastTransitionTime"):
        since = str(old["lastTransitionTime"])
    return {
        "type": ACTIVE,
        "status": status,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": since,
        "observedGeneration": record.generation,
    }


def body(
    record: QueueRecord, status: QueueStatus | None, stamp: str, past: float | None = None
) -> dict[str, Any]:
    """The status `record` should show (module docstring); `status` None: the queue was
    not in the round (its spec cannot be used); `past` None: fair sharing over time is
    off."""
    if record.spec is None or status is None:
        return {
            "observedGeneration": record.generation,
            "admittedWorkloads": 0,
            "waitingWorkloads": 0,
            "waitingPods": 0,
            "weightedShare": 0,
            "resources": [],
            "conditions": [
                _condition(record, "False", INVALID, record.problem or "not in the round", stamp)
            ],
        }
    lines = []
    for bucket in sorted(record.spec.quotas):
        resource, model = bucket
        lines.append(
            {
                "name": resource,
                "model": model,
                "used": quantity(resource, status.used.get(bucket, 0)),
                "borrowed": quantity(resource, status.borrowed.get(bucket, 0)),
                "lent": quantity(resource, status.lent.get(bucket, 0)),
            }
        )
    found = {
        "observedGeneration": record.generation,
        "admittedWorkloads": status.admitted,
        "waitingWorkloads": status.waiting,
        "waitingPods": status.waiting_pods,
        "weightedShare": round(status.share * 1000),
        "resources": lines,
        "conditions": [_condition(record, "True", READY, "the queue admits workloads", stamp)],
    }
    if past is not None:
        found[PAST] = round(past * 1000)
        found[PAST_TIME] = stamp
    elif PAST in record.status:  # fair sharing over time turned off: forget (merge patch)
        found[PAST] = None
        found[PAST_TIME] = None
    return found


def _rest(status: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in status.items() if key not in (PAST, PAST_TIME)}


def changed(record: QueueRecord, wanted: Mapping[str, Any]) -> bool:
    """Whether `wanted` differs from what the queue shows, its past share's value aside:
    it moves with every round as it decays, and what the status last said still gives
    it exactly (`remembered`, while the share it shows is the one held since), so only
    its coming or going is a change. O(quota lines)."""
    return differs(record.status, wanted)


def differs(shown: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """`changed` on two statuses (the one shown or last written, the one wanted)."""
    if _rest(shown) != _rest(wanted):
        return True
    return (shown.get(PAST) is not None) != (wanted.get(PAST) is not None)


def remembered(record: QueueRecord) -> tuple[float, float, float] | None:
    """(past share, share, POSIX seconds) the status last said, for
    `ShareHistory.restore`; None when it says no past share (or not readably)."""
    past, share, when = (record.status.get(k) for k in (PAST, "weightedShare", PAST_TIME))
    if not isinstance(past, int) or not isinstance(share, int) or not isinstance(when, str):
        return None
    try:
        moment = datetime.fromisoformat(when.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return max(0, past) / 1000, max(0, share) / 1000, moment.timestamp()
