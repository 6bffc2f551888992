"""The pods a controller keeps, indexed, fed by the process's one informer of managed pods.

The sidecar lists and watches managed pods once (`gpuplace.cluster.mirroring`: the label
`gpuplace.io/managed=true`, which the webhook puts on every pod it mutates, gang members
and queued pods included, in the same patch as their gang and queue labels, and which it
refuses to see removed); each pod version is read once into its immutable
`gpuplace.cluster.pods.PodRecord` and handed to the `LedgerSync`, whose pod listeners feed
a `PodIndex` per controller, with the very same records (never a copy, never a second
parse, never a second watch):

- `gang_members(sync)`: the pods labelled `gpuplace.io/gang`, by gang
  (`PodRecord.gang_key`; a member whose gang annotations cannot be read is kept, in no
  gang);
- `queued_pods(sync)`: the pods labelled `gpuplace.io/queue` (the queue controller groups
  them into workloads itself, `gpuplace.queues.workloads`).

The records carry what the controllers' crash-safe writers read back: the plan mark, our
gates, the assignment (`gpuplace.controllers.plans`). `version` grows with every change
among the kept pods (a round's signature); `synced` is the ledger's `ready` (nodes and
pods listed). O(1) per change; built over a synced ledger, O(pods) once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.placement.gangs import GangKey

K = TypeVar("K", bound=Hashable)


class PodIndex(Generic[K]):
    """The pods `keeps` selects, by UID and by `group` (None: in no group); see the
    module docstring."""

    def __init__(
        self,
        sync: LedgerSync,
        keeps: Callable[[PodRecord], bool],
        group: Callable[[PodRecord], K | None] = lambda _: None,
    ) -> None:
        self._keeps = keeps
        self._group = group
        self.pods: dict[str, PodRecord] = {}
        """The kept pods, by UID."""
        self._groups: dict[K, dict[str, PodRecord]] = {}
        self.version = 0
        """Grows with every change among the kept pods."""
        self.synced: asyncio.Event = sync.ready
        """Set once the informers have listed (the ledger's `ready`)."""
        for record in sync.pods.values():
            if keeps(record):
                self._put(record)
        sync.pod_listeners.append(self._changed)

    # --- reading ---------------------------------------------------------------------

    def groups(self) -> dict[K, list[PodRecord]]:
        """Every group with its pods (any state). O(kept pods)."""
        return {key: list(members.values()) for key, members in self._groups.items()}

    def members(self, key: K) -> list[PodRecord]:
        return list(self._groups.get(key, {}).values())

    def get(self, uid: str) -> PodRecord | None:
        return self.pods.get(uid)

    # --- the ledger sync's listener ----------------------------------------------------

    def _put(self, record: PodRecord) -> None:
        self.pods[record.uid] = record
        key = self._group(record)
        if key is not None:
            self._groups.setdefault(key, {})[record.uid] = record

    def _drop(self, uid: str) -> bool:
        old = self.pods.pop(uid, None)
        if old is None:
            return False
        key = self._group(old)
        if key is not None and key in self._groups:
            members = self._groups[key]
            members.pop(uid, None)
            if not members:
                del self._groups[key]
        return True

    def _changed(self, old: PodRecord | None, new: PodRecord | None) -> None:
        """A managed pod changed (`new` None: it went). O(1)."""
        uid = new.uid if new is not None else old.uid if old is not None else ""
        changed = self._drop(uid)
        if new is not None and self._keeps(new):
            self._put(new)
            changed = True
        if changed:
            self.version += 1


def gang_members(sync: LedgerSync) -> PodIndex[GangKey]:
    """The gang controller's pods: labelled `gpuplace.io/gang`, by gang."""
    return PodIndex(
        sync,
        lambda record: bool(record.gang),
        lambda record: record.gang_key if record.controlled.gang_name else None,
    )


def queued_pods(sync: LedgerSync) -> PodIndex[None]:
    """The queue controller's pods: labelled `gpuplace.io/queue`."""
    return PodIndex(sync, lambda record: bool(record.controlled.queue))
