"""The two API servers the local API's contract tests run against (issue 27, point 3): the
local API (`gpuplace.dev.localapi`, enforcing the RBAC deploy/ ships) and the real
kube-apiserver v1.36.2 of the real-cluster tier (the session's control plane with gpuplace
installed as README says: `tests.realcluster.sessions`, docs/realcluster.md).

A contract test takes the `server` fixture (`Served`), runs once against each, and asserts
the same answers. The real server is the reference: an assertion that holds there and
fails on the local API is a bug in the local API, fixed there. Every request goes over
HTTP, set-up included (as an admin in `system:masters`, or as one of the shipped
ServiceAccounts); only what a test cannot ask of an API server is played by the test on
both sides the same way:

- `compact()`: an etcd compaction on the real one (`kit.Cluster.compact`), the history
  dropped on the local one (`FakeApi.compact`);
- what controllers do on a cluster and the local API has none of: `settle_budget` waits
  for the disruption controller's status on the real one and writes that status on the
  local one.

On the real server each test gets a namespace of its own (removed after it, without
waiting for the sweep) and names its cluster-scoped objects after it (`node_name`); the
pods it makes name a scheduler nobody runs, so that no kube-scheduler binds them, and
carry no `gpuplace.io/` key, so that gpuplace's own admission never sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio import client

from gpuplace.dev import localapi
from gpuplace.dev.localapi import access
from gpuplace.dev.localapi.access import ADMIN, User
from tests.realcluster.install import Installation

JSON = "application/json"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
NOBODY = "referee-nobody"
"""The scheduler name of the pods the contract tests make: none runs by that name."""

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP answer: its status code and parsed JSON body (text when not JSON)."""

    status: int
    body: Any

    @property
    def reason(self) -> str:
        return str((self.body or {}).get("reason", "")) if isinstance(self.body, dict) else ""

    @property
    def message(self) -> str:
        return str((self.body or {}).get("message", "")) if isinstance(self.body, dict) else ""

    def ok(self, *codes: int) -> Any:
        """The body, asserting the status is one of `codes` (default 200 or 201)."""
        assert self.status in (codes or (200, 201)), (self.status, self.body)
        return self.body


@dataclass(frozen=True, slots=True)
class Credentials:
    """How a request presents a user: a bearer token and/or a TLS context (client cert)."""

    token: str | None
    tls: ssl.SSLContext | None
    configure: Callable[[client.Configuration], None]


