"""The cert-manager overlay (cert-manager.io/v1 objects are CRDs: kubernetes-validate has no
schema for them, so their shape is checked here field by field against cert-manager's v1
API): a self-signed Issuer makes a CA that keeps its key across renewals, a CA Issuer signs
the serving certificate into the Secret the Deployment mounts, and cainjector fills both
webhook configurations from the CA."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

from gpuplace.certs import issuing
from gpuplace.cluster import certificates
from tests.deploy.rendering import Obj, named, one, render

CERTIFICATE_SPEC = {
    "secretName",
    "commonName",
    "dnsNames",
    "ipAddresses",
    "duration",
    "renewBefore",
    "usages",
    "privateKey",
    "issuerRef",
    "isCA",
    "subject",
    "secretTemplate",
    "revisionHistoryLimit",
}
USAGES = {"server auth", "digital signature", "key encipherment", "cert sign", "crl sign"}


def hours(text: str) -> timedelta:
    match = re.fullmatch(r"(\d+)h", text)
    assert match, text
    return timedelta(hours=int(match[1]))


@pytest.fixture(scope="module")
def objects() -> list[Obj]:
    return render("overlays/cert-manager")


def test_issuer_chain(objects: list[Obj]) -> None:
    issuers = named(objects, "Issuer")
    certificates = named(objects, "Certificate")
    assert issuers["gpuplace-selfsigned"]["spec"] == {"selfSigned": {}}
    ca = certificates["gpuplace-ca"]["spec"]
    assert ca["isCA"] is True
    assert ca["issuerRef"] == {
        "group": "cert-manager.io",
        "kind": "Issuer",
        "name": "gpuplace-selfsigned",
    }
    assert issuers["gpuplace-ca"]["spec"] == {"ca": {"secretName": ca["secretName"]}}
    serving = certificates["gpuplace-webhook"]["spec"]
    assert serving["issuerRef"] == {
        "group": "cert-manager.io",
        "kind": "Issuer",
        "name": "gpuplace-ca",
    }
    for obj in [*issuers.values(), *certificates.values()]:
        assert obj["apiVersion"] == "cert-manager.io/v1"
        assert obj["metadata"]["namespace"] == "gpuplace"
    for cert in certificates.values():
        assert set(cert["spec"]) <= CERTIFICATE_SPEC


def test_serving_certificate_matches_service_secret_and_renewal_policy(objects: list[Obj]) -> None:
    serving = one(objects, "Certificate", "gpuplace-webhook")["spec"]
    service = one(objects, "Service", "gpuplace-webhook")["metadata"]
    assert tuple(serving["dnsNames"]) == issuing.service_names(
        service["name"], service["namespace"]
    )
    assert serving["secretName"] == certificates.DEFAULT_SECRET
    pod = one(objects, "Deployment", "gpuplace")["spec"]["template"]["spec"]
    assert any(
        v.get("secret", {}).get("secretName") == serving["secretName"] for v in pod["volumes"]
    )
    assert "server auth" in serving["usages"] and set(serving["usages"]) <= USAGES
    assert serving["privateKey"] == {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"}
    # Renewed at 2/3 of its lifetime, like `gpuplace certs rotate`.
    assert hours(serving["renewBefore"]) * 3 == hours(serving["duration"])
    assert hours(serving["duration"]) == issuing.SERVING_VALIDITY


def test_ca_keeps_its_key_so_renewal_never_distrusts_live_certificates(objects: list[Obj]) -> None:
    ca = one(objects, "Certificate", "gpuplace-ca")["spec"]
    assert ca["privateKey"]["rotationPolicy"] == "Never"
    assert hours(ca["renewBefore"]) * 3 == hours(ca["duration"])
    assert hours(ca["duration"]) >= issuing.CA_VALIDITY


def test_cainjector_fills_both_webhook_configurations_from_the_ca(objects: list[Obj]) -> None:
    ca = one(objects, "Certificate", "gpuplace-ca")
    wanted = f"{ca['metadata']['namespace']}/{ca['metadata']['name']}"
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        config = one(objects, kind)
        assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == wanted
        assert all("caBundle" not in w["clientConfig"] for w in config["webhooks"])
        assert config["webhooks"] == one(render("base"), kind)["webhooks"]  # only annotated


def test_no_self_managed_rotation_in_this_overlay(objects: list[Obj]) -> None:
    assert not [o for o in objects if o["kind"] == "CronJob"]
    assert "gpuplace-certs" not in named(objects, "ServiceAccount")
