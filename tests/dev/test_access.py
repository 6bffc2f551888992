"""Authentication and RBAC, refereed: `kubectl auth can-i` answers for the identities deploy/
ships, asked of the local API and of the real kube-apiserver by sending each request as that
identity (with the shipped RBAC applied to both), and the 401/403 wire; request attributes
as kube-apiserver computes them (the local API's own function)."""

from __future__ import annotations

import aiohttp
import pytest

from gpuplace.dev.localapi import access, objects
from gpuplace.dev.localapi.access import ADMIN, CERTS, GPUPLACE, SCHEDULER, User
from gpuplace.dev.localapi.server import FakeApi, serve
from tests.dev.servers import Served

ANYONE = access.service_account("default", "default")
ADMISSION = "admissionregistration.k8s.io"


@pytest.fixture(scope="module")
def rbac() -> access.Rbac:
    return access.Rbac.shipped()


def can_i(rbac: access.Rbac, user: User, verb: str, what: str, namespace: str = "") -> bool:
    """`kubectl auth can-i VERB RESOURCE[.GROUP][/NAME] [-n NS] --as USER`, and a
    subresource as RESOURCE/NAME/SUB (`pods/p/binding`)."""
    resource, name, sub = [*what.split("/"), "", ""][:3]
    resource, _, group = resource.partition(".")
    return rbac.allows(
        access.Attributes(user, verb, group, resource, sub, namespace, name, resource_request=True)
    )


CASES = [
    # the sidecar: what gpuplace/cluster/kube.py calls, and nothing more
    (GPUPLACE, "get", "leases.coordination.k8s.io/gpuplace-scheduler", "gpuplace", True),
    (GPUPLACE, "get", "leases.coordination.k8s.io/kube-scheduler", "kube-system", False),
    (GPUPLACE, "get", "leases.coordination.k8s.io/other", "gpuplace", False),
    (GPUPLACE, "update", "leases.coordination.k8s.io/gpuplace-scheduler", "gpuplace", False),
    (GPUPLACE, "list", "pods", "", True),
    (GPUPLACE, "watch", "nodes", "", True),
    (GPUPLACE, "create", "pods/p/binding", "team-a", True),
    (GPUPLACE, "patch", "pods/p/status", "team-a", True),
    (GPUPLACE, "update", "pods/p/status", "team-a", False),
    (GPUPLACE, "delete", "pods/p", "team-a", False),
    (GPUPLACE, "get", "secrets/gpuplace-ca", "gpuplace", False),
    (GPUPLACE, "create", "events", "team-a", True),
    # ResourceClaims: the DRA component's role only (`gpuplace-dra`, checked below)
    (GPUPLACE, "list", "resourceclaims.resource.k8s.io", "", False),
    (GPUPLACE, "create", "resourceclaims.resource.k8s.io", "team-a", False),
    # the stock kube-scheduler: Kubernetes' own roles plus its Lease
    (SCHEDULER, "create", "pods/p/binding", "team-a", True),
    (SCHEDULER, "delete", "pods/p", "team-a", True),
    (SCHEDULER, "update", "leases.coordination.k8s.io/gpuplace-scheduler", "gpuplace", True),
    (SCHEDULER, "update", "leases.coordination.k8s.io/gpuplace-scheduler", "default", False),
    (SCHEDULER, "update", "persistentvolumeclaims/c", "team-a", True),
    (
        SCHEDULER,
        "get",
        "configmaps/extension-apiserver-authentication",
        "kube-system",
        True,
    ),
    (SCHEDULER, "get", "configmaps/extension-apiserver-authentication", "gpuplace", False),
    (SCHEDULER, "patch", "pods/p", "team-a", False),
    (SCHEDULER, "update", "resourceclaims.resource.k8s.io/c/status", "team-a", True),
    (SCHEDULER, "create", "resourceclaims.resource.k8s.io", "team-a", True),
    # the certs job
    (CERTS, "get", "secrets/gpuplace-ca", "gpuplace", True),
    (CERTS, "get", "secrets/other", "gpuplace", False),
    (CERTS, "create", "secrets", "gpuplace", True),
    (CERTS, "patch", f"mutatingwebhookconfigurations.{ADMISSION}/gpuplace", "", True),
    (CERTS, "list", "pods", "", False),
    # others
    (ADMIN, "delete", "nodes/n", "", True),
    (ANYONE, "get", "pods/p", "default", False),
]  # fmt: skip


