"""`kustomize build` of deploy/, with the real kustomize: the standalone `kustomize` binary if
it is on PATH, else the one built into kubectl (`kubectl kustomize`). The rendered output is
what the tests validate. Without either binary the tests that need it are skipped, saying
so; nothing here imitates kustomize.
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("self-managed", "cert-manager", "self-managed-node-agent", "self-managed-dra")
NODE_AGENT = "overlays/self-managed-node-agent"
"""The shipped overlay that turns the node agent on (components/node-agent)."""
DRA = "overlays/self-managed-dra"
"""... and gpuplace on DRA for the nodes labelled so (components/dra)."""
TREES = ("base", *(f"overlays/{name}" for name in OVERLAYS))

Obj = dict[str, Any]


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@functools.cache
def _build(tree: str) -> str:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither `kustomize` nor `kubectl` (with kustomize built in) is on PATH")
    done = subprocess.run(
        [*command, str(DEPLOY / tree)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"kustomize build {tree} failed:\n{done.stderr}")
    return done.stdout


@functools.cache
def _parsed(tree: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(_build(tree)) if doc]


def render(tree: str) -> list[Obj]:
    """The objects `kustomize build deploy/<tree>` prints, in order: a fresh copy on each call
    (callers may edit it), parsed once per tree, so that a property test reading the
    configuration per example does not parse YAML per example."""
    return copy.deepcopy(_parsed(tree))


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def named(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(pod_spec: Obj, name: str) -> Obj:
    found: list[Obj] = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def pod_specs(objects: list[Obj]) -> dict[str, Obj]:
    """Every pod template by workload name (Deployments and CronJobs)."""
    specs: dict[str, Obj] = {}
    for obj in objects:
        if obj["kind"] == "Deployment":
            specs[obj["metadata"]["name"]] = obj["spec"]["template"]["spec"]
        elif obj["kind"] == "CronJob":
            template = obj["spec"]["jobTemplate"]["spec"]["template"]
            specs[obj["metadata"]["name"]] = template["spec"]
    return specs


def pod_labels(objects: list[Obj], workload: str) -> dict[str, str]:
    for obj in objects:
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == workload:
            labels: dict[str, str] = obj["spec"]["template"]["metadata"]["labels"]
            return labels
    raise AssertionError(workload)


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against labels."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True
