"""bind: choose the GPUs, reserve them, write the assignment, then the Binding.

The order makes a crash harmless:

1. decide and reserve in memory (a *hold*), synchronously: no await between reading
   the ledger and reserving, so concurrent binds can never both take the same share;
2. PATCH the pod's assignment annotations, with the pod's resourceVersion and UID as
   preconditions (409 when anyone changed the pod since we read it): from here on the
   grant lives in the API and a restarted sidecar rebuilds it;
3. create the Binding (pods/NAME/binding, UID precondition), carrying the same
   annotations so that the pod gets them with its node in one write even if step 2's
   were removed meanwhile.

A crash or failure after 2 leaves the pod annotated but unbound, holding its GPUs as a
RESERVED grant: kube-scheduler retries the pod, `filter` offers it only that node, and
the next bind there finds the annotations and just creates the Binding. If no bind
comes within the reservation timeout, the reaper (`gpuplace.cluster.reaping`) removes the
annotations and the GPUs return. A failure whose outcome is unknown (timeout, 5xx)
keeps the hold for the same reason: the write may have landed. So a pod ends up bound
with a matching grant, or unbound with none; never two grants.

Retries are idempotent: a pod already bound to the node answers success, a pod already
annotated is not annotated again, a bind for a pod whose bind is in flight is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
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
            await self._binding(record, node, None)
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
                datetime.fromtimestamp(self._wall(), UTC),
            )
            record = await self._annotate(record, grant, fresh)
            if record.bound:
                return self._already_bound(record, node)
        await self._binding(record, node, fresh)
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

    async def _annotate(
        self, record: PodRecord, grant: Grant, annotations: dict[str, str]
    ) -> PodRecord:
        """Write the assignment (resourceVersion and UID preconditions); one retry on 409
        when the pod changed in a way that does not touch the assignment."""
        for attempt in (1, 2):
            patch = {
                "metadata": {
                    "uid": record.uid,
                    "resourceVersion": record.resource_version,
                    "annotations": annotations,
                }
            }
            try:
                pod = await self.api.patch_pod(record.namespace, record.name, patch)
                return self.decider.reader.record(pod)
            except kube.ApiError as error:
                if error.conflict or error.not_found:
                    _, current = await self._recheck(record, grant)
                    if current.grant is not None or current.bound:
                        return current
                    if attempt == 1 and not error.not_found:
                        record = current
                        continue
                self._give_up(record, grant, error)
                raise BindError(
                    f"cannot write the GPU assignment of pod {record}: {error.message}"
                ) from error
        raise AssertionError("unreachable")

    async def _recheck(self, record: PodRecord, grant: Grant) -> tuple[dict[str, Any], PodRecord]:
        """After a 409/404: what the pod is now; raises when it can no longer take `grant`."""
        try:
            pod, current = await self._fresh(record.namespace, record.name)
        except BindError:
            self.sync.unhold(record.uid)
            raise
        if current.uid != record.uid:
            self.sync.unhold(record.uid)
            raise BindError(f"pod {record} was replaced while binding", "conflict")
        if current.grant is not None and not current.grant.same_hold(grant):
            self.sync.unhold(record.uid)
            raise BindError(
                f"pod {record} was assigned other GPUs meanwhile "
                f"({current.grant.node} {list(current.grant.gpus)})",
                "conflict",
            )
        return pod, current

    def _give_up(self, record: PodRecord, grant: Grant, error: kube.ApiError) -> None:
        """Release the hold when the write certainly did not happen (a 4xx answer); keep
        it when it may have (timeouts, 5xx): the informer or the reaper settles it."""
        if 400 <= error.status < 500:
            self.sync.unhold(record.uid)
        else:
            log.warning(
                "assignment write outcome unknown; keeping the reservation",
                extra={"pod": str(record), "node": grant.node, "status": error.status},
            )

    async def _binding(
        self, record: PodRecord, node: str, annotations: dict[str, str] | None
    ) -> None:
        try:
            await self.api.bind_pod(
                record.namespace, record.name, uid=record.uid, node=node, annotations=annotations
            )
        except kube.ApiError as error:
            if error.conflict:
                _, current = await self._fresh(record.namespace, record.name)
                if current.uid == record.uid and current.node_name == node:
                    return  # an earlier attempt of ours landed
                raise BindError(
                    f"cannot bind pod {record} to {node}: {error.message}", "conflict"
                ) from error
            raise BindError(f"cannot bind pod {record} to {node}: {error.message}") from error


def _assigned_message(grant: Grant, node: Any) -> str:
    gpus = ",".join(str(index) for index in grant.gpus)
    share = requests.share_text(grant.milli)
    memory = f", {grant.memory_mib} MiB" if grant.memory_mib else ""
    plural = "s" if len(grant.gpus) > 1 else ""
    return f"assigned GPU{plural} {gpus} of node {grant.node} ({share}{memory} each)"
