"""Making keys, a webhook CA and serving certificates signed by it.

What a Kubernetes API server (Go crypto/tls) needs to call a webhook Service: a serving
certificate whose SANs hold `NAME.NAMESPACE.svc` (the name the API server dials) and
`NAME.NAMESPACE.svc.cluster.local`, extended key usage serverAuth, signed by a CA that is in
the webhook configuration's `caBundle`. Pure: cryptography only; the clock is a parameter.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpuplace.certs import pairs

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

CA_VALIDITY = timedelta(days=5 * 365)
SERVING_VALIDITY = timedelta(days=365)
RENEW_FRACTION = 2 / 3
BACKDATE = timedelta(minutes=5)
"""notBefore is set this far in the past so a peer whose clock lags a little accepts it."""


@dataclass(frozen=True, slots=True)
class Spec:
    """What to issue. `dns_names` must include the Service names (see `service_names`)."""

    dns_names: tuple[str, ...]
    ip_addresses: tuple[IpAddress, ...] = ()
    key_type: pairs.KeyType = "ecdsa-p256"
    ca_validity: timedelta = CA_VALIDITY
    serving_validity: timedelta = SERVING_VALIDITY
    renew_fraction: float = RENEW_FRACTION
    """Renew a certificate once this fraction of its lifetime has passed."""
    ca_name: str = "gpuplace-ca"
    organization: str = field(default="gpuplace")

    def __post_init__(self) -> None:
        if not self.dns_names and not self.ip_addresses:
            raise pairs.CertError("a serving certificate needs at least one DNS name or IP")
        if self.key_type not in pairs.KEY_TYPES:
            raise pairs.CertError(f"key type must be one of {', '.join(pairs.KEY_TYPES)}")
        if not 0 < self.renew_fraction < 1:
            raise pairs.CertError("renew fraction must be between 0 and 1 (exclusive)")
        for validity in (self.ca_validity, self.serving_validity):
            if validity <= BACKDATE:
                raise pairs.CertError("validity must be longer than a few minutes")
        for name in self.dns_names:
            _check_dns_name(name)


def service_names(service: str, namespace: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The DNS names a webhook Service is reached by, then `extra`, without duplicates."""
    wanted = [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local", *extra]
    return tuple(dict.fromkeys(name.strip().lower().rstrip(".") for name in wanted))


def new_key(kind: pairs.KeyType) -> pairs.PrivateKey:
    if kind == "ecdsa-p256":
        return ec.generate_private_key(ec.SECP256R1())
    bits = {"rsa-2048": 2048, "rsa-3072": 3072, "rsa-4096": 4096}[kind]
    return rsa.generate_private_key(public_exponent=65537, key_size=bits)


def new_ca(spec: Spec, now: datetime) -> pairs.Pair:
    """A self-signed CA that may sign end-entity certificates only (pathLen 0).

    Its common name carries the issue time so that two CAs in one caBundle are told apart.
    """
    now = _utc(now)
    key = new_key(spec.key_type)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, spec.organization),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{spec.ca_name}@{int(now.timestamp())}"),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + spec.ca_validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            _key_usage(signs_certificates=True),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    return pairs.Pair(cert=cert, key=key)


def _key_usage(*, signs_certificates: bool = False, encipherment: bool = False) -> x509.KeyUsage:
    """Digital signature always; certificate and CRL signing for a CA; key encipherment
    for an RSA serving key. Everything else off."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=encipherment,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs_certificates,
        crl_sign=signs_certificates,
        encipher_only=False,
        decipher_only=False,
    )


def new_serving(ca: pairs.Pair, spec: Spec, now: datetime) -> pairs.Pair:
    """A serving certificate for `spec`'s names signed by `ca`, never outliving it."""
    now = _utc(now)
    if not ca.not_before <= now < ca.not_after:
        raise pairs.CertError("the CA is not valid now; issue a new CA first")
    key = new_key(spec.key_type)
    first = spec.dns_names[0] if spec.dns_names else str(spec.ip_addresses[0])
    sans: list[x509.GeneralName] = [x509.DNSName(name) for name in spec.dns_names]
    sans += [x509.IPAddress(ip) for ip in spec.ip_addresses]
    ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, spec.organization),
                    x509.NameAttribute(NameOID.COMMON_NAME, first[:64]),
                ]
            )
        )
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(max(now - BACKDATE, ca.not_before))
        .not_valid_after(min(now + spec.serving_validity, ca.not_after))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            # RSA key exchange needs keyEncipherment; ECDSA keys must not claim it.
            _key_usage(encipherment=isinstance(key, rsa.RSAPrivateKey)),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    return pairs.Pair(cert=cert, key=key)


def parse_ip(text: str) -> IpAddress:
    try:
        return ipaddress.ip_address(text.strip())
    except ValueError:
        raise pairs.CertError(f"not an IP address: {text!r}") from None


def _check_dns_name(name: str) -> None:
    labels = name.split(".")
    if len(labels) > 1 and labels[0] == "*":
        labels = labels[1:]  # a wildcard is allowed as the whole leftmost label only
    ok = 0 < len(name) <= 253 and all(
        0 < len(label) <= 63
        and label.isascii()
        and all(c.isalnum() or c == "-" for c in label)
        and not label.startswith("-")
        and not label.endswith("-")
        for label in labels
    )
    if not ok:
        raise pairs.CertError(f"not a DNS name: {name!r}")


def _utc(now: datetime) -> datetime:
    if now.tzinfo is None:
        raise pairs.CertError("times must be timezone-aware (UTC)")
    return now
