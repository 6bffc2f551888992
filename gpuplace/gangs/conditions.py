"""The `gpuplace.io/GangReady` condition on gang members (pods/status).

False, with the reason `GangIncomplete` or `GangUnschedulable` and why, once a gang's
`gang-timeout` has passed without it starting; True (`GangPlaced`) when a gang that had
timed out starts after all. A gang that starts in time never gets the condition.
`Conditions.set` writes it unless the member already says so (read from the informer,
or written by this process), keeping its `lastTransitionTime` while the status stays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from gpuplace.cluster import assignments, keys, kube, recording
from gpuplace.cluster.pods import PodRecord
from gpuplace.controllers.writing import Change, Writer
from gpuplace.gangs.events import PLACED

log = logging.getLogger(__name__)


def change(status: str, reason: str, message: str, stamp: str) -> Change:
    """The status merge patch that makes a pod's GangReady (`status`, `reason`,
    `message`), None when it already says so; `stamp` is the transition time."""

    def patch(current: dict[str, Any]) -> dict[str, Any] | None:
        conditions = [
            item
            for item in (current.get("status") or {}).get("conditions") or []
            if isinstance(item, dict)
        ]
        mine = next((c for c in conditions if c.get("type") == keys.GANG_CONDITION), None)
        if mine is not None and (mine.get("status"), mine.get("reason")) == (status, reason):
            return None
        moved = mine is None or mine.get("status") != status
        entry = {
            "type": keys.GANG_CONDITION,
            "status": status,
            "reason": reason,
            "message": message[: recording.MAX_MESSAGE],
            "lastProbeTime": None,
            "lastTransitionTime": stamp
            if moved or mine is None
            else mine.get("lastTransitionTime", stamp),
        }
        others = [c for c in conditions if c.get("type") != keys.GANG_CONDITION]
        return {"status": {"conditions": [*others, entry]}}

    return patch


class Conditions:
    """Writes GangReady; remembers, per member UID, what it last wrote (bounded by
    `keep`)."""

    def __init__(self, writer: Writer, clock: Callable[[], float]) -> None:
        self.writer = writer
        self.clock = clock
        self._written: dict[str, tuple[str, str]] = {}

    async def set(self, pod: PodRecord, status: str, reason: str, message: str) -> None:
        """Set GangReady on one member (pods/status), unless it already says so. A
        refused write is logged and tried again at the next call."""
        if self._written.get(pod.uid) == (status, reason):
            return
        if pod.controlled.gang_ready == (status, reason) and pod.uid not in self._written:
            self._written[pod.uid] = (status, reason)
            return
        stamp = assignments.rfc3339(datetime.fromtimestamp(self.clock(), UTC))
        try:
            await self.writer.write(pod, None, change(status, reason, message, stamp), status=True)
        except kube.ApiError as error:
            log.warning(
                "gang condition not written",
                extra={"pod": str(pod), "status": error.status, "reason": error.reason},
            )
            return
        self._written[pod.uid] = (status, reason)

    async def ready(self, pod: PodRecord) -> None:
        """Turn a GangReady=False condition (written at timeout) True."""
        if pod.controlled.gang_ready is None and pod.uid not in self._written:
            return
        await self.set(pod, "True", PLACED, "all members of the gang are placed")

    def keep(self, uids: Iterable[str]) -> None:
        """Forget the members not among `uids` (gone from the API)."""
        alive = set(uids)
        for uid in [uid for uid in self._written if uid not in alive]:
            del self._written[uid]
