"""gpuplace installed from its image on the kit's node, as docs/deploy.md's steps say: the
shipped Deployment (the sidecar from gpuplace's image, kube-scheduler from an image of the
kit's binary), the certificate CronJob and the node-agent DaemonSet running as pods.

`installed(cluster, workdir, built)` (a context manager):

1. clears what the tier's host-process installation left (`retire`: its processes
   stopped by PID, its objects deleted: they have the same names);
2. imports both images into the node's containerd and routes pods to the API server
   (`image.kubernetes_service`);
3. writes the test overlay (`overlay`) over the shipped `deploy/overlays/self-managed-node-agent`;
4. runs docs/deploy.md steps 3-5 verbatim: the three lines of step 3, step 4's
   `create job --from=cronjob/gpuplace-certs` and its `wait`, step 5's `rollout status` and
   `label node`; the node first gets the labels GPU Feature Discovery would give it;
5. waits for the node agent's pod and the kubelet offering its devices;

and at the end deletes what it installed (`kubectl delete -k`) and the images.

What the overlay changes, and why (nothing else differs from what a user applies):

- `images:` the two entries of README step 2 (gpuplace → the local tag; kube-scheduler → the
  kit's version, which is the shipped one);
- the node agent's DaemonSet only: a ConfigMap mounted at /etc/gpuplace-rc holding the NVML
  reading it replays and the MPS stand-in, named by the agent's own settings
  (`GPUPLACE_NVML_REPLAY`, `GPUPLACE_MPS_CONTROL`): there is no GPU and no NVIDIA driver here.

Nothing for the network: with no kube-proxy and no cluster DNS (the kit's fact 9) the tier
itself stands in, outside the manifests: `image.kubernetes_service` DNATs the `kubernetes`
Service for pods, and the kit's kube-apiserver runs with `--enable-aggregator-routing=true`
(`kit.APISERVER_FLAGS`), so it calls the webhook Service at a ready endpoint.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.deploy import test_install_sequence as install_sequence
from tests.realcluster import image
from tests.realcluster.image import Built
from tests.realcluster.install import AGENT_NAMESPACE, MPS_STANDIN, NAMESPACE, SHIPPED, play
from tests.realcluster.kit import ROOT, Cluster, Kubectl, Result
from tests.realcluster.objects import (
    label_real_node,
    real_node_reading,
    wait_agent_devices,
)
from tests.realcluster.processes import HostProcess

CERTS_STEP = (
    "kubectl -n gpuplace create job gpuplace-certs-init --from=cronjob/gpuplace-certs",
    "kubectl -n gpuplace wait --for=condition=complete job/gpuplace-certs-init --timeout=5m",
)
"""docs/deploy.md step 4, self-managed, as written there (a test checks it is)."""
ROLLOUT_STEP = (
    "kubectl -n gpuplace rollout status deploy/gpuplace",
    "kubectl label node NODE gpuplace.io/enabled=true",
)
"""docs/deploy.md step 5, as written there."""
TEST_SETTINGS = "/etc/gpuplace-rc"
TEST_CONFIGMAP = "gpuplace-rc-node-agent"
MPS_ROOT = Path("/run/gpuplace")
"""The DaemonSet's hostPath (DirectoryOrCreate): removed at the end when it made it."""
TIMEOUT = 300
SELECTOR = "app.kubernetes.io/name=gpuplace,app.kubernetes.io/component=scheduler"
AGENT_SELECTOR = "app.kubernetes.io/name=gpuplace,app.kubernetes.io/component=node-agent"


