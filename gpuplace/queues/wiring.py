"""The queue controller wired once, for the sidecar (`gpuplace.wiring.sidecar`) and the tests alike.

`build(api, sync, directory, policy, ...)` makes what a running queue controller needs: the
store of queued pods and the informer that fills it (pods labelled
`gpuplace.io/managed=true` and `gpuplace.io/queue`), and the controller itself, deciding
only while `active()` says this replica leads (the sidecar passes the gang controller's
leader gate, `gpuplace.gangs.leader.LeaseFollower`, which follows kube-scheduler's
Lease). The GpuQueue and namespace informers are the caller's
(`gpuplace.cluster.queue_directory`): the webhook reads the same directory.
`Queues.work()` is the background work to run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import kube, recording, watching
from gpuplace.cluster.queue_directory import QueueDirectory
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.gangs.api import KubePods
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import Fences
from gpuplace.queues import pods
from gpuplace.queues.controller import QueueController, QueueSettings


class KubeQueues(KubePods):
    """`controller.QueueApi` over a `gpuplace.cluster.kube.Kube`."""

    async def patch_gpuqueue_status(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """JSON merge patch of gpuqueues/NAME/status. Raises `kube.ApiError`."""
        return await self.api.patch_gpuqueue_status(name, patch)


@dataclass(slots=True)
class Queues:
    """A queue controller with its informer, built and not started."""

    store: pods.QueueStore
    informer: watching.Informer[pods.QueuedPod]
    controller: QueueController

    def work(self) -> list[Coroutine[Any, Any, None]]:
        """The coroutines to run as background tasks (each runs until cancelled)."""
        return [self.informer.run(), self.controller.run()]


def build(
    api: kube.Kube,
    sync: LedgerSync,
    directory: QueueDirectory,
    policy: Callable[[], Policy],
    *,
    fences: Fences | None,
    recorder: recording.Recorder | None,
    registry: CollectorRegistry | None,
    settings: QueueSettings,
    page_size: int = 500,
    watch_seconds: int = 300,
    clock: Callable[[], float] = time.time,
    active: Callable[[], bool] | None = None,
    blocked: Callable[[], str | None] | None = None,
) -> Queues:
    """The queue controller over `api`, admitting on `sync`'s ledger with `policy()`
    the queues of `directory`; `active` (None: always) says whether it decides now,
    `blocked` why it cannot tell. `clock`: POSIX seconds."""
    store = pods.QueueStore()
    informer = pods.informer(api, store, page_size=page_size, watch_seconds=watch_seconds)
    controller = QueueController(
        KubeQueues(api),
        store,
        directory,
        sync,
        policy,
        recorder=recorder,
        registry=registry,
        fences=fences,
        settings=settings,
        clock=clock,
        active=active,
        blocked=blocked,
    )
    return Queues(store, informer, controller)
