"""A minimal in-memory Kubernetes API: only the endpoints gpuplace uses, in the real wire
format, on 127.0.0.1. For `gpuplace demo` and for tests — never used against a real
cluster, and never imported by a room below `gpuplace.dev` (import-linter).

What it serves (the kube-apiserver behaviour gpuplace relies on, nothing more): pods,
nodes, events, namespaces, configmaps, secrets, coordination.k8s.io leases, policy/v1
PodDisruptionBudgets, admissionregistration.k8s.io/v1 webhook configurations (for
`gpuplace certs`) and gpuplace.io/v1alpha1 GpuQueues (as if their CRD were installed:
status subresource and generation, not its schema); list with label and field selectors
and `limit`/`continue`; watch
with ADDED/MODIFIED/DELETED, BOOKMARK and 410 ERROR events; create/get/put/delete, the
three PATCH content types (a strategic merge merges `webhooks` by name), `/status`
subresources, `pods/NAME/binding` and `pods/NAME/eviction` (with the disruption-budget
check); resourceVersion, uid and creationTimestamp set by the server; optimistic
concurrency (409), immutable pod fields (422), the gated-pod update rules (`podupdates`),
Secrets' rules (base64 data, the keys of a TLS Secret, immutable type). With
`FakeApi(access=Access.shipped())`, bearer-token authentication and the RBAC that deploy/
ships (module `access`), so a missing rule fails as on a cluster; without it, no
authentication. No admission, no persistence.

Refereed (issue 27): the contract tests in `tests/dev` (test_wire, test_access,
test_eviction, test_gated, test_certs_kinds) run against this server and against the
real kube-apiserver v1.36.2 of the real-cluster tier, with the same requests as the same
users (the shipped RBAC applied to both), and assert what the real one answers: status codes, Status
reasons, causes and messages, list and watch shapes (remainingItemCount, continue, 410
after a compaction, BOOKMARKs), resourceVersion semantics, graceful pod deletion,
bindings, eviction and PodDisruptionBudget answers, and the gated-pod update rules of
KEP-3838 (module `podupdates`). What it does not model, and a test must not rely on:
admission (no webhooks are called, no defaulting: a pod is stored as sent), controllers
(no disruption controller: a budget's status is written by the test; no namespace
lifecycle, garbage collection or kubelet), a watch cache (a compaction forgets all
history here, where kube-apiserver still resumes watches within its cache's window), the
Go rendering of an invalid value in a 422 message (JSON here), field validation of
objects beyond the rules above, and every resource and verb gpuplace does not use.

Usage::

    from gpuplace.dev import localapi
    from gpuplace.dev.localapi import objects

    async with localapi.serve() as server:         # FakeApi on an ephemeral port
        server.api.create(objects.node("gpu-0"))   # set-up without HTTP
        configuration = server.configuration()     # kubernetes_asyncio Configuration
        server.kubeconfig(tmp_path / "kubeconfig") # or a kubeconfig file

    api = localapi.FakeApi(access=localapi.Access.shipped())   # RBAC from deploy/
    async with localapi.serve(api) as server:
        sidecar = server.configuration(localapi.GPUPLACE)  # as the ServiceAccount
        admin = server.configuration()                     # system:masters (default)
        ...
        server.api.calls_to("PATCH", "/pods/")     # what clients sent
        server.api.fail("POST", "/binding$", 500)  # the next binding fails (tests)
        server.api.before("PATCH", "/nodes/", write)  # write() first (a racing writer)
        server.api.drop_watches()                  # watches end; clients must resume
        server.api.compact(); server.api.drop_watches()  # ... and then get 410 Gone
        server.api.expire_watches()                # ERROR 410 on every open watch

`serve_in_thread()` runs one on its own thread and loop (synchronous tests such as CLI
runs); `serve_in_subprocess(api)` forks one (benchmarks: no shared GIL). Kinds beyond the
default ones are added with `FakeApi(resources=[*DEFAULT_RESOURCES, Resource(...)])`.

Modules: `resources` (what is served where), `store` (state, resourceVersions,
history, watchers and the server's rules), `server` (HTTP), `patching` (merge,
strategic-merge, JSON patch), `selectors` (label/field selectors), `statuses` (Status
bodies), `objects` (gpuplace Node/Pod builders), `access` (authentication and RBAC).
"""

from gpuplace.dev.localapi.access import (
    ADMIN,
    CERTS,
    DRA_NODE_AGENT,
    DRA_SHIPPED,
    GPUPLACE,
    NODE_AGENT,
    SCHEDULER,
    Access,
    ManifestsMissing,
    Rbac,
    User,
)
from gpuplace.dev.localapi.resources import (
    DEFAULT_RESOURCES,
    EVENTS,
    GPUQUEUES,
    MUTATING_WEBHOOKS,
    NODES,
    PDBS,
    PODS,
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    SECRETS,
    VALIDATING_WEBHOOKS,
    Resource,
)
from gpuplace.dev.localapi.server import (
    Call,
    FakeApi,
    Server,
    ThreadedServer,
    serve,
    serve_in_subprocess,
    serve_in_thread,
)
from gpuplace.dev.localapi.statuses import ApiStatusError

__all__ = [
    "ADMIN",
    "CERTS",
    "DEFAULT_RESOURCES",
    "DRA_NODE_AGENT",
    "DRA_SHIPPED",
    "EVENTS",
    "GPUPLACE",
    "GPUQUEUES",
    "MUTATING_WEBHOOKS",
    "NODES",
    "NODE_AGENT",
    "PDBS",
    "PODS",
    "RESOURCE_CLAIMS",
    "RESOURCE_SLICES",
    "SCHEDULER",
    "SECRETS",
    "VALIDATING_WEBHOOKS",
    "Access",
    "ApiStatusError",
    "Call",
    "FakeApi",
    "ManifestsMissing",
    "Rbac",
    "Resource",
    "Server",
    "ThreadedServer",
    "User",
    "serve",
    "serve_in_subprocess",
    "serve_in_thread",
]
