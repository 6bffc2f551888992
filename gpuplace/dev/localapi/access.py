"""Who may do what on the local API: bearer-token authentication and RBAC authorization,
as kube-apiserver does them, so that a rule missing from deploy/ fails a test as it fails
a cluster (issue 18: the sidecar could not read the scheduler's Lease, and only a real
cluster showed it).

- **Authentication**: `Access.token(user)` hands out a bearer token for a `User`; a
  request with an unknown token gets 401 Unauthorized; one without any is the
  anonymous user (`ANONYMOUS`, group `system:unauthenticated`: kube-apiserver's default
  `--anonymous-auth=true`), whom RBAC then denies every resource (403). `ADMIN` is in
  `system:masters` (test set-up and the demo's user); `GPUPLACE`, `SCHEDULER` and
  `CERTS` are the ServiceAccounts deploy/ ships, with the groups a ServiceAccount
  token carries.
- **Request attributes** (`attributes`), as kube-apiserver's RequestInfoFactory computes
  them: verb from the method (GET object = get, GET collection = list, `watch=true` =
  watch, POST = create, PUT = update, PATCH = patch, DELETE = delete or
  deletecollection), API group, resource and subresource (`pods/binding`,
  `pods/status`), namespace and name (none for create or a collection, except a
  `metadata.name=` field selector).
- **Authorization** (`Rbac`): Roles, ClusterRoles, RoleBindings and ClusterRoleBindings
  (verbs, apiGroups, resources with `*` and `*/subresource`, resourceNames; User, Group
  and ServiceAccount subjects; a RoleBinding grants in its namespace only), loaded from
  the shipped manifests (`shipped`) plus the default roles Kubernetes creates that those
  bindings reference (`BOOTSTRAP`, from kube-apiserver's bootstrap policy). A denial is
  the real 403 Forbidden Status, message and details included.

Non-resource paths (`/version`, `/api`) are allowed to any authenticated user (the
bootstrap `system:discovery` binding), and `PUBLIC_INFO` (`/version`, `/healthz`, ...) to
the anonymous user too (`system:public-info-viewer`). Never used against a real cluster.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml

from gpuplace.dev.localapi.statuses import ApiStatusError

Obj = dict[str, Any]

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
"""deploy/ of the source tree this package was loaded from (absent in an installed wheel)."""
SHIPPED = "overlays/self-managed-node-agent"

RBAC_KINDS = ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")
RBAC_GROUP = "rbac.authorization.k8s.io"


@dataclass(frozen=True, slots=True)
class User:
    name: str
    groups: tuple[str, ...] = ("system:authenticated",)


def service_account(namespace: str, name: str) -> User:
    """The user a ServiceAccount token authenticates as."""
    return User(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
    )


ANONYMOUS = User("system:anonymous", ("system:unauthenticated",))
"""Who sends a request without credentials."""
ADMIN = User("kubernetes-admin", ("system:masters", "system:authenticated"))
GPUPLACE = service_account("gpuplace", "gpuplace")
"""The webhook + extender sidecar + gang controller."""
SCHEDULER = service_account("gpuplace", "gpuplace-scheduler")
"""The stock kube-scheduler of the gpuplace pod."""
CERTS = service_account("gpuplace", "gpuplace-certs")
"""`gpuplace certs rotate` in the self-managed overlay's CronJob."""
NODE_AGENT = service_account("kube-system", "gpuplace-node-agent")
"""`gpuplace node-agent`, the DaemonSet on GPU nodes."""
DRA_NODE_AGENT = service_account("kube-system", "gpuplace-node-agent-dra")
"""`gpuplace node-agent --kubelet-plugin=dra`, the DaemonSet on DRA nodes
(`DRA_SHIPPED`)."""
DRA_SHIPPED = "overlays/self-managed-dra"
"""The shipped overlay with the DRA component (its RBAC: the DRA agent's, the sidecar's
slice writes)."""


# --- request attributes ------------------------------------------------------------

VERBS = {"GET": "get", "HEAD": "get", "POST": "create", "PUT": "update", "PATCH": "patch"}
NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})


@dataclass(frozen=True, slots=True)
class Attributes:
    """What one request asks for (kube-apiserver's authorizer.Attributes)."""

    user: User
    verb: str
    group: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    path: str = ""
    resource_request: bool = True


