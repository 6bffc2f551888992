"""The GpuQueue CRD on a real kube-apiserver (../shared/k8s, v1.36.2; control plane only, no
kubelet, ports of its own so that it runs beside another cluster on the default ones): it
installs, good queues are stored with their defaults, every bad queue of gpuqueue_cases is
refused with the message that says why, the status subresource takes what the controller
reports and spec writes there are ignored, and `kubectl get` shows the printer columns.
Skips, saying why, where ../shared/k8s is absent."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import gpuqueue_cases as cases
from tests.deploy import rendering
from tests.deploy.test_gpuqueue_crd import CRD_NAME

KIT = rendering.ROOT.parent / "shared" / "k8s"
pytestmark = [
    pytest.mark.skipif(
        not (KIT / "cluster.sh").is_file(),
        reason="../shared/k8s (a real kube-apiserver) is absent",
    ),
    pytest.mark.timeout(900),
]


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports() -> dict[str, str]:
    """Free ports for every component (etcd's peer port is its port + 1)."""
    rng = random.Random()
    while True:
        base = rng.randrange(40_000, 60_000, 10)
        wanted = [base, base + 2, base + 3, base + 4, base + 5]
        if all(_free(port) for port in wanted):
            break
    return {
        "K8S_APISERVER_PORT": str(base + 2),
        "K8S_ETCD_PORT": str(base),
        "K8S_SCHEDULER_PORT": str(base + 3),
        "K8S_KCM_PORT": str(base + 4),
    }


@pytest.fixture(scope="module")
def kubectl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """`kubectl` against a fresh control plane with the CRD applied; down afterwards."""
    env = {
        **os.environ,
        **_ports(),
        "K8S_STATE_DIR": str(tmp_path_factory.mktemp("k8s-state")),
        "K8S_CACHE_DIR": str(tmp_path_factory.mktemp("k8s-cache")),
        "K8S_START_KCM": "0",
        "NODES": "none",
    }
    up = subprocess.run(
        [str(KIT / "cluster.sh"), "up"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    try:
        if up.returncode != 0:
            pytest.fail(f"cluster.sh up failed:\n{up.stderr[-3000:]}")
        values = dict(line.split("=", 1) for line in up.stdout.splitlines() if "=" in line)
        command = [
            str(Path(values["K8S_BIN_DIR"]) / "kubectl"),
            "--kubeconfig",
            values["KUBECONFIG"],
        ]
        crd = rendering.one(rendering.render("base"), "CustomResourceDefinition", CRD_NAME)
        run(command, "apply", "-f", "-", stdin=crd)
        run(command, "wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=120s")
        yield command
    finally:
        subprocess.run(
            [str(KIT / "cluster.sh"), "down"],
            env=env,
            capture_output=True,
            timeout=300,
            check=False,
        )


def run(
    command: list[str], *args: str, stdin: Any = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*command, *args],
        input=None if stdin is None else yaml.safe_dump(stdin),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if check and done.returncode != 0:
        pytest.fail(f"kubectl {' '.join(args)} failed:\n{done.stderr}")
    return done


@pytest.mark.parametrize("name", sorted(cases.GOOD))
def test_the_api_server_stores_good_queues(kubectl: list[str], name: str) -> None:
    done = run(
        kubectl, "create", "--dry-run=server", "-o", "json", "-f", "-", stdin=cases.GOOD[name]
    )
    stored = json.loads(done.stdout)
    assert stored["spec"]["queueingStrategy"] in ("BestEffortFIFO", "StrictFIFO")
    assert all(line["model"] for line in stored["spec"]["resources"])  # defaulted to "*"


@pytest.mark.parametrize("name", sorted(cases.BAD))
def test_the_api_server_refuses_bad_queues_saying_why(kubectl: list[str], name: str) -> None:
    case = cases.BAD[name]
    done = run(kubectl, "create", "--dry-run=server", "-f", "-", stdin=case.obj, check=False)
    assert done.returncode != 0, f"{name} was stored"
    assert case.api in done.stderr, done.stderr


def test_status_is_a_subresource_the_controller_writes(kubectl: list[str]) -> None:
    queue = cases.queue("status-check", cohort="research")
    run(kubectl, "create", "-f", "-", stdin=queue)
    report = {
        "status": {
            "admittedWorkloads": 3,
            "waitingWorkloads": 2,
            "waitingPods": 5,
            "weightedShare": 125,
            "pastShare": 340,
            "pastShareTime": "2026-11-27T10:00:00Z",
            "resources": [{"name": "gpus", "model": "*", "used": "9", "borrowed": "1", "lent": 0}],
        },
        "spec": {"weight": "7"},
    }
    run(
        kubectl, "patch", "gpuqueue", "status-check", "--subresource=status", "--type=merge",
        "-p", json.dumps(report),
    )  # fmt: skip
    stored = json.loads(run(kubectl, "get", "gpuqueue", "status-check", "-o", "json").stdout)
    assert stored["status"]["admittedWorkloads"] == 3
    assert stored["status"]["resources"][0]["borrowed"] == "1"
    assert stored["status"]["pastShare"] == 340  # fair sharing over time, read back
    assert stored["status"]["pastShareTime"] == "2026-11-27T10:00:00Z"
    assert stored["spec"]["weight"] == "1"  # spec is not written through status
    table = run(kubectl, "get", "gq", "status-check").stdout.split()
    assert table[:6] == ["NAME", "COHORT", "WEIGHT", "ADMITTED", "WAITING", "SHARE"]
    assert table[7:13] == ["status-check", "research", "1", "3", "2", "125"]
