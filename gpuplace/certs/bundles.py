"""The `caBundle`: the CA certificates an API server trusts for a webhook.

During a CA rotation the bundle holds the old and the new CA, so that a replica still
serving a certificate of the old CA and one already serving the new are both trusted; a CA
leaves the bundle only once it has expired (nothing it signed can be valid any more).
Pure: cryptography only; the clock is a parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from gpuplace.certs import pairs


def parse(pem: bytes) -> tuple[x509.Certificate, ...]:
    """The certificates of a PEM bundle; empty or whitespace gives ()."""
    return pairs.load_certs(pem)


def encode(certs: Iterable[x509.Certificate]) -> bytes:
    return b"".join(cert.public_bytes(serialization.Encoding.PEM) for cert in certs)


def fingerprint(cert: x509.Certificate) -> bytes:
    return cert.fingerprint(hashes.SHA256())


def merge(*groups: Iterable[x509.Certificate]) -> tuple[x509.Certificate, ...]:
    """Every CA of every group once (same DER = same CA), oldest first by notBefore.

    Order is by age so the text of a bundle does not change when the same CAs are merged
    again in another order: re-patching an unchanged bundle is then a no-op.
    """
    seen: dict[bytes, x509.Certificate] = {}
    for group in groups:
        for cert in group:
            seen.setdefault(fingerprint(cert), cert)
    return tuple(sorted(seen.values(), key=lambda c: (c.not_valid_before_utc, fingerprint(c))))


def prune(certs: Iterable[x509.Certificate], now: datetime) -> tuple[x509.Certificate, ...]:
    """`certs` without those that have expired at `now` and without non-CA certificates."""
    kept = []
    for cert in certs:
        if cert.not_valid_after_utc <= now:
            continue
        try:
            constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            continue
        if constraints.ca:
            kept.append(cert)
    return tuple(kept)


def combine(now: datetime, *groups: Iterable[x509.Certificate]) -> tuple[x509.Certificate, ...]:
    """The bundle to publish: all CAs of `groups`, merged, expired ones dropped."""
    return prune(merge(*groups), now)