def attributes(user: User, method: str, path: str, query: Mapping[str, str]) -> Attributes:
    """The attributes of `method path?query` by `user`, as kube-apiserver derives them."""
    verb = "delete" if method == "DELETE" else VERBS.get(method, method.lower())
    parts = [unquote(part) for part in path.strip("/").split("/") if part]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return Attributes(user, verb, path=path, resource_request=False)
    if not rest:
        return Attributes(user, verb, path=path, resource_request=False)
    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch") in ("1", "t", "T", "TRUE", "true", "True") else "list"
        selector = query.get("fieldSelector") or ""
        for term in selector.split(","):
            key, _, value = term.partition("=")
            if key.strip() == "metadata.name" and value.strip() and "!" not in key:
                name = value.lstrip("=").strip()
    if not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(user, verb, group, resource, subresource, namespace, name, path)


# --- RBAC --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rule:
    verbs: frozenset[str]
    groups: frozenset[str]
    resources: frozenset[str]
    names: frozenset[str]

    @classmethod
    def of(cls, rule: Mapping[str, Any]) -> Rule:
        return cls(
            frozenset(rule.get("verbs") or ()),
            frozenset(rule.get("apiGroups") or ()),
            frozenset(rule.get("resources") or ()),
            frozenset(rule.get("resourceNames") or ()),
        )

    def allows(self, asked: Attributes) -> bool:
        """RBAC's rule evaluation (VerbMatches, APIGroupMatches, ResourceMatches,
        ResourceNameMatches). O(1)."""
        if not ({"*", asked.verb} & self.verbs and {"*", asked.group} & self.groups):
            return False
        combined = asked.resource + (f"/{asked.subresource}" if asked.subresource else "")
        if not (
            {"*", combined} & self.resources
            or (asked.subresource and f"*/{asked.subresource}" in self.resources)
        ):
            return False
        return not self.names or asked.name in self.names


def _rules(role: Obj) -> tuple[Rule, ...]:
    return tuple(Rule.of(rule) for rule in role.get("rules") or () if rule.get("resources"))


def _subject_is(subject: Mapping[str, Any], user: User) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "User":
        return bool(name == user.name)
    if kind == "Group":
        return name in user.groups
    if kind == "ServiceAccount":
        return user.name == f"system:serviceaccount:{subject.get('namespace')}:{name}"
    return False


PUBLIC_INFO = frozenset({"/healthz", "/livez", "/readyz", "/version"})
"""The paths bootstrap ClusterRole `system:public-info-viewer` opens to everyone."""


class Rbac:
    """RBAC authorization over a fixed set of objects. `allows` is O(bindings × rules)."""

    def __init__(self, objects: Iterable[Obj]) -> None:
        self.roles: dict[tuple[str, str], tuple[Rule, ...]] = {}
        self.cluster_roles: dict[str, tuple[Rule, ...]] = {}
        self.bindings: list[Obj] = []
        self.cluster_bindings: list[Obj] = []
        for obj in objects:
            kind, meta = obj.get("kind"), obj.get("metadata") or {}
            if kind == "ClusterRole":
                self.cluster_roles[meta["name"]] = _rules(obj)
            elif kind == "Role":
                self.roles[(meta["namespace"], meta["name"])] = _rules(obj)
            elif kind == "RoleBinding":
                self.bindings.append(obj)
            elif kind == "ClusterRoleBinding":
                self.cluster_bindings.append(obj)

    @classmethod
    def shipped(
        cls,
        tree: str = SHIPPED,
        *,
        edit: Callable[[list[Obj]], list[Obj]] | None = None,
    ) -> Rbac:
        """The RBAC of deploy/`tree` plus the Kubernetes defaults it refers to; `edit`
        may change the manifests first (a test removing a rule)."""
        objects = shipped_objects(tree)
        if edit is not None:
            objects = edit(objects)
        return cls([*BOOTSTRAP, *objects])

    def _granted(self, user: User, namespace: str) -> Iterator[tuple[Rule, ...]]:
        for binding in self.cluster_bindings:
            if any(_subject_is(s, user) for s in binding.get("subjects") or ()):
                yield self.cluster_roles.get(binding["roleRef"]["name"], ())
        if not namespace:
            return
        for binding in self.bindings:
            if binding["metadata"].get("namespace") != namespace:
                continue
            if any(_subject_is(s, user) for s in binding.get("subjects") or ()):
                ref = binding["roleRef"]
                if ref["kind"] == "ClusterRole":
                    yield self.cluster_roles.get(ref["name"], ())
                else:
                    yield self.roles.get((namespace, ref["name"]), ())

    def allows(self, asked: Attributes) -> bool:
        if not asked.resource_request:
            if asked.verb != "get":
                return False
            return "system:authenticated" in asked.user.groups or asked.path in PUBLIC_INFO
        return any(
            rule.allows(asked) for rules in self._granted(asked.user, asked.namespace)
            for rule in rules
        )  # fmt: skip


