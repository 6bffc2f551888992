"""An in-process fake kube-apiserver for the objects `gpuplace certs` touches: Secrets and
the two webhook configuration kinds. Tests only.

It follows the real wire format where gpuplace depends on it: every write bumps
`metadata.resourceVersion`; GET of a missing object is a 404 `Status`; create of an existing
object is a 409 `AlreadyExists`; PUT must carry the current resourceVersion (missing → 422,
stale → 409 `Conflict`); a Secret's data must be base64 and a `kubernetes.io/tls` Secret must
hold `tls.crt` and `tls.key` (422); `type` is immutable (422). PATCH with
`application/strategic-merge-patch+json` merges the `webhooks` list by its patch merge key
`name` (as the Go type declares), honours a `metadata.resourceVersion` precondition (409),
and other patch types are answered 415. It runs in its own thread with its own event loop,
so code under test may call `asyncio.run` as the real command does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

ADMISSION = "/apis/admissionregistration.k8s.io/v1"
KINDS = {
    "mutatingwebhookconfigurations": "MutatingWebhookConfiguration",
    "validatingwebhookconfigurations": "ValidatingWebhookConfiguration",
}
STRATEGIC = "application/strategic-merge-patch+json"

Key = tuple[str, str, str]  # (plural, namespace or "", name)


@dataclass
class State:
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    version: int = 100
    log: list[tuple[str, str]] = field(default_factory=list)
    """(method, path) of every request, in order."""
    before_write: Callable[[State, Key], None] | None = None
    """Called under the lock before a PATCH/PUT is applied (e.g. to simulate a racing writer)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bump(self, obj: dict[str, Any]) -> None:
        self.version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)

    def put(self, plural: str, obj: dict[str, Any]) -> None:
        """Seed an object (as if created earlier)."""
        meta = obj["metadata"]
        with self.lock:
            stored = copy.deepcopy(obj)
            self.bump(stored)
            self.objects[(plural, meta.get("namespace", ""), meta["name"])] = stored

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            obj = self.objects.get((plural, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def writes(self) -> list[tuple[str, str]]:
        return [(m, p) for m, p in self.log if m in ("POST", "PUT", "PATCH", "DELETE")]


def status(code: int, reason: str, message: str, **details: Any) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }
    return web.json_response(body, status=code)


def _not_found(plural: str, name: str) -> web.Response:
    return status(404, "NotFound", f'{plural} "{name}" not found', name=name, kind=plural)


def _conflict(plural: str, name: str) -> web.Response:
    return status(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {plural} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        name=name,
        kind=plural,
    )


def _invalid(plural: str, name: str, message: str) -> web.Response:
    return status(422, "Invalid", f'{plural} "{name}" is invalid: {message}', name=name)


def _secret_problem(obj: dict[str, Any]) -> str | None:
    data = obj.get("data") or {}
    for key, value in data.items():
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError, TypeError):
            return f"data[{key}]: Invalid value: illegal base64 data"
    if obj.get("type") == "kubernetes.io/tls":
        for key in ("tls.crt", "tls.key"):
            if key not in data:
                return f"data[{key}]: Required value"
    return None


