"""Is a serving certificate usable: valid now, for these names, chained to a trusted CA?

The chain is verified with cryptography's X.509 path validation (RFC 5280 / web PKI
profile), the same checks a TLS client makes, for each name the API server may dial.
Pure: cryptography only; the clock is a parameter. Messages name what is wrong, never key
material.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from datetime import datetime

from cryptography import exceptions, x509
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID

from gpuplace.certs import issuing, pairs


def dns_names(cert: x509.Certificate) -> tuple[str, ...]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(str(name) for name in san.get_values_for_type(x509.DNSName))


def ip_addresses(cert: x509.Certificate) -> tuple[issuing.IpAddress, ...]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(
        ip
        for ip in san.get_values_for_type(x509.IPAddress)
        if not isinstance(ip, ipaddress.IPv4Network | ipaddress.IPv6Network)
    )


def covers(
    cert: x509.Certificate,
    names: Iterable[str] = (),
    ips: Iterable[issuing.IpAddress] = (),
) -> bool:
    """True when every wanted name and IP is literally among the certificate's SANs."""
    have = {name.lower() for name in dns_names(cert)}
    return all(name.lower() in have for name in names) and set(ips) <= set(ip_addresses(cert))


def server_auth(cert: x509.Certificate) -> bool:
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return False
    return ExtendedKeyUsageOID.SERVER_AUTH in eku


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """True when `ca` signed `cert` (names chain and the signature verifies)."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, exceptions.InvalidSignature):
        return False
    return True


def problems(
    cert: x509.Certificate,
    bundle: Sequence[x509.Certificate],
    now: datetime,
    names: Iterable[str] = (),
    ips: Iterable[issuing.IpAddress] = (),
) -> list[str]:
    """Why `cert` would be refused by a TLS client trusting `bundle` at `now`; [] if none.

    With no names given, the certificate's own DNS SANs are checked.
    """
    wanted_names = tuple(names) or dns_names(cert)
    wanted_ips = tuple(ips)
    found: list[str] = []
    if now < cert.not_valid_before_utc:
        found.append(f"not valid before {cert.not_valid_before_utc.isoformat()}")
    if now >= cert.not_valid_after_utc:
        found.append(f"expired at {cert.not_valid_after_utc.isoformat()}")
    if not server_auth(cert):
        found.append("extended key usage lacks serverAuth")
    missing = [n for n in wanted_names if not covers(cert, names=[n])]
    missing += [str(ip) for ip in wanted_ips if not covers(cert, ips=[ip])]
    if missing:
        found.append(f"SANs lack {', '.join(missing)}")
    if not bundle:
        found.append("the CA bundle is empty")
    elif not any(issued_by(cert, ca) for ca in bundle):
        found.append("not signed by any CA in the bundle")
    if found:
        return found
    store = verification.Store(list(bundle))
    subjects: list[verification.Subject] = [x509.DNSName(n) for n in wanted_names]
    subjects += [x509.IPAddress(ip) for ip in wanted_ips]
    for subject in subjects:
        verifier = (
            verification.PolicyBuilder().store(store).time(now).build_server_verifier(subject)
        )
        try:
            verifier.verify(cert, [])
        except verification.VerificationError as exc:
            found.append(f"chain does not verify for {subject.value}: {exc}")
    return found


def verify(
    pair: pairs.Pair,
    bundle: Sequence[x509.Certificate],
    now: datetime,
    names: Iterable[str] = (),
    ips: Iterable[issuing.IpAddress] = (),
) -> None:
    """Raise `CertError` saying every reason `pair` cannot serve; return when it can."""
    if not pairs.matches(pair.cert, pair.key):
        raise pairs.CertError("private key does not match the certificate's public key")
    found = problems(pair.cert, bundle, now, names, ips)
    if found:
        raise pairs.CertError("; ".join(found))
