"""The HTTP side of the webhook over real TLS: errors as JSON, limits, audit, metrics, TLS."""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from gpuplace.cluster import keys
from gpuplace.placement.inventory import Capabilities
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import Paths
from tests.webhook import helpers
from tests.webhook.conftest import MakeWebhook, Webhook

SHARE = {keys.GPU_PERCENT: "50", keys.GPU_MEMORY: "10G"}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"not json", "the body is not JSON"),
        (b"", "the body is not JSON"),
        (b"[]", "the body is not an AdmissionReview admission.k8s.io/v1 with a request"),
        (
            json.dumps(
                {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}}
            ).encode(),
            "not an AdmissionReview",
        ),
        (
            json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "Pod"}).encode(),
            "not an AdmissionReview",
        ),
        (
            json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode(),
            "not an AdmissionReview",
        ),
    ],
)
async def test_malformed_reviews_are_400_with_json(
    webhook: Webhook, body: bytes, error: str
) -> None:
    for path in ("/mutate", "/validate"):
        status, answer = await webhook.post(path, body)
        assert status == 400
        assert error in answer["error"]
    assert (
        webhook.metric("gpuplace_admission_reviews_total", endpoint="mutate", result="malformed")
        == 1
    )
    assert [line["decision"] for line in webhook.audit_lines()] == ["malformed", "malformed"]


async def test_malformed_details_name_the_field(webhook: Webhook) -> None:
    body = helpers.review(helpers.pod())
    del body["request"]["uid"]
    body["request"]["operation"] = "PATCH"
    status, answer = await webhook.post("/mutate", body)
    assert status == 400
    assert any(detail.startswith("request.uid") for detail in answer["details"])
    assert any(detail.startswith("request.operation") for detail in answer["details"])


async def test_malformed_pod_inside_a_review_is_400(webhook: Webhook) -> None:
    pod = helpers.pod(SHARE)
    pod["spec"]["containers"] = "oops"
    status, answer = await webhook.post("/mutate", helpers.review(pod))
    assert status == 400 and "object.spec.containers must be a list" in answer["error"]


async def test_body_over_the_limit_is_413(make_webhook: MakeWebhook) -> None:
    webhook = await make_webhook(WebhookConfig(max_body_bytes=64 * 1024))
    huge = helpers.review(helpers.pod({"big": "x" * 70_000, **SHARE}))
    status, answer = await webhook.post("/mutate", huge)
    assert status == 413 and "larger than 65536 bytes" in answer["error"]

    async def chunks() -> Any:
        data = json.dumps(huge).encode()
        for start in range(0, len(data), 8192):
            yield data[start : start + 8192]

    async with webhook.session.post(webhook.url + "/validate", data=chunks()) as response:
        assert response.status == 413
        assert "larger than" in (await response.json())["error"]
    assert (
        webhook.metric("gpuplace_admission_reviews_total", endpoint="validate", result="too_large")
        == 1
    )
    # and the server still answers normally afterwards
    status, _ = await webhook.post("/mutate", helpers.review(helpers.pod(SHARE)))
    assert status == 200


async def test_default_limit_is_3_mib_and_a_big_pod_below_it_works(webhook: Webhook) -> None:
    big = helpers.review(helpers.pod({"big": "y" * 2_500_000, **SHARE}))
    status, answer = await webhook.post("/mutate", big)
    assert status == 200 and answer["response"]["allowed"]
    line = webhook.audit_lines()[-1]
    assert "big" not in line["annotations"] and len(json.dumps(line)) < 4000