def strategic_merge(target: Any, patch: Any, path: str = "") -> Any:
    """Strategic merge for the fields gpuplace patches: maps merge recursively, a null
    deletes, `webhooks` lists merge by `name`, other lists are replaced."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: dict[str, Any] = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            raise ValueError(f"directive {key} not supported by the fake")
        if value is None:
            result.pop(key, None)
        elif key == "webhooks" and path == "" and isinstance(value, list):
            merged = list(result.get(key) or [])
            for item in value:
                names = [w.get("name") for w in merged]
                if item.get("name") in names:
                    at = names.index(item["name"])
                    merged[at] = strategic_merge(merged[at], item, f"{path}/{key}")
                else:
                    merged.append(copy.deepcopy(item))
            result[key] = merged
        else:
            result[key] = strategic_merge(result.get(key), value, f"{path}/{key}")
    return result


def make_app(state: State) -> web.Application:
    routes = web.RouteTableDef()

    @web.middleware
    async def record(
        request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        with state.lock:
            state.log.append((request.method, request.path))
        response: web.StreamResponse = await handler(request)
        return response

    @routes.get("/api/v1/namespaces/{ns}/secrets/{name}")
    async def get_secret(request: web.Request) -> web.Response:
        obj = state.get("secrets", request.match_info["ns"], request.match_info["name"])
        if obj is None:
            return _not_found("secrets", request.match_info["name"])
        return web.json_response(obj)

    @routes.post("/api/v1/namespaces/{ns}/secrets")
    async def create_secret(request: web.Request) -> web.Response:
        obj = await request.json()
        ns = request.match_info["ns"]
        name = obj.get("metadata", {}).get("name", "")
        problem = _secret_problem(obj)
        if problem:
            return _invalid("secrets", name, problem)
        with state.lock:
            if ("secrets", ns, name) in state.objects:
                return status(409, "AlreadyExists", f'secrets "{name}" already exists', name=name)
            if obj["metadata"].get("resourceVersion"):
                return _invalid("secrets", name, "metadata.resourceVersion: must be empty")
            obj["metadata"]["namespace"] = ns
            obj["metadata"]["uid"] = f"uid-{state.version}"
            state.bump(obj)
            state.objects[("secrets", ns, name)] = obj
            return web.json_response(copy.deepcopy(obj), status=201)

    @routes.put("/api/v1/namespaces/{ns}/secrets/{name}")
    async def replace_secret(request: web.Request) -> web.Response:
        obj = await request.json()
        ns, name = request.match_info["ns"], request.match_info["name"]
        problem = _secret_problem(obj)
        if problem:
            return _invalid("secrets", name, problem)
        with state.lock:
            if state.before_write is not None:
                state.before_write(state, ("secrets", ns, name))
            current = state.objects.get(("secrets", ns, name))
            if current is None:
                return _not_found("secrets", name)
            wanted = obj.get("metadata", {}).get("resourceVersion")
            if not wanted:
                return _invalid(
                    "secrets", name, "metadata.resourceVersion: must be specified for an update"
                )
            if wanted != current["metadata"]["resourceVersion"]:
                return _conflict("secrets", name)
            if obj.get("type", "Opaque") != current.get("type", "Opaque"):
                return _invalid("secrets", name, "type: Invalid value: field is immutable")
            obj["metadata"]["uid"] = current["metadata"].get("uid")
            state.bump(obj)
            state.objects[("secrets", ns, name)] = obj
            return web.json_response(copy.deepcopy(obj))

    @routes.get(ADMISSION + "/{plural}/{name}")
    async def get_config(request: web.Request) -> web.Response:
        plural, name = request.match_info["plural"], request.match_info["name"]
        if plural not in KINDS:
            return status(404, "NotFound", "the server could not find the requested resource")
        obj = state.get(plural, "", name)
        if obj is None:
            return _not_found(plural, name)
        return web.json_response(obj)

    @routes.patch(ADMISSION + "/{plural}/{name}")
    async def patch_config(request: web.Request) -> web.Response:
        plural, name = request.match_info["plural"], request.match_info["name"]
        if plural not in KINDS:
            return status(404, "NotFound", "the server could not find the requested resource")
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        if content_type != STRATEGIC:
            return status(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown "
                f"format - accepted media types include: {STRATEGIC}",
            )
        patch = await request.json()
        with state.lock:
            if state.before_write is not None:
                state.before_write(state, (plural, "", name))
            current = state.objects.get((plural, "", name))
            if current is None:
                return _not_found(plural, name)
            wanted = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
                return _conflict(plural, name)
            try:
                merged = strategic_merge(current, patch)
            except ValueError as exc:
                return status(400, "BadRequest", str(exc))
            for webhook in merged.get("webhooks") or []:
                bundle = (webhook.get("clientConfig") or {}).get("caBundle")
                if bundle is not None:
                    try:
                        base64.b64decode(bundle, validate=True)
                    except (binascii.Error, ValueError):
                        return _invalid(plural, name, "caBundle: illegal base64 data")
            state.bump(merged)
            state.objects[(plural, "", name)] = merged
            return web.json_response(copy.deepcopy(merged))

    app = web.Application(middlewares=[record])
    app.add_routes(routes)
    return app


@contextmanager
def serving(state: State) -> Iterator[str]:
    """Run the fake on 127.0.0.1 in a thread; yields its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(state))
    started = threading.Event()
    port: list[int] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port.append(int(runner.addresses[0][1]))
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, name="fake-kube-apiserver", daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("fake API server did not start")
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def kubeconfig(url: str) -> str:
    """A kubeconfig text that points a client at the fake (no credentials)."""
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: fake\n  cluster:\n    server: {url}\n"
        "users:\n- name: fake\n  user: {}\n"
        "contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n"
        "current-context: fake\n"
    )
