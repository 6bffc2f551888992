"""POST pods/NAME/eviction as kube-apiserver serves it (pkg/registry/core/pod/storage/
eviction.go): 201 Success, 429 TooManyRequests with a DisruptionBudget cause when a
PodDisruptionBudget forbids, the budget decremented and the pod recorded in
`disruptedPods`, 404 for a missing pod, 409 on a UID precondition that does not hold,
graceful deletion of a running pod, and RBAC on the `pods/eviction` subresource."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpuplace.cluster import disruptions
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects


@pytest.fixture
async def server() -> AsyncIterator[localapi.Server]:
    api = localapi.FakeApi(bookmark_interval=0.05, access=localapi.Access.shipped())
    async with localapi.serve(api) as running:
        yield running


def running_pod(api: localapi.FakeApi, name: str, labels: dict[str, str] | None = None) -> Any:
    api.create(objects.pod(name, labels=labels or {"app": "web"}))
    api.bind("default", name, "gpu-0")
    return api.patch(
        "pods",
        name,
        {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        "default",
        subresource="status",
    )


def budget(
    api: localapi.FakeApi,
    name: str,
    allowed: int,
    *,
    labels: dict[str, str] | None = None,
    selector: dict[str, Any] | None = None,
) -> Any:
    chosen = selector if selector is not None else {"matchLabels": labels or {"app": "web"}}
    api.create(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"selector": chosen, "minAvailable": 1},
        }
    )
    return api.patch(
        "policy/poddisruptionbudgets",
        name,
        {
            "status": {
                "disruptionsAllowed": allowed,
                "currentHealthy": 1 + allowed,
                "desiredHealthy": 1,
                "expectedPods": 1 + allowed,
                "observedGeneration": 1,
            }
        },
        "default",
        subresource="status",
    )


def observed(api: localapi.FakeApi, name: str, generation: int) -> None:
    """What the disruption controller has seen of budget `name` (generation 1 exists)."""
    status = {"status": {"observedGeneration": generation}}
    api.patch("policy/poddisruptionbudgets", name, status, "default", subresource="status")


def eviction(name: str, uid: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": "default"},
    }
    if uid is not None:
        body["deleteOptions"] = {"preconditions": {"uid": uid}}
    return body


async def evict(
    server: localapi.Server, name: str, uid: str | None = None, user: Any = localapi.GPUPLACE
) -> tuple[int, dict[str, Any]]:
    async with client.ApiClient(server.configuration(user)) as api_client:
        core: Any = client.CoreV1Api(api_client)
        try:
            response = await core.create_namespaced_pod_eviction(
                name, "default", eviction(name, uid), _preload_content=False
            )
        except ApiException as error:
            return int(error.status or 0), json.loads(error.body or b"{}")
        return response.status, json.loads(await response.read())


async def test_an_eviction_without_budget_deletes_gracefully_and_answers_201(
    server: localapi.Server,
) -> None:
    pod = running_pod(server.api, "web-0")
    status, body = await evict(server, "web-0", pod["metadata"]["uid"])
    assert status == 201
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "code": 201,
    }
    # a running pod on a node terminates: the kubelet removes it after its grace period
    left = server.api.get("pods", "web-0", "default")
    assert left["metadata"]["deletionTimestamp"]
    (target,) = [c for c in left["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert (target["reason"], target["message"]) == (
        "EvictionByEvictionAPI",
        "Eviction API: evicting",
    )
    assert left["metadata"]["deletionGracePeriodSeconds"] == 30
    # evicting it again while it terminates needs no budget and changes nothing more
    assert (await evict(server, "web-0"))[0] == 201


async def test_a_budget_with_room_is_decremented_and_records_the_pod(
    server: localapi.Server,
) -> None:
    budget(server.api, "web", 1)
    pod = running_pod(server.api, "web-0")
    running_pod(server.api, "web-1")
    assert (await evict(server, "web-0", pod["metadata"]["uid"]))[0] == 201
    pdb = server.api.get("policy/poddisruptionbudgets", "web", "default")
    assert pdb["status"]["disruptionsAllowed"] == 0
    assert set(pdb["status"]["disruptedPods"]) == {"web-0"}
    # the budget is spent: the next eviction is refused as kube-apiserver refuses it
    # (currentHealthy is the PDB controller's to update, not the eviction's)
    status, body = await evict(server, "web-1")
    assert status == 429
    assert body["reason"] == "TooManyRequests"
    assert body["message"] == "Cannot evict pod as it would violate the pod's disruption budget."
    assert body["details"]["causes"] == [
        {
            "reason": "DisruptionBudget",
            "message": "The disruption budget web needs 1 healthy pods and has 2 currently",
        }
    ]
    assert not server.api.get("pods", "web-1", "default")["metadata"].get("deletionTimestamp")


async def test_an_unobserved_budget_and_two_budgets_refuse(server: localapi.Server) -> None:
    budget(server.api, "web", 3)
    observed(server.api, "web", 0)
    running_pod(server.api, "web-0")
    status, body = await evict(server, "web-0")
    assert status == 429
    assert "still being processed" in body["details"]["causes"][0]["message"]
    budget(server.api, "web-too", 3)
    observed(server.api, "web", 1)
    status, body = await evict(server, "web-0")
    assert status == 500
    assert "more than one PodDisruptionBudget" in body["message"]


async def test_an_empty_selector_covers_every_pod_of_its_namespace(
    server: localapi.Server,
) -> None:
    # policy/v1: `selector: {}` selects all pods of the namespace (LabelSelectorAsSelector
    # gives Everything); only an absent selector selects none
    budget(server.api, "all", 0, selector={})
    running_pod(server.api, "job-0", labels={"app": "job"})
    status, body = await evict(server, "job-0")
    assert status == 429
    assert "The disruption budget all needs" in body["details"]["causes"][0]["message"]
    server.api.delete("policy/poddisruptionbudgets", "all", "default")
    server.api.create(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "none", "namespace": "default"},
            "spec": {"minAvailable": 1},
            "status": {"disruptionsAllowed": 0},
        }
    )
    assert (await evict(server, "job-0"))[0] == 201


async def test_too_many_unconfirmed_disruptions_are_forbidden(server: localapi.Server) -> None:
    budget(server.api, "web", 5)
    stamp = "2026-01-01T00:00:00Z"
    crowd = {f"gone-{i}": stamp for i in range(disruptions.MAX_DISRUPTED_PODS + 1)}
    server.api.patch(
        "policy/poddisruptionbudgets",
        "web",
        {"status": {"disruptedPods": crowd}},
        "default",
        subresource="status",
    )
    running_pod(server.api, "web-0")
    status, body = await evict(server, "web-0")
    assert status == 403
    assert body["message"] == (
        'poddisruptionbudget.policy "web" is forbidden: DisruptedPods map too big - too '
        "many evictions not confirmed by PDB controller"
    )
    assert not server.api.get("pods", "web-0", "default")["metadata"].get("deletionTimestamp")


async def test_missing_pod_is_404_and_a_replaced_pod_is_409(server: localapi.Server) -> None:
    status, body = await evict(server, "nobody")
    assert (status, body["reason"]) == (404, "NotFound")
    running_pod(server.api, "web-0")
    status, body = await evict(server, "web-0", "0000-not-its-uid")
    assert (status, body["reason"]) == (409, "Conflict")
    assert "Precondition failed: UID in precondition: 0000-not-its-uid" in body["message"]
    assert not server.api.get("pods", "web-0", "default")["metadata"].get("deletionTimestamp")


async def test_a_pending_pod_is_deleted_at_once_without_budget(server: localapi.Server) -> None:
    budget(server.api, "web", 0)
    server.api.create(objects.pod("web-0", labels={"app": "web"}))
    assert (await evict(server, "web-0"))[0] == 201
    assert server.api.objects("pods", "default") == []


async def test_the_eviction_subresource_needs_its_own_grant(server: localapi.Server) -> None:
    running_pod(server.api, "web-0")
    status, body = await evict(server, "web-0", user=localapi.NODE_AGENT)
    assert status == 403
    assert 'cannot create resource "pods/eviction"' in body["message"]
    # the sidecar may evict, and may still not delete
    async with client.ApiClient(server.configuration(localapi.GPUPLACE)) as api_client:
        core: Any = client.CoreV1Api(api_client)
        with pytest.raises(ApiException) as refused:
            await core.delete_namespaced_pod("web-0", "default")
        assert refused.value.status == 403
    assert (await evict(server, "web-0"))[0] == 201


async def test_a_mismatched_name_is_400(server: localapi.Server) -> None:
    running_pod(server.api, "web-0")
    async with client.ApiClient(server.configuration()) as api_client:
        core: Any = client.CoreV1Api(api_client)
        with pytest.raises(ApiException) as refused:
            await core.create_namespaced_pod_eviction("web-0", "default", eviction("web-1"))
        assert refused.value.status == 400
        assert "name in URL does not match name in Eviction object" in str(refused.value.body)
