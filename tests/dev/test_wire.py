"""The fake API server speaks kube-apiserver's wire format to the real kubernetes-asyncio
client: lists, watches (bookmarks, 410), conflicts, bindings, status subresources."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects


@pytest.fixture
async def server() -> AsyncIterator[localapi.Server]:
    async with localapi.serve(localapi.FakeApi(bookmark_interval=0.05)) as running:
        yield running


@pytest.fixture
async def core(server: localapi.Server) -> AsyncIterator[Any]:
    """The generated CoreV1Api (typed Any: its stubs want models where it accepts dicts)."""
    async with client.ApiClient(server.configuration()) as api_client:
        yield client.CoreV1Api(api_client)


async def _json(response: Any) -> Any:
    return json.loads(await response.read())


async def test_list_filters_by_label_and_paginates(server: localapi.Server, core: Any) -> None:
    for index in range(5):
        server.api.create(objects.pod(f"p{index}", managed=index % 2 == 0))
    page = await _json(
        await core.list_pod_for_all_namespaces(
            label_selector="gpuplace.io/managed=true", limit=2, _preload_content=False
        )
    )
    assert page["kind"] == "PodList"
    assert [item["metadata"]["name"] for item in page["items"]] == ["p0", "p2"]
    assert "kind" not in page["items"][0]
    rest = await _json(
        await core.list_pod_for_all_namespaces(
            label_selector="gpuplace.io/managed=true",
            limit=2,
            _continue=page["metadata"]["continue"],
            _preload_content=False,
        )
    )
    assert [item["metadata"]["name"] for item in rest["items"]] == ["p4"]
    assert rest["metadata"]["resourceVersion"] == page["metadata"]["resourceVersion"]
    assert "continue" not in rest["metadata"]
    typed = await core.list_pod_for_all_namespaces(label_selector="!gpuplace.io/managed")
    assert sorted(pod.metadata.name for pod in typed.items) == ["p1", "p3"]


async def test_expired_continue_is_410(server: localapi.Server, core: Any) -> None:
    for index in range(3):
        server.api.create(objects.node(f"n{index}"))
    page = await _json(await core.list_node(limit=1, _preload_content=False))
    server.api.store.expire_continues()
    with pytest.raises(ApiException) as raised:
        await core.list_node(limit=1, _continue=page["metadata"]["continue"])
    assert raised.value.status == 410
    assert json.loads(raised.value.body or b"{}")["reason"] == "Expired"


async def _watch_lines(
    server: localapi.Server, query: str, count: int, timeout: float = 5.0
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    url = f"{server.url}/api/v1/pods?watch=true&{query}"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200

        async def read() -> None:
            async for line in response.content:
                events.append(json.loads(line))
                if len(events) >= count:
                    return

        await asyncio.wait_for(read(), timeout)
    return events


async def test_watch_resumes_from_resource_version_with_selector_transitions(
    server: localapi.Server,
) -> None:
    api = server.api
    api.create(objects.pod("a"))
    rv = api.store.resource_version
    api.patch("pods", "a", {"metadata": {"labels": {"gpuplace.io/managed": None}}}, "default")
    api.create(objects.pod("b"))
    api.delete("pods", "b", "default")
    events = await _watch_lines(
        server, f"resourceVersion={rv}&labelSelector=gpuplace.io/managed%3Dtrue", 3
    )
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("DELETED", "a"),
        ("ADDED", "b"),
        ("DELETED", "b"),
    ]
    assert events[1]["object"]["kind"] == "Pod"


async def test_watch_sends_bookmarks_only_when_asked(server: localapi.Server) -> None:
    server.api.create(objects.pod("a"))
    rv = server.api.store.resource_version
    events = await _watch_lines(server, f"resourceVersion={rv}&allowWatchBookmarks=true", 1)
    assert events[0]["type"] == "BOOKMARK"
    assert events[0]["object"]["metadata"]["resourceVersion"] == str(rv)
    with pytest.raises(TimeoutError):
        await _watch_lines(server, f"resourceVersion={rv}", 1, timeout=0.2)


async def test_too_old_watch_gets_410_error_event(server: localapi.Server) -> None:
    first = server.api.create(objects.pod("a"))["metadata"]["resourceVersion"]
    server.api.create(objects.pod("b"))
    server.api.compact()
    events = await _watch_lines(server, "resourceVersion=0", 2)
    assert {event["type"] for event in events} == {"ADDED"}
    old = await _watch_lines(server, f"resourceVersion={first}", 1)
    assert old[0]["type"] == "ERROR"
    assert old[0]["object"]["code"] == 410
    assert old[0]["object"]["reason"] == "Expired"


async def test_merge_patch_with_stale_resource_version_conflicts(
    server: localapi.Server, core: Any
) -> None:
    created = server.api.create(objects.pod("a"))
    rv = created["metadata"]["resourceVersion"]
    body = {"metadata": {"resourceVersion": rv, "annotations": {"x": "1"}}}
    patched = await _json(
        await core.patch_namespaced_pod(
            "a",
            "default",
            body,
            _content_type="application/merge-patch+json",
            _preload_content=False,
        )
    )
    assert patched["metadata"]["annotations"]["x"] == "1"
    assert patched["metadata"]["resourceVersion"] != rv
    with pytest.raises(ApiException) as raised:
        await core.patch_namespaced_pod(
            "a", "default", body, _content_type="application/merge-patch+json"
        )
    assert raised.value.status == 409
    assert json.loads(raised.value.body or b"{}")["reason"] == "Conflict"


async def test_json_patch_test_failure_is_422_and_unknown_is_404(
    server: localapi.Server, core: Any
) -> None:
    server.api.create(objects.pod("a"))
    with pytest.raises(ApiException) as raised:
        await core.patch_namespaced_pod(
            "a", "default", [{"op": "test", "path": "/metadata/name", "value": "b"}]
        )
    assert raised.value.status == 422
    with pytest.raises(ApiException) as missing:
        await core.read_namespaced_pod("nope", "default")
    assert missing.value.status == 404
    assert json.loads(missing.value.body or b"{}")["details"] == {"kind": "pods", "name": "nope"}


async def test_binding_sets_node_once(server: localapi.Server, core: Any) -> None:
    created = server.api.create(objects.pod("a"))
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "a", "uid": created["metadata"]["uid"], "annotations": {"k": "v"}},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
    }
    response = await core.create_namespaced_pod_binding(
        "a", "default", body, _preload_content=False
    )
    assert response.status == 201
    pod = server.api.get("pods", "a", "default")
    assert pod["spec"]["nodeName"] == "n1"
    assert pod["metadata"]["annotations"]["k"] == "v"
    with pytest.raises(ApiException) as raised:
        await core.create_namespaced_pod_binding("a", "default", body)
    assert raised.value.status == 409
    assert "already assigned" in json.loads(raised.value.body or b"{}")["message"]


async def test_status_subresource_changes_only_status(server: localapi.Server, core: Any) -> None:
    server.api.create(objects.node("n1"))
    body = {
        "status": {"capacity": {"gpuplace.io/gpu-percent": "800"}},
        "metadata": {"labels": {"x": "y"}},
    }
    await core.patch_node_status("n1", body)
    node = server.api.get("nodes", "n1")
    assert node["status"]["capacity"]["gpuplace.io/gpu-percent"] == "800"
    assert "x" not in node["metadata"]["labels"]
    rv = node["metadata"]["resourceVersion"]
    await core.patch_node_status("n1", body)
    assert server.api.get("nodes", "n1")["metadata"]["resourceVersion"] == rv
    await core.patch_node("n1", {"status": {"capacity": {"cpu": "1"}}})
    assert server.api.get("nodes", "n1")["status"]["capacity"]["cpu"] == "64"


async def test_pod_spec_is_immutable_except_gates_and_gated_affinity(
    server: localapi.Server, core: Any
) -> None:
    server.api.create(objects.pod("g", gates=["gpuplace.io/gang"]))
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
                ]
            }
        }
    }
    await core.patch_namespaced_pod("g", "default", {"spec": {"affinity": affinity}})
    await core.patch_namespaced_pod("g", "default", {"spec": {"schedulingGates": None}})
    with pytest.raises(ApiException) as raised:
        await core.patch_namespaced_pod("g", "default", {"spec": {"affinity": None}})
    assert raised.value.status == 422
    with pytest.raises(ApiException):
        await core.patch_namespaced_pod("g", "default", {"spec": {"nodeName": "n1"}})


async def test_injected_fault_and_events(server: localapi.Server, core: Any) -> None:
    server.api.fail("POST", "/events$", 500)
    event = {"metadata": {"generateName": "a."}, "message": "m", "involvedObject": {"name": "a"}}
    with pytest.raises(ApiException) as raised:
        await core.create_namespaced_event("default", event)
    assert raised.value.status == 500
    await core.create_namespaced_event("default", event)
    assert len(server.api.objects("events", "default")) == 1
    assert len(server.api.calls_to("POST", "/events$")) == 2
