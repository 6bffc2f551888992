"""bind: choose the GPUs, reserve them, then one write: the Binding with the assignment.

The order makes a crash harmless:

1. decide and reserve in memory (a *hold*), synchronously: no await between reading
   the ledger and reserving, so concurrent binds can never both take the same share;
2. create the Binding (pods/NAME/binding, UID precondition) carrying the assignment
   annotations: kube-apiserver sets `spec.nodeName` and merges the annotations in one
   storage update, so the pod is bound with its grant or not at all. From there the
   grant lives in the API and a restarted sidecar rebuilds it.

There is no state between two writes to repair. A crash before the write leaves the pod
unbound with no grant (the hold was only in memory); kube-scheduler retries it. A failure
whose outcome is unknown (timeout, 5xx) keeps the hold: the write may have landed, and
then the informer turns the hold into the pod's CONFIRMED grant; if it did not, a retry
of the bind reuses the hold, or the reaper drops it at its deadline. A certain failure
(a 4xx answer) drops the hold. So a pod ends up bound with a matching grant, or unbound
with none; never two grants.

Earlier versions PATCHed the annotations first and created the Binding second (a grant
in the API before the bind). That was two API writes per bind, and the PATCH changed
`gpuplace.io/` annotations, so kube-apiserver called the validating webhook inside it:
three round trips against the stock scheduler's one (docs/performance.md). Pods
annotated but unbound still exist (gang plans, and pods left by those versions): their
bind writes only the Binding, and the reaper clears those that never bind.

Retries are idempotent: a pod already bound to the node with this grant answers success,
a pod already annotated is bound without new annotations, a bind for a pod whose bind is
in flight is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import assignments, kube, recording
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender import deciding
from gpuplace.extender.wire import BindingArgs
from gpuplace.placement import choosing, requests
from gpuplace.placement.ledger import Grant, LedgerError

log = logging.getLogger(__name__)


class BindError(Exception):
    """The bind did not happen; the message is for kube-scheduler's event and log."""

    def __init__(self, message: str, result: str = "error") -> None:
        super().__init__(message)
        self.result = result
        """Metrics label: error, conflict, misfit, busy."""


@dataclass(frozen=True, slots=True)
class Bound:
    grant: Grant | None
    """The pod's grant (None for a pod that asked for no GPU)."""
    repaired: bool
    """True when the assignment was already written (a retried or repaired bind)."""


