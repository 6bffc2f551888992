"""Informers against the fake API server: list then watch, resume after a dropped watch
without relisting, relist on 410 (HTTP or ERROR event), back off on failures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpuplace.cluster import kube, watching
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from tests.cluster.conftest import eventually

FAST = watching.Backoff(first=0.01, cap=0.05)


class Recording:
    """A handler that mirrors what it is told, by UID, and counts replaces."""

    def __init__(self) -> None:
        self.state: dict[str, dict[str, Any]] = {}
        self.replaces = 0

    def replace(self, objects: list[dict[str, Any]]) -> None:
        self.replaces += 1
        self.state = {obj["metadata"]["uid"]: obj for obj in objects}

    def upsert(self, obj: dict[str, Any]) -> None:
        self.state[obj["metadata"]["uid"]] = obj

    def delete(self, obj: dict[str, Any]) -> None:
        self.state.pop(obj["metadata"]["uid"], None)

    def names(self) -> set[str]:
        return {obj["metadata"]["name"] for obj in self.state.values()}


@contextlib.asynccontextmanager
async def running(
    api: kube.Kube, kind: kube.Kind = "pods", selector: str = ""
) -> AsyncIterator[tuple[watching.Informer[dict[str, Any]], Recording]]:
    handler = Recording()
    informer: watching.Informer[dict[str, Any]] = watching.Informer(
        api, kind, handler, lambda raw: raw, label_selector=selector, page_size=2, backoff=FAST
    )
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 5)
        yield informer, handler
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def truth(server: localapi.Server, selector_managed: bool = True) -> set[str]:
    return {
        pod["metadata"]["name"]
        for pod in server.api.objects("pods")
        if not selector_managed or pod["metadata"]["labels"].get("gpuplace.io/managed") == "true"
    }


async def test_lists_in_pages_then_follows_changes(server: localapi.Server, api: kube.Kube) -> None:
    for index in range(5):
        server.api.create(objects.pod(f"p{index}", managed=index != 4))
    async with running(api, selector="gpuplace.io/managed=true") as (informer, handler):
        assert handler.names() == {"p0", "p1", "p2", "p3"}
        lists = [c for c in server.api.calls_to("GET", "/api/v1/pods$") if "watch" not in c.query]
        assert len(lists) == 2  # two pages of two
        server.api.create(objects.pod("new"))
        server.api.delete("pods", "p0", "default")
        server.api.patch(
            "pods", "p4", {"metadata": {"labels": {"gpuplace.io/managed": "true"}}}, "default"
        )
        server.api.patch(
            "pods", "p1", {"metadata": {"labels": {"gpuplace.io/managed": "no"}}}, "default"
        )
        await eventually(lambda: handler.names() == truth(server))
        assert handler.replaces == 1
        assert set(informer.objects) == set(handler.state)


@pytest.mark.parametrize("abort", [False, True])
async def test_dropped_watch_resumes_from_last_version_without_relist(
    server: localapi.Server, api: kube.Kube, abort: bool
) -> None:
    server.api.create(objects.pod("a"))
    async with running(api) as (informer, handler):
        await eventually(lambda: server.api.open_watches == 1)
        seen = informer.resource_version
        server.api.drop_watches(abort=abort)
        server.api.create(objects.pod("b"))
        server.api.delete("pods", "a", "default")
        await eventually(lambda: handler.names() == {"b"})
        watches = [call for call in server.api.calls if call.query.get("watch") == "True"]
        assert len(watches) >= 2
        assert watches[1].query["resourceVersion"] == seen
        assert watches[1].query["allowWatchBookmarks"] == "True"
        assert handler.replaces == 1


@pytest.mark.parametrize("as_http", [False, True])
async def test_too_old_version_relists_and_replaces(
    server: localapi.Server, api: kube.Kube, as_http: bool
) -> None:
    server.api.gone_as_http = as_http
    server.api.create(objects.pod("a"))
    server.api.create(objects.pod("b"))
    async with running(api) as (_, handler):
        await eventually(lambda: server.api.open_watches == 1)
        server.api.fail("GET", "/api/v1/pods$", 0, delay=0.3)  # the resumed watch is slow...
        server.api.drop_watches()
        server.api.delete("pods", "a", "default")  # ... while history moves on
        server.api.create(objects.pod("c"))
        server.api.compact()
        await eventually(lambda: handler.replaces == 2)
        assert handler.names() == {"b", "c"}
        server.api.create(objects.pod("d"))
        await eventually(lambda: handler.names() == {"b", "c", "d"})


async def test_error_event_410_on_open_watch_relists(
    server: localapi.Server, api: kube.Kube
) -> None:
    server.api.create(objects.pod("a"))
    async with running(api) as (_, handler):
        await eventually(lambda: server.api.open_watches == 1)
        server.api.expire_watches()
        await eventually(lambda: handler.replaces == 2)
        assert handler.names() == {"a"}


async def test_bookmarks_advance_the_resume_point(server: localapi.Server, api: kube.Kube) -> None:
    server.api.create(objects.pod("a"))
    async with running(api, selector="gpuplace.io/managed=true") as (informer, handler):
        before = informer.resource_version
        server.api.create(objects.pod("other", managed=False))
        await eventually(lambda: informer.resource_version != before)
        server.api.compact()
        server.api.drop_watches()
        await asyncio.sleep(0.2)
        assert handler.replaces == 1


async def test_failures_back_off_and_recover(server: localapi.Server, api: kube.Kube) -> None:
    server.api.create(objects.node("n0"))
    server.api.fail("GET", "/api/v1/nodes$", 500, times=3)
    async with running(api, "nodes") as (_, handler):
        assert handler.names() == {"n0"}
    assert len(server.api.calls_to("GET", "/api/v1/nodes$")) >= 4


async def test_expired_continue_token_relists(server: localapi.Server, api: kube.Kube) -> None:
    for index in range(5):
        server.api.create(objects.pod(f"p{index}"))
    server.api.fail("GET", "/api/v1/pods$", 0, delay=0.2)
    handler = Recording()
    informer: watching.Informer[dict[str, Any]] = watching.Informer(
        api, "pods", handler, lambda raw: raw, page_size=2, backoff=FAST
    )
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.sleep(0.1)
        server.api.store.expire_continues()
        await asyncio.wait_for(informer.synced.wait(), 5)
        assert len(handler.names()) == 5
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