def overlay(workdir: Path, tag: str, scheduler: str, replay: dict[str, Any]) -> Path:
    """The test overlay (see the module docstring) in `workdir/overlay`, pointing gpuplace
    at `tag` and kube-scheduler at `scheduler` (NAME:TAG)."""
    directory = workdir / "overlay"
    directory.mkdir(parents=True, exist_ok=True)
    shipped = directory / "shipped"
    if not shipped.exists():
        shipped.symlink_to(ROOT / "deploy")
    (directory / "nvml.json").write_text(json.dumps(replay))
    shutil.copyfile(MPS_STANDIN, directory / "mps_standin.py")
    name, _, version = tag.rpartition(":")
    patch = [
        {
            "op": "add",
            "path": "/spec/template/spec/volumes/-",
            "value": {"name": "gpuplace-rc", "configMap": {"name": TEST_CONFIGMAP}},
        },
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/volumeMounts/-",
            "value": {"name": "gpuplace-rc", "mountPath": TEST_SETTINGS, "readOnly": True},
        },
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/env/-",
            "value": {"name": "GPUPLACE_NVML_REPLAY", "value": f"{TEST_SETTINGS}/nvml.json"},
        },
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/env/-",
            # the image's python (its venv's, first on PATH); the stand-in is stdlib only
            "value": {
                "name": "GPUPLACE_MPS_CONTROL",
                "value": f"python {TEST_SETTINGS}/mps_standin.py",
            },
        },
    ]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [f"shipped/{SHIPPED}"],
        "images": [
            {"name": "gpuplace", "newName": name, "newTag": version},
            {
                "name": "registry.k8s.io/kube-scheduler",
                "newTag": scheduler.rpartition(":")[2],
            },
        ],
        "configMapGenerator": [
            {
                "name": TEST_CONFIGMAP,
                "namespace": AGENT_NAMESPACE,
                "files": ["nvml.json", "mps_standin.py"],
                "options": {"disableNameSuffixHash": True},
            }
        ],
        "patches": [
            {
                "target": {"kind": "DaemonSet", "name": "gpuplace-node-agent"},
                "patch": json.dumps(patch),
            }
        ],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