def request_for(verb: str, what: str, namespace: str) -> tuple[str, str, dict[str, str]]:
    """The request `kubectl auth can-i VERB WHAT -n NAMESPACE` asks about, with a body
    (`{}`) no API server accepts: what it answers besides 403 Forbidden does not matter."""
    resource, name, sub = [*what.split("/"), "", ""][:3]
    plural, _, group = resource.partition(".")
    prefix = f"/apis/{group}/v1" if group else "/api/v1"
    path = prefix + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    path += f"/{name}" if name else ""
    path += f"/{sub}" if sub else ""
    method = {"get": "GET", "list": "GET", "watch": "GET", "create": "POST"}.get(verb)
    method = method or {"update": "PUT", "patch": "PATCH", "delete": "DELETE"}[verb]
    query = {"watch": "true", "timeoutSeconds": "1"} if verb == "watch" else {}
    return method, path, query


DRA_CASES = [
    (GPUPLACE, verb, "resourceclaims.resource.k8s.io", "", True)
    for verb in ("list", "watch")
] + [
    (GPUPLACE, "create", "resourceclaims.resource.k8s.io", "team-a", True),
    (GPUPLACE, "get", "resourceclaims.resource.k8s.io/c", "team-a", True),
    (GPUPLACE, "update", "resourceclaims.resource.k8s.io/c", "team-a", False),
    (GPUPLACE, "delete", "resourceclaims.resource.k8s.io/c", "team-a", True),  # a stale pin
    (GPUPLACE, "update", "resourceclaims.resource.k8s.io/c/status", "team-a", False),
    (GPUPLACE, "create", "resourceclaimtemplates.resource.k8s.io", "team-a", False),
    (GPUPLACE, "update", "resourceslices.resource.k8s.io/s", "", True),
    (GPUPLACE, "create", "resourceslices.resource.k8s.io", "", False),
]  # fmt: skip
"""With deploy/components/dra (overlays/self-managed-dra): the sidecar's claim informer and
claim controller, nothing more (the real tier applies it in tests/realcluster/test_dra.py,
where the sidecar runs with it)."""


@pytest.mark.parametrize("case", DRA_CASES)
def test_can_i_with_the_dra_component(case: tuple[User, str, str, str, bool]) -> None:
    user, verb, what, namespace, allowed = case
    assert can_i(access.Rbac.shipped("overlays/self-managed-dra"), user, verb, what, namespace) is (
        allowed
    )


@pytest.mark.parametrize("case", CASES)
async def test_can_i(
    server: Served, rbac: access.Rbac, case: tuple[User, str, str, str, bool]
) -> None:
    """Each answer of the shipped RBAC, asked of both servers by sending the request as
    that user (403 Forbidden or not), and of the local API's `Rbac` directly."""
    user, verb, what, namespace, allowed = case
    if what == "nodes/n":
        what = f"nodes/{server.node_name('n')}"  # nodes are shared on the real server
    method, path, query = request_for(verb, what, namespace)
    body: dict[str, str] | None = None if method in ("GET", "DELETE") else {}
    answer = await server.call(method, path, body, user=user, query=query)
    assert (answer.status != 403) is allowed, answer
    assert can_i(rbac, user, verb, what, namespace) is allowed


ATTRIBUTES = [
    ("GET", "/api/v1/namespaces/a/pods/p", {}, ("get", "", "pods", "", "a", "p")),
    ("GET", "/api/v1/pods", {}, ("list", "", "pods", "", "", "")),
    ("GET", "/api/v1/pods", {"watch": "true"}, ("watch", "", "pods", "", "", "")),
    ("GET", "/api/v1/namespaces/a/pods", {"watch": "1", "fieldSelector": "metadata.name=p"},
     ("watch", "", "pods", "", "a", "p")),
    ("POST", "/api/v1/namespaces/a/pods", {}, ("create", "", "pods", "", "a", "")),
    ("POST", "/api/v1/namespaces/a/pods/p/binding", {},
     ("create", "", "pods", "binding", "a", "p")),
    ("PATCH", "/api/v1/nodes/n/status", {}, ("patch", "", "nodes", "status", "", "n")),
    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/g/leases/l", {},
     ("update", "coordination.k8s.io", "leases", "", "g", "l")),
    ("DELETE", "/api/v1/namespaces/a/pods", {}, ("deletecollection", "", "pods", "", "a", "")),
    ("GET", "/api/v1/namespaces/a", {}, ("get", "", "namespaces", "", "a", "a")),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "query", "wanted"), ATTRIBUTES)
