"""Chains, names, pairs: `gpuplace.certs.checking` and `gpuplace.certs.pairs`, and a real TLS
handshake on
127.0.0.1 with the issued pair (what kube-apiserver does when it calls the webhook)."""

from __future__ import annotations

import asyncio
import ssl
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509

from gpuplace.certs import bundles, checking, issuing, pairs, renewal

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
SPEC = issuing.Spec(dns_names=issuing.service_names("gpuplace-webhook", "gpuplace"))


@pytest.fixture(scope="module")
def material() -> renewal.Material:
    return renewal.issue((), SPEC, NOW)


@pytest.fixture(scope="module")
def stranger() -> pairs.Pair:
    return issuing.new_ca(SPEC, NOW)


def test_chain_verifies_against_its_ca_for_every_service_name(
    material: renewal.Material,
) -> None:
    assert checking.problems(material.serving.cert, [material.ca.cert], NOW, SPEC.dns_names) == []
    checking.verify(material.serving, material.bundle, NOW, SPEC.dns_names)


def test_chain_verifies_in_a_bundle_with_other_cas(
    material: renewal.Material, stranger: pairs.Pair
) -> None:
    bundle = bundles.merge([stranger.cert], material.bundle)
    assert checking.problems(material.serving.cert, bundle, NOW) == []


def test_unrelated_ca_is_refused(material: renewal.Material, stranger: pairs.Pair) -> None:
    found = checking.problems(material.serving.cert, [stranger.cert], NOW)
    assert found == ["not signed by any CA in the bundle"]
    with pytest.raises(pairs.CertError, match="not signed"):
        checking.verify(material.serving, [stranger.cert], NOW)


def test_expired_and_not_yet_valid(material: renewal.Material) -> None:
    after = material.serving.not_after + timedelta(seconds=1)
    assert any("expired" in p for p in checking.problems(material.serving.cert, [], after))
    before = material.serving.not_before - timedelta(seconds=1)
    found = checking.problems(material.serving.cert, material.bundle, before)
    assert any("not valid before" in p for p in found)


def test_missing_names_are_named(material: renewal.Material) -> None:
    found = checking.problems(
        material.serving.cert, material.bundle, NOW, ["other.gpuplace.svc", *SPEC.dns_names]
    )
    assert found == ["SANs lack other.gpuplace.svc"]


def test_a_ca_certificate_cannot_serve(material: renewal.Material) -> None:
    found = checking.problems(material.ca.cert, material.bundle, NOW, ["gpuplace-ca"])
    assert "extended key usage lacks serverAuth" in found


def test_pair_load_refuses_a_key_of_another_certificate(
    material: renewal.Material, stranger: pairs.Pair
) -> None:
    assert pairs.load(material.serving.cert_pem(), material.serving.key_pem()).cert == (
        material.serving.cert
    )
    with pytest.raises(pairs.CertError, match="does not match"):
        pairs.load(material.serving.cert_pem(), stranger.key_pem())
    with pytest.raises(pairs.CertError, match="does not match"):
        checking.verify(pairs.Pair(material.serving.cert, stranger.key), material.bundle, NOW)


@pytest.mark.parametrize(
    ("cert_pem", "key_pem", "message"),
    [
        (b"", b"", "no PEM certificate"),
        (b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", b"", "not a PEM"),
        (None, b"not a key", "not an unencrypted PEM private key"),
    ],
)
def test_pair_load_explains_malformed_input(
    material: renewal.Material, cert_pem: bytes | None, key_pem: bytes, message: str
) -> None:
    with pytest.raises(pairs.CertError, match=message) as caught:
        pairs.load(material.serving.cert_pem() if cert_pem is None else cert_pem, key_pem)
    assert b"PRIVATE KEY" not in str(caught.value).encode()


def test_first_certificate_of_a_chain_file_is_the_leaf(material: renewal.Material) -> None:
    chain = material.serving.cert_pem() + material.ca.cert_pem()
    assert pairs.load(chain, material.serving.key_pem()).cert == material.serving.cert


def test_key_type_names(material: renewal.Material) -> None:
    assert pairs.key_type(material.serving.key) == "ecdsa-p256"


async def _handshake(server_pair: pairs.Pair, trusted: list[x509.Certificate]) -> str:
    """Serve TLS on 127.0.0.1 with `server_pair`; connect as the API server would
    (hostname = the Service DNS name, trusting `trusted`); return what the server said."""
    with tempfile.TemporaryDirectory() as tmp:
        cert_file, key_file = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        cert_file.write_bytes(server_pair.cert_pem())
        key_file.write_bytes(server_pair.key_pem())
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(cert_file, key_file)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    client_ctx = ssl.create_default_context(cadata=bundles.encode(trusted).decode())
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                "127.0.0.1", port, ssl=client_ctx, server_hostname=SPEC.dns_names[0]
            ),
            5,
        )
        data = await reader.read()
        writer.close()
        return data.decode()
    finally:
        server.close()
        await server.wait_closed()


async def test_real_tls_handshake_trusts_the_bundle() -> None:
    now = datetime.now(UTC)  # the TLS stack reads the real clock
    fresh = renewal.issue((), SPEC, now)
    assert await _handshake(fresh.serving, list(fresh.bundle)) == "ok"


async def test_real_tls_handshake_refuses_an_unrelated_ca() -> None:
    now = datetime.now(UTC)
    fresh = renewal.issue((), SPEC, now)
    other = issuing.new_ca(SPEC, now)
    with pytest.raises(ssl.SSLCertVerificationError):
        await _handshake(fresh.serving, [other.cert])


async def test_real_tls_during_ca_overlap_both_pairs_are_trusted() -> None:
    """A replica still on the old CA's pair and one on the new CA's pair both pass TLS
    against the overlap bundle; the old bundle alone refuses the new pair (so the bundle
    must be published first)."""
    now = datetime.now(UTC)
    old = renewal.issue((), SPEC, now)
    new = renewal.issue(old.bundle, SPEC, now)
    assert len(new.bundle) == 2
    assert await _handshake(old.serving, list(new.bundle)) == "ok"
    assert await _handshake(new.serving, list(new.bundle)) == "ok"
    with pytest.raises(ssl.SSLCertVerificationError):
        await _handshake(new.serving, list(old.bundle))
