"""The fake kube-apiserver over HTTP: an aiohttp app on 127.0.0.1 speaking the real wire format.

Routes (core group under /api/v1, other groups under /apis/GROUP/VERSION):

- `GET` collection: list (`labelSelector`, `fieldSelector`, `limit`/`continue`; items
  without kind/apiVersion, `metadata.resourceVersion` of the snapshot) or, with
  `watch=true`, a chunked stream of JSON lines `{"type", "object"}`: ADDED, MODIFIED,
  DELETED, BOOKMARK (with `allowWatchBookmarks=true`, every `bookmark_interval`
  seconds) and ERROR (a Status; 410 Expired when `resourceVersion` is older than the
  history); the stream ends after `timeoutSeconds`;
- `GET`/`PUT`/`PATCH`/`DELETE` object and `/status` (a pod's DELETE is graceful:
  `Store.terminate`); `POST` collection (create,
  `generateName`); `POST pods/NAME/binding` (201); `POST pods/NAME/eviction` (201, or
  429 when a PodDisruptionBudget forbids: `Store.evict`);
- failures are `Status` bodies with the real codes and reasons (400, 404, 409
  Conflict/AlreadyExists, 410 Expired, 415, 422 Invalid, 429 TooManyRequests);
- with `access` (`localapi.access.Access`), every request is authenticated by its bearer
  token (401 without one) and authorized by RBAC (403 Forbidden) before it is routed, as
  kube-apiserver does; `Server.configuration(user)` / `kubeconfig(path, user)` present
  that user's token. Without `access`, anyone may do anything.

`FakeApi` is the state plus fault injection (`fail`, `before`), the call log (`calls`) and
synchronous helpers for test set-up; `serve` runs it on an ephemeral port of 127.0.0.1
in the current event loop, `serve_in_thread` in a thread of its own (for benchmarks,
so the fake's work is not timed with the code under test).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import re
import socket
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote

import yaml
from aiohttp import web
from kubernetes_asyncio import client

from gpuplace.dev.localapi.access import ADMIN, Access, User
from gpuplace.dev.localapi.patching import MERGE, TYPES
from gpuplace.dev.localapi.resources import DEFAULT_RESOURCES, PODS, Resource
from gpuplace.dev.localapi.statuses import ApiStatusError, success
from gpuplace.dev.localapi.store import BOOKMARK, ERROR, Obj, Store
from gpuplace.runtime import gc_tuning

T = TypeVar("T")

MAX_BODY = 8 * 1024 * 1024
NOT_SERVED = "the server could not find the requested resource"


@dataclass(frozen=True, slots=True)
class Call:
    """One request the fake served (for assertions on what a client sent)."""

    method: str
    path: str
    query: Mapping[str, str]
    content_type: str
    body: Any
    user: str = ""
    """Who sent it (with `access`): e.g. system:serviceaccount:gpuplace:gpuplace."""


@dataclass(slots=True)
class Fault:
    method: str
    path: re.Pattern[str]
    code: int
    times: int
    message: str
    delay: float
    action: Callable[[], object] | None = None


def _json_line(kind: str, obj: Obj) -> bytes:
    return json.dumps({"type": kind, "object": obj}, separators=(",", ":")).encode() + b"\n"


def _true(value: str | None) -> bool:
    """Go's strconv.ParseBool truths, as kube-apiserver reads boolean query parameters."""
    return value in ("1", "t", "T", "TRUE", "true", "True")


def _strip_kind(obj: Obj) -> Obj:
    return {key: value for key, value in obj.items() if key not in ("kind", "apiVersion")}


