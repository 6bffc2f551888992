"""`gpuplace serve` against hostile callers (issue 30): the composed process on the local
API with the shipped RBAC, probed from outside over its real sockets, as the issue's
probe did. Each test here failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from gpuplace import composing
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from tests.gpuplace.test_serve_cluster import enforcing, settings, started
from tests.webhook import helpers


@pytest.fixture
def tls(tmp_path: Path) -> tuple[Path, Path]:
    return helpers.write_certificate(tmp_path / "tls")


@dataclass
class Running:
    """A started `gpuplace serve`, its local API and a client session."""

    api: localapi.FakeApi
    process: composing.Process
    session: aiohttp.ClientSession

    def url(self, site: str, path: str) -> str:
        scheme = "https" if site == "webhook" else "http"
        return f"{scheme}://127.0.0.1:{self.process.server.port(site)}{path}"

    async def post(self, verb: str, body: Any) -> tuple[int, Any]:
        async with self.session.post(self.url("extender", f"/{verb}"), json=body) as response:
            return response.status, await response.json(content_type=None)


@contextlib.asynccontextmanager
async def serving(
    tls: tuple[Path, Path], tmp_path: Path, nodes: dict[str, int], **values: Any
) -> AsyncIterator[Running]:
    """`gpuplace serve` composed with `values` on a local API holding `nodes` (name →
    GPUs), started and ready."""
    async with localapi.serve(enforcing()) as api_server:
        for name, gpus in nodes.items():
            api_server.api.create(objects.node(name, gpus=gpus))
        kubeconfig = api_server.kubeconfig(tmp_path / "kubeconfig", localapi.GPUPLACE)
        config = settings(tls, tmp_path, kubeconfig, **values)
        process = await composing.compose(config, CollectorRegistry())
        async with started(process) as session:
            yield Running(api_server.api, process, session)


async def bound_pod(running: Running, name: str, node: str, percent: int) -> dict[str, Any]:
    """A pod placed through the extender's own /bind, once the sidecar sees it bound."""
    pod = running.api.create(objects.pod(name, percent=percent))
    bind = {
        "PodName": name,
        "PodNamespace": "default",
        "PodUID": pod["metadata"]["uid"],
        "Node": node,
    }
    assert await running.post("bind", bind) == (200, {"Error": ""})
    sidecar = running.process.sidecar
    assert sidecar is not None
    uid = pod["metadata"]["uid"]
    for _ in range(100):
        record = sidecar.sync.pods.get(uid)
        if record is not None and record.bound:
            return pod
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} was not seen bound")


# --- point 3: one huge preempt call must not freeze the process ----------------------------


@pytest.mark.parametrize(
    ("victims", "values", "status"),
    [
        (100_000, {}, 413),  # the call: over --preempt-max-body-bytes
        (80_000, {"preempt_max_victims": 100_000}, 200),  # worked out, limits lifted
    ],
)
async def test_readyz_and_filter_answer_while_a_huge_preempt_is_in_flight(
    tls: tuple[Path, Path],
    tmp_path: Path,
    victims: int,
    values: dict[str, Any],
    status: int,
) -> None:
    """The issue's probe: /preempt with the pod and tens of thousands of victims on one
    node (its one GPU held, the others holding none) froze every verb and /readyz for
    ~67 s at 100,000 (a list scanned per victim). Now every /readyz and /filter sent
    while it is in flight answers within a second."""
    async with serving(tls, tmp_path, {"gpu-x": 1, "gpu-y": 1}, **values) as running:
        low = await bound_pod(running, "low", "gpu-x", 100)
        high = objects.pod("high", percent=70)
        high["metadata"]["uid"] = "high-uid"
        high["spec"]["priority"] = 1000
        others = (f"{i:08x}-0000-4000-8000-000000000000" for i in range(victims))  # UID-long
        offered = [low["metadata"]["uid"], *others]
        body = {
            "Pod": high,
            "NodeNameToVictims": None,
            "NodeNameToMetaVictims": {
                "gpu-x": {"Pods": [{"UID": uid} for uid in offered], "NumPDBViolations": 0}
            },
        }
        preempt = asyncio.create_task(running.post("preempt", body))
        slowest, probes = 0.0, 0
        while not preempt.done() or probes < 2:
            started = time.perf_counter()
            async with running.session.get(running.url("ops", "/readyz")) as response:
                assert response.status == 200
            filter_args = {"Pod": high, "NodeNames": ["gpu-y"], "Nodes": None}
            assert (await running.post("filter", filter_args))[0] == 200
            slowest = max(slowest, time.perf_counter() - started)
            probes += 1
        answer_status, answer = await preempt
    assert answer_status == status
    if status == 200:
        assert set(answer["NodeNameToMetaVictims"]) == {"gpu-x"}
    assert slowest < 1.0, f"/readyz + /filter took {slowest:.2f} s during the preempt"
