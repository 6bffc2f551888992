"""The queue controller's builder (`--queues`), for the sidecar (`gpuplace.wiring.sidecar`)
and the tests alike.

`build(api, sync, policy, ...)` makes what running queues need: the directory of
GpuQueues and namespaces and its informers (`gpuplace.cluster.queue_directory`; the
webhook of the same process reads the same directory: `Queues.directory`), the index of
queued pods (pods labelled `gpuplace.io/queue`, fed by the sidecar's one informer of
managed pods through `sync`: `gpuplace.controllers.store.queued_pods`), and the
controller itself, deciding only while `active()` says this replica leads (the sidecar
passes the leader gate it shares with the gang controller, `gpuplace.wiring.leading`).
A caller that keeps its own directory (the tests) passes it, and runs its informers
itself. `Queues.work()` is the background work to run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import kube, queue_directory, recording, watching
from gpuplace.cluster.queue_directory import QueueDirectory
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import store as stores
from gpuplace.controllers.api import KubePods
from gpuplace.controllers.controller import Parts
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import Fences
from gpuplace.queues.controller import QueueApi, QueueController, QueueSettings
from gpuplace.wiring.settings import SidecarSettings


class KubeQueues(KubePods):
    """`controller.QueueApi` over a `gpuplace.cluster.kube.Kube`."""

    async def patch_gpuqueue_status(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """JSON merge patch of gpuqueues/NAME/status. Raises `kube.ApiError`."""
        return await self.api.patch_gpuqueue_status(name, patch)


@dataclass(slots=True)
class Queues:
    """A queue controller with its directory of queues, its informers and its index of
    queued pods, built and not started."""

    directory: QueueDirectory
    informers: list[watching.Informer[Any]]
    """The directory's GpuQueue and namespace informers (none: the caller runs its own)."""
    store: stores.PodIndex[None]
    controller: QueueController

    def work(self) -> list[Coroutine[Any, Any, None]]:
        """The coroutines to run as background tasks (each runs until cancelled)."""
        return [*(informer.run() for informer in self.informers), self.controller.run()]


def build(
    api: kube.Kube,
    sync: LedgerSync,
    policy: Callable[[], Policy],
    *,
    directory: QueueDirectory | None = None,
    page_size: int = 500,
    watch_seconds: int = 300,
    fences: Fences | None,
    recorder: recording.Recorder | None,
    registry: CollectorRegistry | None,
    settings: QueueSettings,
    clock: Callable[[], float] = time.time,
    active: Callable[[], bool] | None = None,
    blocked: Callable[[], str | None] | None = None,
) -> Queues:
    """The queue controller over `api`, admitting on `sync`'s ledger with `policy()` the
    queues of `directory` (None: a new one, listed and watched with `page_size` and
    `watch_seconds`); `active` (None: always) says whether it decides now, `blocked` why
    it cannot tell. `clock`: POSIX seconds."""
    informers: list[watching.Informer[Any]] = []
    if directory is None:
        directory = QueueDirectory()
        informers = list(
            queue_directory.informers(
                api, directory, page_size=page_size, watch_seconds=watch_seconds
            )
        )
    store = stores.queued_pods(sync)
    parts: Parts[QueueApi] = Parts(
        KubeQueues(api), sync, policy, recorder, fences, clock, active, blocked
    )
    controller = QueueController(parts, store, directory, registry=registry, settings=settings)
    return Queues(directory, informers, store, controller)


def settings_from(flags: SidecarSettings) -> QueueSettings:
    """The queue controller's settings as the sidecar's flags set them (`--queue-window`,
    `--queue-min-round-seconds`, `--reservation-timeout-seconds`,
    `--queue-fair-sharing-half-life-seconds`, `--queue-hold-after-seconds`)."""
    return QueueSettings(
        window=flags.queue_window,
        min_round_seconds=flags.queue_min_round_seconds,
        hold_seconds=flags.reservation_timeout_seconds,
        half_life_seconds=flags.queue_fair_sharing_half_life_seconds,
        hold_after_seconds=flags.queue_hold_after_seconds,
    )
