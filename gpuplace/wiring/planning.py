"""The planner's builder (`--plan-pin`), for the sidecar (`gpuplace.wiring.sidecar`) and the
tests alike.

`build(api, sync, policy, ...)` makes what a running planner needs: the index of the pods
behind its gate `gpuplace.io/place` (fed by the sidecar's one informer of managed pods
through `sync`: `gpuplace.planning.controller.planned_pods`), the leader gate it shares
with the gang and queue controllers (`active`, `blocked`: the sidecar's), and the
controller itself (`fences` shared with the extender's filter and the other
controllers). `Planning.work()` is the background work to run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import kube, recording
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers.api import KubePods, PodApi
from gpuplace.controllers.controller import Parts
from gpuplace.controllers.store import PodIndex
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import Fences
from gpuplace.planning.controller import PlanController, PlanSettings, planned_pods
from gpuplace.wiring.settings import SidecarSettings


@dataclass(slots=True)
class Planning:
    """A planner with its index of gated pods, built and not started."""

    store: PodIndex[None]
    controller: PlanController

    def work(self) -> list[Coroutine[Any, Any, None]]:
        """The coroutines to run as background tasks (each runs until cancelled)."""
        return [self.controller.run()]


def build(
    api: kube.Kube,
    sync: LedgerSync,
    policy: Callable[[], Policy],
    *,
    fences: Fences,
    recorder: recording.Recorder | None,
    registry: CollectorRegistry | None,
    settings: PlanSettings,
    clock: Callable[[], float] = time.time,
    active: Callable[[], bool] | None = None,
    blocked: Callable[[], str | None] | None = None,
) -> Planning:
    """The planner over `api`, planning on `sync`'s ledger with `policy()`; it decides
    while `active()` (None: always), and `blocked()` says why it cannot tell. `clock`:
    POSIX seconds."""
    store = planned_pods(sync)
    parts: Parts[PodApi] = Parts(
        KubePods(api), sync, policy, recorder, fences, clock, active=active, blocked=blocked
    )
    return Planning(store, PlanController(parts, store, registry=registry, settings=settings))


def settings_from(flags: SidecarSettings) -> PlanSettings:
    """The planner's settings as the sidecar's flags set them (`--plan-pin`,
    `--reservation-timeout-seconds`)."""
    return PlanSettings(pin=flags.plan_pin, hold_seconds=flags.reservation_timeout_seconds)
