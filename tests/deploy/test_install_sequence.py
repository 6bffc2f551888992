"""The install commands docs/deploy.md documents (between its `install-sequence` markers)
work on a fresh cluster: each is played, in order, on a model of the API server that holds
what a server-side dry run and an apply would find, against the manifests kustomize renders.

The model knows what made the first documented command fail on a real cluster: a
namespaced object needs its namespace to exist, and a server-side dry run (`--dry-run=server`)
stores nothing, so the Namespace in the same apply does not count; an apply creates objects
in the order kustomize prints them (Namespace first); a kind from a CRD needs the CRD. It
knows only the command forms it parses; any other form fails the test, so the document and
this model change together.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from tests.deploy import rendering

DOC = rendering.ROOT / "docs" / "deploy.md"
FRESH = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})
BUILT_IN_GROUPS = frozenset(
    {
        "",
        "apps",
        "batch",
        "policy",
        "networking.k8s.io",
        "rbac.authorization.k8s.io",
        "admissionregistration.k8s.io",
        "scheduling.k8s.io",
        "coordination.k8s.io",
        "apiextensions.k8s.io",
        "flowcontrol.apiserver.k8s.io",
        "resource.k8s.io",
    }
)
CLUSTER_SCOPED = frozenset(
    {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "PriorityClass",
        "CustomResourceDefinition",
        "ClusterIssuer",
        "FlowSchema",
        "DeviceClass",
    }
)
CERT_MANAGER = "cert-manager.io"
Obj = dict[str, Any]


@dataclass
class Cluster:
    """What the API server holds: namespaces, the API groups its CRDs add, and objects."""

    namespaces: set[str] = field(default_factory=lambda: set(FRESH))
    crd_groups: set[str] = field(default_factory=set)
    objects: dict[tuple[str, str, str], Obj] = field(default_factory=dict)


class Failed(Exception):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


def documented() -> list[str]:
    """The shell lines between the markers, comments and blank lines left out."""
    text = DOC.read_text()
    found = re.search(r"<!-- install-sequence\b.*?-->(.*?)<!-- /install-sequence -->", text, re.S)
    assert found, f"no install-sequence markers in {DOC}"
    block = re.search(r"```sh\n(.*?)```", found.group(1), re.S)
    assert block, "the install sequence is not a ```sh block"
    lines = [line.split(" #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def tree(directory: str, overlay: str) -> str:
    """The kustomize tree a `-k` argument names; the user's overlay is one of ours."""
    if directory.rstrip("/") == "my-gpuplace":
        return f"overlays/{overlay}"
    assert directory.startswith("deploy/"), f"the model does not know -k {directory}"
    return directory.removeprefix("deploy/").rstrip("/")


def key(obj: Obj) -> tuple[str, str, str]:
    """Where the API server keeps `obj`: kind, namespace ("" for cluster-scoped), name."""
    namespace = "" if obj["kind"] in CLUSTER_SCOPED else obj["metadata"].get("namespace", "default")
    return obj["kind"], namespace, obj["metadata"]["name"]


def apply(cluster: Cluster, objects: list[Obj], *, dry_run: bool) -> None:
    """`kubectl apply` of `objects` in order; each object that fails is one error line."""
    errors: list[str] = []
    namespaces = set(cluster.namespaces)
    for obj in objects:
        api_version = obj["apiVersion"]
        kind, namespace, name = key(obj)
        if api_version.rpartition("/")[0] not in BUILT_IN_GROUPS | cluster.crd_groups:
            errors.append(f'no matches for kind "{kind}" in version "{api_version}"')
            continue
        if namespace and namespace not in namespaces:
            errors.append(f'{kind} {name}: namespaces "{namespace}" not found')
            continue
        if not dry_run:
            cluster.objects[kind, namespace, name] = obj
            if kind == "Namespace":
                namespaces.add(name)
    if errors:
        raise Failed(errors)
    cluster.namespaces = namespaces


def run(cluster: Cluster, line: str, overlay: str) -> None:
    """One documented line (`a && b` runs b only when a succeeded; `a | b` pipes YAML)."""
    for command in line.split("&&"):
        stdin: list[Obj] | None = None
        for part in command.split("|"):
            stdin = _kubectl(cluster, shlex.split(part), overlay, stdin)


def _kubectl(cluster: Cluster, argv: list[str], overlay: str, stdin: list[Obj] | None) -> Any:
    assert argv[0] == "kubectl", f"the model knows only kubectl, not {argv}"
    verb, *args = argv[1:]
    options = dict(arg.split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)
    dry_run = options.get("--dry-run", "none")
    if verb == "create" and args[0] == "namespace":
        name = args[1]
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        if dry_run == "client":
            assert args[args.index("-o") + 1] == "yaml", args
            return [namespace]
        if name in cluster.namespaces:
            raise Failed([f'namespaces "{name}" already exists'])
        apply(cluster, [namespace], dry_run=dry_run == "server")
        return None
    assert verb == "apply", f"the model does not know kubectl {verb}"
    assert dry_run in ("none", "server"), f"the model does not know --dry-run={dry_run}"
    if "-k" in args:
        objects = rendering.render(tree(args[args.index("-k") + 1], overlay))
    elif args[args.index("-f") + 1] == "-":
        assert stdin is not None, "kubectl apply -f - with nothing piped in"
        objects = stdin
    else:
        path = rendering.ROOT / args[args.index("-f") + 1]
        objects = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    apply(cluster, objects, dry_run=dry_run == "server")
    return None


