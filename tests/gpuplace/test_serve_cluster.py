"""`gpuplace serve` against an API server (the local wire-format one, through a kubeconfig
file): the composed process — webhook, extender sidecar, gang controller, ops — in
process and as a real subprocess. The local API enforces the RBAC deploy/ ships and the
sidecar presents the gpuplace ServiceAccount's token, as in a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from gpuplace.cluster import keys
from gpuplace.cluster.gang_marks import plan_mark
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.wiring import composing
from gpuplace.wiring.settings import Settings
from tests.webhook import helpers


@pytest.fixture
def tls(tmp_path: Path) -> tuple[Path, Path]:
    return helpers.write_certificate(tmp_path / "tls")


def settings(tls: tuple[Path, Path], tmp_path: Path, kubeconfig: Path, **values: Any) -> Settings:
    base: dict[str, Any] = {
        "webhook_address": "127.0.0.1",
        "webhook_port": 0,
        "extender_port": 0,
        "metrics_address": "127.0.0.1",
        "metrics_port": 0,
        "cert_file": tls[0],
        "key_file": tls[1],
        "audit_log": str(tmp_path / "audit.jsonl"),
        "kubeconfig": kubeconfig,
        "gc_freeze_seconds": 0.0,
        "node_status_min_interval_seconds": 0.0,
    }
    base.update(values)
    return Settings(**base)


def member(name: str, gang: str, size: int) -> dict[str, Any]:
    """A gang member as the mutating webhook stores it: 2 whole GPUs, label, gate."""
    return objects.pod(
        name,
        percent=None,
        count=2,
        annotations={keys.GANG_NAME: gang, keys.GANG_SIZE: str(size)},
        labels={keys.GANG_LABEL: gang},
        gates=[keys.GANG_GATE],
    )


def scheduler_lease(holder: str) -> dict[str, Any]:
    """kube-scheduler's leader-election Lease as it keeps it (identity `<hostname>_<uuid>`)."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "gpuplace-scheduler", "namespace": "gpuplace"},
        "spec": {
            "holderIdentity": f"{holder}_0a7c3e2d-5f1b-4c8e-9d6a-2b4f8e1c7a90",
            "leaseDurationSeconds": 15,
            "acquireTime": stamp,
            "renewTime": stamp,
            "leaseTransitions": 0,
        },
    }


def enforcing(edit: Any = None) -> localapi.FakeApi:
    """A local API that authenticates and enforces the shipped RBAC (edited by `edit`)."""
    return localapi.FakeApi(access=localapi.Access.shipped(edit=edit))


