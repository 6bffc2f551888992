"""Fixtures: a fake API server on 127.0.0.1 and a `gpuplace.cluster.kube.Kube` talking to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from gpuplace.cluster import connecting, kube
from gpuplace.dev import localapi


@pytest.fixture
async def server() -> AsyncIterator[localapi.Server]:
    async with localapi.serve(
        localapi.FakeApi(bookmark_interval=0.05, access=localapi.Access.shipped())
    ) as running:
        yield running


@pytest.fixture
async def api(server: localapi.Server) -> AsyncIterator[kube.Kube]:
    connection = kube.Kube(
        connecting.client_for(server.configuration(localapi.GPUPLACE)), timeout=5.0
    )
    try:
        yield connection
    finally:
        await connection.close()


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until `check()` holds (polling the loop), or fail after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.01)