def play(lines: list[str], overlay: str, cluster: Cluster | None = None) -> Cluster:
    cluster = cluster if cluster is not None else Cluster()
    for line in lines:
        run(cluster, line, overlay)
    return cluster


def cert_manager_installed() -> Cluster:
    return Cluster(crd_groups={CERT_MANAGER})


@pytest.mark.parametrize("overlay", rendering.OVERLAYS)
def test_documented_sequence_installs_on_a_fresh_cluster(overlay: str) -> None:
    lines = documented()
    assert any("--dry-run=server" in line for line in lines), "the server check is gone"
    cluster = play(lines, overlay, cert_manager_installed())
    rendered = rendering.render(f"overlays/{overlay}")
    assert len(cluster.objects) == len(rendered)
    assert "gpuplace" in cluster.namespaces
    # The apply, not the namespace line, has the last word on the Namespace: its labels.
    namespace = cluster.objects["Namespace", "", "gpuplace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


PREVIOUS = "test.gpuplace.io/previous-release"
"""Marks each object of the release installed before the upgrade."""


@pytest.mark.parametrize("overlay", rendering.OVERLAYS)
def test_documented_sequence_runs_again_for_an_upgrade(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same lines on a cluster that holds the previous release (every object of it
    marked) succeed, namespace line included (it must not fail on the namespace that
    exists), and leave exactly the new release: each object replaced by its new version,
    none twice, the namespace's Pod Security labels in place."""
    current = rendering.render

    def previous(tree: str) -> list[Obj]:
        objects = current(tree)
        for obj in objects:
            obj["metadata"].setdefault("annotations", {})[PREVIOUS] = "true"
        return objects

    monkeypatch.setattr(rendering, "render", previous)
    cluster = play(documented(), overlay, cert_manager_installed())
    installed = dict(cluster.objects)
    assert installed and all(
        PREVIOUS in obj["metadata"]["annotations"] for obj in installed.values()
    )
    monkeypatch.setattr(rendering, "render", current)

    upgraded = play(documented(), overlay, cluster)

    rendered = current(f"overlays/{overlay}")
    assert upgraded.objects == {key(obj): obj for obj in rendered}
    assert upgraded.objects.keys() == installed.keys()
    assert not any(PREVIOUS in obj["metadata"].get("annotations", {}) for obj in rendered)
    namespace = upgraded.objects["Namespace", "", "gpuplace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_the_old_sequence_fails_as_it_did_on_a_real_cluster() -> None:
    """The README's former one-liner: 17 `namespaces "gpuplace" not found` on a fresh
    cluster with the self-managed overlay, as the real cluster answered; the model must
    see that, or the test above proves nothing. Since that check the overlay gained the
    Role and RoleBinding that let the sidecar read the scheduler's Lease (issue 18), two
    more objects in the namespace."""
    old = "kubectl apply -k my-gpuplace --dry-run=server && kubectl apply -k my-gpuplace"
    with pytest.raises(Failed) as failed:
        play([old], "self-managed")
    errors = failed.value.errors
    added_since = {
        "Role gpuplace-read-scheduler-lease",
        "RoleBinding gpuplace-read-scheduler-lease",
    }
    assert {error.partition(":")[0] for error in errors} >= added_since
    assert len(errors) == 17 + len(added_since)
    assert all(error.endswith('namespaces "gpuplace" not found') for error in errors)
    # docs/deploy.md tells the reader how many to expect (issue 46: it said 17)
    told = re.search(r"\((\d+) with the self-managed overlay\)", DOC.read_text())
    assert told is not None and int(told.group(1)) == len(errors)


def test_a_plain_create_namespace_would_break_the_upgrade() -> None:
    """Why the documented line pipes a client-side dry run into apply."""
    with pytest.raises(Failed, match="already exists"):
        play(
            ["kubectl create namespace gpuplace"],
            "self-managed",
            play(documented(), "self-managed"),
        )


def test_cert_manager_overlay_needs_cert_manager() -> None:
    """Without cert-manager the dry run stops the install, naming its kinds."""
    with pytest.raises(Failed) as failed:
        play(documented(), "cert-manager")
    kinds = {re.sub(r'.*kind "(\w+)".*', r"\1", error) for error in failed.value.errors}
    assert kinds == {"Certificate", "Issuer"}


def test_steps_4_and_5_are_the_lines_the_image_tier_runs() -> None:
    """The real-cluster tier's install from the image (tests/realcluster/pods.py) plays
    docs/deploy.md's steps 4 and 5 from its own copies of the lines: they must be the
    document's, to the character (NODE stands for the node's name in both)."""
    from tests.realcluster import pods

    text = DOC.read_text()
    for line in (*pods.CERTS_STEP, *pods.ROLLOUT_STEP):
        assert f"\n     {line}\n" in text or f"\n   {line}\n" in text, line
