"""kube-apiserver's wire format, refereed: each test runs against the local API and the
real kube-apiserver (`tests.dev.servers`) with the real kubernetes-asyncio client or raw
HTTP, and asserts what the real one answers: lists (selectors, pages, `continue`),
watches (resumption, selector transitions, BOOKMARK, 410 after a compaction),
resourceVersion semantics, conflicts, patches, bindings and status subresources. What
only the local API has (fault injection) is tested on it alone, at the end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from tests.dev import servers
from tests.dev.servers import JSON_PATCH, Served, pod

KEPT = "referee.gpuplace.io/kept"


@pytest.fixture
async def core(server: Served) -> AsyncIterator[Any]:
    """The generated CoreV1Api (typed Any: its stubs want models where it accepts dicts)."""
    async with client.ApiClient(server.configuration()) as api_client:
        yield client.CoreV1Api(api_client)


async def _json(response: Any) -> Any:
    return json.loads(await response.read())


def _names(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["type"], e["object"].get("metadata", {}).get("name", "")) for e in events]


async def test_list_filters_by_label_and_paginates(server: Served, core: Any) -> None:
    for index in range(5):
        labels = {"app": f"p{index}", KEPT: "true"} if index % 2 == 0 else {"app": f"p{index}"}
        await server.create(pod(f"p{index}", labels=labels))
    ns = server.namespace
    page = await _json(
        await core.list_namespaced_pod(
            ns, label_selector=f"{KEPT}=true", limit=2, _preload_content=False
        )
    )
    assert (page["kind"], page["apiVersion"]) == ("PodList", "v1")
    assert [item["metadata"]["name"] for item in page["items"]] == ["p0", "p2"]
    assert "kind" not in page["items"][0] and "apiVersion" not in page["items"][0]
    assert set(page["metadata"]) == {"resourceVersion", "continue"}  # no count: a selector
    rest = await _json(
        await core.list_namespaced_pod(
            ns,
            label_selector=f"{KEPT}=true",
            limit=2,
            _continue=page["metadata"]["continue"],
            _preload_content=False,
        )
    )
    assert [item["metadata"]["name"] for item in rest["items"]] == ["p4"]
    assert rest["metadata"]["resourceVersion"] == page["metadata"]["resourceVersion"]
    assert set(rest["metadata"]) == {"resourceVersion"}
    typed = await core.list_namespaced_pod(ns, label_selector=f"!{KEPT}")
    assert sorted(pod.metadata.name for pod in typed.items) == ["p1", "p3"]
    everything = await server.call("GET", server.path("pods"), query={"limit": "2"})
    assert everything.ok()["metadata"]["remainingItemCount"] == 3
    bad = await server.call("GET", server.path("pods"), query={"labelSelector": "a in (b"})
    assert (bad.status, bad.reason) == (400, "BadRequest")


def _event(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name},
        "involvedObject": {"kind": "Pod", "name": "a", "namespace": namespace},
        "reason": "Refereed",
        "message": "m",
    }


async def test_a_continue_from_before_a_compaction_is_410(server: Served) -> None:
    """Events: a kind kube-apiserver serves from etcd, not from its watch cache (which
    it turns off for events), as the local API serves every kind."""
    for index in range(3):
        await server.create(_event(f"e{index}", server.namespace))
    page = await server.call("GET", server.path("events"), query={"limit": "1"})
    token = page.ok()["metadata"]["continue"]
    await server.create(_event("e3", server.namespace))
    server.compact()
    expired = await server.call(
        "GET", server.path("events"), query={"limit": "1", "continue": token}
    )
    assert (expired.status, expired.reason) == (410, "Expired")
    assert expired.message.startswith("The provided continue parameter is too old")


async def test_watch_resumes_from_resource_version_with_selector_transitions(
    server: Served,
) -> None:
    await server.create(pod("a", labels={KEPT: "true"}))
    rv = (await server.get(server.path("pods")))["metadata"]["resourceVersion"]
    patch = {"metadata": {"labels": {KEPT: None}}}
    (await server.patch(server.path("pods", "a"), patch)).ok()
    await server.create(pod("b", labels={KEPT: "true"}))
    (await server.call("DELETE", server.path("pods", "b"))).ok()
    status, events = await server.watch(
        server.path("pods"), {"resourceVersion": rv, "labelSelector": f"{KEPT}=true"}, count=4
    )
    assert status == 200
    # a pod's deletion is graceful, also unbound: deletionTimestamp (MODIFIED), then gone
    assert _names(events) == [("DELETED", "a"), ("ADDED", "b"), ("MODIFIED", "b"), ("DELETED", "b")]
    assert events[2]["object"]["metadata"]["deletionGracePeriodSeconds"] == 0
    assert (events[1]["object"]["kind"], events[1]["object"]["apiVersion"]) == ("Pod", "v1")
    rvs = [int(event["object"]["metadata"]["resourceVersion"]) for event in events]
    assert rvs == sorted(rvs) and rvs[0] > int(rv)


async def test_a_write_that_changes_nothing_keeps_the_resource_version(server: Served) -> None:
    created = await server.create(pod("a"))
    rv = created["metadata"]["resourceVersion"]
    same = await server.patch(server.path("pods", "a"), {"metadata": {"labels": {"app": "a"}}})
    assert same.ok()["metadata"]["resourceVersion"] == rv
    changed = await server.patch(server.path("pods", "a"), {"metadata": {"labels": {"x": "1"}}})
    new_rv = changed.ok()["metadata"]["resourceVersion"]
    assert int(new_rv) > int(rv)
    status, events = await server.watch(
        server.path("pods"), {"resourceVersion": rv, "timeoutSeconds": "1"}
    )
    assert (status, _names(events)) == (200, [("MODIFIED", "a")])
    assert events[0]["object"]["metadata"]["resourceVersion"] == new_rv


async def test_bookmarks_come_only_when_asked_and_when_the_kind_moved_on(
    server: Served,
) -> None:
    """A watch with `allowWatchBookmarks` gets BOOKMARKs once its kind (pods, in any
    namespace) changed where it does not look, carrying that change's resourceVersion;
    none while nothing of its kind changed (another kind does not count), and none
    without asking. kube-apiserver sends them two seconds before the watch's timeout
    and each second after; the local API every `bookmark_interval`."""
    await server.create(pod("seen", labels={KEPT: "true"}))
    rv = (await server.get(server.path("pods")))["metadata"]["resourceVersion"]
    watched = {"resourceVersion": rv, "labelSelector": f"{KEPT}=true", "timeoutSeconds": "4"}

    async def change() -> str:
        await asyncio.sleep(0.5)
        await server.create(servers.node(server.node_name("other-kind")))
        await asyncio.sleep(0.5)
        return str((await server.create(pod("unseen")))["metadata"]["resourceVersion"])

    asked, plain, unseen_rv = await asyncio.gather(
        server.watch(server.path("pods"), {**watched, "allowWatchBookmarks": "true"}),
        server.watch(server.path("pods"), watched),
        change(),
    )
    assert plain == (200, [])
    status, events = asked
    assert status == 200 and events, "no BOOKMARK"
    assert {event["type"] for event in events} == {"BOOKMARK"}
    for event in events:
        obj = event["object"]
        assert (obj["kind"], obj["apiVersion"]) == ("Pod", "v1")
        assert obj["metadata"] == {"resourceVersion": unseen_rv}

    quiet = {**watched, "resourceVersion": unseen_rv, "allowWatchBookmarks": "true"}
    other = server.create(servers.node(server.node_name("still-other-kind")))
    still, _ = await asyncio.gather(server.watch(server.path("pods"), quiet), other)
    assert still == (200, [])


async def test_a_watch_from_a_resource_version_too_old_gets_a_410_error_event(
    server: Served,
) -> None:
    """After a compaction, from resourceVersion 0 every object there is now comes as
    ADDED; from a resourceVersion older than any history the server keeps, HTTP 200 and
    one ERROR event holding a 410 Expired Status ("too old resource version"), which an
    informer answers with a new list. kube-apiserver serves a watch from its watch cache,
    whose window a compaction does not shorten (a resumption from just before it still
    works there): only a resourceVersion from before the cache began (here "1", older
    than the session's install) is too old on both (the message is the watch cache's);
    the local API forgets all its history at a compaction, a stricter server that
    gpuplace's informers also meet."""
    await server.create(_event("a", server.namespace))
    await server.create(_event("b", server.namespace))
    server.compact()
    status, events = await server.watch(
        server.path("events"), {"resourceVersion": "0", "timeoutSeconds": "1"}
    )
    assert (status, sorted(_names(events))) == (200, [("ADDED", "a"), ("ADDED", "b")])
    status, old = await server.watch(server.path("events"), {"resourceVersion": "1"})
    assert status == 200 and len(old) == 1
    assert old[0]["type"] == "ERROR"
    error = old[0]["object"]
    assert (error["kind"], error["status"], error["code"], error["reason"]) == (
        "Status",
        "Failure",
        410,
        "Expired",
    )
    assert error["message"] == "The resourceVersion for the provided watch is too old."


