"""The Kubernetes API calls gpuplace makes, as raw JSON, through kubernetes-asyncio.

Every API call of the sidecar goes through here (a test fails when a generated `*Api`
is used anywhere else, and reads the calls here to check the shipped RBAC): the generated
`CoreV1Api`, `CoordinationV1Api`, `PolicyV1Api`, `ResourceV1Api` (DRA: ResourceSlices
and ResourceClaims, `resource.k8s.io/v1`) and `CustomObjectsApi` (GpuQueues only:
`gpuqueues.gpuplace.io`) with `_preload_content=False`, decoded here with
`json.loads`: pods and nodes stay the dicts the API server sent (the
informers and the extender read them as such, and a model round trip costs more than
the decision). A failure becomes one exception type, `ApiError`, carrying the parsed
`Status` (code, reason, message), so callers branch on `conflict` / `gone` /
`not_found` and never on strings.

Each answer is reported to `self.refusals` (`gpuplace.cluster.refusals`): a 401/403 — or a 404 of
something that must exist — is logged loudly, counted and, where it blocks the sidecar,
shown in /readyz.

This module owns no state beyond that and never retries: retry policy belongs to the callers
(informers back off and resume, bind answers the scheduler, which retries).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, Literal

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpuplace.cluster import refusals as refusing

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
MAX_LINE = 16 * 1024 * 1024
"""Longest watch event accepted (etcd stores objects up to 1.5 MiB)."""

Kind = Literal["nodes", "pods", "namespaces", "gpuqueues", "resourceslices", "resourceclaims"]
"""What the informers list and watch (GpuQueues are the custom resource of
deploy/base/gpuqueue-crd.yaml; ResourceSlices the DRA node agent's own; ResourceClaims the
sidecar's, every namespace's, on the DRA path)."""
GPUQUEUES = ("gpuplace.io", "v1alpha1", "gpuqueues")
"""Group, version and plural of the GpuQueue custom resource."""
SLICES = "resourceslices.resource.k8s.io"
CLAIMS = "resourceclaims.resource.k8s.io"
"""The DRA resources as RBAC and kubectl name them (group-qualified), for refusals."""


class ApiError(Exception):
    """A failed API call: HTTP `status` (0 when the server was not reached) and its Status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def already_exists(self) -> bool:
        """409 AlreadyExists: a create found an object of that name (`conflict` is any 409)."""
        return self.status == 409 and self.reason == "AlreadyExists"

    @property
    def gone(self) -> bool:
        return self.status == 410

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @classmethod
    def from_status(cls, status: int, body: bytes | str | Mapping[str, Any]) -> ApiError:
        """From an HTTP status and a (maybe) `Status` body."""
        parsed: Any = body
        if isinstance(body, bytes | str):
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = {}
        if not isinstance(parsed, Mapping):
            parsed = {}
        code = parsed.get("code")
        return cls(
            int(code) if isinstance(code, int) and code else status,
            str(parsed.get("reason") or "Unknown"),
            str(parsed.get("message") or "")[:500],
        )


async def _call(request: Awaitable[Any]) -> Any:
    """Await one generated-client call made with `_preload_content=False`; decode its JSON."""
    try:
        response = await request
    except ApiException as error:
        raise ApiError.from_status(error.status or 0, error.body or b"") from error
    except (aiohttp.ClientError, OSError, TimeoutError) as error:
        raise ApiError(0, "Unreachable", str(error) or type(error).__name__) from error
    try:
        body = await response.read()
    except (aiohttp.ClientError, OSError, TimeoutError) as error:
        raise ApiError(0, "Unreachable", str(error) or type(error).__name__) from error
    finally:
        response.release()
    if response.status >= 400:
        raise ApiError.from_status(response.status, body)
    if not body:
        return {}
    try:
        return json.loads(body)
    except ValueError as error:
        raise ApiError(response.status, "Undecodable", "the response is not JSON") from error