@functools.cache
def _shipped(tree: str = SHIPPED) -> Rbac:
    return Rbac.shipped(tree)


def forbidden(asked: Attributes) -> ApiStatusError:
    """kube-apiserver's 403 for a denied request (responsewriters.ForbiddenStatusError)."""
    user = asked.user.name
    if not asked.resource_request:
        return ApiStatusError(
            403, f'forbidden: User "{user}" cannot {asked.verb} path "{asked.path}"',
            reason="Forbidden",
        )  # fmt: skip
    shown = asked.resource + (f"/{asked.subresource}" if asked.subresource else "")
    scope = f'in the namespace "{asked.namespace}"' if asked.namespace else "at the cluster scope"
    why = (
        f'User "{user}" cannot {asked.verb} resource "{shown}" in API group "{asked.group}" {scope}'
    )
    qualified = asked.resource + (f".{asked.group}" if asked.group else "")
    named = f' "{asked.name}"' if asked.name else ""
    return ApiStatusError(
        403,
        f"{qualified}{named} is forbidden: {why}",
        reason="Forbidden",
        kind=asked.resource,
        name=asked.name,
        group=asked.group,
    )


def unauthorized() -> ApiStatusError:
    return ApiStatusError(401, "Unauthorized", reason="Unauthorized")


class Access:
    """Authentication and authorization of one local API; see the module docstring."""

    def __init__(self, rbac: Rbac) -> None:
        self.rbac = rbac
        self._users: dict[str, User] = {}
        self._tokens: dict[User, str] = {}

    @classmethod
    def shipped(
        cls, tree: str = SHIPPED, *, edit: Callable[[list[Obj]], list[Obj]] | None = None
    ) -> Access:
        """Enforcing the RBAC deploy/`tree` ships (see `Rbac.shipped`; read once per
        process unless `edit` changes it)."""
        return cls(_shipped(tree) if edit is None else Rbac.shipped(tree, edit=edit))

    def token(self, user: User) -> str:
        """A bearer token that authenticates as `user` (the same one each time)."""
        if user not in self._tokens:
            token = secrets.token_urlsafe(24)
            self._tokens[user] = token
            self._users[token] = user
        return self._tokens[user]

    def user(self, authorization: str | None) -> User:
        """The user an `Authorization` header authenticates as (none: `ANONYMOUS`);
        401 for a token nobody issued."""
        if not authorization:
            return ANONYMOUS
        scheme, _, token = authorization.partition(" ")
        user = self._users.get(token.strip()) if scheme.lower() == "bearer" else None
        if user is None:
            raise unauthorized()
        return user

    def authorize(self, user: User, method: str, path: str, query: Mapping[str, str]) -> None:
        """Return if `user` may send this request; else raise the 403 Forbidden."""
        asked = attributes(user, method, path, query)
        if not self.rbac.allows(asked):
            raise forbidden(asked)


# --- the manifests -----------------------------------------------------------------

RENAMING = (
    "namePrefix",
    "nameSuffix",
    "namespace",
    "patchesStrategicMerge",
    "patchesJson6902",
    "replacements",
)
"""kustomization fields that could change RBAC objects; reading the files as they are
would then be wrong, so `shipped_objects` refuses them (and `patches` that target RBAC or
ServiceAccounts; `components` are followed like `resources`)."""


_PATCHABLE = frozenset({"Deployment", "DaemonSet"})
"""Kinds a shipped `patches` entry may target: nothing the RBAC read here depends on."""


class ManifestsMissing(RuntimeError):
    """deploy/ is not next to this package (an installed wheel, not a source tree)."""


def shipped_objects(tree: str = SHIPPED, deploy: Path = DEPLOY) -> list[Obj]:
    """The objects of deploy/`tree`, following kustomization `resources:` (files and
    directories). Only what kustomize leaves unchanged for RBAC objects is supported:
    `labels` and generators are ignored, anything renaming or patching is refused
    (tests/deploy compares the result with `kustomize build`). Raises
    `ManifestsMissing` without deploy/."""
    root = deploy / tree
    if not (root / "kustomization.yaml").is_file():
        raise ManifestsMissing(
            f"the shipped manifests are not at {root}: the local API reads the RBAC it "
            "enforces from deploy/ of a source checkout"
        )
    return list(_walk(root))


