"""The session fixtures of real Kubernetes (docs/realcluster.md), shared by every test
folder: `tests/conftest.py` registers this module as a plugin, so that the real-cluster
tier (`tests/realcluster`) and the local API's referee (`tests/dev`, the contract tests
run against the real kube-apiserver too) use one cluster per session.

Each starts at the first test that asks for it, in this order, and stops at the end of
the session whatever happened:

- `control_plane`: `kit.Cluster`, etcd + kube-apiserver + kube-controller-manager +
  kube-scheduler (`cluster.sh up`, ports chosen free, state under pytest's tmp);
- `cluster`: the same `kit.Cluster` with the machine's one kubelet node added
  (`Cluster.add_node`; `node_problem` says why there is none: not root, another kubelet
  runs here);
- `installed`: `install.Installation`, README's install on the control plane (RBAC,
  webhook configurations, admission policies as shipped), nothing running;
- `gpuplace`: the installation with `gpuplace serve` and the gpuplace kube-scheduler
  running (and leading).

The installation from the image (`tests/realcluster/pods.py`, fixture `in_pods` of
`test_image_install.py`) takes the cluster over: the same names in the same namespace, the
machine's one kubelet node. Its tests run last in the session (`pytest_collection_modifyitems`
moves them), and it stops the host processes recorded under `HOST_PROCESSES` first.

Skips: where `../shared/k8s` is absent every test asking for one skips, saying so. Where
the kit is there but unusable (a binary missing, `up` failing) it skips with the reason,
and FAILS under `CI=true`. A test that asks for any of them is marked `realcluster`
(deselect with `-m "not realcluster"`) and gets a timeout of `TIMEOUT` seconds (unless it
names its own), which also covers the session's start; so is a test parametrized with
`REAL` (`real_param`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, NoReturn

import pytest

from tests.realcluster import install, kit
from tests.realcluster.install import Installation
from tests.realcluster.kit import Cluster
from tests.realcluster.processes import HostProcess

TIMEOUT = 600
SESSION_FIXTURES = frozenset({"control_plane", "cluster", "installed", "gpuplace"})
TAKES_OVER = "in_pods"
"""The fixture of the installation from the image, which ends the host-process one."""
HOST_PROCESSES = pytest.StashKey[list[HostProcess]]()
"""The tier's host processes (serve, its kube-scheduler, the node agent), for `in_pods`
to stop before it installs the same components as pods."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SESSION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.realcluster)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TIMEOUT))
    # stable: every other test keeps its place, the takeover's keep their order
    takes_over = [item for item in items if TAKES_OVER in getattr(item, "fixturenames", ())]
    if takes_over:
        items[:] = [item for item in items if item not in takes_over] + takes_over


def host_process(config: pytest.Config, process: HostProcess) -> HostProcess:
    """Record a host process of the tier (see `HOST_PROCESSES`); returns it."""
    config.stash.setdefault(HOST_PROCESSES, []).append(process)
    return process


def real_param(value: Any, *, id: str = "real") -> Any:
    """A `pytest.param` of a test parametrized over servers that is the real one: marked
    and timed as the tier's tests are."""
    return pytest.param(value, id=id, marks=[pytest.mark.realcluster, pytest.mark.timeout(TIMEOUT)])


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def unusable(reason: str) -> NoReturn:
    """The kit is here but cannot serve: skip, or fail under CI=true."""
    message = f"real-cluster tier: {reason}"
    if in_ci():
        pytest.fail(message + " (CI=true: the tier must run)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not kit.KIT.is_dir():
        pytest.skip(f"real-cluster tier: {kit.KIT} absent (../shared beside the checkout)")
    problem = kit.kit_missing()
    if problem is not None:
        unusable(problem)
    state = tmp_path_factory.mktemp("k8s") / "state"
    try:
        started = Cluster.up(state, node=False)
    except kit.ClusterError as error:
        unusable(str(error))
    try:
        yield started
    finally:
        started.down()


@pytest.fixture(scope="session")
def cluster(control_plane: Cluster) -> Cluster:
    if os.geteuid() != 0:
        control_plane.node_problem = "the kubelet node needs root"
    elif control_plane.node_problem is not None:
        control_plane.add_node()
    return control_plane


@pytest.fixture(scope="session")
def installed(
    control_plane: Cluster, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Installation:
    made = install.install(control_plane, tmp_path_factory.mktemp("gpuplace"))
    host_process(request.config, made.serve)
    host_process(request.config, made.scheduler)
    return made


@pytest.fixture(scope="session")
def gpuplace(installed: Installation) -> Iterator[Installation]:
    try:
        installed.serve.start()
        installed.scheduler.start()
        install.wait_leading(installed)
        yield installed
    finally:
        installed.scheduler.stop()
        installed.serve.stop()