async def test_merge_patch_with_stale_resource_version_conflicts(server: Served, core: Any) -> None:
    created = await server.create(pod("a"))
    rv = created["metadata"]["resourceVersion"]
    body = {"metadata": {"resourceVersion": rv, "annotations": {"x": "1"}}}
    ns, merge = server.namespace, "application/merge-patch+json"
    patched = await _json(
        await core.patch_namespaced_pod("a", ns, body, _content_type=merge, _preload_content=False)
    )
    assert patched["metadata"]["annotations"]["x"] == "1"
    assert patched["metadata"]["resourceVersion"] != rv
    with pytest.raises(ApiException) as raised:
        await core.patch_namespaced_pod("a", ns, body, _content_type=merge)
    assert raised.value.status == 409
    status = json.loads(raised.value.body or b"{}")
    assert status["reason"] == "Conflict"
    assert status["message"] == (
        'Operation cannot be fulfilled on pods "a": the object has been modified; please '
        "apply your changes to the latest version and try again"
    )
    assert status["details"] == {"name": "a", "kind": "pods"}


async def test_json_patch_test_failure_is_422_and_unknown_is_404(server: Served, core: Any) -> None:
    await server.create(pod("a"))
    ns = server.namespace
    with pytest.raises(ApiException) as raised:
        await core.patch_namespaced_pod(
            "a", ns, [{"op": "test", "path": "/metadata/name", "value": "b"}]
        )
    assert raised.value.status == 422
    assert json.loads(raised.value.body or b"{}")["reason"] == "Invalid"
    with pytest.raises(ApiException) as missing:
        await core.read_namespaced_pod("nope", ns)
    assert missing.value.status == 404
    body = json.loads(missing.value.body or b"{}")
    assert (body["reason"], body["message"]) == ("NotFound", 'pods "nope" not found')
    assert body["details"] == {"kind": "pods", "name": "nope"}
    bad = await server.call(
        "PATCH", server.path("pods", "a"), {"spec": {}}, content_type="text/plain"
    )
    assert (bad.status, bad.reason) == (415, "UnsupportedMediaType")
    assert (await server.call("PATCH", server.path("pods", "a"), [], content_type=JSON_PATCH)).ok()