@dataclass
class RealApi:
    """The tier's kube-apiserver, as the contract tests reach it (session-wide)."""

    installation: Installation
    _tokens: dict[User, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.installation.cluster.server

    def credentials(self, user: User) -> Credentials:
        cluster = self.installation.cluster
        ca = str(cluster.ca_file)
        if user == ADMIN:
            pki = cluster.state / "pki"
            cert, key = str(pki / "admin.crt"), str(pki / "admin.key")  # system:masters
            tls = ssl.create_default_context(cafile=ca)
            tls.load_cert_chain(cert, key)

            def admin(configuration: client.Configuration) -> None:
                configuration.cert_file, configuration.key_file = cert, key

            return Credentials(None, tls, admin)
        token = self.token(user)

        def bearer(configuration: client.Configuration) -> None:
            configuration.api_key = {"BearerToken": f"Bearer {token}"}

        return Credentials(token, ssl.create_default_context(cafile=ca), bearer)

    def token(self, user: User) -> str:
        """A token of a ServiceAccount user (`kubectl create token`), one per session."""
        if user not in self._tokens:
            _, _, namespace, name = user.name.split(":")
            self._tokens[user] = self.installation.token(namespace, name)
        return self._tokens[user]


@dataclass
class Served:
    """One API server under test; see the module docstring."""

    name: str
    """"local" or "real"."""
    url: str
    namespace: str
    """This test's namespace (on the local API nothing needs to exist first)."""
    session: aiohttp.ClientSession
    _credentials: Callable[[User], Credentials]
    _compact: Callable[[], object]
    local: localapi.Server | None = None
    """The local API's server (None on the real one): for what only it can do."""
    real: RealApi | None = None
    made: list[str] = field(default_factory=list)
    """Paths of cluster-scoped objects this test created (removed after it)."""
    _ready: Callable[[], Awaitable[None]] | None = None
    """Makes `namespace` on first use (then None)."""

    @property
    def is_real(self) -> bool:
        return self.local is None

    def configuration(self, user: User = ADMIN) -> client.Configuration:
        """A kubernetes-asyncio Configuration reaching this server as `user`."""
        if self.local is not None:
            return self.local.configuration(user)
        assert self.real is not None
        configuration = client.Configuration(host=self.url)
        configuration.ssl_ca_cert = str(self.real.installation.cluster.ca_file)
        self._credentials(user).configure(configuration)
        return configuration

    def token(self, user: User) -> str:
        """The bearer token that authenticates as `user` (a ServiceAccount)."""
        token = self._credentials(user).token
        assert token is not None, f"{user.name} authenticates with a client certificate"
        return token

    def node_name(self, suffix: str) -> str:
        """A Node name of this test (nodes are cluster-scoped: shared on the real one)."""
        return f"{self.namespace}-{suffix}"

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        user: User | None = ADMIN,
        content_type: str = JSON,
        query: Mapping[str, str] | None = None,
        token: str | None = None,
    ) -> Answer:
        """One request as `user` (None: no credentials; `token`: that bearer token)."""
        await self._ensure(path)
        headers = {"Content-Type": content_type}
        tls: ssl.SSLContext | bool = True
        if user is not None:
            credentials = self._credentials(user)
            tls = credentials.tls or True
            if credentials.token is not None:
                headers["Authorization"] = f"Bearer {credentials.token}"
        elif self.is_real:
            tls = self._credentials(access.GPUPLACE).tls or True  # the CA, no client certificate
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body)
        async with self.session.request(
            method, self.url + path, data=data, headers=headers, params=query, ssl=tls
        ) as response:
            raw = await response.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        if method == "POST" and response.status == 201 and isinstance(parsed, dict):
            meta = parsed.get("metadata") or {}
            if "namespace" not in meta and meta.get("name") and "/namespaces/" not in path:
                self.made.append(f"{path}/{meta['name']}")
        return Answer(response.status, parsed)

    async def _ensure(self, path: str) -> None:
        if self._ready is not None and f"/namespaces/{self.namespace}/" in path:
            ready, self._ready = self._ready, None
            await ready()

    async def create(self, obj: Mapping[str, Any], *, user: User = ADMIN) -> Obj:
        """POST `obj` to its collection (namespaced ones into this test's namespace)."""
        resource = resource_of(obj)
        namespace = self.namespace if resource.namespaced else None
        found: Obj = (await self.call("POST", resource.path(namespace), obj, user=user)).ok(201)
        return found

    async def get(self, path: str, *, user: User = ADMIN) -> Obj:
        found: Obj = (await self.call("GET", path, user=user)).ok(200)
        return found

    async def patch(
        self, path: str, body: Any, *, content_type: str = MERGE, user: User = ADMIN
    ) -> Answer:
        return await self.call("PATCH", path, body, content_type=content_type, user=user)

    def path(self, plural: str, name: str | None = None, sub: str | None = None) -> str:
        """The path of this test's objects of `plural` (`pods`, `policy/
        poddisruptionbudgets`), of one of them, and of its subresource."""
        group, _, kind = plural.rpartition("/")
        resource = next(
            r for r in localapi.DEFAULT_RESOURCES if (r.group, r.plural) == (group, kind)
        )
        found = resource.path(self.namespace if resource.namespaced else None, name)
        return found + (f"/{sub}" if sub else "")

    async def watch(
        self,
        path: str,
        query: Mapping[str, str],
        *,
        count: int = 1_000,
        timeout: float = 10.0,
        user: User = ADMIN,
    ) -> tuple[int, list[Obj]]:
        """Open a watch (`watch=true` added) and read its events until `count` came,
        the stream ended or `timeout` seconds passed: (HTTP status, events)."""
        await self._ensure(path)
        events: list[Obj] = []
        credentials = self._credentials(user)
        headers = {"Authorization": f"Bearer {credentials.token}"} if credentials.token else {}
        params = {"watch": "true", **query}
        async with self.session.get(
            self.url + path, params=params, headers=headers, ssl=credentials.tls or True
        ) as response:
            if response.status != 200:
                return response.status, [json.loads(await response.read())]

            async def read() -> None:
                async for line in response.content:
                    if line.strip():
                        events.append(json.loads(line))
                        if len(events) >= count:
                            return

            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(read(), timeout)
            return response.status, events

    def compact(self) -> None:
        """Forget the change history: an older resourceVersion is then too old (410)."""
        self._compact()

    async def settle_budget(self, name: str, allowed: int, healthy: int, desired: int) -> Obj:
        """Budget `name` as the disruption controller reports it once it has seen the
        pods: `disruptionsAllowed`, `currentHealthy`, `desiredHealthy` (waited for on
        the real server, written on the local one). Returns the budget."""
        path = self.path("policy/poddisruptionbudgets", name)
        wanted = {"disruptionsAllowed": allowed, "currentHealthy": healthy}
        wanted["desiredHealthy"] = desired
        if not self.is_real:
            budget = await self.get(path)
            status = {**wanted, "expectedPods": healthy}
            status["observedGeneration"] = budget["metadata"].get("generation", 1)
            patched = await self.patch(path + "/status", {"status": status})
            found: Obj = patched.ok(200)
            return found
        deadline = time.monotonic() + 60
        while True:
            budget = await self.get(path)
            status = budget.get("status") or {}
            observed = status.get("observedGeneration") == budget["metadata"].get("generation")
            if observed and all(status.get(key) == value for key, value in wanted.items()):
                return budget
            assert time.monotonic() < deadline, f"the disruption controller left {status}"
            await asyncio.sleep(0.2)

    async def run_pod(self, name: str, node: str, labels: Mapping[str, str]) -> Obj:
        """A pod bound to `node` and running and ready there, as the scheduler and the
        kubelet leave it (a Binding, then its status as the kubelet writes it)."""
        await self.create(pod(name, labels=labels))
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        (await self.call("POST", self.path("pods", name, "binding"), binding)).ok(201)
        status = {
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        }
        found: Obj = (await self.patch(self.path("pods", name, "status"), status)).ok(200)
        return found


