"""The API calls the gang and queue controllers make, as a protocol, and their
kubernetes-asyncio form.

`PodApi` is all a controller needs of pods: read a pod, merge-patch it, merge-patch its
status (the GangReady condition), and for a preemption or a reclaim evict a pod
(Eviction API) and list a namespace's PodDisruptionBudgets. `Pod` is what a write or an
Event needs to name its pod (a gang member, a queued pod, a victim's record: all
`gpuplace.cluster.pods.PodRecord`s, which satisfy it). `KubePods` provides `PodApi` over
`gpuplace.cluster.kube.Kube`, the one layer every API call goes through
(tests/deploy/test_rbac.py checks it). Failures are `gpuplace.cluster.kube.ApiError`,
as everywhere. Owns no state, never retries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from gpuplace.cluster import kube


class Pod(Protocol):
    """The pod a write or an Event is for: where, and which one."""

    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def uid(self) -> str: ...


class PodApi(Protocol):
    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def patch_pod(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...

    async def patch_pod_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...

    async def evict_pod(self, namespace: str, name: str, *, uid: str) -> None: ...

    async def disruption_budgets(self, namespace: str) -> list[dict[str, Any]]: ...


class KubePods:
    """`PodApi` over a `gpuplace.cluster.kube.Kube`."""

    def __init__(self, api: kube.Kube) -> None:
        self.api = api

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.api.get_pod(namespace, name)

    async def patch_pod(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        return await self.api.patch_pod(namespace, name, patch)

    async def patch_pod_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of pods/NAME/status. Raises `kube.ApiError`."""
        return await self.api.patch_pod_status(namespace, name, patch)

    async def evict_pod(self, namespace: str, name: str, *, uid: str) -> None:
        """pods/NAME/eviction with the UID as precondition. Raises `kube.ApiError`."""
        await self.api.evict_pod(namespace, name, uid=uid)

    async def disruption_budgets(self, namespace: str) -> list[dict[str, Any]]:
        return await self.api.disruption_budgets(namespace)