def without_lease_rule(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The shipped manifests as they were before issue 18: no Lease read for gpuplace."""
    return [o for o in objects if o["metadata"]["name"] != "gpuplace-read-scheduler-lease"]


async def two_nodes_led_here(
    api_server: localapi.Server, tls: tuple[Path, Path], tmp_path: Path
) -> composing.Process:
    """Two 4-GPU nodes, this pod's kube-scheduler holding the Lease, and `gpuplace serve`
    composed with the gpuplace ServiceAccount's kubeconfig."""
    for i in range(2):
        api_server.api.create(objects.node(f"gpu-{i}", gpus=4))
    api_server.api.create(scheduler_lease(socket.gethostname()))
    kubeconfig = api_server.kubeconfig(tmp_path / "kubeconfig", localapi.GPUPLACE)
    return await composing.compose(settings(tls, tmp_path, kubeconfig), CollectorRegistry())


def gated(api: localapi.FakeApi) -> list[bool]:
    return [bool(pod["spec"].get("schedulingGates")) for pod in api.objects("pods")]


@contextlib.asynccontextmanager
async def started(process: composing.Process) -> AsyncIterator[aiohttp.ClientSession]:
    stop = asyncio.Event()
    task = asyncio.create_task(process.server.run(stop))
    try:
        await asyncio.wait_for(process.server.started.wait(), 10)
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{process.server.port('ops')}/readyz"
            for _ in range(200):
                async with session.get(url) as response:
                    if response.status == 200:
                        break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("gpuplace serve did not become ready")
            yield session
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_serve_runs_the_gang_controller_which_ungates_a_complete_gang(
    tls: tuple[Path, Path], tmp_path: Path
) -> None:
    async with localapi.serve(enforcing()) as api_server:
        api = api_server.api
        process = await two_nodes_led_here(api_server, tls, tmp_path)
        sidecar = process.sidecar
        assert sidecar is not None and sidecar.gangs is not None
        async with started(process) as session:
            # an incomplete gang stays gated and holds nothing
            for i in range(3):
                api.create(member(f"w{i}", "train", 4))
            await asyncio.sleep(0.5)
            assert all(pod["spec"].get("schedulingGates") for pod in api.objects("pods"))
            assert len(sidecar.sync.ledger) == 0
            api.create(member("w3", "train", 4))
            deadline = time.monotonic() + 10
            while any(pod["spec"].get("schedulingGates") for pod in api.objects("pods")):
                assert time.monotonic() < deadline, "the gang was not ungated"
                await asyncio.sleep(0.05)
            pods = api.objects("pods")
            marks = [plan_mark(pod) for pod in pods]
            assert len({mark.id for mark in marks if mark is not None}) == 1
            nodes = {pod["metadata"]["annotations"][keys.ASSIGNED_NODE] for pod in pods}
            assert nodes == {"gpu-0", "gpu-1"}  # 4 × 2 GPUs on two 4-GPU nodes
            # kube-scheduler's part: each ungated member goes through filter and bind
            extender = f"http://127.0.0.1:{process.server.port('extender')}"
            for pod in pods:
                body = {"Pod": pod, "NodeNames": ["gpu-0", "gpu-1"], "Nodes": None}
                async with session.post(f"{extender}/filter", json=body) as response:
                    passed = (await response.json())["NodeNames"]
                planned_node = pod["metadata"]["annotations"][keys.ASSIGNED_NODE]
                assert passed == [planned_node]
                bind = {
                    "PodName": pod["metadata"]["name"],
                    "PodNamespace": "default",
                    "PodUID": pod["metadata"]["uid"],
                    "Node": planned_node,
                }
                async with session.post(f"{extender}/bind", json=bind) as response:
                    assert (await response.json())["Error"] == ""
            bound = sorted(pod["spec"]["nodeName"] for pod in api.objects("pods"))
            assert bound == ["gpu-0", "gpu-0", "gpu-1", "gpu-1"]
        # every call was the sidecar's own, under the shipped RBAC, and none was refused
        assert {call.user for call in api.calls} == {localapi.GPUPLACE.name}
        assert sidecar.api.refusals.in_force() == []


async def test_without_the_lease_rule_no_gang_starts_and_gpuplace_says_why(
    tls: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 18, as a real cluster showed it: RBAC without `get` on the scheduler's Lease.
    The gang stays gated (the controller never leads) — and now that is loud: an ERROR
    naming verb and resource, the refusal metric and an Event on each waiting member that
    names the missing rule; /readyz stays ready, since every pod that is not in a gang is
    still admitted and bound."""
    async with localapi.serve(enforcing(without_lease_rule)) as api_server:
        api = api_server.api
        process = await two_nodes_led_here(api_server, tls, tmp_path)
        stop = asyncio.Event()
        with caplog.at_level(logging.INFO):
            task = asyncio.create_task(process.server.run(stop))
            try:
                await asyncio.wait_for(process.server.started.wait(), 10)
                for i in range(4):
                    api.create(member(f"w{i}", "train", 4))
                deadline = time.monotonic() + 10
                while len(blocked_events(api)) < 4:
                    assert time.monotonic() < deadline, "no Event on the waiting members"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)
                assert gated(api) == [True] * 4
                ops = f"http://127.0.0.1:{process.server.port('ops')}"
                async with aiohttp.ClientSession() as session:
                    async with session.get(f"{ops}/readyz") as response:
                        assert response.status == 200
                    async with session.get(f"{ops}/metrics") as response:
                        metrics = await response.text()
            finally:
                stop.set()
                await asyncio.wait_for(task, 10)
    assert (
        'gpuplace_api_refusals_total{code="403",resource="leases.coordination.k8s.io",'
        'verb="get"}' in metrics
    )
    assert "gpuplace_gang_members_gated 4.0" in metrics
    assert "gpuplace_gangs_waiting 1.0" in metrics
    assert "gpuplace_gang_controller_leading 0.0" in metrics
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [(r.verb, r.resource, r.code) for r in errors] == [  # type: ignore[attr-defined]
        ("get", "leases.coordination.k8s.io", 403)
    ]
    message = blocked_events(api)[0]["message"]
    assert "get on leases.coordination.k8s.io gpuplace-scheduler" in message
    assert "gpuplace-read-scheduler-lease" in message
    assert api_server.token(localapi.GPUPLACE) not in caplog.text


def blocked_events(api: localapi.FakeApi) -> list[dict[str, Any]]:
    return [e for e in api.objects("events") if e.get("reason") == "GangControllerBlocked"]


async def test_gangs_false_runs_no_gang_controller(tls: tuple[Path, Path], tmp_path: Path) -> None:
    async with localapi.serve(enforcing()) as api_server:
        api_server.api.create(objects.node("gpu-0", gpus=4))
        api_server.api.create(scheduler_lease(socket.gethostname()))
        kubeconfig = api_server.kubeconfig(tmp_path / "kubeconfig", localapi.GPUPLACE)
        process = await composing.compose(
            settings(tls, tmp_path, kubeconfig, gangs=False), CollectorRegistry()
        )
        assert process.sidecar is not None and process.sidecar.gangs is None
        async with started(process):
            api_server.api.create(member("w0", "pair", 2))
            api_server.api.create(member("w1", "pair", 2))
            await asyncio.sleep(0.5)
            assert gated(api_server.api) == [True, True]


@pytest.mark.parametrize("lease", ["another-pod", None])
async def test_a_replica_whose_scheduler_does_not_lead_plans_no_gang(
    tls: tuple[Path, Path], tmp_path: Path, lease: str | None
) -> None:
    async with localapi.serve(enforcing()) as api_server:
        api = api_server.api
        api.create(objects.node("gpu-0", gpus=4))
        if lease is not None:
            api.create(scheduler_lease(lease))
        kubeconfig = api_server.kubeconfig(tmp_path / "kubeconfig", localapi.GPUPLACE)
        process = await composing.compose(settings(tls, tmp_path, kubeconfig), CollectorRegistry())
        async with started(process):
            api.create(member("w0", "pair", 2))
            api.create(member("w1", "pair", 2))
            await asyncio.sleep(0.6)
            assert gated(api) == [True, True]
            assert process.sidecar is not None and len(process.sidecar.sync.ledger) == 0


async def test_without_a_scheduler_lease_setting_a_single_replica_always_plans(
    tls: tuple[Path, Path], tmp_path: Path
) -> None:
    async with localapi.serve(enforcing()) as api_server:
        api = api_server.api
        api.create(objects.node("gpu-0", gpus=4))
        kubeconfig = api_server.kubeconfig(tmp_path / "kubeconfig", localapi.GPUPLACE)
        config = settings(tls, tmp_path, kubeconfig, scheduler_lease="")
        process = await composing.compose(config, CollectorRegistry())
        async with started(process):
            api.create(member("w0", "pair", 2))
            api.create(member("w1", "pair", 2))
            deadline = time.monotonic() + 10
            while any(gated(api)):
                assert time.monotonic() < deadline, "the gang was not ungated"
                await asyncio.sleep(0.05)


# --- as a process ----------------------------------------------------------------------------


@contextlib.contextmanager
def threaded_api() -> Iterator[localapi.ThreadedServer]:
    with localapi.serve_in_thread(enforcing()) as server:
        yield server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _http(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def test_gpuplace_serve_process_against_the_api(tls: tuple[Path, Path], tmp_path: Path) -> None:
    with threaded_api() as api_server:
        api_server.call(lambda: api_server.api.create(objects.node("gpu-0", gpus=2)))
        api_server.call(lambda: api_server.api.create(objects.node("cpu-0", gpus=0, enabled=False)))
        kubeconfig = api_server.server.kubeconfig(tmp_path / "kubeconfig", localapi.GPUPLACE)
        webhook, extender, ops = _free_port(), _free_port(), _free_port()
        command = [
            sys.executable,
            "-m",
            "gpuplace.cli",
            "serve",
            "--kubeconfig",
            str(kubeconfig),
            "--cert-file",
            str(tls[0]),
            "--key-file",
            str(tls[1]),
            "--webhook-address",
            "127.0.0.1",
            "--webhook-port",
            str(webhook),
            "--extender-port",
            str(extender),
            "--metrics-address",
            "127.0.0.1",
            "--metrics-port",
            str(ops),
            "--audit-log",
            str(tmp_path / "audit.jsonl"),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPLACE_")}
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=helpers.REPO
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    status, _ = _http("GET", f"http://127.0.0.1:{ops}/readyz")
                    if status == 200:
                        break
                except OSError:
                    pass
                assert process.poll() is None, process.stderr.read() if process.stderr else ""
                assert time.monotonic() < deadline, "gpuplace serve did not become ready"
                time.sleep(0.1)
            pod = api_server.call(
                lambda: api_server.api.create(objects.pod("share", percent=50, memory="8Gi"))
            )
            status, verdict = _http(
                "POST",
                f"http://127.0.0.1:{extender}/filter",
                {"Pod": pod, "NodeNames": ["gpu-0", "cpu-0"], "Nodes": None},
            )
            assert status == 200, verdict
            assert verdict["NodeNames"] == ["gpu-0"]
            # a node passed: kube-scheduler reads no failed node, and none is listed
            assert verdict["FailedNodes"] == verdict["FailedAndUnresolvableNodes"] == {}
            status, verdict = _http(
                "POST",
                f"http://127.0.0.1:{extender}/filter",
                {"Pod": pod, "NodeNames": ["cpu-0"], "Nodes": None},
            )
            assert status == 200 and verdict["NodeNames"] == [], verdict
            assert set(verdict["FailedNodes"]) | set(verdict["FailedAndUnresolvableNodes"]) == {
                "cpu-0"
            }
            status, scores = _http(
                "POST",
                f"http://127.0.0.1:{extender}/prioritize",
                {"Pod": pod, "NodeNames": ["gpu-0"], "Nodes": None},
            )
            assert status == 200 and scores == [{"Host": "gpu-0", "Score": 10}]
            # the sidecar advertised the node's GPU totals on its status
            node = api_server.call(lambda: api_server.api.get("nodes", "gpu-0"))
            allocatable = node["status"]["allocatable"]
            assert allocatable[keys.RESOURCE_PERCENT] == "200"
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=15)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert process.returncode == 0, stderr.decode()
    messages = [json.loads(line)["message"] for line in stderr.decode().splitlines()]
    assert "cluster state synced" in messages and "stopped" in messages
