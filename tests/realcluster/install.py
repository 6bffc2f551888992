"""gpuplace installed on the tier's cluster as README "Installing into a cluster" says, and
run as host processes with the shipped identities.

`install(cluster, workdir)`:

1. writes the test-only overlay (`overlay(...)`) on top of the shipped
   `deploy/overlays/self-managed-node-agent` (self-managed certificates plus the node
   agent component: the superset, so that the node agent's RBAC and admission policies are
   the shipped ones too);
2. runs README step 3 verbatim, the lines of docs/deploy.md's install-sequence block:
   `kubectl create namespace gpuplace --dry-run=client -o yaml | kubectl apply -f -`,
   `kubectl apply -k OVERLAY --dry-run=server`, `kubectl apply -k OVERLAY` (each output
   kept for the tests that check them);
3. step 4 the way docs/deploy.md offers for running it from one's own machine: `gpuplace
   certs rotate --secret gpuplace-webhook-tls --inject`, plus `--ip-address 127.0.0.1`
   (the API server calls the webhook at that address, see below) and `--out-dir` (the
   host process reads the pair from files, as the container reads the mounted Secret);
4. starts `gpuplace serve` with the Deployment's own arguments and a kubeconfig holding a
   token of ServiceAccount gpuplace/gpuplace (`kubectl create token`), and the stock
   kube-scheduler with the shipped KubeSchedulerConfiguration (from the rendered
   ConfigMap) and the token of gpuplace/gpuplace-scheduler from the Secret the Deployment
   mounts, its extender URL pointed at the sidecar's port.

What the overlay changes, and why (nothing else differs from what a user applies):

- both webhook configurations' `clientConfig.service` → `url:
  https://127.0.0.1:PORT/{mutate,validate}`: this API server listens on 127.0.0.1 only and
  has no kube-proxy or cluster DNS (the kit's README, fact 9), so a Service cannot lead it to
  a process; `gpuplace certs --inject` fills `caBundle` as it does for the Service;
- Deployment `gpuplace`: `replicas: 0`; DaemonSet `gpuplace-node-agent`: a node selector no
  node matches; CronJob `gpuplace-certs`: suspended. Their image cannot be pulled (no
  registry); the processes of this module run their containers' commands instead.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.deploy import test_install_sequence as install_sequence
from tests.realcluster.kit import ROOT, Cluster, Kubectl, Result, free_port
from tests.realcluster.processes import HostProcess, container, with_flags

SHIPPED = "overlays/self-managed-node-agent"
"""The shipped overlay the tier installs (deploy/...)."""
GPUPLACE = str(Path(sys.executable).parent / "gpuplace")
"""The gpuplace console script of this environment."""
NAMESPACE = "gpuplace"
LEASE = "gpuplace-scheduler"
NO_IMAGE_LABEL = "gpuplace.io/realcluster-no-image"


def overlay(workdir: Path, webhook_port: int) -> Path:
    """The test-only overlay (see the module docstring) in `workdir/overlay`; the shipped
    tree is reached through a symlink, as kustomize takes no absolute paths."""
    directory = workdir / "overlay"
    directory.mkdir(parents=True, exist_ok=True)
    shipped = directory / "shipped"
    if not shipped.exists():
        shipped.symlink_to(ROOT / "deploy")

    def url(kind: str, path: str) -> dict[str, Any]:
        return {
            "target": {"kind": kind, "name": "gpuplace"},
            "patch": json.dumps(
                [
                    {
                        "op": "replace",
                        "path": "/webhooks/0/clientConfig",
                        "value": {"url": f"https://127.0.0.1:{webhook_port}/{path}"},
                    }
                ]
            ),
        }

    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [f"shipped/{SHIPPED}"],
        "patches": [
            url("MutatingWebhookConfiguration", "mutate"),
            url("ValidatingWebhookConfiguration", "validate"),
            {
                "target": {"kind": "Deployment", "name": "gpuplace"},
                "patch": json.dumps([{"op": "replace", "path": "/spec/replicas", "value": 0}]),
            },
            {
                "target": {"kind": "DaemonSet", "name": "gpuplace-node-agent"},
                "patch": json.dumps(
                    [
                        {
                            "op": "add",
                            "path": "/spec/template/spec/nodeSelector/"
                            + NO_IMAGE_LABEL.replace("/", "~1"),
                            "value": "true",
                        }
                    ]
                ),
            },
            {
                "target": {"kind": "CronJob", "name": "gpuplace-certs"},
                "patch": json.dumps([{"op": "add", "path": "/spec/suspend", "value": True}]),
            },
        ],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


@dataclass
class Ports:
    webhook: int = field(default_factory=free_port)
    extender: int = field(default_factory=free_port)
    metrics: int = field(default_factory=free_port)
    scheduler: int = field(default_factory=free_port)


@dataclass
class Installation:
    """gpuplace on the tier's cluster: what the install printed and the two processes."""

    cluster: Cluster
    kubectl: Kubectl
    workdir: Path
    overlay: Path
    ports: Ports
    steps: dict[str, Result]
    """README step → kubectl's output: namespace, dry-run, apply; and certs."""
    stored_after_dry_run: list[str]
    """Objects of the overlay found right after the server dry run (expected: none)."""
    rendered: list[dict[str, Any]]
    serve: HostProcess = field(init=False)
    scheduler: HostProcess = field(init=False)

    def token(self, namespace: str, account: str, **bound: str) -> str:
        """A fresh token of ServiceAccount namespace/account (`kubectl create token`;
        `bound` adds --bound-object-kind/-name)."""
        args = ["-n", namespace, "create", "token", account, "--duration=6h"]
        if bound:
            args += [f"--bound-object-kind={bound['kind']}", f"--bound-object-name={bound['name']}"]
        return self.kubectl.run(*args).out.strip()

    def sa_kubeconfig(self, namespace: str, account: str, **bound: str) -> Path:
        """A kubeconfig with a fresh token of ServiceAccount namespace/account (`token`)."""
        token = self.token(namespace, account, **bound)
        path = self.workdir / f"{namespace}-{account}.kubeconfig"
        return self.cluster.kubeconfig_for(path, f"{namespace}-{account}", token)


