"""A certificate with its private key, PEM in and out, and whether the two belong together.

Owns the `Pair` value and `CertError`. Pure: cryptography only, no files, no clock, no
Kubernetes; never logs or prints key material.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
KeyType = Literal["ecdsa-p256", "rsa-2048", "rsa-3072", "rsa-4096"]
KEY_TYPES: tuple[KeyType, ...] = ("ecdsa-p256", "rsa-2048", "rsa-3072", "rsa-4096")


class CertError(ValueError):
    """Certificate material that cannot be used, with a message that says why."""


@dataclass(frozen=True, slots=True)
class Pair:
    """A certificate and the private key of its public key."""

    cert: x509.Certificate
    key: PrivateKey

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    @property
    def not_before(self) -> datetime:
        return self.cert.not_valid_before_utc

    @property
    def not_after(self) -> datetime:
        return self.cert.not_valid_after_utc


def key_type(key: PrivateKey) -> KeyType | None:
    """The `KeyType` spelling of `key`, or None for a key gpuplace would not generate."""
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return "ecdsa-p256" if isinstance(key.curve, ec.SECP256R1) else None
    size = key.key_size
    if size == 2048:
        return "rsa-2048"
    if size == 3072:
        return "rsa-3072"
    if size == 4096:
        return "rsa-4096"
    return None


def load_cert(pem: bytes) -> x509.Certificate:
    """The first certificate of a PEM text (a serving file may carry its chain after it)."""
    certs = load_certs(pem)
    if not certs:
        raise CertError("no PEM certificate found")
    return certs[0]


def load_certs(pem: bytes) -> tuple[x509.Certificate, ...]:
    """Every certificate of a PEM text, in order; empty text gives an empty tuple."""
    if not pem.strip():
        return ()
    try:
        return tuple(x509.load_pem_x509_certificates(pem))
    except ValueError as exc:
        raise CertError(f"not a PEM certificate: {exc}") from None


def load_key(pem: bytes) -> PrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        # The exception text never contains key bytes, only what failed.
        raise CertError(f"not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise CertError(f"unsupported private key type {type(key).__name__}")
    return key


def matches(cert: x509.Certificate, key: PrivateKey) -> bool:
    """True when `key` is the private half of the public key in `cert`."""
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return cert.public_key().public_bytes(*spki) == key.public_key().public_bytes(*spki)


def load(cert_pem: bytes, key_pem: bytes) -> Pair:
    """A `Pair` from PEM texts; `CertError` when either is malformed or they do not match
    (e.g. a reload that caught the new certificate beside the old key)."""
    cert = load_cert(cert_pem)
    key = load_key(key_pem)
    if not matches(cert, key):
        raise CertError("private key does not match the certificate's public key")
    return Pair(cert=cert, key=key)
