"""The kinds `gpuplace certs` writes, on the wire to the real kubernetes-asyncio client:
Secrets (base64 data, a TLS Secret's keys, immutable type) and the webhook configurations
(a strategic merge patch merges `webhooks` by name, a caBundle must be base64); and a
writer racing a client (`FakeApi.before`)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpuplace.dev import localapi
from gpuplace.dev.localapi import MUTATING_WEBHOOKS, SECRETS, patching

PEM = base64.b64encode(b"-----BEGIN CERTIFICATE-----").decode()


def webhook(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "clientConfig": {"service": {"name": "gpuplace-webhook", "namespace": "gpuplace"}},
        "rules": [{"operations": ["CREATE"], "resources": ["pods"]}],
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
    }


def configuration(*webhooks: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "gpuplace"},
        "webhooks": list(webhooks),
    }


def secret(name: str, data: dict[str, str], kind: str = "Opaque") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": "gpuplace"},
        "type": kind,
        "data": data,
    }


@pytest.fixture
async def server() -> AsyncIterator[localapi.Server]:
    async with localapi.serve() as running:
        yield running


@pytest.fixture
async def kube(server: localapi.Server) -> AsyncIterator[client.ApiClient]:
    async with client.ApiClient(server.configuration()) as api_client:
        yield api_client


def failure(raised: pytest.ExceptionInfo[ApiException]) -> tuple[int, str, str]:
    body = json.loads(raised.value.body or b"{}")
    return raised.value.status, body["reason"], body["message"]


async def test_strategic_merge_patch_merges_webhooks_by_name(
    server: localapi.Server, kube: client.ApiClient
) -> None:
    server.api.create(configuration(webhook("a"), webhook("b")))
    admission: Any = client.AdmissionregistrationV1Api(kube)
    patch = {"webhooks": [{"name": "b", "clientConfig": {"caBundle": PEM}}, webhook("c")]}
    await admission.patch_mutating_webhook_configuration("gpuplace", patch)  # strategic
    stored = server.api.get(MUTATING_WEBHOOKS, "gpuplace")
    assert [w["name"] for w in stored["webhooks"]] == ["a", "b", "c"]
    assert stored["webhooks"][0] == webhook("a")
    merged = webhook("b")
    merged["clientConfig"]["caBundle"] = PEM
    assert stored["webhooks"][1] == merged  # its service and rules kept
    # A JSON merge patch replaces the list, as RFC 7386 says.
    await admission.patch_mutating_webhook_configuration(
        "gpuplace", {"webhooks": [webhook("d")]}, _content_type=patching.MERGE
    )
    assert server.api.get(MUTATING_WEBHOOKS, "gpuplace")["webhooks"] == [webhook("d")]


async def test_a_webhook_without_its_name_or_with_a_bad_ca_bundle_is_refused(
    server: localapi.Server, kube: client.ApiClient
) -> None:
    server.api.create(configuration(webhook("a")))
    before = server.api.get(MUTATING_WEBHOOKS, "gpuplace")
    admission: Any = client.AdmissionregistrationV1Api(kube)
    with pytest.raises(ApiException) as nameless:
        await admission.patch_mutating_webhook_configuration(
            "gpuplace", {"webhooks": [{"clientConfig": {"caBundle": PEM}}]}
        )
    assert failure(nameless)[:2] == (400, "BadRequest")
    with pytest.raises(ApiException) as undecodable:
        await admission.patch_mutating_webhook_configuration(
            "gpuplace", {"webhooks": [{"name": "a", "clientConfig": {"caBundle": "not base64!"}}]}
        )
    code, reason, message = failure(undecodable)
    assert (code, reason) == (400, "BadRequest")
    assert "webhooks[0].clientConfig.caBundle: illegal base64 data" in message
    assert server.api.get(MUTATING_WEBHOOKS, "gpuplace") == before


async def test_secrets_hold_base64_a_tls_secret_its_pair_and_type_never_changes(
    server: localapi.Server, kube: client.ApiClient
) -> None:
    core: Any = client.CoreV1Api(kube)
    with pytest.raises(ApiException) as undecodable:
        await core.create_namespaced_secret("gpuplace", secret("s", {"a": "not base64!"}))
    assert failure(undecodable) == (
        400,
        "BadRequest",
        'Secret in version "v1" cannot be handled as a Secret: data[a]: illegal base64 data',
    )
    with pytest.raises(ApiException) as half:
        await core.create_namespaced_secret(
            "gpuplace", secret("tls", {"tls.crt": PEM}, "kubernetes.io/tls")
        )
    assert failure(half) == (
        422,
        "Invalid",
        'Secret "tls" is invalid: data[tls.key]: Required value',
    )
    created = await core.create_namespaced_secret(
        "gpuplace", secret("tls", {"tls.crt": PEM, "tls.key": PEM}, "kubernetes.io/tls")
    )
    replaced = secret("tls", {"tls.crt": PEM, "tls.key": PEM})  # type Opaque
    replaced["metadata"]["resourceVersion"] = created.metadata.resource_version
    with pytest.raises(ApiException) as retyped:
        await core.replace_namespaced_secret("tls", "gpuplace", replaced)
    assert failure(retyped)[:2] == (422, "Invalid") and "field is immutable" in failure(retyped)[2]
    assert server.api.get(SECRETS, "tls", "gpuplace")["type"] == "kubernetes.io/tls"


async def test_a_racing_writer_runs_between_a_read_and_a_write(
    server: localapi.Server, kube: client.ApiClient
) -> None:
    server.api.create(configuration(webhook("a")))
    core: Any = client.AdmissionregistrationV1Api(kube)
    read = await core.read_mutating_webhook_configuration("gpuplace")

    def race() -> None:
        server.api.patch(MUTATING_WEBHOOKS, "gpuplace", {"metadata": {"labels": {"x": "y"}}})

    server.api.before("PATCH", "/mutatingwebhookconfigurations/gpuplace$", race)
    patch = {"metadata": {"resourceVersion": read.metadata.resource_version}}
    with pytest.raises(ApiException) as raced:
        await core.patch_mutating_webhook_configuration("gpuplace", patch)
    assert failure(raced)[:2] == (409, "Conflict")
    again = await core.read_mutating_webhook_configuration("gpuplace")
    patch = {"metadata": {"resourceVersion": again.metadata.resource_version}}
    await core.patch_mutating_webhook_configuration("gpuplace", patch)  # it ran once


NAMES = st.sampled_from("abcdef")
ITEMS = st.lists(
    st.fixed_dictionaries({"name": NAMES}, optional={"x": st.integers(), "y": st.integers()}),
    unique_by=lambda item: item["name"],
    max_size=6,
)


@given(ITEMS, ITEMS)
def test_merge_by_key_keeps_order_merges_matches_and_appends_the_new(
    items: list[dict[str, Any]], patch: list[dict[str, Any]]
) -> None:
    merged = patching.merge_by_key(items, patch, "name")
    old = {item["name"]: item for item in items}
    new = {item["name"]: item for item in patch}
    assert [m["name"] for m in merged] == [
        *(item["name"] for item in items),
        *(item["name"] for item in patch if item["name"] not in old),
    ]
    for item in merged:
        name = item["name"]
        expected = patching.merge(old.get(name), new[name]) if name in new else old[name]
        assert item == expected