@dataclass
class InPods:
    """gpuplace running from its image on the kit's cluster."""

    cluster: Cluster
    kubectl: Kubectl
    workdir: Path
    overlay: Path
    built: Built
    scheduler_image: str
    replay: dict[str, Any]
    steps: dict[str, Result] = field(default_factory=dict)
    """docs/deploy.md step → kubectl's output: namespace, dry-run, apply, certs-job,
    certs-wait, rollout, label."""
    seconds: dict[str, float] = field(default_factory=dict)
    """How long each part took: import, apply (step 3), certs (step 4), rollout (step 5's
    first line), node-agent (label → the kubelet offers the agent's devices), install (all)."""
    rendered: list[dict[str, Any]] = field(default_factory=list)

    @property
    def node(self) -> str:
        return self.cluster.node_name

    @property
    def uuids(self) -> list[str]:
        return [gpu["uuid"] for gpu in self.replay["gpus"]]

    def pods(self, selector: str = SELECTOR, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
        """The running pods of the selection (not the terminating ones), oldest first."""
        items = self.kubectl.json("-n", namespace, "get", "pods", "-l", selector)["items"]
        alive = [pod for pod in items if not pod["metadata"].get("deletionTimestamp")]
        return sorted(alive, key=lambda pod: pod["metadata"]["creationTimestamp"])

    def sa_kubeconfig(self, namespace: str, account: str) -> Path:
        """A kubeconfig with a fresh token of ServiceAccount namespace/account."""
        token = self.kubectl.run("-n", namespace, "create", "token", account).out.strip()
        path = self.workdir / f"{namespace}-{account}.kubeconfig"
        return self.cluster.kubeconfig_for(path, f"{namespace}-{account}", token)

    def shipped(self, kind: str, name: str) -> dict[str, Any]:
        """The object as the shipped overlay renders it (what a user applies)."""
        rendered = self.kubectl.run("kustomize", str(ROOT / "deploy" / SHIPPED)).out
        for item in yaml.safe_load_all(rendered):
            if item and item["kind"] == kind and item["metadata"]["name"] == name:
                return dict(item)
        raise AssertionError(f"no {kind}/{name} in deploy/{SHIPPED}")


def retire(kubectl: Kubectl, directory: Path, processes: Sequence[HostProcess]) -> None:
    """Stop the tier's host processes (serve, its kube-scheduler, the node agent) and delete
    every object of an installation: the objects of `directory`'s overlay, which has the
    names of every installation's, so the host-process one goes too (a no-op on a fresh
    cluster). The namespace's deletion is waited for."""
    for process in processes:
        process.stop()
    kubectl.run(
        "delete", "-k", str(directory), "--ignore-not-found", "--wait=true", "--timeout=240s",
        timeout=300,
    )  # fmt: skip


@contextlib.contextmanager
def installed(
    cluster: Cluster,
    workdir: Path,
    built: Built,
    *,
    retiring: Sequence[HostProcess] = (),
) -> Iterator[InPods]:
    """gpuplace installed from `built` (see the module docstring), removed at the end."""
    kubectl = cluster.kubectl(workdir)
    scheduler, scheduler_tarball = image.scheduler_image(cluster)
    replay = real_node_reading()
    directory = overlay(workdir, built.tag, scheduler, replay)
    made_mps_root = not MPS_ROOT.exists()
    retire(kubectl, directory, retiring)
    started = time.monotonic()
    image.load(cluster, built.archive)
    image.load(cluster, scheduler_tarball)
    found = InPods(cluster, kubectl, workdir, directory, built, scheduler, replay)
    found.seconds["import"] = round(time.monotonic() - started, 1)
    try:
        with image.kubernetes_service(cluster, kubectl):
            install(found)
            yield found
    finally:
        uninstall(kubectl, directory)
        kubectl.run(
            "label", "node", cluster.node_name, "gpuplace.io/enabled-", "nvidia.com/gpu.count-",
            "nvidia.com/gpu.product-", "nvidia.com/gpu.memory-", check=False,
        )  # fmt: skip
        image.remove(cluster, built.tag, image.UPGRADE_TAG)
        if made_mps_root:
            shutil.rmtree(MPS_ROOT, ignore_errors=True)


def uninstall(kubectl: Kubectl, directory: Path) -> None:
    """`kubectl delete -k` of the overlay, waited for. A pod that no kubelet will ever
    stop (one bound to a node that has none, which a failed test may leave) would hold
    the namespace's deletion for good: after a first wait, what is left of the
    installation's pods is deleted at once (--force), and the deletion waited for again."""
    deleted = kubectl.run(
        "delete", "-k", str(directory), "--ignore-not-found", "--wait=true", "--timeout=120s",
        check=False, timeout=150,
    )  # fmt: skip
    if deleted.code == 0:
        return
    for namespace, selector in ((NAMESPACE, "app.kubernetes.io/name=gpuplace"),
                                (AGENT_NAMESPACE, AGENT_SELECTOR)):  # fmt: skip
        kubectl.run(
            "-n", namespace, "delete", "pods", "-l", selector, "--force", "--grace-period=0",
            "--ignore-not-found", check=False,
        )  # fmt: skip
    kubectl.run(
        "delete", "-k", str(directory), "--ignore-not-found", "--wait=true", "--timeout=120s",
        check=False, timeout=150,
    )  # fmt: skip


def install(found: InPods) -> None:
    """docs/deploy.md steps 3-5 on `found.overlay` (see the module docstring)."""
    kubectl, directory, seconds = found.kubectl, found.overlay, found.seconds
    started = time.monotonic()
    lines = install_sequence.documented()
    assert len(lines) == 3, lines
    for step, line in zip(("namespace", "dry-run", "apply"), lines, strict=True):
        found.steps[step] = play(kubectl, line, directory)
    seconds["apply"] = round(time.monotonic() - started, 1)
    found.rendered = [
        item for item in yaml.safe_load_all(kubectl.run("kustomize", str(directory)).out) if item
    ]
    label_real_node(kubectl, found.node)  # as GPU Feature Discovery did long before
    mark = time.monotonic()
    found.steps["certs-job"] = play(kubectl, CERTS_STEP[0], directory)
    found.steps["certs-wait"] = play(kubectl, CERTS_STEP[1], directory, timeout=TIMEOUT + 30)
    seconds["certs"] = round(time.monotonic() - mark, 1)
    mark = time.monotonic()
    found.steps["rollout"] = play(kubectl, ROLLOUT_STEP[0], directory, timeout=TIMEOUT)
    seconds["rollout"] = round(time.monotonic() - mark, 1)
    mark = time.monotonic()
    found.steps["label"] = play(kubectl, ROLLOUT_STEP[1].replace("NODE", found.node), directory)
    wait_agent_devices(kubectl, found.node, timeout=TIMEOUT)
    kubectl.watch(
        ["pods", "-n", AGENT_NAMESPACE, "-l", AGENT_SELECTOR],
        lambda seen: any(ready(obj) for obj in seen.values()),
        timeout=TIMEOUT,
        what="the node agent's pod Ready",
    )
    seconds["node-agent"] = round(time.monotonic() - mark, 1)
    seconds["install"] = round(time.monotonic() - started, 1)


def ready(obj: dict[str, Any] | None) -> bool:
    """Running, every container ready, not terminating."""
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        return False
    status = obj.get("status") or {}
    statuses = status.get("containerStatuses") or []
    return (
        status.get("phase") == "Running"
        and bool(statuses)
        and all(container.get("ready") for container in statuses)
    )
