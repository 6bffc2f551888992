"""The caBundle: merge keeps each CA once, prune drops exactly the expired ones."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from hypothesis import given
from hypothesis import strategies as st

from gpuplace.certs import bundles, issuing, pairs

START = datetime(2026, 1, 1, tzinfo=UTC)
SPEC = issuing.Spec(
    dns_names=issuing.service_names("gpuplace-webhook", "gpuplace"),
    ca_validity=timedelta(days=400),
)

# Six CAs issued 100 days apart, each valid 400 days: at any moment some have expired.
POOL = tuple(issuing.new_ca(SPEC, START + timedelta(days=100 * i)).cert for i in range(6))
LEAF = issuing.new_serving(issuing.new_ca(SPEC, START), SPEC, START).cert


def test_encode_parse_round_trip() -> None:
    assert bundles.parse(bundles.encode(POOL)) == POOL
    assert bundles.parse(b"") == ()
    assert bundles.parse(b"  \n") == ()
    with pytest.raises(pairs.CertError):
        bundles.parse(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")


@given(st.lists(st.sampled_from(POOL), max_size=12), st.lists(st.sampled_from(POOL)))
def test_merge_keeps_each_ca_once_oldest_first_whatever_the_order(
    first: list[x509.Certificate], second: list[x509.Certificate]
) -> None:
    merged = bundles.merge(first, second)
    assert set(merged) == set(first) | set(second)
    assert len(merged) == len(set(merged))
    starts = [c.not_valid_before_utc for c in merged]
    assert starts == sorted(starts)
    # Same CAs in any order and any repetition give the same bytes: no needless patch.
    assert bundles.encode(bundles.merge(second, first, first)) == bundles.encode(merged)


@given(st.lists(st.sampled_from(POOL), max_size=12), st.integers(0, 1200))
def test_prune_drops_exactly_the_expired(certs: list[x509.Certificate], day: int) -> None:
    now = START + timedelta(days=day)
    kept = bundles.prune(certs, now)
    assert all(c.not_valid_after_utc > now for c in kept)
    assert [c for c in certs if c.not_valid_after_utc > now] == list(kept)


def test_prune_drops_non_ca_certificates() -> None:
    assert bundles.prune([LEAF, POOL[0]], START) == (POOL[0],)


def test_combine_is_idempotent() -> None:
    now = START + timedelta(days=450)
    once = bundles.combine(now, POOL[:3], POOL[2:])
    assert bundles.combine(now, once, once) == once
    assert POOL[0] not in once  # expired at day 400
    assert POOL[1] in once
