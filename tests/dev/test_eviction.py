"""POST pods/NAME/eviction as kube-apiserver serves it (pkg/registry/core/pod/storage/
eviction.go), refereed: each test runs against the local API and the real kube-apiserver
(`tests.dev.servers`) and asserts what the real one answers: 201 Success, 429
TooManyRequests with a DisruptionBudget cause when a PodDisruptionBudget forbids, the
budget decremented, 500 for two budgets, 404 for a missing pod, 409 on a UID
precondition that does not hold, graceful deletion of a running pod (a pending one goes
at once), 400 on a mismatched name, and RBAC on the `pods/eviction` subresource. A
budget's status is the disruption controller's on a cluster: `Served.settle_budget`
waits for it there and writes it on the local API. What a controller makes racy on a
cluster (an unobserved budget, `disruptedPods` before the controller prunes it, a full
`disruptedPods` map) is tested on the local API alone, at the end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpuplace.cluster import disruptions
from gpuplace.dev import localapi
from gpuplace.dev.localapi import access, objects
from gpuplace.dev.localapi.access import User
from tests.dev.servers import Answer, Served, pod

WEB = {"app": "web"}


def budget_object(name: str, selector: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"minAvailable": 1}
    if selector is not None:
        spec["selector"] = selector
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name},
        "spec": spec,
    }


def eviction_of(name: str, namespace: str, uid: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
    }
    if uid is not None:
        body["deleteOptions"] = {"preconditions": {"uid": uid}}
    return body


async def evict_on(
    server: Served, name: str, uid: str | None = None, user: User = access.GPUPLACE
) -> Answer:
    path = server.path("pods", name, "eviction")
    return await server.call("POST", path, eviction_of(name, server.namespace, uid), user=user)


async def test_an_eviction_without_budget_deletes_gracefully_and_answers_201(
    server: Served,
) -> None:
    running = await server.run_pod("web-0", "n1", WEB)
    answer = await evict_on(server, "web-0", running["metadata"]["uid"])
    assert (answer.status, answer.body) == (
        201,
        {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201},
    )
    # a running pod on a node terminates: the kubelet removes it after its grace period
    left = await server.get(server.path("pods", "web-0"))
    assert left["metadata"]["deletionTimestamp"]
    (target,) = [c for c in left["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert (target["reason"], target["message"]) == (
        "EvictionByEvictionAPI",
        "Eviction API: evicting",
    )
    assert left["metadata"]["deletionGracePeriodSeconds"] == 30
    # evicting it again while it terminates needs no budget
    assert (await evict_on(server, "web-0")).status == 201


async def test_a_budget_with_room_is_decremented_then_refuses_with_its_cause(
    server: Served,
) -> None:
    await server.create(budget_object("web", {"matchLabels": WEB}))
    running = await server.run_pod("web-0", "n1", WEB)
    await server.run_pod("web-1", "n1", WEB)
    await server.settle_budget("web", allowed=1, healthy=2, desired=1)
    assert (await evict_on(server, "web-0", running["metadata"]["uid"])).status == 201
    spent = await server.get(server.path("policy/poddisruptionbudgets", "web"))
    assert spent["status"]["disruptionsAllowed"] == 0
    # the controller then counts web-0 (terminating) out: 1 healthy of 1 desired
    await server.settle_budget("web", allowed=0, healthy=1, desired=1)
    answer = await evict_on(server, "web-1")
    assert (answer.status, answer.reason) == (429, "TooManyRequests")
    assert answer.message == "Cannot evict pod as it would violate the pod's disruption budget."
    assert answer.body["details"]["causes"] == [
        {
            "reason": "DisruptionBudget",
            "message": "The disruption budget web needs 1 healthy pods and has 1 currently",
        }
    ]
    left = await server.get(server.path("pods", "web-1"))
    assert not left["metadata"].get("deletionTimestamp")


async def test_two_budgets_over_one_pod_are_a_500(server: Served) -> None:
    await server.create(budget_object("web", {"matchLabels": WEB}))
    await server.create(budget_object("web-too", {"matchLabels": WEB}))
    await server.run_pod("web-0", "n1", WEB)
    # (the disruption controller leaves both unprocessed: it refuses a pod with two)
    answer = await evict_on(server, "web-0")
    assert (answer.status, answer.body) == (
        500,
        {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "This pod has more than one PodDisruptionBudget, which the eviction "
            "subresource does not support.",
            "code": 500,
        },
    )  # fmt: skip


async def test_an_empty_selector_covers_every_pod_and_none_covers_none(server: Served) -> None:
    # policy/v1: `selector: {}` selects all pods of the namespace (LabelSelectorAsSelector
    # gives Everything); only an absent selector selects none
    await server.create(budget_object("all", {}))
    await server.run_pod("job-0", "n1", {"app": "job"})
    await server.settle_budget("all", allowed=0, healthy=1, desired=1)
    answer = await evict_on(server, "job-0")
    assert answer.status == 429
    cause = answer.body["details"]["causes"][0]["message"]
    assert cause == "The disruption budget all needs 1 healthy pods and has 1 currently"
    deleted = await server.call("DELETE", server.path("policy/poddisruptionbudgets", "all"))
    deleted.ok(200)
    await server.create(budget_object("none"))
    assert (await evict_on(server, "job-0")).status == 201


async def test_missing_pod_is_404_and_a_replaced_pod_is_409(server: Served) -> None:
    missing = await evict_on(server, "nobody")
    assert (missing.status, missing.reason, missing.message) == (
        404,
        "NotFound",
        'pods "nobody" not found',
    )
    running = await server.run_pod("web-0", "n1", WEB)
    replaced = await evict_on(server, "web-0", "0000-not-its-uid")
    assert (replaced.status, replaced.reason) == (409, "Conflict")
    assert replaced.message == (
        'Operation cannot be fulfilled on Pod "web-0": the UID in the precondition '
        f"(0000-not-its-uid) does not match the UID in record ({running['metadata']['uid']}). "
        "The object might have been deleted and then recreated"
    )
    left = await server.get(server.path("pods", "web-0"))
    assert not left["metadata"].get("deletionTimestamp")


async def test_a_pending_pod_is_deleted_at_once_without_budget(server: Served) -> None:
    await server.create(budget_object("web", {"matchLabels": WEB}))
    await server.create(pod("web-0", labels=WEB))
    await server.settle_budget("web", allowed=0, healthy=0, desired=1)
    assert (await evict_on(server, "web-0")).status == 201
    assert (await server.call("GET", server.path("pods", "web-0"))).status == 404


async def test_the_eviction_subresource_needs_its_own_grant(server: Served) -> None:
    await server.run_pod("web-0", "n1", WEB)
    # the certificate job's identity has no grant on pods (the node agent, which had none
    # before issue 43, now evicts pods over their grant where the operator chose it)
    refused = await evict_on(server, "web-0", user=access.CERTS)
    assert (refused.status, refused.message) == (
        403,
        f'pods "web-0" is forbidden: User "{access.CERTS.name}" cannot create resource '
        f'"pods/eviction" in API group "" in the namespace "{server.namespace}"',
    )
    # the sidecar may evict, and may still not delete
    deleting = await server.call("DELETE", server.path("pods", "web-0"), user=access.GPUPLACE)
    assert deleting.status == 403
    assert (await evict_on(server, "web-0")).status == 201


async def test_a_mismatched_name_is_400(server: Served) -> None:
    await server.run_pod("web-0", "n1", WEB)
    body = eviction_of("web-1", server.namespace)
    answer = await server.call("POST", server.path("pods", "web-0", "eviction"), body)
    assert (answer.status, answer.reason) == (400, "BadRequest")
    assert answer.message == "name in URL does not match name in Eviction object"


# --- the local API alone: what the disruption controller makes racy on a cluster -----


@pytest.fixture
async def local() -> AsyncIterator[localapi.Server]:
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


def budget(api: localapi.FakeApi, name: str, allowed: int) -> Any:
    api.create(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"selector": {"matchLabels": {"app": "web"}}, "minAvailable": 1},
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


async def evict(server: localapi.Server, name: str) -> tuple[int, dict[str, Any]]:
    async with client.ApiClient(server.configuration(localapi.GPUPLACE)) as api_client:
        core: Any = client.CoreV1Api(api_client)
        try:
            response = await core.create_namespaced_pod_eviction(
                name, "default", eviction_of(name, "default"), _preload_content=False
            )
        except ApiException as error:
            return int(error.status or 0), json.loads(error.body or b"{}")
        return response.status, json.loads(await response.read())


async def test_the_evicted_pod_is_recorded_in_disrupted_pods(local: localapi.Server) -> None:
    budget(local.api, "web", 1)
    running_pod(local.api, "web-0")
    running_pod(local.api, "web-1")
    assert (await evict(local, "web-0"))[0] == 201
    pdb = local.api.get("policy/poddisruptionbudgets", "web", "default")
    assert set(pdb["status"]["disruptedPods"]) == {"web-0"}


async def test_an_unobserved_budget_refuses(local: localapi.Server) -> None:
    budget(local.api, "web", 3)
    observed(local.api, "web", 0)
    running_pod(local.api, "web-0")
    status, body = await evict(local, "web-0")
    assert status == 429
    assert "still being processed" in body["details"]["causes"][0]["message"]


async def test_too_many_unconfirmed_disruptions_are_forbidden(local: localapi.Server) -> None:
    budget(local.api, "web", 5)
    stamp = "2026-01-01T00:00:00Z"
    crowd = {f"gone-{i}": stamp for i in range(disruptions.MAX_DISRUPTED_PODS + 1)}
    local.api.patch(
        "policy/poddisruptionbudgets",
        "web",
        {"status": {"disruptedPods": crowd}},
        "default",
        subresource="status",
    )
    running_pod(local.api, "web-0")
    status, body = await evict(local, "web-0")
    assert status == 403
    assert body["message"] == (
        'poddisruptionbudget.policy "web" is forbidden: DisruptedPods map too big - too '
        "many evictions not confirmed by PDB controller"
    )
    assert not local.api.get("pods", "web-0", "default")["metadata"].get("deletionTimestamp")
