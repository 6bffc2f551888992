"""Fixtures of the real-cluster tier (docs/realcluster.md): real Kubernetes v1.36.2 from
`../shared/k8s`, gpuplace installed as the README says, its processes on this host.

The session ones live in `tests.realcluster.sessions` (registered for every test folder
by `tests/conftest.py`, so that the local API's referee in `tests/dev` shares the
cluster): `control_plane`, `cluster` (plus the one kubelet node), `installed` and
`gpuplace` (`install.Installation`, with `gpuplace serve` and the gpuplace kube-scheduler
running and leading). Here, session-scoped too, `node_agent`: `Agent`, the real node opted
in (GFD-like labels for two H100s), `gpuplace node-agent` registered with its kubelet, NVML
replayed from two GPUs derived from `../shared/fixtures/gpu/nvml-idle.json`.

`kubelet_node` (`KubeletNode`) says which agent serves the node now: the DRA tests
(tests/realcluster/test_dra.py) borrow the node from the device-plugin agent and give it
back.

Per test: `scope` (`Scope`: a namespace and a GPU model of its own, fake nodes and
cluster-scoped objects it made, all removed after it) and `kubectl` (admin, in the test's
tmp dir). `serve` is running at the start of every test (a test that stops it, the outage,
need not restart it).

Skips: where `../shared/k8s` is absent the whole tier skips, saying so. Where the kit is
there but unusable (a binary missing, `up` failing, not root for the kubelet) the tier
skips with the reason, and FAILS under `CI=true`. Every test here is marked `realcluster`
(deselect with `-m "not realcluster"`) and gets a timeout of `TIMEOUT` seconds, which
also covers the session's start on the first test.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.realcluster import install, kit
from tests.realcluster.install import Installation
from tests.realcluster.kit import Cluster, Kubectl
from tests.realcluster.objects import (
    GPU_FIXTURES,
    add_nodes,
    label_real_node,
    real_node_reading,
    wait_agent_devices,
)
from tests.realcluster.processes import HostProcess
from tests.realcluster.sessions import TIMEOUT, host_process, unusable

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.realcluster)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TIMEOUT))


@pytest.fixture
def kubectl(gpuplace: Installation, tmp_path: Path) -> Kubectl:
    """Admin kubectl working in the test's tmp dir (where a test writes pod.yaml)."""
    if not gpuplace.serve.alive:
        gpuplace.serve.start()
    return Kubectl(gpuplace.kubectl.binary, gpuplace.kubectl.kubeconfig, tmp_path)


@dataclass
class Scope:
    """What one test makes on the shared cluster: its namespace, a GPU model no other
    test's nodes have, and the nodes and cluster-scoped objects to remove after it."""

    kubectl: Kubectl
    namespace: str
    model: str
    nodes: list[str] = field(default_factory=list)
    cluster_objects: list[str] = field(default_factory=list)

    def add_nodes(self, *nodes: Mapping[str, Any]) -> None:
        self.nodes += [node["metadata"]["name"] for node in nodes]
        add_nodes(self.kubectl, *nodes)

    def create(self, *objects: Mapping[str, Any]) -> None:
        """`kubectl apply` of the objects; cluster-scoped ones are removed after the test."""
        for obj in objects:
            if "namespace" not in obj["metadata"]:
                self.cluster_objects.append(f"{obj['kind'].lower()}/{obj['metadata']['name']}")
        self.kubectl.apply(*objects)

    def node(self, suffix: str) -> str:
        """A node name of this test."""
        return f"{self.namespace}-{suffix}"

    def close(self) -> None:
        """Remove what the test made: the pods first, waiting (their GPUs go back to the
        ledger and the kubelet as they go; their grace periods are 0-2 s), then the
        namespace without waiting for the namespace controller's sweep of the rest."""
        kubectl, name = self.kubectl, self.namespace
        with contextlib.suppress(subprocess.TimeoutExpired):
            kubectl.run(
                "-n", name, "delete", "pods", "--all", "--wait=true", "--timeout=120s",
                check=False, timeout=150,
            )  # fmt: skip
        kubectl.run("delete", "namespace", name, "--wait=false", check=False)
        for node in self.nodes:
            kubectl.run("delete", "node", node, "--wait=false", check=False)
        for obj in self.cluster_objects:
            kubectl.run("delete", obj, "--wait=false", check=False)

    @classmethod
    def made(cls, kubectl: Kubectl, test: str) -> Scope:
        """A namespace and a GPU model named after `test` (created now)."""
        slug = re.sub(r"[^a-z0-9]+", "-", test.lower().removeprefix("test_"))[:22].strip("-")
        tag = hashlib.sha256(test.encode()).hexdigest()[:4]
        # short enough for `gpuplace explain`'s 40-character columns, with node suffixes
        name = f"rc-{slug}-{tag}"
        kubectl.run("create", "namespace", name)
        return cls(kubectl, name, f"RC-{slug.upper()}-{tag.upper()}")


