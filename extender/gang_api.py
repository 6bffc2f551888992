"""The API calls the gang controller makes, as a protocol, and their kubernetes-asyncio form.

`PodApi` is all the controller needs: read a pod, merge-patch it, merge-patch its
status (the GangReady condition). `KubePods` provides it over `cluster.kube.Kube`;
`patch_pod_status` is here because `Kube` has no pods/status call (yet). Failures are
`cluster.kube.ApiError`, as everywhere. Owns no state, never retries.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from cluster import kube


class PodApi(Protocol):
    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def patch_pod(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...

    async def patch_pod_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...


class KubePods:
    """`PodApi` over a `cluster.kube.Kube`."""

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
        try:
            response = await self.api.core.patch_namespaced_pod_status(
                name,
                namespace,
                dict(patch),
                _content_type=kube.MERGE_PATCH,
                _preload_content=False,
                _request_timeout=self.api.timeout,
            )
        except ApiException as error:
            raise kube.ApiError.from_status(error.status or 0, error.body or b"") from error
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            raise kube.ApiError(0, "Unreachable", str(error) or type(error).__name__) from error
        try:
            body = await response.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            raise kube.ApiError(0, "Unreachable", str(error) or type(error).__name__) from error
        finally:
            response.release()
        if response.status >= 400:
            raise kube.ApiError.from_status(response.status, body)
        try:
            decoded = json.loads(body) if body else {}
        except ValueError as error:
            raise kube.ApiError(response.status, "Undecodable", "not JSON") from error
        if not isinstance(decoded, dict):
            raise kube.ApiError(response.status, "Undecodable", "not a JSON object")
        return decoded