class Binder:
    def __init__(
        self,
        api: kube.Kube,
        sync: LedgerSync,
        decider: deciding.Decider,
        *,
        recorder: recording.Recorder | None = None,
        hold_seconds: float = 300.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.sync = sync
        self.decider = decider
        self.recorder = recorder
        self.hold_seconds = hold_seconds
        self._wall = wall

    async def _fresh(self, namespace: str, name: str) -> tuple[dict[str, Any], PodRecord]:
        try:
            pod = await self.api.get_pod(namespace, name)
        except kube.ApiError as error:
            if error.not_found:
                raise BindError(f"pod {namespace}/{name} no longer exists") from error
            raise BindError(f"cannot read pod {namespace}/{name}: {error.message}") from error
        return pod, self.decider.reader.record(pod)

    async def bind(self, args: BindingArgs) -> Bound:
        """Bind the pod to `args.node` with GPUs there. Raises `BindError`."""
        uid = args.pod_uid
        if uid in self.sync.busy:
            raise BindError(
                f"a bind of pod {args.pod_namespace}/{args.pod_name} is in progress", "busy"
            )
        self.sync.busy.add(uid)
        try:
            return await self._bind(args)
        finally:
            self.sync.busy.discard(uid)

    async def _bind(self, args: BindingArgs) -> Bound:
        namespace, name, uid, node = args.pod_namespace, args.pod_name, args.pod_uid, args.node
        record = self.sync.pod(namespace, name)
        if record is None or record.uid != uid:
            _, record = await self._fresh(namespace, name)
        if record.uid != uid:
            raise BindError(
                f"pod {namespace}/{name} was replaced: its uid is {record.uid}, not {uid}",
                "conflict",
            )
        if record.bound:
            return self._already_bound(record, node)
        request = record.request
        if request is None or request.count == 0:
            if record.problem:
                raise BindError(f"pod {record}: {record.problem}", "misfit")
            await self._binding(record, node, None, None)
            return Bound(None, repaired=False)

        grant = self.sync.ledger.get(uid)
        annotated = record.grant is not None
        fresh: dict[str, str] | None = None
        if grant is not None:
            if grant.node != node:
                raise BindError(
                    f"GPUs are reserved for pod {record} on node {grant.node}, not {node}",
                    "conflict",
                )
            annotated = record.grant is not None and record.grant.same_hold(grant)
            busy = self.sync.ledger.overcommitted(grant)
            if busy and not annotated:
                raise BindError(
                    f"GPU {','.join(map(str, busy))} of node {node} reserved for pod {record} "
                    "is still used by pods being preempted",
                    "busy",
                )
        else:
            outcome = self.decider.best_on(node, request)
            if not isinstance(outcome, choosing.Choice):
                raise BindError(
                    f"node {node} no longer fits pod {record}: {outcome.message}", "misfit"
                )
            grant = choosing.grant_for(uid, outcome, request)
            try:
                self.sync.hold(grant, seconds=self.hold_seconds)
            except LedgerError as error:  # cannot happen without an await in between
                raise BindError(f"node {node}: {error}", "misfit") from error
            annotated = False
        if not annotated:
            fresh = assignments.annotations_for(
                grant,
                self.sync.ledger.inventory.get(node),
                self.sync.stamps.next(self._wall()),
            )
        await self._binding(record, node, grant, fresh)
        self.sync.confirm(uid)
        self.decider.forget(uid)
        log.info(
            "bound",
            extra={
                "pod": str(record),
                "node": node,
                "gpus": list(grant.gpus),
                "milli": grant.milli,
            },
        )
        if self.recorder is not None:
            self.recorder.emit(
                recording.Subject(record.namespace, record.name, uid),
                recording.NORMAL,
                "GpusAssigned",
                _assigned_message(grant, self.sync.ledger.inventory.get(node)),
            )
        return Bound(grant, repaired=not fresh)

    def _already_bound(self, record: PodRecord, node: str) -> Bound:
        if record.node_name != node:
            self.sync.unhold(record.uid)
            raise BindError(f"pod {record} is already bound to {record.node_name}", "conflict")
        if record.grant is not None:
            self.sync.confirm(record.uid)
        return Bound(record.grant, repaired=True)

    def _give_up(self, record: PodRecord, grant: Grant, error: kube.ApiError) -> None:
        """After a failed Binding that carried a new assignment: release the hold when the
        write certainly did not happen (a 4xx answer); keep it when it may have (timeouts,
        5xx): the informer confirms it, or a retried bind reuses it, or the reaper drops
        it at its deadline."""
        if 400 <= error.status < 500:
            self._drop_own_hold(record.uid)
        else:
            log.warning(
                "binding outcome unknown; keeping the reservation",
                extra={"pod": str(record), "node": grant.node, "status": error.status},
            )

    def _drop_own_hold(self, uid: str) -> None:
        """Drop the bind's own hold (never a planner's: a gang plan's hold is its)."""
        hold = self.sync.hold_of(uid)
        if hold is not None and hold.owner == "bind":
            self.sync.unhold(uid)

    async def _binding(
        self, record: PodRecord, node: str, grant: Grant | None, annotations: dict[str, str] | None
    ) -> None:
        """Create the Binding, with `annotations` (a new assignment for `grant`) or none
        (the grant is already in the API, or the pod asks for no GPU). A 409 is re-read:
        the pod bound to `node` with this grant is an earlier attempt of ours that landed."""
        try:
            await self.api.bind_pod(
                record.namespace, record.name, uid=record.uid, node=node, annotations=annotations
            )
        except kube.ApiError as error:
            if not error.conflict:
                if annotations is not None and grant is not None:
                    self._give_up(record, grant, error)
                raise BindError(f"cannot bind pod {record} to {node}: {error.message}") from error
            try:
                _, current = await self._fresh(record.namespace, record.name)
            except BindError:
                self._drop_own_hold(record.uid)
                raise
            ours = grant is None or (current.grant is not None and current.grant.same_hold(grant))
            if current.uid == record.uid and current.node_name == node and ours:
                return  # an earlier attempt of ours landed
            self._drop_own_hold(record.uid)
            raise BindError(
                f"cannot bind pod {record} to {node}: {error.message}", "conflict"
            ) from error


def _assigned_message(grant: Grant, node: Any) -> str:
    gpus = ",".join(str(index) for index in grant.gpus)
    share = requests.share_text(grant.milli)
    memory = f", {grant.memory_mib} MiB" if grant.memory_mib else ""
    plural = "s" if len(grant.gpus) > 1 else ""
    return f"assigned GPU{plural} {gpus} of node {grant.node} ({share}{memory} each)"