async def test_slow_body_is_408_not_a_hang(
    make_webhook: MakeWebhook, tls_files: tuple[Path, Path]
) -> None:
    webhook = await make_webhook(WebhookConfig(read_timeout_seconds=0.3))
    context = ssl.create_default_context(cafile=str(tls_files[0]))
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", webhook.port, ssl=context, server_hostname="127.0.0.1"
    )
    writer.write(
        b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"apiVersion"'
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
    assert head.startswith(b"HTTP/1.1 408")
    writer.close()


async def test_wrong_method_and_path(webhook: Webhook) -> None:
    async with webhook.session.get(webhook.url + "/mutate") as response:
        assert response.status == 405
    async with webhook.session.post(webhook.url + "/nope", data=b"{}") as response:
        assert response.status == 404


async def test_answer_carries_warnings_and_audit_annotations(webhook: Webhook) -> None:
    sent = helpers.review(helpers.pod(SHARE), uid="u-1")
    status, answer = await webhook.post("/mutate", sent)
    response = answer["response"]
    assert status == 200 and response["uid"] == "u-1"
    assert response["warnings"] == [
        "gpuplace.io/gpu-memory was rounded up to whole MiB: 9537Mi per GPU"
    ]
    assert response["auditAnnotations"] == {
        "decision": "mutated",
        "request": "count=1 percent=50 memory=9537Mi",
    }


async def test_denial_shape(webhook: Webhook) -> None:
    sent = helpers.review(helpers.pod({keys.PREFIX + "gpu-precent": "50"}))
    status, answer = await webhook.post("/mutate", sent)
    assert status == 200
    assert answer["response"]["allowed"] is False
    assert answer["response"]["status"] == {
        "metadata": {},
        "status": "Failure",
        "code": 422,
        "reason": "Invalid",
        "message": "unknown annotation gpuplace.io/gpu-precent; did you mean gpu-percent?",
    }
    assert (
        webhook.metric(
            "gpuplace_admission_denials_total", endpoint="mutate", reason="invalid-annotation"
        )
        == 1
    )


async def test_audit_line(webhook: Webhook) -> None:
    pod = helpers.pod(
        {**SHARE, "other": "not ours"},
        containers=[
            {"name": "c", "image": "secret-image:1", "env": [{"name": "TOKEN", "value": "s3cr3t"}]}
        ],
    )
    pod["metadata"]["annotations"][keys.GANG_NAME] = "n" * 300
    sent = helpers.review(pod, user="bob", uid="u-2")
    await webhook.post("/mutate", sent)
    (line,) = webhook.audit_lines()
    assert line["uid"] == "u-2" and line["endpoint"] == "mutate"
    assert (line["operation"], line["namespace"], line["name"], line["user"]) == (
        "CREATE",
        "default",
        "p",
        "bob",
    )
    assert line["dryRun"] is False
    assert line["decision"] == "denied" and line["reason"] == "invalid-annotation"
    assert set(line["annotations"]) == {keys.GPU_PERCENT, keys.GPU_MEMORY, keys.GANG_NAME}
    assert len(line["annotations"][keys.GANG_NAME]) <= 101
    assert line["latencyMs"] >= 0 and line["time"].endswith("Z")
    text = json.dumps(line)
    for secret in ("s3cr3t", "secret-image", "not ours"):
        assert secret not in text


async def test_audit_line_lists_patch_paths_not_values(webhook: Webhook) -> None:
    await webhook.post("/mutate", helpers.review(helpers.pod(SHARE)))
    (line,) = webhook.audit_lines()
    assert "/spec/schedulerName" in line["patch"]
    assert "valueFrom" not in json.dumps(line)


async def test_metrics(webhook: Webhook) -> None:
    await webhook.post("/mutate", helpers.review(helpers.pod(SHARE)))
    await webhook.post("/mutate", helpers.review(helpers.pod()))
    await webhook.post("/validate", helpers.review(helpers.pod(SHARE)))
    assert (
        webhook.metric("gpuplace_admission_reviews_total", endpoint="mutate", result="allowed") == 2
    )
    assert (
        webhook.metric(
            "gpuplace_admission_denials_total", endpoint="validate", reason="not-mutated"
        )
        == 1
    )
    assert (
        webhook.metric(
            "gpuplace_admission_duration_seconds_count",
            endpoint="mutate",
            operation="CREATE",
            result="allowed",
        )
        == 2
    )
    assert webhook.metric("gpuplace_admission_patch_operations_total", endpoint="mutate") > 5


async def test_a_bug_is_a_500_never_an_allow(
    make_webhook: MakeWebhook, capabilities: Capabilities
) -> None:
    webhook = await make_webhook()

    class Broken:
        def capabilities(self) -> Capabilities | None:
            raise RuntimeError("boom")

        def paths(self) -> Paths | None:
            raise RuntimeError("boom")

    from gpuplace.webhook import app as webhook_app

    webhook.server.app[webhook_app.REVIEWER].source = Broken()
    pod = helpers.pod(SHARE)
    status, answer = await webhook.post("/validate", helpers.review(pod))
    assert status == 500 and answer == {"error": "internal error; see the gpuplace logs"}
    assert (
        webhook.metric("gpuplace_admission_reviews_total", endpoint="validate", result="error") == 1
    )
    assert "boom" not in json.dumps(answer)


# --- TLS ----------------------------------------------------------------------------------


async def _peer_serial(port: int, cafile: Path) -> int:
    context = ssl.create_default_context(cafile=str(cafile))
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"
    )
    ssl_object = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True)
    writer.close()
    return x509.load_der_x509_certificate(der).serial_number


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
async def test_tls_versions(webhook: Webhook, tls_files: tuple[Path, Path]) -> None:
    assert webhook.certificates.context.minimum_version == ssl.TLSVersion.TLSv1_2
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        context = ssl.create_default_context(cafile=str(tls_files[0]))
        context.minimum_version = context.maximum_version = version
        _, writer = await asyncio.open_connection(
            "127.0.0.1", webhook.port, ssl=context, server_hostname="127.0.0.1"
        )
        assert writer.get_extra_info("ssl_object").version() in ("TLSv1.2", "TLSv1.3")
        writer.close()
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.load_verify_locations(str(tls_files[0]))
    old.set_ciphers("DEFAULT:@SECLEVEL=0")
    old.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
    old.maximum_version = ssl.TLSVersion.TLSv1_1
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await asyncio.open_connection(
            "127.0.0.1", webhook.port, ssl=old, server_hostname="127.0.0.1"
        )