def resource_of(obj: Mapping[str, Any]) -> localapi.Resource:
    return next(
        r
        for r in localapi.DEFAULT_RESOURCES
        if (r.api_version, r.kind) == (obj.get("apiVersion", "v1"), obj.get("kind"))
    )


def pod(
    name: str,
    *,
    labels: Mapping[str, str] | None = None,
    gates: tuple[str, ...] = (),
    affinity: Mapping[str, Any] | None = None,
    node_selector: Mapping[str, str] | None = None,
    grace: int | None = None,
) -> Obj:
    """A plain pod no scheduler takes (`NOBODY`) and gpuplace's admission leaves alone."""
    spec: Obj = {
        "schedulerName": NOBODY,
        "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "3600"]}],
    }
    if gates:
        spec["schedulingGates"] = [{"name": gate} for gate in gates]
    if affinity is not None:
        spec["affinity"] = dict(affinity)
    if node_selector is not None:
        spec["nodeSelector"] = dict(node_selector)
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    meta: Obj = {"name": name, "labels": dict(labels or {"app": name})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def node(name: str, labels: Mapping[str, str] | None = None) -> Obj:
    """A Node with a kubelet-like status (not opted in to gpuplace)."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "Referee"}],
        },
    }


def namespace_of(test: str) -> str:
    """A namespace name for test `test` (its pytest name, the server's id left out):
    short, unique, the same on both servers."""
    test = re.sub(r"\[(local|real)-?", "[", test)
    slug = re.sub(r"[^a-z0-9]+", "-", test.lower().removeprefix("test_"))[:24].strip("-")
    return f"ref-{slug}-{hashlib.sha256(test.encode()).hexdigest()[:5]}"


@contextlib.asynccontextmanager
async def local(namespace: str) -> AsyncIterator[Served]:
    """A local API enforcing the shipped RBAC, on an ephemeral port."""
    api = localapi.FakeApi(access=localapi.Access.shipped())
    async with localapi.serve(api) as running, aiohttp.ClientSession() as session:

        def credentials(user: User) -> Credentials:
            token = running.token(user)

            def configure(configuration: client.Configuration) -> None:
                configuration.api_key = {"BearerToken": f"Bearer {token}"}

            return Credentials(token, None, configure)

        yield Served("local", running.url, namespace, session, credentials, api.compact, running)


@contextlib.asynccontextmanager
async def real(api: RealApi, namespace: str) -> AsyncIterator[Served]:
    """The tier's kube-apiserver; the namespace `namespace` is made at the first request
    that names it (with its default ServiceAccount, which a pod needs) and removed after."""
    async with aiohttp.ClientSession() as session:
        compact = api.installation.cluster.compact
        served = Served("real", api.url, namespace, session, api.credentials, compact, real=api)
        namespaces = "/api/v1/namespaces"
        made: list[str] = []

        async def ready() -> None:
            (await served.call("POST", namespaces, {"metadata": {"name": namespace}})).ok(201)
            served.made.pop()
            made.append(f"{namespaces}/{namespace}")
            await _wait(
                lambda: served.call("GET", f"{namespaces}/{namespace}/serviceaccounts/default"),
                what=f"the ServiceAccount {namespace}/default",
            )

        served._ready = ready
        try:
            yield served
        finally:
            if made:
                # its pods at once (no pod events left to a namespace sweep during the
                # next test's watches), then the rest
                now = {"gracePeriodSeconds": 0}
                await served.call("DELETE", served.path("pods"), now)
            for path in [*served.made, *made]:
                await served.call("DELETE", path)


async def _wait(ask: Callable[[], Awaitable[Answer]], *, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (answer := await ask()).status != 200:
        assert time.monotonic() < deadline, f"{what}: {answer}"
        await asyncio.sleep(0.1)
