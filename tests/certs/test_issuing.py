"""What `gpuplace.certs.issuing` puts into a CA and a serving certificate."""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID
from hypothesis import given
from hypothesis import strategies as st

from gpuplace.certs import checking, issuing, pairs

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
NAMES = issuing.service_names("gpuplace-webhook", "gpuplace")


def spec(**kwargs: object) -> issuing.Spec:
    return issuing.Spec(dns_names=NAMES, **kwargs)  # type: ignore[arg-type]


def test_service_names_are_what_the_api_server_dials() -> None:
    assert NAMES == (
        "gpuplace-webhook.gpuplace.svc",
        "gpuplace-webhook.gpuplace.svc.cluster.local",
    )
    extra = issuing.service_names("hook", "ns", ["Hook.Example.COM.", "hook.ns.svc"])
    assert extra == ("hook.ns.svc", "hook.ns.svc.cluster.local", "hook.example.com")


def test_serving_certificate_sans_usages_and_constraints() -> None:
    ip = ipaddress.ip_address("10.0.0.7")
    wanted = issuing.Spec(dns_names=(*NAMES, "gpuplace.example.com"), ip_addresses=(ip,))
    ca = issuing.new_ca(wanted, NOW)
    serving = issuing.new_serving(ca, wanted, NOW)
    cert = serving.cert

    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [*NAMES, "gpuplace.example.com"]
    assert san.get_values_for_type(x509.IPAddress) == [ip]

    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.digital_signature
    assert not usage.value.key_cert_sign and not usage.value.key_encipherment  # ECDSA key
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca is False

    assert cert.issuer == ca.cert.subject
    assert checking.issued_by(cert, ca.cert)
    assert isinstance(serving.key, ec.EllipticCurvePrivateKey)
    assert isinstance(serving.key.curve, ec.SECP256R1)
    assert cert.not_valid_before_utc <= NOW < cert.not_valid_after_utc
    assert cert.not_valid_after_utc == NOW + issuing.SERVING_VALIDITY


def test_ca_is_a_ca_that_signs_only_leaves() -> None:
    ca = issuing.new_ca(spec(), NOW)
    constraints = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = ca.cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    assert ca.cert.subject == ca.cert.issuer
    assert ca.not_after - NOW == issuing.CA_VALIDITY
    assert timedelta(days=3 * 365) <= issuing.CA_VALIDITY  # "years"
    # Two CAs issued at different times are told apart in a bundle by their names.
    later = issuing.new_ca(spec(), NOW + timedelta(days=1))
    assert later.cert.subject != ca.cert.subject


def test_rsa_serving_key_claims_key_encipherment() -> None:
    wanted = spec(key_type="rsa-2048")
    ca = issuing.new_ca(wanted, NOW)
    serving = issuing.new_serving(ca, wanted, NOW)
    assert isinstance(serving.key, rsa.RSAPrivateKey) and serving.key.key_size == 2048
    usage = serving.cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_encipherment and usage.digital_signature
    assert checking.problems(serving.cert, [ca.cert], NOW, NAMES) == []


def test_serving_certificate_never_outlives_its_ca() -> None:
    short = spec(ca_validity=timedelta(days=30))
    ca = issuing.new_ca(short, NOW)
    serving = issuing.new_serving(ca, short, NOW + timedelta(days=10))
    assert serving.not_after == ca.not_after


def test_refuses_to_sign_with_a_ca_that_is_not_valid_now() -> None:
    ca = issuing.new_ca(spec(), NOW)
    with pytest.raises(pairs.CertError, match="CA is not valid now"):
        issuing.new_serving(ca, spec(), ca.not_after + timedelta(seconds=1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dns_names": ()}, "at least one DNS name"),
        ({"dns_names": ("bad_name.svc",)}, "not a DNS name"),
        ({"dns_names": ("-x.svc",)}, "not a DNS name"),
        ({"dns_names": ("a" * 64 + ".svc",)}, "not a DNS name"),
        ({"dns_names": NAMES, "renew_fraction": 1.0}, "renew fraction"),
        ({"dns_names": NAMES, "key_type": "dsa-1024"}, "key type"),
        ({"dns_names": NAMES, "serving_validity": timedelta(minutes=1)}, "validity"),
    ],
)
def test_spec_refuses_what_cannot_be_issued(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(pairs.CertError, match=message):
        issuing.Spec(**kwargs)  # type: ignore[arg-type]


def test_wildcard_names_are_allowed_as_the_leftmost_label_only() -> None:
    issuing.Spec(dns_names=("*.gpuplace.example.com",))
    with pytest.raises(pairs.CertError):
        issuing.Spec(dns_names=("gpuplace.*.example.com",))


def test_naive_times_are_refused() -> None:
    with pytest.raises(pairs.CertError, match="timezone"):
        issuing.new_ca(spec(), datetime(2026, 1, 1))


def test_parse_ip() -> None:
    assert issuing.parse_ip(" ::1 ") == ipaddress.ip_address("::1")
    with pytest.raises(pairs.CertError, match="not an IP"):
        issuing.parse_ip("10.0.0")


@given(
    service=st.from_regex(r"[a-z]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True),
    namespace=st.from_regex(r"[a-z]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True),
)
def test_any_valid_service_and_namespace_gives_a_usable_spec(service: str, namespace: str) -> None:
    names = issuing.service_names(service, namespace)
    assert names[0] == f"{service}.{namespace}.svc"
    assert names[1] == f"{service}.{namespace}.svc.cluster.local"
    issuing.Spec(dns_names=names)
