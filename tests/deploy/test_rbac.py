"""Least privilege, as rendered: each identity is bound to exactly the roles listed here,
our roles grant exactly the verbs in docs/deploy.md, nothing uses wildcards, names are
pinned wherever Kubernetes allows it, and every verb is commented with why in deploy/."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client

from gpuplace.cluster import kube
from gpuplace.commands import node_agent as node_agent_command
from gpuplace.dev.localapi import access
from gpuplace.wiring.settings import SidecarSettings
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
    ("", "pods/eviction", "create", ()),
    ("", "pods/status", "patch", ()),
    ("policy", "poddisruptionbudgets", "list", ()),
    ("", "nodes", "list", ()),
    ("", "nodes", "watch", ()),
    ("", "nodes", "patch", ()),
    ("", "nodes/status", "patch", ()),
    ("", "events", "create", ()),
    ("", "events", "patch", ()),
}
GPUPLACE_QUEUES: set[Grant] = {
    ("gpuplace.io", "gpuqueues", "list", ()),
    ("gpuplace.io", "gpuqueues", "watch", ()),
    ("gpuplace.io", "gpuqueues/status", "patch", ()),
    ("", "namespaces", "list", ()),
    ("", "namespaces", "watch", ()),
}
"""ClusterRole `gpuplace-queues`: the queue controller's and its informers' (issue 29)."""
QUEUES_VIEWER: set[Grant] = {
    ("gpuplace.io", resource, verb, ())
    for resource in ("gpuqueues", "gpuqueues/status")
    for verb in ("get", "list", "watch")
}
QUEUES_EDITOR: set[Grant] = {
    ("gpuplace.io", "gpuqueues", verb, ()) for verb in ("create", "update", "patch", "delete")
}
GPUPLACE_LEASE: set[Grant] = {("coordination.k8s.io", "leases", "get", (LEASE,))}
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

NODE_AGENT: set[Grant] = {
    ("", "nodes", "patch", ()),
    ("", "pods", "list", ()),
    ("", "pods", "watch", ()),
    ("", "pods/eviction", "create", ()),
    ("", "events", "create", ()),
    ("", "events", "patch", ()),
}
DRA_NODE_AGENT: set[Grant] = {
    ("resource.k8s.io", "resourceslices", verb, ())
    for verb in ("list", "watch", "create", "update", "delete")
} | {("resource.k8s.io", "resourceclaims", "get", ()), ("", "nodes", "get", ())}
"""ClusterRole `gpuplace-node-agent-dra` (components/dra), on top of `gpuplace-node-agent`."""
GPUPLACE_DRA: set[Grant] = {
    ("resource.k8s.io", "resourceslices", "get", ()),
    ("resource.k8s.io", "resourceslices", "update", ()),
} | {
    ("resource.k8s.io", "resourceclaims", verb, ())
    for verb in ("get", "list", "watch", "create", "delete")
}
"""ClusterRole `gpuplace-dra`: the sidecar's silence taints (--dra-silence-taints), its
ResourceClaim informer and the claims it creates, and deletes when their pinned GPUs were
taken meanwhile (--dra-claims)."""
NAMESPACE_OF = {"gpuplace-node-agent": "kube-system", "gpuplace-node-agent-dra": "kube-system"}
"""Identities outside the gpuplace namespace (the node agent, a node daemon)."""

# identity -> {(binding kind, role kind, role name, binding namespace)}
BINDINGS: dict[str, set[tuple[str, str, str, str | None]]] = {
    "gpuplace": {
        ("ClusterRoleBinding", "ClusterRole", "gpuplace", None),
        ("ClusterRoleBinding", "ClusterRole", "gpuplace-queues", None),
        ("RoleBinding", "Role", "gpuplace-read-scheduler-lease", "gpuplace"),
    },
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
    "gpuplace-node-agent": {
        ("ClusterRoleBinding", "ClusterRole", "gpuplace-node-agent", None),
    },
}
DRA_BINDINGS = {
    **BINDINGS,
    "gpuplace": BINDINGS["gpuplace"]
    | {("ClusterRoleBinding", "ClusterRole", "gpuplace-dra", None)},
    "gpuplace-node-agent-dra": {
        ("ClusterRoleBinding", "ClusterRole", "gpuplace-node-agent", None),
        ("ClusterRoleBinding", "ClusterRole", "gpuplace-node-agent-dra", None),
    },
}
"""With components/dra (overlays/self-managed-dra)."""


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
            namespace = NAMESPACE_OF.get(account, "gpuplace")
            if subject == {"kind": "ServiceAccount", "name": account, "namespace": namespace}:
                ref = obj["roleRef"]
                found.add((obj["kind"], ref["kind"], ref["name"], obj["metadata"].get("namespace")))
    return found


@pytest.fixture(scope="module")
def objects() -> list[Obj]:
    return render(rendering.NODE_AGENT)  # every identity deploy/ ships but DRA's


@pytest.fixture(scope="module")
def dra_objects() -> list[Obj]:
    return render(rendering.DRA)  # and with DRA


@pytest.mark.parametrize("tree", ["node-agent", "dra"])
def test_each_identity_is_bound_to_exactly_its_roles(
    objects: list[Obj], dra_objects: list[Obj], tree: str
) -> None:
    rendered, bindings = (
        (objects, BINDINGS) if tree == "node-agent" else (dra_objects, DRA_BINDINGS)
    )
    for account, wanted in bindings.items():
        assert bindings_of(rendered, account) == wanted, account
    # No binding names any other subject (no groups, users or default accounts).
    for obj in rendered:
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for subject in obj["subjects"]:
                assert subject["kind"] == "ServiceAccount" and subject["name"] in bindings
                assert subject["namespace"] == NAMESPACE_OF.get(subject["name"], "gpuplace")


def test_our_roles_grant_exactly_the_documented_verbs(objects: list[Obj]) -> None:
    cluster_roles, roles = named(objects, "ClusterRole"), named(objects, "Role")
    assert grants(cluster_roles["gpuplace"]) == GPUPLACE_CLUSTER
    assert grants(roles["gpuplace-read-scheduler-lease"]) == GPUPLACE_LEASE
    assert grants(roles["gpuplace-scheduler-leader-election"]) == SCHEDULER_LEASE
    assert grants(roles["gpuplace-certs"]) == CERTS_SECRETS
    assert grants(cluster_roles["gpuplace-certs"]) == CERTS_WEBHOOKS
    assert grants(cluster_roles["gpuplace-node-agent"]) == NODE_AGENT
    assert grants(cluster_roles["gpuplace-queues"]) == GPUPLACE_QUEUES
    assert grants(cluster_roles["gpuplace-queues-viewer"]) == QUEUES_VIEWER
    assert grants(cluster_roles["gpuplace-queues-editor"]) == QUEUES_EDITOR
    assert set(cluster_roles) == {
        "gpuplace",
        "gpuplace-certs",
        "gpuplace-node-agent",
        "gpuplace-queues",
        "gpuplace-queues-viewer",
        "gpuplace-queues-editor",
    }
    assert set(roles) == {
        "gpuplace-read-scheduler-lease",
        "gpuplace-scheduler-leader-election",
        "gpuplace-certs",
    }


def test_the_dra_component_adds_exactly_its_roles(
    objects: list[Obj], dra_objects: list[Obj]
) -> None:
    before, after = named(objects, "ClusterRole"), named(dra_objects, "ClusterRole")
    assert set(after) - set(before) == {"gpuplace-node-agent-dra", "gpuplace-dra"}
    assert grants(after["gpuplace-node-agent-dra"]) == DRA_NODE_AGENT
    assert grants(after["gpuplace-dra"]) == GPUPLACE_DRA
    assert {name: grants(role) for name, role in before.items()} == {
        name: grants(after[name]) for name in before
    }


def test_the_sidecar_cannot_read_secrets_or_touch_rbac_or_webhooks(objects: list[Obj]) -> None:
    roles = named(objects, "ClusterRole")
    sidecar = grants(roles["gpuplace"]) | grants(roles["gpuplace-queues"])
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
    # it removes pods only through the Eviction API (PodDisruptionBudgets hold), never
    # by a plain DELETE, and deletes nothing else
    assert not {verb for _, _, verb, _ in sidecar} & {"delete", "deletecollection"}
    assert {(r, v) for _, r, v, _ in sidecar if r.startswith("pods")} >= {
        ("pods/eviction", "create")
    }
    assert {r for _, r, _, _ in sidecar if r.startswith("pods/")} == {
        "pods/binding",
        "pods/eviction",
        "pods/status",
    }


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
    for role in ("gpuplace-scheduler-leader-election", "gpuplace-read-scheduler-lease"):
        assert (
            one(objects, "Role", role)["metadata"]["namespace"] == (election["resourceNamespace"])
        )
    # the sidecar follows the Lease the scheduler elects on, by default
    default = SidecarSettings.model_fields["scheduler_lease"].default
    assert default == f"{election['resourceNamespace']}/{election['resourceName']}"


RBAC_SOURCES = [
    rendering.DEPLOY / "components" / "dra" / "rbac-dra.yaml",
    rendering.DEPLOY / "base" / "rbac-gpuplace.yaml",
    rendering.DEPLOY / "base" / "rbac-scheduler.yaml",
    rendering.DEPLOY / "base" / "rbac-queues.yaml",
    rendering.DEPLOY / "components" / "node-agent" / "rbac-node-agent.yaml",
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
CLI_ONLY = {("", "list_namespaced_event")}
VERB_OF = {"read": ("get",), "list": ("list", "watch"), "patch": ("patch",),
           "create": ("create",), "replace": ("update",), "delete": ("delete",)}  # fmt: skip
GROUP_OF = {
    "core": "",
    "coordination": "coordination.k8s.io",
    "policy": "policy",
    "custom": "gpuplace.io",
    "resource": "resource.k8s.io",
}
"""`gpuplace.cluster.kube.Kube`'s generated clients, by attribute, and their API groups
(`custom`, the CustomObjectsApi, serves GpuQueues only)."""
CUSTOM_OBJECTS = {
    "list_cluster_custom_object": {("gpuqueues", "list"), ("gpuqueues", "watch")},
    "patch_cluster_custom_object_status": {("gpuqueues/status", "patch")},
}
"""What each CustomObjectsApi method Kube calls needs (on gpuqueues, the one custom
resource it reads: `kube.GPUQUEUES`)."""

KUBE = rendering.ROOT / "gpuplace" / "cluster" / "kube.py"
SIDECAR_ROOMS = ("gpuplace",)
"""The package whose API calls must all go through `gpuplace.cluster.kube` (every room's,
the node agent's too)."""
OWN_CLIENTS = {rendering.ROOT / "gpuplace" / "cluster" / "certificates.py"}
"""The certs job's calls (identity gpuplace-certs), checked by their own test below."""
GENERATED_METHODS = {
    name
    for api in dir(client)
    if api.endswith("Api") and isinstance(getattr(client, api), type)
    for name in vars(getattr(client, api))
    if re.match(r"(read|list|create|patch|replace|delete|connect)_", name)
} - set(vars(kube.Kube))
"""The generated clients' API methods (less the names `kube.Kube` itself offers)."""
GENERATED = re.compile(
    r"\b[A-Z]\w*V\d\w*Api\(|\bcall_api\(|\.(?:"
    + "|".join(sorted(GENERATED_METHODS, key=len, reverse=True))
    + r")\("
)
"""A generated API class, a raw `call_api`, or a generated method called directly."""


def api_calls(path: Path = KUBE, clients: dict[str, str] = GROUP_OF) -> set[tuple[str, str]]:
    """(API group, generated method) of every call `path` makes (`self.core.METHOD`,
    `self.coordination.METHOD`, ...)."""
    found: set[tuple[str, str]] = set()
    names = "|".join(clients)
    for attribute, method in re.findall(rf"\b({names})\.([a-z_]+)\b", path.read_text()):
        found.add((clients[attribute], method))
    return found


AGENT_ONLY = {
    ("", "read_node"),
    ("resource.k8s.io", "create_resource_slice"),
    ("resource.k8s.io", "delete_resource_slice"),
    ("resource.k8s.io", "list_resource_slice"),
}
"""Calls only the DRA node agent makes (its RBAC: components/dra)."""
DRA_SIDECAR = {
    ("resource.k8s.io", "read_resource_slice"),
    ("resource.k8s.io", "replace_resource_slice"),
    ("resource.k8s.io", "list_resource_claim_for_all_namespaces"),
    ("resource.k8s.io", "create_namespaced_resource_claim"),
    ("resource.k8s.io", "read_namespaced_resource_claim"),
    ("resource.k8s.io", "delete_namespaced_resource_claim"),
}
"""The sidecar's calls with --dra-silence-taints and --dra-claims (granted by
components/dra only; the DRA node agent reads claims too, with its own role)."""
ONE_OFF_LISTS = {"list_namespaced_pod_disruption_budget": "poddisruptionbudgets"}
KINDS = {"resource_slice": "resourceslices", "resource_claim": "resourceclaims"}
"""Generated method names whose kind is two words."""
"""Lists made once, with no watch after them (no informer), and their resources."""


def needed(method: str) -> set[tuple[str, str]]:
    """(resource, verb) a generated method needs: read_namespaced_pod -> (pods, get),
    patch_node_status -> (nodes/status, patch), list_pod_for_all_namespaces -> pods list
    and watch (the informers list, then watch), read_namespaced_lease -> (leases, get),
    create_namespaced_pod_eviction -> (pods/eviction, create)."""
    if method in ONE_OFF_LISTS:
        return {(ONE_OFF_LISTS[method], "list")}
    if method in CUSTOM_OBJECTS:
        return CUSTOM_OBJECTS[method]
    action, _, rest = method.partition("_")
    rest = rest.removeprefix("namespaced_").removesuffix("_for_all_namespaces")
    if rest in KINDS:
        return {(KINDS[rest], verb) for verb in VERB_OF[action]}
    kind, _, sub = rest.partition("_")
    resource = f"{kind}s" + (f"/{sub}" if sub else "")
    return {(resource, verb) for verb in VERB_OF[action]}


def granted_to(objects: list[Obj], account: str) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every role bound to `account`."""
    roles = {("Role", n): r for n, r in named(objects, "Role").items()}
    roles |= {("ClusterRole", n): r for n, r in named(objects, "ClusterRole").items()}
    found = set()
    for _, kind, name, _ in bindings_of(objects, account):
        found |= {(g, r, v) for g, r, v, _ in grants(roles[(kind, name)])}
    return found


def test_every_api_call_goes_through_cluster_kube() -> None:
    """One client layer: anything else that builds a generated API, or calls a generated
    method, escapes the RBAC check below (issue 18: the Lease read did)."""
    outside = []
    for room in SIDECAR_ROOMS:
        for path in (rendering.ROOT / room).rglob("*.py"):
            if path == KUBE or path in OWN_CLIENTS:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if GENERATED.search(line):
                    outside.append(f"{path.relative_to(rendering.ROOT)}:{number}: {line.strip()}")
    assert outside == [], "API calls outside gpuplace/cluster/kube.py:\n" + "\n".join(outside)


def test_the_scan_sees_calls_outside_kube() -> None:
    stray = "self._coordination = client.CoordinationV1Api(api.api_client)\n"
    stray += "await self._coordination.read_namespaced_lease(name, namespace)\n"
    assert len([line for line in stray.splitlines() if GENERATED.search(line)]) == 2


def test_rbac_covers_every_call_the_sidecar_makes(objects: list[Obj]) -> None:
    granted = granted_to(objects, "gpuplace")
    calls = api_calls() - CLI_ONLY - AGENT_ONLY - DRA_SIDECAR
    # the scan works, and sees every client Kube holds
    assert {("", "create_namespaced_pod_binding"), ("", "patch_node_status")} <= calls
    assert ("coordination.k8s.io", "read_namespaced_lease") in calls
    assert ("", "create_namespaced_pod_eviction") in calls
    assert ("", "delete_namespaced_pod") not in calls  # evicted, never deleted
    attributes = set(re.findall(r"self\.(\w+): Any = client\.\w+Api\(", KUBE.read_text()))
    assert attributes == set(GROUP_OF), "a client in Kube the scan does not read"
    wanted = {(group, r, v) for group, call in calls for r, v in needed(call)}
    missing = wanted - granted
    assert missing == set(), f"calls without RBAC: {missing}"
    unused = granted - wanted
    assert unused == set(), f"RBAC no call needs: {unused}"


AGENT_SOURCES = (
    rendering.ROOT / "gpuplace" / "agent",
    rendering.ROOT / "gpuplace" / "commands" / "node_agent.py",
    # the Events it writes go through the sidecar's Recorder (built in node_agent.py)
    rendering.ROOT / "gpuplace" / "cluster" / "recording.py",
)
KUBE_NEEDS: dict[str, set[tuple[str, str, str]]] = {
    "patch_node": {("", "nodes", "patch")},
    "get_pod": {("", "pods", "get")},
    "evict_pod": {("", "pods/eviction", "create")},
    "create_event": {("", "events", "create")},
    "patch_event": {("", "events", "patch")},
    "get_node": {("", "nodes", "get")},
    "get_resource_claim": {("resource.k8s.io", "resourceclaims", "get")},
    "create_resource_slice": {("resource.k8s.io", "resourceslices", "create")},
    "replace_resource_slice": {("resource.k8s.io", "resourceslices", "update")},
    "delete_resource_slice": {("resource.k8s.io", "resourceslices", "delete")},
}
"""What each `gpuplace.cluster.kube.Kube` method the node agent calls needs (a method missing here
fails the test below: add it with its grants)."""


def kube_methods_called(*sources: Path) -> set[str]:
    """`Kube` methods called anywhere in `sources` (files or directories)."""
    methods = {name for name in vars(kube.Kube) if not name.startswith("_")} - {"close"}
    pattern = re.compile(r"\.(" + "|".join(sorted(methods)) + r")\(")
    found: set[str] = set()
    for source in sources:
        for path in source.rglob("*.py") if source.is_dir() else [source]:
            found |= set(pattern.findall(path.read_text()))
    return found


def informers_started(*sources: Path) -> set[str]:
    """Resources of the `gpuplace.cluster.watching.Informer`s built in `sources` (they list, then
    watch, through `Kube.list_page` and `Kube.watch`)."""
    pattern = re.compile(r"watching\.Informer\(\s*\w+,\s*\"(\w+)\"")
    found: set[str] = set()
    for source in sources:
        for path in source.rglob("*.py") if source.is_dir() else [source]:
            found |= set(pattern.findall(path.read_text()))
    return found


DRA_ONLY = {
    "get_node",
    "get_resource_claim",
    "create_resource_slice",
    "replace_resource_slice",
    "delete_resource_slice",
}
"""`Kube` methods only the DRA side of the agent calls (--kubelet-plugin=dra)."""
DRA_MODULES = {
    rendering.ROOT / "gpuplace" / "agent" / "kubeletplugin.py",
    rendering.ROOT / "gpuplace" / "agent" / "slices.py",
}
GROUP_OF_RESOURCE = {"resourceslices": "resource.k8s.io", "pods": ""}


def test_rbac_covers_every_call_the_node_agent_makes(
    objects: list[Obj], dra_objects: list[Obj]
) -> None:
    called = kube_methods_called(*AGENT_SOURCES)
    assert "patch_node" in called  # the scan works: publishing writes the Node
    assert "recording.Recorder(" in (AGENT_SOURCES[1]).read_text()  # the agent writes Events
    assert {"evict_pod", "create_event", "patch_event"} <= called  # over-grant (issue 43)
    unknown = called - set(KUBE_NEEDS)
    assert unknown == set(), f"Kube methods the agent calls with no known grants: {unknown}"
    watched = informers_started(*AGENT_SOURCES)
    assert watched == {"pods", "resourceslices"}  # its node's pods; the DRA agent's slice

    def needs(methods: set[str], resources: set[str]) -> set[tuple[str, str, str]]:
        wanted: set[tuple[str, str, str]] = set().union(*(KUBE_NEEDS[m] for m in methods))
        return wanted | {
            (GROUP_OF_RESOURCE[r], r, verb) for r in resources for verb in ("list", "watch")
        }

    # the device-plugin agent: everything but the DRA side
    plain = needs(called - DRA_ONLY, watched - {"resourceslices"})
    assert granted_to(objects, "gpuplace-node-agent") == plain
    # the DRA agent: all of it, from its two roles
    assert granted_to(dra_objects, "gpuplace-node-agent-dra") == needs(called, watched)
    # and the DRA-only calls are made by the DRA side only
    others = [
        path
        for source in AGENT_SOURCES[:1]
        for path in source.rglob("*.py")
        if path not in DRA_MODULES
    ]
    assert kube_methods_called(*others) & DRA_ONLY == set()
    composition = inspect.getsource(node_agent_command.compose)
    assert "get_node" not in composition  # only in _dra, which runs with --kubelet-plugin=dra


def test_the_sidecar_writes_slices_only_with_the_dra_component(
    objects: list[Obj], dra_objects: list[Obj]
) -> None:
    added = granted_to(dra_objects, "gpuplace") - granted_to(objects, "gpuplace")
    wanted = {(group, r, v) for group, call in DRA_SIDECAR for r, v in needed(call)}
    assert added == wanted
    writer = rendering.ROOT / "gpuplace" / "cluster" / "slice_taints.py"
    assert kube_methods_called(writer) == {"get_resource_slice", "replace_resource_slice"}
    assert {"read_resource_slice", "replace_resource_slice"} <= {call for _, call in DRA_SIDECAR}
    claimer = rendering.ROOT / "gpuplace" / "wiring" / "claims.py"
    assert kube_methods_called(claimer) == {
        "create_resource_claim",
        "get_resource_claim",
        "delete_resource_claim",
    }


CERTS_CLIENTS = {"core": "", "adm": "admissionregistration.k8s.io"}


def test_rbac_covers_every_call_the_certs_job_makes(objects: list[Obj]) -> None:
    """`gpuplace certs rotate` in the CronJob (identity gpuplace-certs, its own client in
    gpuplace/cluster/certificates.py)."""
    calls = api_calls(rendering.ROOT / "gpuplace" / "cluster" / "certificates.py", CERTS_CLIENTS)
    assert ("", "read_namespaced_secret") in calls
    wanted = set()
    for group, call in calls:
        if group:  # read_mutating_webhook_configuration -> mutatingwebhookconfigurations
            action, _, kind = call.partition("_")
            wanted |= {(group, kind.replace("_", "") + "s", verb) for verb in VERB_OF[action]}
        else:
            wanted |= {(group, resource, verb) for resource, verb in needed(call)}
    assert ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "patch") in wanted
    granted = granted_to(objects, "gpuplace-certs")
    assert wanted - granted == set()


def test_the_local_api_enforces_the_rbac_kustomize_renders(objects: list[Obj]) -> None:
    """gpuplace.dev.localapi reads deploy/ without kustomize: its RBAC objects must be exactly
    the rendered ones (labels aside)."""

    def rbac(found: list[Obj]) -> list[Obj]:
        kept = []
        for obj in found:
            if obj["kind"] in access.RBAC_KINDS:
                metadata = {k: v for k, v in obj["metadata"].items() if k != "labels"}
                kept.append({**obj, "metadata": metadata})
        return sorted(kept, key=lambda o: (o["kind"], o["metadata"]["name"]))

    assert rbac(access.shipped_objects()) == rbac(objects)
    assert len(rbac(objects)) == 19
