"""What the gang and queue controllers are each made of: one `Controller` apiece.

A controller of the kit is given its `Parts` by its builder (`gpuplace.wiring.gangs`,
`gpuplace.wiring.queues`, for the sidecar and the tests alike): `api` (the pod calls,
`gpuplace.controllers.api.PodApi`), `sync` (the `LedgerSync` shared with the extender: its
ledger, holds and listeners), `policy` (the placement policy in force), `fences` (the
capacity holds the extender's filter reads), `recorder` (Events; None: off), `clock`
(POSIX seconds), `active` (whether this replica decides now: the sidecar's
`gpuplace.controllers.leader.LeaseFollower`; None: always) and `blocked` (why it cannot
tell: `LeaseFollower.blocked_reason`, said in an Event on the pods that wait); and its
`store` (the pods it keeps, `gpuplace.controllers.store`). From those and its `Settings`
it makes its round loop (`gpuplace.controllers.rounds`, woken by
every pod, node and ResourceClaim change of the ledger), its crash-safe writer
(`gpuplace.controllers.writing`) and its memory of what it told (`telling.Told`).
What a round does is the controller's own (`gpuplace.gangs.controller`,
`gpuplace.queues.controller`). No I/O of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client import Gauge

from gpuplace.cluster import recording
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import telling
from gpuplace.controllers.api import Pod, PodApi
from gpuplace.controllers.rounds import Rounds
from gpuplace.controllers.store import PodIndex
from gpuplace.controllers.writing import Writer
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import Fences

A = TypeVar("A", bound=PodApi)


@dataclass(frozen=True, slots=True)
class Parts(Generic[A]):
    """What a controller is given (module docstring); one per controller, as its `api`
    may differ (the queue controller's writes GpuQueue statuses too)."""

    api: A
    sync: LedgerSync
    policy: Callable[[], Policy]
    recorder: recording.Recorder | None = None
    fences: Fences | None = None
    clock: Callable[[], float] = time.time
    active: Callable[[], bool] | None = None
    blocked: Callable[[], str | None] | None = None


@dataclass(frozen=True, slots=True)
class Settings:
    """What every controller of the kit is tuned by; each controller's own settings extend
    it with its figures (`GangSettings`, `QueueSettings`)."""

    poll_seconds: float = 5.0
    """Longest wait between rounds when nothing wakes the controller."""
    settle_seconds: float = 0.05
    """Wait after a wake-up so that bursts of events make one round."""
    min_round_seconds: float = 0.0
    """Rounds that decide are at least this far apart (the event loop is shared)."""
    hold_seconds: float = 300.0
    """In-memory reservation of a plan's or an admission's grants while they are written
    (the written assignment annotations take over as soon as the informer sees them)."""
    concurrency: int = 16
    """API writes in flight at once for one gang or admission."""
    write_attempts: int = 5
    """Attempts of one write that hits 409 Conflict (re-read in between)."""


S = TypeVar("S", bound=Settings)
K = TypeVar("K", bound=Hashable)


class Controller(Generic[S, K, A]):
    """See the module docstring. `name` ("gang", "queue") words its log lines; `leading`
    is its gauge of whether this replica decides."""

    def __init__(
        self, name: str, parts: Parts[A], store: PodIndex[K], *, settings: S, leading: Gauge
    ) -> None:
        self.api = parts.api
        self.sync = sync = parts.sync
        self.policy = parts.policy
        self.recorder = parts.recorder
        self.fences = parts.fences
        self.clock = parts.clock
        self.blocked = parts.blocked
        """Why this replica cannot tell whether it decides (None: it can, or always decides)."""
        self.store = store
        self.settings = settings
        self.loop = Rounds(
            name,
            leading=leading,
            active=parts.active,
            poll_seconds=settings.poll_seconds,
            settle_seconds=settings.settle_seconds,
            min_round_seconds=settings.min_round_seconds,
            clock=parts.clock,
        )
        """The leader-gated round loop."""
        self.writer = Writer(
            self.api, concurrency=settings.concurrency, attempts=settings.write_attempts
        )
        self._told = telling.Told()
        sync.pod_listeners.append(self.loop.poke)  # every pod: the ledger moves too
        sync.node_listeners.append(self.loop.poke)
        sync.claim_listeners.append(self.loop.poke)  # a DRA claim allocated or freed

    @property
    def rounds(self) -> int:
        """Completed rounds, deciding or following (tests wait on it)."""
        return self.loop.rounds

    def wake(self) -> None:
        """Run a round soon (e.g. after the extender released GPUs)."""
        self.loop.wake()

    def _emit(self, pod: Pod, kind: str, reason: str, message: str) -> None:
        telling.emit(self.recorder, pod, kind, reason, message)
