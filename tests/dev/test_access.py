"""The local API's authentication and RBAC: `kubectl auth can-i` answers for the identities
deploy/ ships, request attributes as kube-apiserver computes them, and the 401/403 wire."""

from __future__ import annotations

import json

import aiohttp
import pytest

from gpuplace.dev.localapi import access, objects
from gpuplace.dev.localapi.access import ADMIN, CERTS, GPUPLACE, SCHEDULER, User
from gpuplace.dev.localapi.server import FakeApi, serve

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


@pytest.mark.parametrize("case", CASES)
def test_can_i(rbac: access.Rbac, case: tuple[User, str, str, str, bool]) -> None:
    user, verb, what, namespace, allowed = case
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


def without_lease_rule(objs: list[access.Obj]) -> list[access.Obj]:
    return [o for o in objs if o["metadata"]["name"] != "gpuplace-read-scheduler-lease"]


async def test_the_wire_401_and_403_as_kube_apiserver_sends_them() -> None:
    api = FakeApi(access=access.Access.shipped(edit=without_lease_rule))
    api.create(objects.node("a"))
    async with serve(api) as server, aiohttp.ClientSession() as session:
        lease = f"{server.url}/apis/coordination.k8s.io/v1/namespaces/gpuplace/leases/"
        lease += "gpuplace-scheduler"
        async with session.get(lease) as response:
            assert response.status == 401
            assert json.loads(await response.read()) == {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "Unauthorized", "reason": "Unauthorized", "code": 401,
            }  # fmt: skip
        bearer = {"Authorization": f"Bearer {server.token(GPUPLACE)}"}
        async with session.get(lease, headers=bearer) as response:
            assert response.status == 403
            assert json.loads(await response.read()) == {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": 'leases.coordination.k8s.io "gpuplace-scheduler" is forbidden: '
                'User "system:serviceaccount:gpuplace:gpuplace" cannot get resource "leases" '
                'in API group "coordination.k8s.io" in the namespace "gpuplace"',
                "reason": "Forbidden",
                "details": {
                    "name": "gpuplace-scheduler",
                    "group": "coordination.k8s.io",
                    "kind": "leases",
                },
                "code": 403,
            }
        async with session.get(f"{server.url}/api/v1/nodes", headers=bearer) as response:
            assert response.status == 200
        async with session.delete(f"{server.url}/api/v1/nodes/a", headers=bearer) as response:
            assert response.status == 403
            body = json.loads(await response.read())
            assert body["message"] == (
                'nodes "a" is forbidden: User "system:serviceaccount:gpuplace:gpuplace" '
                'cannot delete resource "nodes" in API group "" at the cluster scope'
            )
        assert [c.user for c in api.calls][-3:] == [GPUPLACE.name] * 3
        assert api.get("nodes", "a")  # the denied request changed nothing


def test_the_shipped_manifests_must_be_there(tmp_path: object) -> None:
    from pathlib import Path

    with pytest.raises(access.ManifestsMissing, match="deploy/"):
        access.shipped_objects(deploy=Path(str(tmp_path)))
