"""Least privilege, as rendered: each identity is bound to exactly the roles listed here,
our roles grant exactly the verbs in docs/deploy.md, nothing uses wildcards, names are
pinned wherever Kubernetes allows it, and every verb is commented with why in deploy/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.deploy import rendering
from tests.deploy.rendering import Obj, named, one, render

Grant = tuple[str, str, str, tuple[str, ...]]  # (apiGroup, resource, verb, resourceNames)

LEASE = "gpuplace-scheduler"

GPUPLACE_CLUSTER: set[Grant] = {
    ("", "pods", "get", ()),
    ("", "pods", "list", ()),
    ("", "pods", "watch", ()),
    ("", "pods", "patch", ()),
    ("", "pods/binding", "create", ()),
    ("", "pods/status", "patch", ()),
    ("", "nodes", "list", ()),
    ("", "nodes", "watch", ()),
    ("", "nodes", "patch", ()),
    ("", "nodes/status", "patch", ()),
    ("", "events", "create", ()),
    ("", "events", "patch", ()),
}
SCHEDULER_LEASE: set[Grant] = {
    ("coordination.k8s.io", "leases", "create", ()),
    ("coordination.k8s.io", "leases", "get", (LEASE,)),
    ("coordination.k8s.io", "leases", "update", (LEASE,)),
}
CERTS_SECRETS: set[Grant] = {
    ("", "secrets", "create", ()),
    ("", "secrets", "get", ("gpuplace-ca", "gpuplace-webhook-tls")),
    ("", "secrets", "update", ("gpuplace-ca", "gpuplace-webhook-tls")),
}
CERTS_WEBHOOKS: set[Grant] = {
    ("admissionregistration.k8s.io", resource, verb, ("gpuplace",))
    for resource in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations")
    for verb in ("get", "patch")
}

# identity -> {(binding kind, role kind, role name, binding namespace)}
BINDINGS = {
    "gpuplace": {("ClusterRoleBinding", "ClusterRole", "gpuplace", None)},
    "gpuplace-scheduler": {
        ("ClusterRoleBinding", "ClusterRole", "system:kube-scheduler", None),
        ("ClusterRoleBinding", "ClusterRole", "system:volume-scheduler", None),
        ("RoleBinding", "Role", "extension-apiserver-authentication-reader", "kube-system"),
        ("RoleBinding", "Role", "gpuplace-scheduler-leader-election", "gpuplace"),
    },
    "gpuplace-certs": {
        ("RoleBinding", "Role", "gpuplace-certs", "gpuplace"),
        ("ClusterRoleBinding", "ClusterRole", "gpuplace-certs", None),
    },
}


def grants(role: Obj) -> set[Grant]:
    found: set[Grant] = set()
    for rule in role["rules"]:
        names = tuple(sorted(rule.get("resourceNames") or ()))
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    found.add((group, resource, verb, names))
    return found


def bindings_of(objects: list[Obj], account: str) -> set[tuple[str, str, str, str | None]]:
    found = set()
    for obj in objects:
        if obj["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        for subject in obj.get("subjects") or []:
            if subject == {"kind": "ServiceAccount", "name": account, "namespace": "gpuplace"}:
                ref = obj["roleRef"]
                found.add((obj["kind"], ref["kind"], ref["name"], obj["metadata"].get("namespace")))
    return found


@pytest.fixture(scope="module")
def objects() -> list[Obj]:
    return render("overlays/self-managed")


def test_each_identity_is_bound_to_exactly_its_roles(objects: list[Obj]) -> None:
    for account, wanted in BINDINGS.items():
        assert bindings_of(objects, account) == wanted, account
    # No binding names any other subject (no groups, users or default accounts).
    for obj in objects:
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for subject in obj["subjects"]:
                assert subject["kind"] == "ServiceAccount" and subject["name"] in BINDINGS


def test_our_roles_grant_exactly_the_documented_verbs(objects: list[Obj]) -> None:
    cluster_roles, roles = named(objects, "ClusterRole"), named(objects, "Role")
    assert grants(cluster_roles["gpuplace"]) == GPUPLACE_CLUSTER
    assert grants(roles["gpuplace-scheduler-leader-election"]) == SCHEDULER_LEASE
    assert grants(roles["gpuplace-certs"]) == CERTS_SECRETS
    assert grants(cluster_roles["gpuplace-certs"]) == CERTS_WEBHOOKS
    assert set(cluster_roles) == {"gpuplace", "gpuplace-certs"}
    assert set(roles) == {"gpuplace-scheduler-leader-election", "gpuplace-certs"}


def test_the_sidecar_cannot_read_secrets_or_touch_rbac_or_webhooks(objects: list[Obj]) -> None:
    sidecar = grants(named(objects, "ClusterRole")["gpuplace"])
    resources = {resource for _, resource, _, _ in sidecar}
    assert not resources & {
        "secrets",
        "mutatingwebhookconfigurations",
        "validatingwebhookconfigurations",
        "roles",
        "clusterroles",
        "rolebindings",
        "clusterrolebindings",
    }
    assert ("", "pods", "delete", ()) not in sidecar


def test_no_wildcards_anywhere(objects: list[Obj]) -> None:
    for kind in ("Role", "ClusterRole"):
        for role in named(objects, kind).values():
            for rule in role["rules"]:
                for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                    assert "*" not in (rule.get(field) or []), (role["metadata"]["name"], field)


def test_leases_named_in_rbac_are_the_scheduler_lease(objects: list[Obj]) -> None:
    config = yaml.safe_load(
        next(
            o
            for o in objects
            if o["kind"] == "ConfigMap" and "scheduler-config" in o["metadata"]["name"]
        )["data"]["config.yaml"]
    )
    election = config["leaderElection"]
    assert (election["resourceName"], election["resourceNamespace"]) == (LEASE, "gpuplace")
    assert (
        one(objects, "Role", "gpuplace-scheduler-leader-election")["metadata"]["namespace"]
        == (election["resourceNamespace"])
    )


RBAC_SOURCES = [
    rendering.DEPLOY / "base" / "rbac-gpuplace.yaml",
    rendering.DEPLOY / "base" / "rbac-scheduler.yaml",
    rendering.DEPLOY / "overlays" / "self-managed" / "certs-rotation.yaml",
]


@pytest.mark.parametrize("path", RBAC_SOURCES, ids=lambda p: Path(p).name)
def test_every_verb_says_why(path: Path) -> None:
    """In the files people read, each `verbs:` line has a comment right above it."""
    lines = path.read_text().splitlines()
    verbs = [i for i, line in enumerate(lines) if re.match(r"\s*verbs:", line)]
    assert verbs, path
    for i in verbs:
        above = lines[i - 1].strip()
        assert above.startswith("#") and len(above) > 10, f"{path.name}:{i + 1} has no why"


# Calls made with a user's own credentials (not the sidecar's): `gpuplace explain`.
CLI_ONLY = {"list_namespaced_event"}
VERB_OF = {"read": ("get",), "list": ("list", "watch"), "patch": ("patch",),
           "create": ("create",), "replace": ("update",), "delete": ("delete",)}  # fmt: skip


def api_calls() -> set[str]:
    """Every CoreV1Api method the cluster and extender rooms use (`core.METHOD`)."""
    found: set[str] = set()
    for room in ("cluster", "extender"):
        for path in (rendering.ROOT / room).rglob("*.py"):
            found |= set(re.findall(r"\bcore\.([a-z_]+)\b", path.read_text()))
    return found


def needed(method: str) -> set[tuple[str, str]]:
    """(resource, verb) a CoreV1Api method needs: read_namespaced_pod -> (pods, get),
    patch_node_status -> (nodes/status, patch), list_pod_for_all_namespaces -> pods list
    and watch (the informers list, then watch)."""
    action, _, rest = method.partition("_")
    rest = rest.removeprefix("namespaced_").removesuffix("_for_all_namespaces")
    kind, _, sub = rest.partition("_")
    resource = f"{kind}s" + (f"/{sub}" if sub else "")
    return {(resource, verb) for verb in VERB_OF[action]}


def test_rbac_covers_every_call_the_sidecar_makes(objects: list[Obj]) -> None:
    granted = {(r, v) for g, r, v, names in grants(named(objects, "ClusterRole")["gpuplace"])}
    calls = api_calls() - CLI_ONLY
    assert {"create_namespaced_pod_binding", "patch_node_status"} <= calls  # the scan works
    missing = {pair for call in calls for pair in needed(call)} - granted
    assert missing == set(), f"calls without RBAC: {missing}"
    unused = granted - {pair for call in calls for pair in needed(call)}
    assert unused == set(), f"RBAC no call needs: {unused}"