STEPS = ("namespace", "dry-run", "apply")
"""The three lines of README step 3, as docs/deploy.md's install-sequence block has them."""


def play(kubectl: Kubectl, line: str, overlay: Path, *, timeout: float = 90) -> Result:
    """One documented line (`kubectl ...`, maybe piped into another `kubectl ...`) with
    the kit's kubectl, the test overlay standing for `my-gpuplace`; each part may run for
    `timeout` seconds."""
    stdin: str | None = None
    result: Result | None = None
    for part in line.split("|"):
        argv = shlex.split(part)
        assert argv[0] == "kubectl", line
        args = [str(overlay) if arg == "my-gpuplace" else arg for arg in argv[1:]]
        result = kubectl.run(*args, input=stdin, timeout=timeout)
        stdin = result.out
    assert result is not None
    return result


def install(cluster: Cluster, workdir: Path) -> Installation:
    """README's install on `cluster`, then serve and the scheduler started (see above)."""
    kubectl = cluster.kubectl(workdir)
    ports = Ports()
    directory = overlay(workdir, ports.webhook)
    lines = install_sequence.documented()
    assert len(lines) == len(STEPS), lines
    steps = {STEPS[0]: play(kubectl, lines[0], directory)}
    steps[STEPS[1]] = play(kubectl, lines[1], directory)
    rendered = [
        item for item in yaml.safe_load_all(kubectl.run("kustomize", str(directory)).out) if item
    ]
    found = kubectl.run("get", "-k", str(directory), "--ignore-not-found", "-o", "name").out
    stored = [name for name in found.split() if name != f"namespace/{NAMESPACE}"]
    steps[STEPS[2]] = play(kubectl, lines[2], directory)
    tls = workdir / "tls"
    certs = subprocess.run(
        [
            GPUPLACE,
            "certs",
            "rotate",
            "--secret=gpuplace-webhook-tls",
            "--inject",
            "--ip-address=127.0.0.1",
            f"--out-dir={tls}",
            f"--kubeconfig={cluster.kubeconfig}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    steps["certs"] = Result(("certs",), certs.returncode, certs.stdout, certs.stderr).check()
    installation = Installation(
        cluster, kubectl, workdir, directory, ports, steps, stored, rendered
    )
    installation.serve = serve_process(installation)
    installation.scheduler = scheduler_process(installation)
    return installation


DRA_DAEMONSET = "gpuplace-node-agent-dra"


def dra_overlay(installation: Installation) -> Path:
    """The install's test overlay plus the shipped DRA component, as a user adds it to
    their overlay; its DaemonSet kept off every node as the test overlay keeps the other
    (no image here: the agent runs as a host process)."""
    directory = installation.workdir / "overlay-dra"
    directory.mkdir(exist_ok=True)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["../overlay"],
        "components": ["../overlay/shipped/components/dra"],
        "patches": [
            {
                "target": {"kind": "DaemonSet", "name": DRA_DAEMONSET},
                "patch": json.dumps(
                    [
                        {
                            "op": "add",
                            "path": "/spec/template/spec/nodeSelector/"
                            + NO_IMAGE_LABEL.replace("/", "~1"),
                            "value": "true",
                        }
                    ]
                ),
            }
        ],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


def serve_process(
    installation: Installation,
    *,
    queues: bool = False,
    flags: Mapping[str, str] | None = None,
    rendered: list[dict[str, Any]] | None = None,
) -> HostProcess:
    """`gpuplace serve` with the Deployment's arguments, as ServiceAccount gpuplace; with
    `queues`, plus `--queues=true` (the queue controller: on by default in `gpuplace serve`,
    so the Deployment runs it too; named so that the queue tests do not rest on a default);
    `flags` set more (the throughput bench's `--plan-pin`); `rendered`: the Deployment of
    another rendering (the DRA component's, `dra_overlay`) instead of the install's."""
    box = container(rendered or installation.rendered, "Deployment", "gpuplace", "gpuplace")
    ports, tls = installation.ports, installation.workdir / "tls"
    kubeconfig = installation.sa_kubeconfig(NAMESPACE, "gpuplace")
    args = with_flags(
        box["args"],
        {
            "--webhook-address": "127.0.0.1",
            "--webhook-port": str(ports.webhook),
            "--extender-port": str(ports.extender),
            "--metrics-address": "127.0.0.1",
            "--metrics-port": str(ports.metrics),
            "--cert-file": str(tls / "tls.crt"),
            "--key-file": str(tls / "tls.key"),
            "--kubeconfig": str(kubeconfig),
            **({"--queues": "true"} if queues else {}),
            **(flags or {}),
        },
    )
    return HostProcess(
        "gpuplace serve" + (" --queues" if queues else ""),
        [GPUPLACE, *args],
        installation.workdir / ("serve-queues.log" if queues else "serve.log"),
        ready_url=f"http://127.0.0.1:{ports.metrics}/readyz",
    )


def scheduler_process(installation: Installation) -> HostProcess:
    """The stock kube-scheduler with the shipped configuration, as gpuplace-scheduler."""
    kubectl, workdir, ports = installation.kubectl, installation.workdir, installation.ports
    kubectl.watch(
        ["secrets", "-n", NAMESPACE, "--field-selector", "metadata.name=gpuplace-scheduler-token"],
        lambda seen: any("token" in (obj.get("data") or {}) for obj in seen.values()),
        what="the token controller to fill gpuplace-scheduler-token",
    )
    secret = kubectl.json("-n", NAMESPACE, "get", "secret", "gpuplace-scheduler-token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    kubeconfig = installation.cluster.kubeconfig_for(
        workdir / "gpuplace-scheduler.kubeconfig", "gpuplace-scheduler", token
    )
    config_map = next(
        item
        for item in installation.rendered
        if item["kind"] == "ConfigMap"
        and item["metadata"]["name"].startswith("gpuplace-scheduler-config")
    )
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    config["clientConnection"]["kubeconfig"] = str(kubeconfig)
    for extender in config["extenders"]:
        extender["urlPrefix"] = f"http://127.0.0.1:{ports.extender}"
    config_file = workdir / "kube-scheduler-config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    box = container(installation.rendered, "Deployment", "gpuplace", "kube-scheduler")
    command = with_flags(
        box["command"][1:],
        {
            "--config": str(config_file),
            "--bind-address": "127.0.0.1",
            "--secure-port": str(ports.scheduler),
            # in a pod: the in-cluster identity; here the same token, named
            "--authentication-kubeconfig": str(kubeconfig),
            "--authorization-kubeconfig": str(kubeconfig),
        },
    )
    return HostProcess(
        "kube-scheduler (gpuplace profile)",
        [str(installation.cluster.bin_dir / "kube-scheduler"), *command],
        workdir / "kube-scheduler.log",
    )


def wait_leading(installation: Installation, timeout: float = 120) -> None:
    """Until the tier's kube-scheduler holds the Lease gpuplace/gpuplace-scheduler (its
    identity starts with this host's name, as the sidecar's gang controller expects)."""
    prefix = socket.gethostname() + "_"
    installation.kubectl.watch(
        ["leases", "-n", NAMESPACE, "--field-selector", f"metadata.name={LEASE}"],
        lambda seen: any(
            str((obj.get("spec") or {}).get("holderIdentity") or "").startswith(prefix)
            for obj in seen.values()
        ),
        timeout=timeout,
        what=f"kube-scheduler to hold the Lease {NAMESPACE}/{LEASE}",
    )


AGENT_NAMESPACE = "kube-system"
AGENT_ACCOUNT = "gpuplace-node-agent"
MPS_STANDIN = ROOT / "tests" / "agent" / "mps_standin.py"
"""The tests' stand-in for NVIDIA's `nvidia-cuda-mps-control` (no GPU, no driver here)."""


def node_agent_process(
    installation: Installation,
    node: str,
    replay: Path,
    device_plugin_dir: Path,
    port: int,
    *,
    daemonset: str = "gpuplace-node-agent",
    account: str = AGENT_ACCOUNT,
    rendered: list[dict[str, Any]] | None = None,
    flags: dict[str, str | None] | None = None,
) -> tuple[HostProcess, Path]:
    """`gpuplace node-agent` with the DaemonSet's arguments on `node`, NVML replayed from
    `replay` and MPS played by the stand-in; as ServiceAccount kube-system/
    gpuplace-node-agent with a token bound to the Node, which carries the node's name
    (`authentication.kubernetes.io/node-name`) as the DaemonSet's pod-bound token does.
    Another DaemonSet of `rendered` (the DRA one) runs as its own `account`, with `flags`
    on top. Returns the process and its MPS root (a new directory; the caller removes
    it)."""
    box = container(rendered or installation.rendered, "DaemonSet", daemonset, "node-agent")
    kubeconfig = installation.sa_kubeconfig(AGENT_NAMESPACE, account, kind="Node", name=node)
    # pipe directories are <root>/<UUID>/pipe and unix socket paths are short: not tmp_path
    mps = Path(tempfile.mkdtemp(prefix="gpuplace-rc-mps-"))
    args = with_flags(
        box["args"],
        {
            "--node-name": node,  # the DaemonSet: env GPUPLACE_NODE_NAME from spec.nodeName
            "--kubeconfig": str(kubeconfig),
            "--nvml-replay": str(replay),
            "--device-plugin-dir": str(device_plugin_dir),
            "--mps-root": str(mps),
            "--mps-control": f"{sys.executable} {MPS_STANDIN}",
            "--metrics-address": "127.0.0.1",
            "--metrics-port": str(port),
            # the operator's choice, so that the tier evicts through the Eviction API as the
            # agent's own ServiceAccount under the shipped RBAC (issue 43); only a pod whose
            # processes exceed its grant is ever evicted, and only the over-grant test's do
            "--evict-over-grant": "true",
            "--usage-seconds": "2",
            **(flags or {}),
        },
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUPLACE_")}
    env.update((item["name"], item["value"]) for item in box.get("env", []) if "value" in item)
    agent = HostProcess(
        f"gpuplace node-agent ({daemonset})",
        [GPUPLACE, *args],
        installation.workdir / f"{daemonset}.log",
        env=env,
        ready_url=f"http://127.0.0.1:{port}/readyz",
    )
    return agent, mps