class Kube:
    """The API calls of the sidecar and `gpuplace explain`. Raises `ApiError`."""

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        timeout: float = 10.0,
        refusals: refusing.Refusals | None = None,
    ) -> None:
        self.api_client = api_client
        # Any: the generated signatures omit `_content_type` and want model objects where
        # the client accepts (and we send) plain dicts.
        self.core: Any = client.CoreV1Api(api_client)
        self.coordination: Any = client.CoordinationV1Api(api_client)
        self.policy: Any = client.PolicyV1Api(api_client)
        self.custom: Any = client.CustomObjectsApi(api_client)
        self.resource: Any = client.ResourceV1Api(api_client)
        self.timeout = timeout
        """Seconds for one request (watches use their own, longer, read timeout)."""
        self.refusals = refusals or refusing.Refusals()
        """Refusals of the calls made here (logged, counted, for /readyz)."""

    async def _ask(
        self,
        verb: str,
        resource: str,
        request: Awaitable[Any],
        *,
        namespace: str | None = None,
        name: str | None = None,
        missing: bool = False,
    ) -> Any:
        """`_call`, with its answer reported to `refusals` (`missing`: a 404 means
        something gpuplace needs does not exist)."""
        try:
            answer = await _call(request)
        except ApiError as error:
            self.refusals.answered(
                verb,
                resource,
                error.status,
                error.reason,
                error.message,
                namespace=namespace,
                name=name,
                missing=missing,
            )
            raise
        self.refusals.answered(verb, resource, 200)
        return answer

    def _lister(self, kind: Kind) -> Any:
        if kind == "gpuqueues":
            return functools.partial(self.custom.list_cluster_custom_object, *GPUQUEUES)
        if kind == "namespaces":
            return self.core.list_namespace
        if kind == "resourceslices":
            return self.resource.list_resource_slice
        if kind == "resourceclaims":
            return self.resource.list_resource_claim_for_all_namespaces
        return self.core.list_node if kind == "nodes" else self.core.list_pod_for_all_namespaces

    async def list_page(
        self,
        kind: Kind,
        *,
        label_selector: str = "",
        field_selector: str = "",
        limit: int = 500,
        token: str = "",
    ) -> dict[str, Any]:
        """One page of a list (`metadata.continue` names the next). Raises `ApiError`."""
        kwargs: dict[str, Any] = {"limit": limit, "_preload_content": False}
        if label_selector:
            kwargs["label_selector"] = label_selector
        if field_selector:
            kwargs["field_selector"] = field_selector
        if token:
            kwargs["_continue"] = token
        kwargs["_request_timeout"] = max(self.timeout, 60.0)
        return await self._object("list", kind, self._lister(kind)(**kwargs), missing=True)

    async def list_all(self, kind: Kind, *, label_selector: str = "") -> list[dict[str, Any]]:
        """Every object of a list, page by page (for commands; informers page themselves).
        Raises `ApiError`. O(objects)."""
        found: list[dict[str, Any]] = []
        token = ""
        while True:
            page = await self.list_page(kind, label_selector=label_selector, token=token)
            found.extend(item for item in page.get("items") or [] if isinstance(item, dict))
            token = str((page.get("metadata") or {}).get("continue") or "")
            if not token:
                return found

    async def watch(
        self,
        kind: Kind,
        *,
        resource_version: str,
        label_selector: str = "",
        field_selector: str = "",
        timeout_seconds: int = 300,
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request, as decoded JSON lines, until the server ends it.

        Raises `ApiError` when the request fails (e.g. 410 Gone) or the stream breaks.
        """
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "resource_version": resource_version,
            "timeout_seconds": timeout_seconds,
            "_preload_content": False,
            "_request_timeout": aiohttp.ClientTimeout(
                total=None, sock_connect=self.timeout, sock_read=timeout_seconds + 30
            ),
        }
        if label_selector:
            kwargs["label_selector"] = label_selector
        if field_selector:
            kwargs["field_selector"] = field_selector
        try:
            response = await self._lister(kind)(**kwargs)
        except ApiException as error:
            refused = ApiError.from_status(error.status or 0, error.body or b"")
            self._report("watch", kind, refused)
            raise refused from error
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            raise ApiError(0, "Unreachable", str(error) or type(error).__name__) from error
        try:
            if response.status >= 400:
                refused = ApiError.from_status(response.status, await response.read())
                self._report("watch", kind, refused)
                raise refused
            self.refusals.answered("watch", kind, response.status)
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                while True:
                    end = buffer.find(b"\n")
                    if end < 0:
                        break
                    line, buffer = buffer[:end], buffer[end + 1 :]
                    if line.strip():
                        yield _event(line)
                if len(buffer) > MAX_LINE:
                    raise ApiError(200, "TooLarge", f"a watch event is over {MAX_LINE} bytes")
            if buffer.strip():
                yield _event(buffer)
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            raise ApiError(0, "Unreachable", str(error) or type(error).__name__) from error
        finally:
            response.close()

    def _report(self, verb: str, resource: str, error: ApiError) -> None:
        self.refusals.answered(
            verb, resource, error.status, error.reason, error.message, missing=True
        )

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return await self._object(
            "get",
            "pods",
            self.core.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=self.timeout
            ),
            namespace,
            name,
        )

    async def read_lease(self, namespace: str, name: str) -> dict[str, Any]:
        """A coordination.k8s.io Lease (kube-scheduler's leader election). A 404 counts
        as a refusal: the Lease the configuration names must exist."""
        return await self._object(
            "get",
            refusing.LEASES,
            self.coordination.read_namespaced_lease(
                name, namespace, _preload_content=False, _request_timeout=self.timeout
            ),
            namespace,
            name,
            missing=True,
        )

    async def _object(
        self,
        verb: str,
        resource: str,
        request: Awaitable[Any],
        namespace: str | None = None,
        name: str | None = None,
        *,
        missing: bool = False,
    ) -> dict[str, Any]:
        """One API call whose answer is an object (a pod, a node, an event, a Lease)."""
        answer = await self._ask(
            verb, resource, request, namespace=namespace, name=name, missing=missing
        )
        if not isinstance(answer, dict):
            raise ApiError(200, "Undecodable", "the answer is not a JSON object")
        return answer

    def _merge(self, method: Any, *names: str, patch: Mapping[str, Any]) -> Awaitable[Any]:
        """A JSON merge patch through `method` (a generated `patch_*` call)."""
        return method(  # type: ignore[no-any-return]
            *names,
            dict(patch),
            _content_type=MERGE_PATCH,
            _preload_content=False,
            _request_timeout=self.timeout,
        )

    async def patch_pod(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of a pod (a `metadata.resourceVersion` in it is a precondition:
        409 when the pod changed since)."""
        return await self._object(
            "patch",
            "pods",
            self._merge(self.core.patch_namespaced_pod, name, namespace, patch=patch),
            namespace,
            name,
        )

    async def bind_pod(
        self,
        namespace: str,
        name: str,
        *,
        uid: str,
        node: str,
        annotations: Mapping[str, str] | None = None,
    ) -> None:
        """Create pods/NAME/binding to `node`; the UID is a precondition (409 when the pod
        was replaced) and `annotations` land on the pod in the same write."""
        metadata: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid}
        if annotations:
            metadata["annotations"] = dict(annotations)
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": metadata,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        await self._create_of_pod(
            "pods/binding", self.core.create_namespaced_pod_binding, namespace, name, body
        )

    async def evict_pod(self, namespace: str, name: str, *, uid: str) -> None:
        """Create pods/NAME/eviction (policy/v1 Eviction), the pod's UID as precondition:
        the API server checks the pod's PodDisruptionBudget (429 TooManyRequests when it
        forbids), then deletes the pod gracefully; 404 when it is gone, 409 when it was
        replaced. The sidecar never DELETEs a pod (docs/gangs.md)."""
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": uid}},
        }
        await self._create_of_pod(
            "pods/eviction", self.core.create_namespaced_pod_eviction, namespace, name, body
        )

    async def _create_of_pod(
        self, resource: str, method: Any, namespace: str, name: str, body: Mapping[str, Any]
    ) -> None:
        """POST a pod's subresource (binding, eviction) through generated `method`."""
        await self._ask(
            "create",
            resource,
            method(
                name, namespace, dict(body), _preload_content=False, _request_timeout=self.timeout
            ),
            namespace=namespace,
            name=name,
        )

    async def disruption_budgets(self, namespace: str) -> list[dict[str, Any]]:
        """The policy/v1 PodDisruptionBudgets of one namespace (one list, no watch: read
        only when a gang is about to preempt there)."""
        return await self._items(
            "poddisruptionbudgets.policy",
            self.policy.list_namespaced_pod_disruption_budget(
                namespace, _preload_content=False, _request_timeout=self.timeout
            ),
            namespace,
        )

    async def patch_pod_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of pods/NAME/status (conditions)."""
        return await self._object(
            "patch",
            "pods/status",
            self._merge(self.core.patch_namespaced_pod_status, name, namespace, patch=patch),
            namespace,
            name,
        )

    async def patch_gpuqueue_status(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """JSON merge patch of gpuqueues/NAME/status (what the queue controller reports)."""
        return await self._object(
            "patch",
            "gpuqueues/status",
            self._merge(
                self.custom.patch_cluster_custom_object_status, *GPUQUEUES, name, patch=patch
            ),
            None,
            name,
        )

    async def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """JSON merge patch of a node (its labels)."""
        return await self._object(
            "patch", "nodes", self._merge(self.core.patch_node, name, patch=patch), None, name
        )

    async def patch_node_status(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """JSON merge patch of nodes/NAME/status."""
        return await self._object(
            "patch",
            "nodes/status",
            self._merge(self.core.patch_node_status, name, patch=patch),
            None,
            name,
        )

    async def get_node(self, name: str) -> dict[str, Any]:
        """One Node (the DRA node agent reads its own: runtime version, UID)."""
        return await self._object(
            "get",
            "nodes",
            self.core.read_node(name, _preload_content=False, _request_timeout=self.timeout),
            None,
            name,
        )

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """A ResourceClaim (the DRA node agent reads the allocation it prepares)."""
        return await self._object(
            "get",
            CLAIMS,
            self.resource.read_namespaced_resource_claim(
                name, namespace, _preload_content=False, _request_timeout=self.timeout
            ),
            namespace,
            name,
        )

    async def create_resource_claim(
        self, namespace: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """POST a ResourceClaim (the sidecar's, for a pod on the DRA path); 409
        AlreadyExists when one of that name is there."""
        return await self._object(
            "create",
            CLAIMS,
            self.resource.create_namespaced_resource_claim(
                namespace, dict(body), _preload_content=False, _request_timeout=self.timeout
            ),
            namespace,
            str((body.get("metadata") or {}).get("name") or ""),
        )

    async def delete_resource_claim(self, namespace: str, name: str, *, uid: str) -> None:
        """DELETE of a ResourceClaim, its UID as precondition (the sidecar's, when a
        pinned claim cannot be allocated and its pod is planned anew)."""
        await self._ask(
            "delete",
            CLAIMS,
            self.resource.delete_namespaced_resource_claim(
                name,
                namespace,
                body={"preconditions": {"uid": uid}},
                _preload_content=False,
                _request_timeout=self.timeout,
            ),
            namespace=namespace,
            name=name,
        )

    async def get_resource_slice(self, name: str) -> dict[str, Any]:
        return await self._object(
            "get",
            SLICES,
            self.resource.read_resource_slice(
                name, _preload_content=False, _request_timeout=self.timeout
            ),
            None,
            name,
        )

    async def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._object(
            "create",
            SLICES,
            self.resource.create_resource_slice(
                dict(body), _preload_content=False, _request_timeout=self.timeout
            ),
        )

    async def replace_resource_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT of a ResourceSlice; its `metadata.resourceVersion` is the precondition (409
        when it changed since)."""
        return await self._object(
            "update",
            SLICES,
            self.resource.replace_resource_slice(
                name, dict(body), _preload_content=False, _request_timeout=self.timeout
            ),
            None,
            name,
        )

    async def delete_resource_slice(self, name: str, *, uid: str) -> None:
        """DELETE of a ResourceSlice, its UID as precondition."""
        await self._ask(
            "delete",
            SLICES,
            self.resource.delete_resource_slice(
                name,
                body={"preconditions": {"uid": uid}},
                _preload_content=False,
                _request_timeout=self.timeout,
            ),
            name=name,
        )

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> dict[str, Any]:
        return await self._object(
            "create",
            "events",
            self.core.create_namespaced_event(
                namespace, dict(event), _preload_content=False, _request_timeout=self.timeout
            ),
            namespace,
        )

    async def patch_event(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        return await self._object(
            "patch",
            "events",
            self._merge(self.core.patch_namespaced_event, name, namespace, patch=patch),
            namespace,
            name,
        )

    async def pod_events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        """Events about one pod (for `gpuplace explain`)."""
        return await self._items(
            "events",
            self.core.list_namespaced_event(
                namespace,
                field_selector=f"involvedObject.name={name}",
                _preload_content=False,
                _request_timeout=self.timeout,
            ),
            namespace,
        )

    async def _items(
        self, resource: str, request: Awaitable[Any], namespace: str
    ) -> list[dict[str, Any]]:
        """The items of one list call (no paging: small namespaced lists)."""
        listed = await self._ask("list", resource, request, namespace=namespace)
        items = listed.get("items") if isinstance(listed, dict) else None
        return [item for item in items or [] if isinstance(item, dict)]

    async def close(self) -> None:
        await self.api_client.close()


def _event(line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError as error:
        raise ApiError(200, "Undecodable", "a watch event is not JSON") from error
    if not isinstance(event, dict):
        raise ApiError(200, "Undecodable", "a watch event is not a JSON object")
    return event