def test_attributes_as_kube_apiserver_computes_them(
    method: str, path: str, query: dict[str, str], wanted: tuple[str, ...]
) -> None:
    got = access.attributes(ANYONE, method, path, query)
    assert (got.verb, got.group, got.resource, got.subresource, got.namespace, got.name) == (wanted)


async def test_the_wire_401_and_403_as_kube_apiserver_sends_them(server: Served) -> None:
    """A token nobody issued: 401. No credentials at all: the anonymous user, whom RBAC
    denies (403; kube-apiserver's default `--anonymous-auth=true`). A ServiceAccount asking
    beyond its roles: 403 with kube-apiserver's message and details."""
    lease = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kube-scheduler"
    unknown = await server.call("GET", lease, user=None, token="not-a-token-anyone-issued")
    assert (unknown.status, unknown.body) == (
        401,
        {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "Unauthorized", "reason": "Unauthorized", "code": 401,
        },
    )  # fmt: skip
    anonymous = await server.call("GET", lease, user=None)
    assert (anonymous.status, anonymous.reason) == (403, "Forbidden")
    assert anonymous.message == (
        'leases.coordination.k8s.io "kube-scheduler" is forbidden: User "system:anonymous" '
        'cannot get resource "leases" in API group "coordination.k8s.io" in the namespace '
        '"kube-system"'
    )
    denied = await server.call("GET", lease, user=GPUPLACE)
    assert (denied.status, denied.body) == (
        403,
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": 'leases.coordination.k8s.io "kube-scheduler" is forbidden: User '
            '"system:serviceaccount:gpuplace:gpuplace" cannot get resource "leases" in API '
            'group "coordination.k8s.io" in the namespace "kube-system"',
            "reason": "Forbidden",
            "details": {"name": "kube-scheduler", "group": "coordination.k8s.io", "kind": "leases"},
            "code": 403,
        },
    )
    name = server.node_name("a")
    await server.create(objects.node(name, enabled=False))
    assert (await server.call("GET", "/api/v1/nodes", user=GPUPLACE)).status == 200
    refused = await server.call("DELETE", f"/api/v1/nodes/{name}", user=GPUPLACE)
    assert refused.status == 403
    assert refused.message == (
        f'nodes "{name}" is forbidden: User "system:serviceaccount:gpuplace:gpuplace" '
        'cannot delete resource "nodes" in API group "" at the cluster scope'
    )
    assert await server.get(f"/api/v1/nodes/{name}")  # the denied request changed nothing


def without_lease_rule(objs: list[access.Obj]) -> list[access.Obj]:
    return [o for o in objs if o["metadata"]["name"] != "gpuplace-read-scheduler-lease"]


async def test_a_rule_removed_from_the_manifests_is_missing_on_the_local_api() -> None:
    """The local API alone: its RBAC is read from deploy/, so a rule taken out there
    (here, the sidecar's read of the scheduler's Lease) is refused as on a cluster."""
    api = FakeApi(access=access.Access.shipped(edit=without_lease_rule))
    async with serve(api) as running, aiohttp.ClientSession() as session:
        lease = f"{running.url}/apis/coordination.k8s.io/v1/namespaces/gpuplace/leases/"
        lease += "gpuplace-scheduler"
        bearer = {"Authorization": f"Bearer {running.token(GPUPLACE)}"}
        async with session.get(lease, headers=bearer) as response:
            assert response.status == 403
            assert [c.user for c in api.calls] == [GPUPLACE.name]


def test_the_shipped_manifests_must_be_there(tmp_path: object) -> None:
    from pathlib import Path

    with pytest.raises(access.ManifestsMissing, match="deploy/"):
        access.shipped_objects(deploy=Path(str(tmp_path)))
