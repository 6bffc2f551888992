"""A fake kube-apiserver for tests: real wire format, in-process, on 127.0.0.1.

Usage::

    from tests import fakeapi
    from tests.fakeapi import objects

    async with fakeapi.serve() as server:          # FakeApi on an ephemeral port
        server.api.create(objects.node("gpu-0"))   # set-up without HTTP
        configuration = server.configuration()     # kubernetes_asyncio Configuration
        server.kubeconfig(tmp_path / "kubeconfig") # or a kubeconfig file
        ...
        server.api.calls_to("PATCH", "/pods/")     # what clients sent
        server.api.fail("POST", "/binding$", 500)  # the next binding fails
        server.api.drop_watches()                  # watches end; clients must resume
        server.api.compact(); server.api.drop_watches()  # ... and then get 410 Gone
        server.api.expire_watches()                # ERROR 410 on every open watch

`serve_in_thread()` runs one on its own thread and loop (synchronous tests such as CLI
runs); `serve_in_subprocess(api)` forks one (benchmarks: no shared GIL). Kinds beyond the default
ones (pods, nodes, events, namespaces, configmaps, coordination.k8s.io leases) are
added with `FakeApi(resources=[*DEFAULT_RESOURCES, Resource(...)])`.

Modules: `resources` (what is served where), `store` (state, resourceVersions,
history, watchers and the server's rules), `server` (HTTP), `patching` (merge,
strategic-merge, JSON patch), `selectors` (label/field selectors), `statuses` (Status
bodies), `objects` (gpuplace Node/Pod builders). Tests only: never imported by
gpuplace code.
"""

from tests.fakeapi.resources import DEFAULT_RESOURCES, EVENTS, NODES, PODS, Resource
from tests.fakeapi.server import (
    Call,
    FakeApi,
    Server,
    ThreadedServer,
    serve,
    serve_in_subprocess,
    serve_in_thread,
)
from tests.fakeapi.statuses import ApiStatusError

__all__ = [
    "DEFAULT_RESOURCES",
    "EVENTS",
    "NODES",
    "PODS",
    "ApiStatusError",
    "Call",
    "FakeApi",
    "Resource",
    "Server",
    "ThreadedServer",
    "serve",
    "serve_in_subprocess",
    "serve_in_thread",
]