async def test_binding_sets_node_once(server: Served, core: Any) -> None:
    created = await server.create(pod("a"))
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "a", "uid": created["metadata"]["uid"], "annotations": {"k": "v"}},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
    }
    ns = server.namespace
    response = await core.create_namespaced_pod_binding("a", ns, body, _preload_content=False)
    assert response.status == 201
    assert await _json(response) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "code": 201,
    }
    bound = await server.get(server.path("pods", "a"))
    assert bound["spec"]["nodeName"] == "n1"
    assert bound["metadata"]["annotations"]["k"] == "v"
    scheduled = [c for c in bound["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert [(c["status"], c.get("reason")) for c in scheduled] == [("True", None)]
    with pytest.raises(ApiException) as raised:
        await core.create_namespaced_pod_binding("a", ns, body)
    assert raised.value.status == 409
    status = json.loads(raised.value.body or b"{}")
    assert (status["reason"], status["message"]) == (
        "Conflict",
        'Operation cannot be fulfilled on pods/binding "a": pod a is already assigned to node "n1"',
    )


async def test_a_gated_pod_cannot_be_bound_nor_a_replaced_one(server: Served) -> None:
    created = await server.create(pod("g", gates=("referee.gpuplace.io/wait",)))
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "g"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
    }
    path = server.path("pods", "g", "binding")
    gated = await server.call("POST", path, binding)
    assert (gated.status, gated.reason) == (409, "Conflict")
    assert gated.message == (
        'Operation cannot be fulfilled on pods/binding "g": pod g has non-empty '
        ".spec.schedulingGates"
    )
    (await server.patch(server.path("pods", "g"), {"spec": {"schedulingGates": None}})).ok()
    stranger = {**binding, "metadata": {"name": "g", "uid": "0000-not-its-uid"}}
    replaced = await server.call("POST", path, stranger)
    assert (replaced.status, replaced.reason) == (409, "Conflict")
    assert replaced.message == (
        'Operation cannot be fulfilled on pods "g": StorageError: invalid object, Code: 4, '
        f"Key: /registry/pods/{server.namespace}/g, ResourceVersion: 0, AdditionalErrorMsg: "
        "Precondition failed: UID in precondition: 0000-not-its-uid, UID in object meta: "
        f"{created['metadata']['uid']}"
    )


async def test_status_subresource_changes_only_status(server: Served, core: Any) -> None:
    name = server.node_name("n1")
    await server.create(servers.node(name))
    body = {
        "status": {"capacity": {"gpuplace.io/gpu-percent": "800"}},
        "metadata": {"labels": {"x": "y"}},
    }
    await core.patch_node_status(name, body)
    node = await server.get(f"/api/v1/nodes/{name}")
    assert node["status"]["capacity"]["gpuplace.io/gpu-percent"] == "800"
    assert node["status"]["capacity"]["cpu"] == "64"
    rv = node["metadata"]["resourceVersion"]
    await core.patch_node_status(name, body)
    again = await server.get(f"/api/v1/nodes/{name}")
    assert again["metadata"]["resourceVersion"] == rv
    await core.patch_node(name, {"status": {"capacity": {"cpu": "1"}}})
    assert (await server.get(f"/api/v1/nodes/{name}"))["status"]["capacity"]["cpu"] == "64"


# --- the local API alone: what no real server offers --------------------------------


@pytest.fixture
async def local() -> AsyncIterator[localapi.Server]:
    async with localapi.serve(localapi.FakeApi(bookmark_interval=0.05)) as running:
        yield running


async def test_injected_fault_and_events(local: localapi.Server) -> None:
    async with client.ApiClient(local.configuration()) as api_client:
        core: Any = client.CoreV1Api(api_client)
        local.api.fail("POST", "/events$", 500)
        event = {
            "metadata": {"generateName": "a."},
            "message": "m",
            "involvedObject": {"name": "a"},
        }
        with pytest.raises(ApiException) as raised:
            await core.create_namespaced_event("default", event)
        assert raised.value.status == 500
        await core.create_namespaced_event("default", event)
    assert len(local.api.objects("events", "default")) == 1
    assert len(local.api.calls_to("POST", "/events$")) == 2


async def test_expire_continues_makes_the_next_page_410(local: localapi.Server) -> None:
    for index in range(3):
        local.api.create(objects.node(f"n{index}"))
    async with client.ApiClient(local.configuration()) as api_client:
        core: Any = client.CoreV1Api(api_client)
        page = await _json(await core.list_node(limit=1, _preload_content=False))
        local.api.store.expire_continues()
        with pytest.raises(ApiException) as raised:
            await core.list_node(limit=1, _continue=page["metadata"]["continue"])
    assert raised.value.status == 410
    assert json.loads(raised.value.body or b"{}")["reason"] == "Expired"
