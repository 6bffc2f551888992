"""A running sidecar (informers, ledger, extender app on 127.0.0.1) against the fake API."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from gpuplace.cluster import connecting, kube
from gpuplace.dev import localapi
from gpuplace.usage.gpu_loads import LoadReader
from gpuplace.wiring.settings import SidecarSettings
from gpuplace.wiring.sidecar import Sidecar
from tests.cluster.conftest import eventually


def settings(**overrides: Any) -> SidecarSettings:
    values: dict[str, Any] = {
        "workload_refresh_seconds": 0.01,
        "reap_interval_seconds": 3600.0,
        "node_status_min_interval_seconds": 0.0,
        "sync_wait_seconds": 2.0,
        "kube_timeout_seconds": 5.0,
        "watch_timeout_seconds": 30,
        "list_page_size": 50,
        "gc_freeze_seconds": 0.0,
    }
    values.update(overrides)
    return SidecarSettings(**values)


class Unschedulable(AssertionError):
    """No node passed filter."""


class NoLongerFits(AssertionError):
    """bind refused the node filter had passed: something took its GPUs in between (a
    race kube-scheduler answers by trying the pod again later)."""


@dataclass
class Harness:
    """A fake API server, a sidecar running against it and an HTTP session to its verbs."""

    server: localapi.Server
    sidecar: Sidecar
    url: str
    session: aiohttp.ClientSession

    @property
    def api(self) -> localapi.FakeApi:
        return self.server.api

    async def post(self, verb: str, body: Any) -> tuple[int, Any]:
        async with self.session.post(f"{self.url}/{verb}", json=body) as response:
            text = await response.text()
            try:
                return response.status, await response.json(content_type=None)
            except ValueError:
                return response.status, text

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.api.get("pods", name, namespace)

    async def filter(self, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
        status, body = await self.post("filter", {"Pod": pod, "NodeNames": names, "Nodes": None})
        assert status == 200, body
        assert isinstance(body, dict)
        return body

    async def prioritize(self, pod: dict[str, Any], names: list[str]) -> dict[str, int]:
        """Each of `names` with the score kube-scheduler adds to it: the answer's, or 0
        for a node the answer leaves out."""
        status, body = await self.post("prioritize", {"Pod": pod, "NodeNames": names})
        assert status == 200, body
        return scored(body, names)

    async def bind(self, pod: dict[str, Any], node: str) -> str:
        metadata = pod["metadata"]
        status, body = await self.post(
            "bind",
            {
                "PodName": metadata["name"],
                "PodNamespace": metadata["namespace"],
                "PodUID": metadata["uid"],
                "Node": node,
            },
        )
        assert status == 200, body
        return str(body["Error"])

    async def schedule(
        self,
        pod: dict[str, Any],
        rng: random.Random | None = None,
        names: list[str] | None = None,
    ) -> str:
        """What kube-scheduler does with the shipped profile: filter; one node passed:
        bind it (kube-scheduler skips scoring); several (a policy's tie): its own plugin
        scores pick one (drawn from `rng` here; the profile has no prioritizeVerb); bind.
        `names`: the nodes its own filters passed (default: every node). Returns the node,
        or raises AssertionError with filter's reasons when none fits."""
        rng = rng or random.Random(0)
        names = sorted(self.sidecar.sync.nodes) if names is None else names
        verdict = await self.filter(pod, names)
        passed = verdict["NodeNames"]
        if not passed:
            raise Unschedulable(str(verdict))
        node = str(passed[0] if len(passed) == 1 else rng.choice(passed))
        error = await self.bind(pod, node)
        if error:
            raise NoLongerFits(error) if "no longer fits" in error else AssertionError(error)
        return node

    async def synced(self, check: Callable[[], bool], timeout: float = 5.0) -> None:
        await eventually(check, timeout)


@contextlib.asynccontextmanager
async def harness(
    server: localapi.Server,
    *,
    clock: Callable[[], float] | None = None,
    load_reader: Callable[[], LoadReader] | None = None,
    load_clock: Callable[[], float] | None = None,
    **overrides: Any,
) -> AsyncIterator[Harness]:
    """A sidecar with `settings(**overrides)`; `clock` times its workload refresh,
    `load_reader` makes its reader of GPU loads (`--load-aware`), `load_clock` their age."""
    api = kube.Kube(connecting.client_for(server.configuration(localapi.GPUPLACE)), timeout=5.0)
    extra: dict[str, Any] = {"clock": clock} if clock is not None else {}
    if load_reader is not None:
        extra["load_reader"] = load_reader
    if load_clock is not None:
        extra["load_clock"] = load_clock
    sidecar = Sidecar(
        settings(**overrides), CollectorRegistry(), api, rng=random.Random(7), **extra
    )
    async with sidecar.running():
        runner = web.AppRunner(sidecar.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                yield Harness(server, sidecar, f"http://127.0.0.1:{port}", session)
        finally:
            await runner.cleanup()


@pytest.fixture
async def server() -> AsyncIterator[localapi.Server]:
    async with localapi.serve(
        localapi.FakeApi(bookmark_interval=0.2, access=localapi.Access.shipped())
    ) as running:
        yield running


def scored(answer: Any, names: list[str]) -> dict[str, int]:
    """prioritize's `answer` as kube-scheduler reads it for `names`: each listed host's
    score (1-10: zeros are left out), 0 for the others. Asserts the answer lists only
    those nodes, each at most once."""
    assert isinstance(answer, list), answer
    listed = {entry["Host"]: entry["Score"] for entry in answer}
    assert len(listed) == len(answer) and listed.keys() <= set(names), answer
    assert all(1 <= score <= 10 for score in listed.values()), answer
    return {name: listed.get(name, 0) for name in names}
