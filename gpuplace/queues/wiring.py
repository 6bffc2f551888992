"""The queue controller wired once, for the sidecar (`gpuplace.wiring.sidecar`) and the tests alike.

`build(api, sync, directory, policy, ...)` makes what a running queue controller needs: the
index of queued pods (pods labelled `gpuplace.io/queue`, fed by the sidecar's one informer
of managed pods through `sync`: `gpuplace.controllers.store.queued_pods`), and the
controller itself, deciding
only while `active()` says this replica leads (the sidecar passes the gang controller's
leader gate, `gpuplace.controllers.leader.LeaseFollower`, which follows kube-scheduler's
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

from gpuplace.cluster import kube, recording
from gpuplace.cluster.queue_directory import QueueDirectory
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import store as stores
from gpuplace.controllers.api import KubePods
from gpuplace.controllers.controller import Parts
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import Fences
from gpuplace.queues.controller import QueueApi, QueueController, QueueSettings


class KubeQueues(KubePods):
    """`controller.QueueApi` over a `gpuplace.cluster.kube.Kube`."""

    async def patch_gpuqueue_status(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """JSON merge patch of gpuqueues/NAME/status. Raises `kube.ApiError`."""
        return await self.api.patch_gpuqueue_status(name, patch)


@dataclass(slots=True)
class Queues:
    """A queue controller with its index of queued pods, built and not started."""

    store: stores.PodIndex[None]
    controller: QueueController

    def work(self) -> list[Coroutine[Any, Any, None]]:
        """The coroutines to run as background tasks (each runs until cancelled)."""
        return [self.controller.run()]


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
    clock: Callable[[], float] = time.time,
    active: Callable[[], bool] | None = None,
    blocked: Callable[[], str | None] | None = None,
) -> Queues:
    """The queue controller over `api`, admitting on `sync`'s ledger with `policy()`
    the queues of `directory`; `active` (None: always) says whether it decides now,
    `blocked` why it cannot tell. `clock`: POSIX seconds."""
    store = stores.queued_pods(sync)
    parts: Parts[QueueApi] = Parts(
        KubeQueues(api), sync, policy, recorder, fences, clock, active, blocked
    )
    controller = QueueController(parts, store, directory, registry=registry, settings=settings)
    return Queues(store, controller)