class FakeApi:
    """A fake kube-apiserver: see the module docstring."""

    def __init__(
        self,
        resources: Iterable[Resource] = DEFAULT_RESOURCES,
        *,
        history: int = 100_000,
        bookmark_interval: float = 1.0,
        max_watch_seconds: float = 1800.0,
        gone_as_http: bool = False,
        record_calls: int = 10_000,
        access: Access | None = None,
    ) -> None:
        self.store = Store(resources, history)
        self.access = access
        """Authentication and RBAC (None: every request is allowed, with or without a
        token). `Access.shipped()` enforces what deploy/ grants."""
        self.bookmark_interval = bookmark_interval
        self.max_watch_seconds = max_watch_seconds
        self.gone_as_http = gone_as_http
        """True: a too-old watch gets HTTP 410; False (real watch cache): 200 + ERROR event."""
        self.calls: deque[Call] = deque(maxlen=record_calls)
        self._faults: list[Fault] = []
        self._streams: set[web.StreamResponse] = set()
        self._serialized: dict[int, tuple[Obj, Any, bytes]] = {}

    # --- test helpers (synchronous, on the server's loop) --------------------------

    def _resource(self, resource: Resource | str) -> Resource:
        if isinstance(resource, Resource):
            return resource
        group, _, plural = resource.rpartition("/") if "/" in resource else ("", "", resource)
        found = self.store.resource(group, plural)
        if found is None:
            raise KeyError(f"unknown resource {resource!r}")
        return found

    def create(self, obj: Obj, namespace: str | None = None, *, uid: str | None = None) -> Obj:
        """Create any registered object (resource from its apiVersion and kind). `uid`
        forces the UID (set-up only: replaying captured payloads that name one)."""
        return self.store.create(self.store.resource_of(obj), obj, namespace, uid=uid)

    def load(self, resource: Resource | str, objects: Iterable[Obj]) -> int:
        """Bulk set-up without copies or history (see `Store.load`); for benchmarks."""
        return self.store.load(self._resource(resource), objects)

    def get(self, resource: Resource | str, name: str, namespace: str | None = None) -> Obj:
        return self.store.get(self._resource(resource), namespace, name)

    def objects(self, resource: Resource | str, namespace: str | None = None) -> list[Obj]:
        return self.store.list(self._resource(resource), namespace)[0]

    def patch(
        self,
        resource: Resource | str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        content_type: str = MERGE,
        subresource: str | None = None,
    ) -> Obj:
        return self.store.patch(
            self._resource(resource),
            namespace,
            name,
            content_type=content_type,
            patch=patch,
            subresource=subresource,
        )

    def delete(self, resource: Resource | str, name: str, namespace: str | None = None) -> Obj:
        return self.store.delete(self._resource(resource), namespace, name)

    def bind(self, namespace: str, name: str, node: str) -> None:
        self.store.bind(namespace, name, {"target": {"kind": "Node", "name": node}})

    def set_phase(self, namespace: str, name: str, phase: str) -> Obj:
        """What the kubelet does when a pod's containers finish: PATCH pods/NAME/status."""
        return self.patch(PODS, name, {"status": {"phase": phase}}, namespace, subresource="status")

    def fail(
        self,
        method: str,
        path: str,
        code: int,
        *,
        times: int = 1,
        message: str = "injected failure",
        delay: float = 0.0,
    ) -> None:
        """The next `times` requests of `method` whose path matches regex `path` fail with
        a Status of `code` (after `delay` seconds); code 0 = only the delay, then serve."""
        self._faults.append(Fault(method.upper(), re.compile(path), code, times, message, delay))

    def before(
        self, method: str, path: str, action: Callable[[], object], *, times: int = 1
    ) -> None:
        """The next `times` requests of `method` whose path matches regex `path` run
        `action()` on the server's loop first, then are served: e.g. a racing writer that
        changes the object between a client's read and its write."""
        self._faults.append(Fault(method.upper(), re.compile(path), 0, times, "", 0.0, action))

    def drop_watches(self, *, abort: bool = False) -> int:
        """End every open watch stream (as a broken connection with `abort`)."""
        return self.store.close_watches(abort=abort)

    def expire_watches(self) -> int:
        """Send every open watch a 410 ERROR event and end it (etcd compaction)."""
        self.store.compact()
        return self.store.close_watches(expire=True)

    def compact(self) -> None:
        """Forget the change history: resuming a watch from before now answers 410."""
        self.store.compact()

    def bookmark(self) -> None:
        self.store.bookmark()

    def calls_to(self, method: str, path: str) -> list[Call]:
        """Served calls of `method` whose path matches regex `path`."""
        pattern = re.compile(path)
        return [c for c in self.calls if c.method == method.upper() and pattern.search(c.path)]

    @property
    def open_watches(self) -> int:
        return len(self.store.watchers)

    # --- HTTP ----------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        app.on_shutdown.append(self._close_streams)
        return app

    async def _close_streams(self, app: web.Application) -> None:
        self.store.close_watches()

    def _route(self, path: str) -> tuple[Resource, str | None, str | None, str | None]:
        if path.startswith("/api/v1/"):
            group, rest = "", path[len("/api/v1/") :]
        elif path.startswith("/apis/"):
            parts = path[len("/apis/") :].split("/", 2)
            if len(parts) < 3:
                raise ApiStatusError(404, NOT_SERVED)
            group, rest = parts[0], parts[2]
        else:
            raise ApiStatusError(404, NOT_SERVED)
        segments = [unquote(part) for part in rest.split("/") if part]
        namespace = None
        if len(segments) >= 3 and segments[0] == "namespaces":
            nested = self.store.resource(group, segments[2])
            if nested is not None and nested.namespaced:
                namespace = segments[1]
                segments = segments[2:]
        if not segments or len(segments) > 3:
            raise ApiStatusError(404, NOT_SERVED)
        resource = self.store.resource(group, segments[0])
        if resource is None or (resource.namespaced and namespace is None and len(segments) > 1):
            raise ApiStatusError(404, NOT_SERVED)
        name = segments[1] if len(segments) > 1 else None
        sub = segments[2] if len(segments) > 2 else None
        if sub is not None and sub not in resource.subresources:
            raise ApiStatusError(404, NOT_SERVED)
        return resource, namespace, name, sub

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as error:
            raise ApiStatusError(
                400, f"couldn't get version/kind; json parse error: {error}"
            ) from error

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            writes = request.method in ("POST", "PUT", "PATCH", "DELETE")
            body = await self._body(request) if writes else None
            call = Call(
                request.method,
                request.path,
                dict(request.query),
                request.headers.get("Content-Type", ""),
                body,
            )
            if self.access is not None:
                try:
                    user = self.access.user(request.headers.get("Authorization"))
                    call = dataclasses.replace(call, user=user.name)
                finally:
                    self.calls.append(call)
                self.access.authorize(user, request.method, request.path, request.query)
            else:
                self.calls.append(call)
            for fault in self._faults:
                if (
                    fault.times > 0
                    and fault.method == request.method
                    and fault.path.search(request.path)
                ):
                    fault.times -= 1
                    if fault.delay:
                        await asyncio.sleep(fault.delay)
                    if fault.action is not None:
                        fault.action()
                    if fault.code:
                        raise ApiStatusError(fault.code, fault.message)
                    break
            self._faults = [fault for fault in self._faults if fault.times > 0]
            return await self._serve(request, body)
        except ApiStatusError as error:
            return web.json_response(error.body(), status=error.code)

    async def _serve(self, request: web.Request, body: Any) -> web.StreamResponse:
        resource, namespace, name, sub = self._route(request.path)
        store = self.store
        query = request.query
        method = request.method
        if name is None:
            if method == "GET":
                if _true(query.get("watch")):
                    return await self._watch(request, resource, namespace)
                return self._list(resource, namespace, query)
            if method == "POST":
                if not isinstance(body, dict):
                    raise ApiStatusError(400, "the body must be a JSON object")
                created = store.create(resource, body, namespace)
                return web.json_response(created, status=201)
            raise ApiStatusError(405, f"{method} is not supported on a collection")
        if sub == "binding":
            if method != "POST" or namespace is None:
                raise ApiStatusError(405, "bindings are created with POST")
            if not isinstance(body, dict):
                raise ApiStatusError(400, "the body must be a Binding object")
            store.bind(namespace, name, body)
            return web.json_response(success(201), status=201)
        if sub == "eviction":
            if method != "POST" or namespace is None:
                raise ApiStatusError(405, "evictions are created with POST")
            if not isinstance(body, dict):
                raise ApiStatusError(400, "the body must be an Eviction object")
            return web.json_response(store.evict(namespace, name, body), status=201)
        if method == "GET":
            return web.json_response(store.get(resource, namespace, name))
        if method == "PUT":
            if not isinstance(body, dict):
                raise ApiStatusError(400, "the body must be a JSON object")
            return web.json_response(store.update(resource, namespace, name, body, sub))
        if method == "PATCH":
            content_type = request.headers.get("Content-Type", "").split(";", maxsplit=1)[0].strip()
            if content_type not in TYPES:
                raise ApiStatusError(
                    415,
                    f"the body of the request was in an unknown format - accepted media types "
                    f"include: {', '.join(TYPES)}",
                )
            patched = store.patch(
                resource, namespace, name, content_type=content_type, patch=body, subresource=sub
            )
            return web.json_response(patched)
        if method == "DELETE" and sub is None:
            options = body if isinstance(body, dict) else {}
            if resource == PODS and namespace is not None:
                return web.json_response(store.terminate(namespace, name, options))
            preconditions = options.get("preconditions")
            return web.json_response(store.delete(resource, namespace, name, preconditions))
        raise ApiStatusError(405, f"{method} is not supported here")

    def _list(
        self, resource: Resource, namespace: str | None, query: Mapping[str, str]
    ) -> web.Response:
        try:
            limit = int(query.get("limit") or 0)
        except ValueError as error:
            raise ApiStatusError(400, "limit must be an integer") from error
        items, rv, token, remaining = self.store.list(
            resource,
            namespace,
            label_selector=query.get("labelSelector"),
            field_selector=query.get("fieldSelector"),
            limit=limit,
            continue_token=query.get("continue"),
        )
        metadata: dict[str, Any] = {"resourceVersion": rv}
        if token:
            metadata["continue"] = token
        if remaining is not None:
            metadata["remainingItemCount"] = remaining
        head = json.dumps(
            {"kind": resource.list_kind, "apiVersion": resource.api_version, "metadata": metadata},
            separators=(",", ":"),
        ).encode()
        items_json = b",".join(self._item_json(item) for item in items)
        return web.Response(
            body=head[:-1] + b',"items":[' + items_json + b"]}",
            content_type="application/json",
        )

    def _item_json(self, obj: Obj) -> bytes:
        """A list item's JSON (no kind/apiVersion), cached per object and resourceVersion,
        as kube-apiserver's watch cache keeps serialized objects."""
        version = obj["metadata"].get("resourceVersion")
        cached = self._serialized.get(id(obj))
        if cached is not None and cached[0] is obj and cached[1] == version:
            return cached[2]
        data = json.dumps(_strip_kind(obj), separators=(",", ":")).encode()
        if len(self._serialized) > 1_000_000:
            self._serialized.clear()
        self._serialized[id(obj)] = (obj, version, data)
        return data

    def warm(self) -> None:
        """Serialize every object now (benchmarks: the first list is then as fast as the
        real API server's, which serves lists from its cache)."""
        for resource in list(self.store._objects):
            for obj in self.store.items(resource):
                self._item_json(obj)

    async def _watch(
        self, request: web.Request, resource: Resource, namespace: str | None
    ) -> web.StreamResponse:
        query = request.query
        try:
            timeout = float(query.get("timeoutSeconds") or self.max_watch_seconds)
        except ValueError as error:
            raise ApiStatusError(400, "timeoutSeconds must be an integer") from error
        timeout = min(timeout, self.max_watch_seconds)
        bookmarks = _true(query.get("allowWatchBookmarks"))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        try:
            watcher = self.store.watch(
                resource,
                namespace,
                label_selector=query.get("labelSelector"),
                field_selector=query.get("fieldSelector"),
                resource_version=query.get("resourceVersion"),
                bookmarks=bookmarks,
            )
        except ApiStatusError as error:
            if error.code != 410 or self.gone_as_http:
                raise
            response.enable_chunked_encoding()
            await response.prepare(request)
            await response.write(_json_line(ERROR, error.body()))
            await response.write_eof()
            return response
        response.enable_chunked_encoding()
        started = query.get("resourceVersion") or "0"
        seen = int(started) if started.isdigit() and started != "0" else self.store.latest(resource)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        aborted = False
        try:
            await response.prepare(request)
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                wait = min(remaining, self.bookmark_interval) if bookmarks else remaining
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    if loop.time() >= deadline:
                        break
                    if self.store.latest(resource) <= seen:
                        continue  # nothing of its kind moved: no bookmark
                    item = (BOOKMARK, self.store.bookmark_object(resource))
                if item is None:
                    aborted = watcher.abort
                    break
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    seen = max(seen, int(item[1]["metadata"]["resourceVersion"]))
                await response.write(_json_line(*item))
        except ConnectionError:
            return response
        finally:
            self.store.unwatch(watcher)
        if aborted and request.transport is not None:
            request.transport.close()
            return response
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response


