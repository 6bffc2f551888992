"""How the gang and queue controllers tell: one Event on a pod, each said once per
episode, and how a duration reads in them.

`emit` writes through `gpuplace.cluster.recording.Recorder` (queued, never blocking);
`Told` remembers, per pod UID, which Events a controller already wrote (a pod hears why
it waits once per reason, not once per round); `duration` words a timeout or a wait.
The reasons themselves are each controller's (`gpuplace.gangs.events`,
`gpuplace.queues.events`), or `gpuplace.cluster.recording`'s where rooms share them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from gpuplace.cluster import recording
from gpuplace.controllers.api import Pod


def emit(
    recorder: recording.Recorder | None, pod: Pod, kind: str, reason: str, message: str
) -> None:
    """One Event on `pod` (nothing without a recorder: Events are off). O(1)."""
    if recorder is not None:
        recorder.emit(recording.Subject(pod.namespace, pod.name, pod.uid), kind, reason, message)


@dataclass(slots=True)
class Told:
    """Events already emitted, per pod UID (each once per episode)."""

    tags: dict[str, set[str]] = field(default_factory=dict)

    def first(self, uid: str, tag: str) -> bool:
        seen = self.tags.setdefault(uid, set())
        if tag in seen:
            return False
        seen.add(tag)
        return True

    def keep(self, uids: Iterable[str]) -> None:
        alive = set(uids)
        for uid in [uid for uid in self.tags if uid not in alive]:
            del self.tags[uid]


def duration(seconds: float) -> str:
    """`45s`, `2m`, `1.5h`, `0.2s`: a timeout or a measured wait as Events say it, to a
    tenth of its unit (whole seconds from 10 s), never `0.241316s`."""
    seconds = max(seconds, 0.0)
    if seconds >= 3600:
        return f"{round(seconds / 3600, 1):g}h"
    if seconds >= 60:
        return f"{round(seconds / 60, 1):g}m"
    return f"{round(seconds, 1 if seconds < 10 else None):g}s"