async def test_certificate_is_reloaded_when_files_change(
    make_webhook: MakeWebhook, tmp_path: Path
) -> None:
    cert_file, key_file = helpers.write_certificate(tmp_path / "live", serial=1001)
    old_cert = tmp_path / "old.crt"
    old_cert.write_bytes(cert_file.read_bytes())
    webhook = await make_webhook(tls=(cert_file, key_file), reload_seconds=0.05)
    port = webhook.port
    assert await _peer_serial(port, old_cert) == 1001
    expiry = webhook.metric("gpuplace_webhook_certificate_expiry_timestamp_seconds")
    assert expiry > 0

    async def wait_for(metric: str, **labels: str) -> None:
        for _ in range(200):
            if webhook.metric(metric, **labels):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{metric} {labels} never counted")

    # a half-written rotation (new cert, old key) keeps the old pair in use
    new_cert, new_key = helpers.write_certificate(tmp_path / "new", serial=2002)
    cert_file.write_bytes(new_cert.read_bytes())
    await wait_for("gpuplace_webhook_certificate_reloads_total", result="failed")
    assert await _peer_serial(port, old_cert) == 1001
    # the key arrives: the new pair is used by new connections
    key_file.write_bytes(new_key.read_bytes())
    await wait_for("gpuplace_webhook_certificate_reloads_total", result="ok")
    assert await _peer_serial(port, new_cert) == 2002
    assert webhook.certificates.reloads == 1
    status, _ = await webhook.post("/mutate", helpers.review(helpers.pod()), ssl=False)
    assert status == 200