@dataclass(frozen=True, slots=True)
class Server:
    """A running fake: its URL and how clients reach it."""

    api: FakeApi
    url: str

    def token(self, user: User) -> str:
        """The bearer token of `user` (any token when the server does not authenticate)."""
        return "fake-token" if self.api.access is None else self.api.access.token(user)

    def configuration(self, user: User = ADMIN) -> client.Configuration:
        """A kubernetes-asyncio Configuration for this server (no TLS) that authenticates
        as `user` (default: an admin in system:masters, for set-up and users' commands)."""
        configuration = client.Configuration(host=self.url)
        configuration.verify_ssl = False
        configuration.api_key = {"BearerToken": f"Bearer {self.token(user)}"}
        return configuration

    def kubeconfig(self, path: Path, user: User = ADMIN) -> Path:
        """Write a kubeconfig file whose current context is this server, as `user`."""
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token(user)}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(document))
        return path


@contextlib.asynccontextmanager
async def serve(api: FakeApi | None = None) -> AsyncIterator[Server]:
    """Run `api` (a new FakeApi by default) on an ephemeral port of 127.0.0.1."""
    api = api or FakeApi()
    runner = web.AppRunner(api.app(), handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Server(api, f"http://127.0.0.1:{port}")
    finally:
        api.store.close_watches()
        await runner.cleanup()


class ThreadedServer:
    """A fake running on its own event loop in a thread; `call` runs code on that loop."""

    def __init__(self, server: Server, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.api = server.api
        self.url = server.url
        self._loop = loop

    def call(self, function: Callable[[], T]) -> T:
        """Run `function()` on the server's loop and return its result (thread-safe)."""

        async def run() -> T:
            return function()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def configuration(self, user: User = ADMIN) -> client.Configuration:
        return self.server.configuration(user)


@contextlib.contextmanager
def serve_in_thread(api: FakeApi | None = None) -> Iterator[ThreadedServer]:
    """Run a fake on its own thread and loop (benchmarks: its work is not timed)."""
    api = api or FakeApi()
    loop = asyncio.new_event_loop()
    started: list[Server] = []
    ready = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        async with serve(api) as server:
            started.append(server)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    ready.wait(10)
    if not started:
        raise RuntimeError("the fake API server did not start")
    try:
        yield ThreadedServer(started[0], loop)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


def _serve_forever(api: FakeApi, sock: socket.socket) -> None:
    api.warm()
    gc_tuning.freeze()  # the set-up objects are permanent: never traverse them again

    async def main() -> None:
        runner = web.AppRunner(api.app(), handle_signals=True, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        await asyncio.Event().wait()

    asyncio.run(main())


@contextlib.contextmanager
def serve_in_subprocess(api: FakeApi) -> Iterator[Server]:
    """Serve `api` (set up beforehand) from a forked process (benchmarks: the fake then
    shares neither the GIL nor the event loop with the code being measured). The
    returned `Server.api` is the parent's copy: it does not see what clients change."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    process = multiprocessing.get_context("fork").Process(
        target=_serve_forever, args=(api, sock), daemon=True
    )
    process.start()
    sock.close()
    try:
        yield Server(api, f"http://127.0.0.1:{port}")
    finally:
        process.terminate()
        process.join(10)
