"""The DRA claim controller's builder (`--dra-claims` other than `off`), for the sidecar
(`gpuplace.wiring.sidecar`) and the tests alike.

`build(api, sync, ...)` makes the index of pods on the DRA path (fed by the sidecar's one
informer of managed pods through `sync`: `gpuplace.claims.controller.dra_pods`) and the
controller, deciding while `active()` says so (the sidecar passes the leader gate it shares
with the gang and queue controllers). Its API is `KubeClaims`: the pod calls of the kit
and the three ResourceClaim calls (create, get, delete), through `gpuplace.cluster.kube.Kube`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.claims.controller import ClaimApi, ClaimController, ClaimSettings, dra_pods
from gpuplace.cluster import kube, recording
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers.api import KubePods
from gpuplace.controllers.controller import Parts
from gpuplace.placement.choosing import Policy
from gpuplace.placement.fences import Fences
from gpuplace.wiring.settings import SidecarSettings


class KubeClaims(KubePods):
    """`gpuplace.claims.controller.ClaimApi` over a `gpuplace.cluster.kube.Kube`."""

    async def create_resource_claim(
        self, namespace: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        return await self.api.create_resource_claim(namespace, body)

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.api.get_resource_claim(namespace, name)

    async def delete_resource_claim(self, namespace: str, name: str, *, uid: str) -> None:
        await self.api.delete_resource_claim(namespace, name, uid=uid)


def build(
    api: kube.Kube,
    sync: LedgerSync,
    policy: Callable[[], Policy],
    *,
    recorder: recording.Recorder | None,
    registry: CollectorRegistry | None,
    settings: ClaimSettings | None = None,
    fences: Fences | None = None,
    clock: Callable[[], float] = time.time,
    active: Callable[[], bool] | None = None,
    blocked: Callable[[], str | None] | None = None,
) -> ClaimController:
    """The claim controller over `api`, on `sync`'s pods and claims (`policy`: the
    placement policy in force, which plans each claim's GPUs; `fences`: the nodes gangs'
    and queued workloads hold, never planned for a lone pod)."""
    parts: Parts[ClaimApi] = Parts(
        KubeClaims(api), sync, policy, recorder, fences, clock, active=active, blocked=blocked
    )
    return ClaimController(parts, dra_pods(sync), registry=registry, settings=settings)


def settings_from(flags: SidecarSettings) -> ClaimSettings:
    """The controller's settings as the sidecar's flags set them (`--dra-pin`,
    `--reservation-timeout-seconds`: how long a plan's hold waits for the allocation)."""
    return ClaimSettings(pin=flags.dra_pin, hold_seconds=flags.reservation_timeout_seconds)
