"""The kinds `gpuplace certs` writes, refereed (the local API and the real kube-apiserver,
`tests.dev.servers`: the `server` fixture): Secrets (base64 data, a TLS Secret's keys,
immutable type) and the webhook configurations (a strategic merge patch merges `webhooks`
by name, a caBundle must be base64); then, on the local API alone, a writer racing a
client (`FakeApi.before`) and the merge by key."""

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
from gpuplace.dev.localapi import MUTATING_WEBHOOKS, patching
from tests.dev.servers import MERGE, STRATEGIC, Served

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
async def local() -> AsyncIterator[localapi.Server]:
    async with localapi.serve() as running:
        yield running


@pytest.fixture
async def kube(local: localapi.Server) -> AsyncIterator[client.ApiClient]:
    async with client.ApiClient(local.configuration()) as api_client:
        yield api_client


def failure(raised: pytest.ExceptionInfo[ApiException]) -> tuple[int, str, str]:
    body = json.loads(raised.value.body or b"{}")
    return raised.value.status, body["reason"], body["message"]


def hook(name: str) -> dict[str, Any]:
    """A webhook a real API server accepts and that can never be called: its rule names
    a resource nobody serves, its failure policy is Ignore."""
    return {
        "name": f"{name}.referee.gpuplace.io",
        "clientConfig": {"url": "https://127.0.0.1:9/never"},
        "rules": [
            {
                "operations": ["CREATE"],
                "apiGroups": ["referee.gpuplace.io"],
                "apiVersions": ["v1"],
                "resources": ["nothings"],
            }
        ],
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "failurePolicy": "Ignore",
    }


def hooks(server: Served, *webhooks: dict[str, Any]) -> dict[str, Any]:
    return {**configuration(*webhooks), "metadata": {"name": server.node_name("hooks")}}


HOOKS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/"


async def test_strategic_merge_patch_merges_webhooks_by_name(server: Served) -> None:
    """Refereed (both servers): kube-apiserver defaults the fields it stores, so the
    comparison is of what gpuplace certs reads back: order, names, the merged CA, the
    rest of the merged webhook kept; a JSON merge patch replaces the list."""
    await server.create(hooks(server, hook("a"), hook("b")))
    path = HOOKS + server.node_name("hooks")
    patch = {"webhooks": [{"name": "b.referee.gpuplace.io", "clientConfig": {"caBundle": PEM}}]}
    patch["webhooks"].append(hook("c"))
    (await server.patch(path, patch, content_type=STRATEGIC)).ok(200)
    stored = (await server.get(path))["webhooks"]
    assert [w["name"].split(".")[0] for w in stored] == ["a", "b", "c"]
    assert "caBundle" not in stored[0]["clientConfig"]
    assert stored[1]["clientConfig"] == {**hook("b")["clientConfig"], "caBundle": PEM}
    assert (stored[1]["rules"][0]["resources"], stored[1]["failurePolicy"]) == (
        ["nothings"],
        "Ignore",
    )
    replaced = {"webhooks": [hook("d")]}
    (await server.patch(path, replaced, content_type=MERGE)).ok(200)
    assert [w["name"] for w in (await server.get(path))["webhooks"]] == ["d.referee.gpuplace.io"]


async def test_a_webhook_without_its_name_or_with_a_bad_ca_bundle_is_refused(
    server: Served,
) -> None:
    await server.create(hooks(server, hook("a")))
    path = HOOKS + server.node_name("hooks")
    before = await server.get(path)
    nameless = {"webhooks": [{"clientConfig": {"caBundle": PEM}}]}
    refused = await server.patch(path, nameless, content_type=STRATEGIC)
    assert (refused.status, refused.reason, refused.message) == (
        500,
        "",
        f"map: map[clientConfig:map[caBundle:{PEM}]] does not contain declared merge key: name",
    )
    bad = {
        "webhooks": [{"name": "a.referee.gpuplace.io", "clientConfig": {"caBundle": "not base64!"}}]
    }
    undecodable = await server.patch(path, bad, content_type=STRATEGIC)
    why = (
        'Invalid value: "map[webhooks:[map[clientConfig:map[caBundle:not base64!] '
        'name:a.referee.gpuplace.io]]]": error decoding from json: illegal base64 data at '
        "input byte 3"
    )
    assert (undecodable.status, undecodable.reason, undecodable.message) == (
        422,
        "Invalid",
        f' "" is invalid: patch: {why}',
    )
    assert undecodable.body["details"]["causes"] == [
        {"reason": "FieldValueInvalid", "message": why, "field": "patch"}
    ]
    assert await server.get(path) == before


async def test_secrets_hold_base64_a_tls_secret_its_pair_and_type_never_changes(
    server: Served,
) -> None:
    def a_secret(name: str, data: dict[str, str], kind: str = "Opaque") -> dict[str, Any]:
        made = secret(name, data, kind)
        del made["metadata"]["namespace"]
        return made

    secrets = server.path("secrets")
    undecodable = await server.call("POST", secrets, a_secret("s", {"a": "not base64!"}))
    assert (undecodable.status, undecodable.reason) == (400, "BadRequest")
    assert (
        undecodable.message.startswith('Secret in version "v1" cannot be handled as a Secret: ')
        and "illegal base64 data" in undecodable.message
    )
    half = await server.call(
        "POST", secrets, a_secret("tls", {"tls.crt": PEM}, "kubernetes.io/tls")
    )
    assert (half.status, half.reason, half.message) == (
        422,
        "Invalid",
        'Secret "tls" is invalid: data[tls.key]: Required value',
    )
    created = await server.create(
        a_secret("tls", {"tls.crt": PEM, "tls.key": PEM}, "kubernetes.io/tls")
    )
    replaced = a_secret("tls", {"tls.crt": PEM, "tls.key": PEM})  # type Opaque
    replaced["metadata"]["resourceVersion"] = created["metadata"]["resourceVersion"]
    retyped = await server.call("PUT", server.path("secrets", "tls"), replaced)
    assert (retyped.status, retyped.reason) == (422, "Invalid")
    assert "field is immutable" in retyped.message
    assert (await server.get(server.path("secrets", "tls")))["type"] == "kubernetes.io/tls"


async def test_a_racing_writer_runs_between_a_read_and_a_write(
    local: localapi.Server, kube: client.ApiClient
) -> None:
    local.api.create(configuration(webhook("a")))
    core: Any = client.AdmissionregistrationV1Api(kube)
    read = await core.read_mutating_webhook_configuration("gpuplace")

    def race() -> None:
        local.api.patch(MUTATING_WEBHOOKS, "gpuplace", {"metadata": {"labels": {"x": "y"}}})

    local.api.before("PATCH", "/mutatingwebhookconfigurations/gpuplace$", race)
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
