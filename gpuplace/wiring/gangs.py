"""The gang controller's builder (`--gangs`), for the sidecar (`gpuplace.wiring.sidecar`)
and the tests alike.

`build(api, sync, policy, ...)` makes what a running gang controller needs: the index of
gang members (pods labelled `gpuplace.io/gang`, fed by the sidecar's one informer of
managed pods through `sync`: `gpuplace.controllers.store.gang_members`), the leader gate
that follows kube-scheduler's Lease (`gpuplace.wiring.leading`; none without
`scheduler_lease`: a single replica always leads, or `active` decides), and the
controller itself with its preemptions (`fences` shared with the extender's filter).
`Gangs.work()` is the background work to run: the lease follower and the controller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import kube, recording
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import store as stores
from gpuplace.controllers.api import KubePods, PodApi
from gpuplace.controllers.controller import Parts
from gpuplace.controllers.leader import LeaseFollower
from gpuplace.gangs.controller import GangController, GangSettings
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import Fences
from gpuplace.placement.gangs import GangKey
from gpuplace.wiring import leading
from gpuplace.wiring.settings import SidecarSettings


@dataclass(slots=True)
class Gangs:
    """A gang controller with its index of members and leader gate, built and not started."""

    store: stores.PodIndex[GangKey]
    controller: GangController
    leader: LeaseFollower | None
    """Whether this replica's kube-scheduler leads (None: always treated as leading)."""

    def work(self) -> list[Coroutine[Any, Any, None]]:
        """The coroutines to run as background tasks (each runs until cancelled)."""
        work = [self.controller.run()]
        if self.leader is not None:
            work.append(self.leader.run())
        return work


def build(
    api: kube.Kube,
    sync: LedgerSync,
    policy: Callable[[], Policy],
    *,
    fences: Fences,
    recorder: recording.Recorder | None,
    registry: CollectorRegistry | None,
    settings: GangSettings,
    scheduler_lease: str = "",
    clock: Callable[[], float] = time.time,
    active: Callable[[], bool] | None = None,
    blocked: Callable[[], str | None] | None = None,
) -> Gangs:
    """The gang controller over `api`, planning on `sync`'s ledger with `policy()`.
    `scheduler_lease` ("NAMESPACE/NAME", "" for none) is kube-scheduler's leader-election
    Lease: the controller decides only while this pod's kube-scheduler holds it; without
    one, `active` (None: always) says whether it decides and `blocked` why it cannot tell
    (the sidecar passes the leader gate it shares with the queue controller). `clock`:
    POSIX seconds."""
    leader = leading.follower(api, scheduler_lease)
    store = stores.gang_members(sync)
    parts: Parts[PodApi] = Parts(
        KubePods(api),
        sync,
        policy,
        recorder,
        fences,
        clock,
        active=leader if leader is not None else active,
        blocked=leader.blocked_reason if leader is not None else blocked,
    )
    controller = GangController(parts, store, registry=registry, settings=settings)
    return Gangs(store, controller, leader)


def settings_from(flags: SidecarSettings) -> GangSettings:
    """The gang controller's settings as the sidecar's flags set them
    (`--gang-starve-after-seconds`, `--reservation-timeout-seconds`)."""
    return GangSettings(
        starve_after_seconds=flags.gang_starve_after_seconds,
        hold_seconds=flags.reservation_timeout_seconds,
    )
