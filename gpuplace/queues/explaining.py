"""What `gpuplace queues` and `gpuplace explain` say about GpuQueues, read from the API.

`snapshot(api, ...)` lists once (no watch) what the controller's informers keep — nodes
and managed pods (the ledger, `gpuplace.cluster.mirroring`; the queued pods among them,
`gpuplace.controllers.store.queued_pods`), the GpuQueues and namespaces
(`gpuplace.cluster.queue_directory`) — and decides one round on it as the controller does
(`gpuplace.queues.controller.decide`: on a scratch ledger, nothing held or written), so
what it shows is what the controller would decide now, whether or not one runs. Every
waiting workload enters that round (no window), so a position is the real one.

- `rows(seen)`: per GpuQueue its quota lines (nominal, used, borrowed, lent), admitted
  and waiting workloads, waiting pods and weighted share — `gpuplace queues`;
- `pod_wait(seen, uid)`: a queued pod's queue, position and why it waits (quota, cohort,
  place, ...), or that it was admitted — `gpuplace explain`.

The reads need the user's own `get`/`list` on pods, nodes, gpuqueues and namespaces.
Cost: the lists, then one round (`gpuplace.placement.queueing.admitting`: about 2 s at 1,000
nodes and 2,000 waiting pods).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from gpuplace.cluster import kube, mirroring, queue_directory
from gpuplace.cluster.queue_directory import QueueDirectory
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import store as stores
from gpuplace.placement.choosing import Policy
from gpuplace.queues import statuses, workloads
from gpuplace.queues.controller import Decided, decide

WHOLE_ROUND = 10**9
"""The window of a round that shows positions: every waiting workload enters it."""


@dataclass(frozen=True, slots=True)
class Seen:
    """The API as listed and the round decided on it."""

    directory: QueueDirectory
    store: stores.PodIndex[None]
    decided: Decided


@dataclass(frozen=True, slots=True)
class Line:
    """One quota line of a queue, quantities as the GpuQueue writes them."""

    resource: str
    model: str
    nominal: str
    used: str
    borrowed: str
    lent: str


@dataclass(frozen=True, slots=True)
class Row:
    """One GpuQueue as `gpuplace queues` shows it (`problem`: why it cannot be used)."""

    name: str
    cohort: str
    weight: float
    lines: tuple[Line, ...]
    admitted: int
    waiting: int
    waiting_pods: int
    share: float
    problem: str = ""
    past: float | None = None
    """Its past share as its status last said (fair sharing over time; None: off)."""


@dataclass(frozen=True, slots=True)
class PodWait:
    """A queued pod's place: its queue, and either `admitted`, or its 1-based `position`
    (0: it is not in the round yet, `why` says so) and why it waits."""

    queue: str
    admitted: bool
    position: int = 0
    why: str = ""
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def snapshot(
    api: kube.Kube,
    policy: Callable[[LedgerSync], Policy],
    *,
    agent_silence: float,
    require_agent: bool,
    clock: Callable[[], float] = time.time,
) -> Seen:
    """List what the controller reads and decide one round on it (module docstring).
    `policy(sync)`: the placement policy over the listed ledger. Raises `kube.ApiError`."""
    sync = LedgerSync(agent_silence=agent_silence, require_agent=require_agent)
    # the claims too, where the cluster serves them: a DRA pod's GPUs are its claim's
    await mirroring.Mirror(api, sync, with_claims=True).load(claims_optional=True)
    directory = QueueDirectory()
    for informer in queue_directory.informers(api, directory):
        await informer.relist()
    store = stores.queued_pods(sync)
    past = {}  # fair sharing over time: the past shares the controller last wrote
    for name, record in directory.queues.items():
        remembered = statuses.remembered(record)
        if remembered is not None:
            past[name] = remembered[0]
    decided = decide(
        sync,
        policy(sync),
        directory.specs(),
        store.pods,
        now=clock(),
        size=WHOLE_ROUND,
        reclaims=0,
        past=past,
    )
    return Seen(directory, store, decided)


def rows(seen: Seen) -> list[Row]:
    """Every GpuQueue by name. O(queues x quota lines)."""
    by_name = {status.name: status for status in seen.decided.round.queues}
    found = []
    for name, record in sorted(seen.directory.queues.items()):
        status = by_name.get(name)
        if record.spec is None or status is None:
            found.append(Row(name, "", 0.0, (), 0, 0, 0, 0.0, record.problem or "not in a round"))
            continue
        remembered = statuses.remembered(record)
        lines = tuple(
            Line(
                resource,
                model,
                statuses.quantity(resource, record.spec.quotas[(resource, model)].nominal),
                statuses.quantity(resource, status.used.get((resource, model), 0)),
                statuses.quantity(resource, status.borrowed.get((resource, model), 0)),
                statuses.quantity(resource, status.lent.get((resource, model), 0)),
            )
            for resource, model in sorted(record.spec.quotas)
        )
        found.append(
            Row(
                name,
                record.spec.cohort,
                record.spec.weight,
                lines,
                status.admitted,
                status.waiting,
                status.waiting_pods,
                status.share,
                past=None if remembered is None else remembered[0],
            )
        )
    return found


def render_rows(found: list[Row]) -> str:
    """`gpuplace queues` as text: one line per quota line of each queue."""
    if not found:
        return "no GpuQueues (kubectl get gpuqueues; docs/queues.md)"
    header: tuple[str, ...] = (
        "QUEUE",
        "COHORT",
        "WEIGHT",
        "RESOURCE",
        "MODEL",
        "NOMINAL",
        "USED",
        "BORROWED",
        "LENT",
        "ADMITTED",
        "WAITING",
        "SHARE",
    )
    past = any(row.past is not None for row in found)
    if past:
        header = (*header, "PAST")
    table: list[tuple[str, ...]] = [header]
    notes = []
    for row in found:
        if row.problem:
            notes.append(f"{row.name}: cannot be used: {row.problem}")
            continue
        for index, line in enumerate(row.lines):
            first = index == 0
            extra = (f"{row.past or 0.0:.3f}" if first else "",) if past else ()
            table.append(
                (
                    row.name if first else "",
                    (row.cohort or "-") if first else "",
                    f"{row.weight:g}" if first else "",
                    line.resource,
                    line.model,
                    line.nominal,
                    line.used,
                    line.borrowed,
                    line.lent,
                    str(row.admitted) if first else "",
                    f"{row.waiting} ({row.waiting_pods} pods)" if first else "",
                    f"{row.share:.3f}" if first else "",
                    *extra,
                )
            )
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    text = [
        "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()
        for cells in table
    ]
    return "\n".join(text + notes)


def pod_wait(seen: Seen, uid: str) -> PodWait | None:
    """Where the queued pod `uid` stands (None: not a queued pod). O(waiting workloads)."""
    pod = seen.store.pods.get(uid)
    if pod is None:
        return None
    if not pod.controlled.queue_gated:
        return PodWait(pod.controlled.queue, admitted=True)
    for aside in seen.decided.found.aside:
        if any(member.uid == uid for member in aside.pods):
            return PodWait(pod.controlled.queue, False, 0, aside.why, aside.reason)
    for waiting in seen.decided.round.waiting:
        if waiting.key == pod.workload:
            return PodWait(
                pod.controlled.queue, False, waiting.position, waiting.why.value, waiting.reason
            )
    for admission in seen.decided.round.admissions:
        if uid in admission.uids:
            return PodWait(
                pod.controlled.queue,
                False,
                0,
                "admitting",
                "its queue admits it now: the controller's next round removes its gate",
            )
    if pod.controlled.queue not in seen.directory.queues:
        return PodWait(
            pod.controlled.queue,
            False,
            0,
            "no queue",
            f"GpuQueue {pod.controlled.queue} does not exist",
        )
    return PodWait(pod.controlled.queue, False, 0, workloads.MEMBERS, "not in the round")


def render_pod(wait: PodWait) -> str:
    """A pod's queue section of `gpuplace explain`."""
    if wait.admitted:
        return f"queue: admitted by GpuQueue {wait.queue}"
    where = f"position {wait.position}" if wait.position else "not in line yet"
    return f"queue: waiting in GpuQueue {wait.queue}, {where} ({wait.why}): {wait.reason}"
