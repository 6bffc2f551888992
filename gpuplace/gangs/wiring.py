"""The gang controller wired once, for the sidecar (`gpuplace.wiring.sidecar`) and the tests alike.

`build(api, sync, policy, ...)` makes what a running gang controller needs: the store of
gang members and the informer that fills it (pods labelled `gpuplace.io/managed=true`
and `gpuplace.io/gang`), the leader gate that follows kube-scheduler's Lease (none
without `scheduler_lease`: a single replica always leads, or `active` decides), and the
controller itself with its preemptions (`fences` shared with the extender's filter).
`Gangs.work()` is the background work to run: informer, lease follower, controller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import kube, recording, watching
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.gangs import store as stores
from gpuplace.gangs.api import KubePods
from gpuplace.gangs.controller import GangController, GangSettings
from gpuplace.gangs.leader import LeaseFollower
from gpuplace.gangs.members import GangPod
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import Fences


@dataclass(slots=True)
class Gangs:
    """A gang controller with its informer and leader gate, built and not started."""

    store: stores.GangStore
    informer: watching.Informer[GangPod]
    controller: GangController
    leader: LeaseFollower | None
    """Whether this replica's kube-scheduler leads (None: always treated as leading)."""

    def work(self) -> list[Coroutine[Any, Any, None]]:
        """The coroutines to run as background tasks (each runs until cancelled)."""
        work = [self.informer.run(), self.controller.run()]
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
    page_size: int = 500,
    watch_seconds: int = 300,
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
    leader = None
    if scheduler_lease:
        namespace, _, name = scheduler_lease.partition("/")
        leader = LeaseFollower(api, namespace=namespace, name=name)
    store = stores.GangStore()
    informer = stores.informer(api, store, page_size=page_size, watch_seconds=watch_seconds)
    controller = GangController(
        KubePods(api),
        store,
        sync,
        policy,
        recorder=recorder,
        registry=registry,
        fences=fences,
        settings=settings,
        clock=clock,
        active=leader if leader is not None else active,
        blocked=leader.blocked_reason if leader is not None else blocked,
    )
    return Gangs(store, informer, controller, leader)