def _walk(directory: Path) -> Iterator[Obj]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}
    refused = [field for field in RENAMING if kustomization.get(field)]
    if any(
        ((patch or {}).get("target") or {}).get("kind") not in _PATCHABLE
        for patch in kustomization.get("patches") or ()
    ):
        refused.append("patches of RBAC objects (or without a target kind)")
    if refused:
        raise ValueError(
            f"{directory}/kustomization.yaml uses {', '.join(refused)}: read the RBAC from "
            "`kustomize build` instead"
        )
    for entry in [
        *(kustomization.get("resources") or ()),
        *(kustomization.get("components") or ()),
    ]:
        path = (directory / entry).resolve()
        if path.is_dir():
            yield from _walk(path)
        else:
            yield from (doc for doc in yaml.safe_load_all(path.read_text()) if doc)


# --- what Kubernetes creates itself ------------------------------------------------


def _role(kind: str, name: str, *rules: Obj, namespace: str = "") -> Obj:
    meta: Obj = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": f"{RBAC_GROUP}/v1", "kind": kind, "metadata": meta, "rules": list(rules)}


def _rule(verbs: str, groups: str, resources: str, names: str = "") -> Obj:
    rule: Obj = {
        "verbs": verbs.split(),
        "apiGroups": ["" if g == "core" else g for g in groups.split()],
        "resources": resources.split(),
    }
    if names:
        rule["resourceNames"] = names.split()
    return rule


READ = "get list watch"
READ_UPDATE = "get list watch update patch"

BOOTSTRAP: tuple[Obj, ...] = (
    _role("ClusterRole", "cluster-admin", _rule("*", "*", "*")),
    {
        "apiVersion": f"{RBAC_GROUP}/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "cluster-admin"},
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"apiGroup": RBAC_GROUP, "kind": "Group", "name": "system:masters"}],
    },
    _role(
        "ClusterRole",
        "system:kube-scheduler",
        _rule("create update patch", "core events.k8s.io", "events"),
        _rule("create", "coordination.k8s.io", "leases"),
        _rule("get update", "coordination.k8s.io", "leases", "kube-scheduler"),
        _rule(READ, "core", "nodes"),
        _rule("get list watch delete", "core", "pods"),
        _rule("create", "core", "pods/binding bindings"),
        _rule("patch update", "core", "pods/status"),
        _rule(READ, "core", "services replicationcontrollers"),
        _rule(READ, "apps extensions", "replicasets"),
        _rule(READ, "apps", "statefulsets"),
        _rule(READ, "policy", "poddisruptionbudgets"),
        _rule(READ, "core", "persistentvolumeclaims persistentvolumes"),
        _rule("create", "authentication.k8s.io", "tokenreviews"),
        _rule("create", "authorization.k8s.io", "subjectaccessreviews"),
        _rule(READ, "storage.k8s.io", "csinodes csidrivers csistoragecapacities"),
        _rule(READ, "core", "namespaces"),
        # dynamic resource allocation, as v1.36.2's bootstrap policy has it
        _rule(READ, "resource.k8s.io", "deviceclasses resourceslices"),
        _rule(READ_UPDATE, "resource.k8s.io", "resourceclaims resourceclaims/status"),
        _rule("create delete", "resource.k8s.io", "resourceclaims"),
        _rule("patch update", "resource.k8s.io", "resourceclaims/binding"),
        _rule("update", "core", "pods/finalizers"),
    ),
    _role(
        "ClusterRole",
        "system:volume-scheduler",
        _rule(READ_UPDATE, "core", "persistentvolumes"),
        _rule(READ, "storage.k8s.io", "storageclasses"),
        _rule(READ_UPDATE, "core", "persistentvolumeclaims"),
    ),
    _role(
        "Role",
        "extension-apiserver-authentication-reader",
        _rule(READ, "core", "configmaps", "extension-apiserver-authentication"),
        namespace="kube-system",
    ),
)
"""The default roles the shipped bindings refer to, as kube-apiserver's bootstrap policy
(plugin/pkg/auth/authorizer/rbac/bootstrappolicy) creates them (system:kube-scheduler's
dynamic-resource-allocation rules as `kubectl get clusterrole system:kube-scheduler`
shows them on v1.36.2)."""