@pytest.fixture
def scope(kubectl: Kubectl, request: pytest.FixtureRequest) -> Iterator[Scope]:
    made = Scope.made(kubectl, request.node.name)
    try:
        yield made
    finally:
        made.close()


def kubelet_node_reading(cluster: Cluster) -> dict[str, Any]:
    """The NVML reading a node agent replays on the kit's node; the tier cannot run one
    without the node or the GPU fixture (skip, or fail under CI)."""
    if cluster.node_problem is not None:
        unusable(f"no kubelet node: {cluster.node_problem}")
    readings = GPU_FIXTURES / "nvml-idle.json"
    if not readings.is_file():
        unusable(f"GPU fixture {readings} missing")
    return real_node_reading()


@dataclass
class Agent:
    """The node agent on the kit's kubelet node."""

    process: HostProcess
    node: str
    uuids: list[str]
    metrics_url: str
    replay: Path


def derived_replay(workdir: Path) -> tuple[Path, list[str]]:
    """NVML of REAL_NODE_GPUS H100s derived from the captured one (`real_node_reading`),
    written in `workdir`; and their UUIDs."""
    readings = GPU_FIXTURES / "nvml-idle.json"
    if not readings.is_file():
        unusable(f"GPU fixture {readings} missing")
    derived = real_node_reading()
    replay = workdir / "nvml-derived.json"
    replay.write_text(json.dumps(derived))
    return replay, [gpu["uuid"] for gpu in derived["gpus"]]


def offered(kubectl: Kubectl, node: str) -> None:
    """Until the kubelet offers the device plugin's slots and the sidecar its GPUs."""
    wait_agent_devices(kubectl, node)


@dataclass
class KubeletNode:
    """Who serves the kit's one kubelet node: the device-plugin agent (`node_agent`), or,
    while a DRA module runs, its DRA agent. A node is on one path, so `lent()` stops the
    device-plugin agent for the block and brings it back after."""

    agent: Agent | None = None
    kubectl: Kubectl | None = None

    @contextlib.contextmanager
    def lent(self) -> Iterator[None]:
        agent = self.agent
        if agent is None or not agent.process.alive:
            yield
            return
        agent.process.stop()
        try:
            yield
        finally:
            agent.process.start()
            assert self.kubectl is not None
            offered(self.kubectl, agent.node)


@pytest.fixture(scope="session")
def kubelet_node() -> KubeletNode:
    return KubeletNode()


@pytest.fixture(scope="session")
def node_agent(
    cluster: Cluster,
    gpuplace: Installation,
    kubelet_node: KubeletNode,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Agent]:
    kubelet_node_reading(cluster)  # the node and the GPU fixture, or skip (fail under CI)
    workdir = tmp_path_factory.mktemp("agent")
    replay, uuids = derived_replay(workdir)
    node = cluster.node_name
    kubectl = gpuplace.kubectl
    label_real_node(kubectl, node, "gpuplace.io/enabled=true")  # and gpuplace's opt-in
    port = kit.free_port()
    process, mps = install.node_agent_process(
        gpuplace, node, replay, Path(cluster.env["K8S_DEVICE_PLUGIN_DIR"]), port
    )
    host_process(request.config, process)
    try:
        process.start()
        offered(kubectl, node)
        agent = Agent(process, node, uuids, f"http://127.0.0.1:{port}/metrics", replay)
        kubelet_node.agent, kubelet_node.kubectl = agent, kubectl
        yield agent
    finally:
        kubelet_node.agent = None
        process.stop()
        shutil.rmtree(mps, ignore_errors=True)
