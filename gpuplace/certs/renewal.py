"""When to renew, and what a rotation produces, decided from the certificates and a clock.

A certificate is renewed once `renew_fraction` (2/3 by default) of its lifetime has passed,
so a one-year serving certificate is replaced with four months to spare and a five-year CA
with twenty months. A new CA is added to the bundle beside the old one, and the old one
stays there until it expires: every certificate either CA signed stays trusted through the
whole overlap, whatever order replicas reload in. The caller must publish the new bundle
before the new serving pair (see `docs/certs.md`). Pure: cryptography only, the clock is a
parameter, nothing is written anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509

from gpuplace.certs import bundles, checking, issuing, pairs


def renew_at(cert: x509.Certificate, fraction: float = issuing.RENEW_FRACTION) -> datetime:
    """The moment `fraction` of the certificate's lifetime has passed."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) * fraction


def due(cert: x509.Certificate, now: datetime, fraction: float = issuing.RENEW_FRACTION) -> bool:
    return now >= renew_at(cert, fraction)


@dataclass(frozen=True, slots=True)
class Plan:
    """What a rotation must issue, and why (one reason per decision, readable)."""

    new_ca: bool
    new_serving: bool
    reasons: tuple[str, ...]

    @property
    def nothing(self) -> bool:
        return not (self.new_ca or self.new_serving)


@dataclass(frozen=True, slots=True)
class Material:
    """Everything one webhook installation holds: its CA (with key, to sign renewals), the
    serving pair, and the bundle the API server trusts (always including `ca.cert`)."""

    ca: pairs.Pair
    serving: pairs.Pair
    bundle: tuple[x509.Certificate, ...]

    def bundle_pem(self) -> bytes:
        return bundles.encode(self.bundle)


def decide(
    ca: pairs.Pair | None,
    serving: pairs.Pair | None,
    spec: issuing.Spec,
    now: datetime,
) -> Plan:
    """What to issue so that a CA and a serving pair for `spec` are valid well past `now`."""
    fraction = spec.renew_fraction
    if ca is None:
        return Plan(True, True, ("no CA yet",))
    if now >= ca.not_after:
        return Plan(True, True, (f"CA expired at {ca.not_after.isoformat()}",))
    if due(ca.cert, now, fraction):
        when = renew_at(ca.cert, fraction).isoformat()
        return Plan(True, True, (f"CA renewal was due at {when}",))
    if serving is None:
        return Plan(False, True, ("no serving certificate yet",))
    reasons: list[str] = []
    if not checking.issued_by(serving.cert, ca.cert):
        reasons.append("serving certificate was not signed by the current CA")
    if now >= serving.not_after:
        reasons.append(f"serving certificate expired at {serving.not_after.isoformat()}")
    elif due(serving.cert, now, fraction):
        when = renew_at(serving.cert, fraction).isoformat()
        reasons.append(f"serving renewal was due at {when}")
    if not checking.covers(serving.cert, spec.dns_names, spec.ip_addresses):
        reasons.append("serving certificate lacks some of the wanted names")
    if pairs.key_type(serving.key) != spec.key_type:
        reasons.append(f"serving key is not {spec.key_type}")
    return Plan(False, bool(reasons), tuple(reasons))


def rotate(
    ca: pairs.Pair | None,
    serving: pairs.Pair | None,
    bundle: Sequence[x509.Certificate],
    spec: issuing.Spec,
    now: datetime,
) -> tuple[Plan, Material]:
    """Apply `decide`: the material to hold after this run (unchanged pairs kept as they are).

    The returned bundle is the old bundle plus the old and the new CA, minus expired CAs.
    """
    plan = decide(ca, serving, spec, now)
    new_ca = issuing.new_ca(spec, now) if plan.new_ca or ca is None else ca
    if plan.new_serving or serving is None:
        new_serving = issuing.new_serving(new_ca, spec, now)
    else:
        new_serving = serving
    previous = () if ca is None else (ca.cert,)
    trusted = bundles.combine(now, bundle, previous, (new_ca.cert,))
    return plan, Material(ca=new_ca, serving=new_serving, bundle=trusted)


def issue(bundle: Sequence[x509.Certificate], spec: issuing.Spec, now: datetime) -> Material:
    """A new CA and serving pair regardless of what exists; CAs of `bundle` that have not
    expired stay trusted, so replicas still serving an older pair keep working."""
    ca = issuing.new_ca(spec, now)
    serving = issuing.new_serving(ca, spec, now)
    return Material(ca=ca, serving=serving, bundle=bundles.combine(now, bundle, (ca.cert,)))
