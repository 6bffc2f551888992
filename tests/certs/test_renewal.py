"""Renewal decisions on an injected clock, and twelve years of daily rotations."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.certs import bundles, checking, issuing, renewal

T0 = datetime(2026, 1, 1, tzinfo=UTC)
NAMES = issuing.service_names("gpuplace-webhook", "gpuplace")
SPEC = issuing.Spec(dns_names=NAMES)


@pytest.fixture(scope="module")
def installed() -> renewal.Material:
    return renewal.issue((), SPEC, T0)


def test_renew_at_two_thirds_of_the_lifetime(installed: renewal.Material) -> None:
    cert = installed.serving.cert
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    at = renewal.renew_at(cert)
    assert at - cert.not_valid_before_utc == lifetime * 2 / 3
    assert not renewal.due(cert, at - timedelta(seconds=1))
    assert renewal.due(cert, at)
    # Four months to spare for a one-year certificate, twenty for a five-year CA.
    assert cert.not_valid_after_utc - at > timedelta(days=120)
    ca_at = renewal.renew_at(installed.ca.cert)
    assert installed.ca.not_after - ca_at > timedelta(days=600)


def test_nothing_to_do_on_a_fresh_installation(installed: renewal.Material) -> None:
    plan = renewal.decide(installed.ca, installed.serving, SPEC, T0 + timedelta(days=30))
    assert plan.nothing and plan.reasons == ()


def test_serving_renewal_keeps_the_ca(installed: renewal.Material) -> None:
    when = renewal.renew_at(installed.serving.cert)
    plan, after = renewal.rotate(installed.ca, installed.serving, installed.bundle, SPEC, when)
    assert (plan.new_ca, plan.new_serving) == (False, True)
    assert "serving renewal was due" in plan.reasons[0]
    assert after.ca == installed.ca
    assert after.bundle == installed.bundle  # caBundle unchanged: nothing to patch
    assert after.serving.cert != installed.serving.cert
    assert checking.problems(after.serving.cert, after.bundle, when, NAMES) == []


def test_ca_renewal_keeps_the_old_ca_in_the_bundle(installed: renewal.Material) -> None:
    when = renewal.renew_at(installed.ca.cert)
    plan, after = renewal.rotate(installed.ca, installed.serving, installed.bundle, SPEC, when)
    assert (plan.new_ca, plan.new_serving) == (True, True)
    assert after.bundle == (installed.ca.cert, after.ca.cert)
    assert checking.issued_by(after.serving.cert, after.ca.cert)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"dns_names": (*NAMES, "gpuplace.example.com")}, "lacks some of the wanted names"),
        ({"key_type": "rsa-2048"}, "serving key is not rsa-2048"),
    ],
)
def test_changed_wishes_renew_the_serving_certificate(
    installed: renewal.Material, change: dict[str, object], reason: str
) -> None:
    wanted = issuing.Spec(**{"dns_names": NAMES, **change})  # type: ignore[arg-type]
    plan = renewal.decide(installed.ca, installed.serving, wanted, T0 + timedelta(days=1))
    assert plan.new_serving and not plan.new_ca
    assert reason in plan.reasons[0]


def test_missing_and_foreign_material(installed: renewal.Material) -> None:
    assert renewal.decide(None, None, SPEC, T0).reasons == ("no CA yet",)
    plan = renewal.decide(installed.ca, None, SPEC, T0)
    assert plan.reasons == ("no serving certificate yet",) and not plan.new_ca
    other = renewal.issue((), SPEC, T0)
    plan = renewal.decide(installed.ca, other.serving, SPEC, T0)
    assert plan.reasons == ("serving certificate was not signed by the current CA",)


def test_long_expired_installation_starts_over(installed: renewal.Material) -> None:
    years_later = installed.ca.not_after + timedelta(days=10)
    plan, after = renewal.rotate(
        installed.ca, installed.serving, installed.bundle, SPEC, years_later
    )
    assert plan.new_ca and "CA expired" in plan.reasons[0]
    assert after.bundle == (after.ca.cert,)  # the expired CA left the bundle


def test_twelve_years_of_daily_rotation_never_leave_a_gap() -> None:
    """The CronJob's life, one run a day, on an injected clock.

    Every day: the serving pair is valid and verifies for every Service name against the
    published bundle; the pair of the day before (still on a replica that has not reloaded
    yet) verifies against today's bundle too; no expired CA is published."""
    material = renewal.issue((), SPEC, T0)
    serving_renewals = ca_renewals = 0
    for day in range(1, 12 * 365):
        now = T0 + timedelta(days=day)
        before = material
        plan, material = renewal.rotate(before.ca, before.serving, before.bundle, SPEC, now)
        ca_renewals += plan.new_ca
        serving_renewals += plan.new_serving
        if plan.nothing:
            assert (material.ca, material.serving) == (before.ca, before.serving)
            # Only an expired CA may leave the bundle on a quiet day.
            assert material.bundle == bundles.prune(before.bundle, now)
            continue
        assert checking.problems(material.serving.cert, material.bundle, now, NAMES) == []
        assert checking.problems(before.serving.cert, material.bundle, now, NAMES) == []
        assert all(ca.not_valid_after_utc > now for ca in material.bundle)
        assert material.ca.cert in material.bundle
        # Decided once, done: the next run the same day has nothing left to do.
        assert renewal.decide(material.ca, material.serving, SPEC, now).nothing
    # 5-year CA renewed at 2/3: days 1217, 2434, 3651 -> 3 new CAs, each with a new
    # serving pair. 1-year serving renewed at 2/3 (due 243.3 days after issue, so on the
    # 244th daily run): 4 times within each 1217-day CA period, twice in the last 728 days.
    assert ca_renewals == 3
    assert serving_renewals == 3 * (1 + 4) + 2


@settings(max_examples=30, deadline=None)
@given(
    serving_days=st.integers(2, 800),
    ca_days=st.integers(2, 3000),
    fraction=st.floats(0.2, 0.9),
    first_run=st.integers(0, 4000),
    step=st.integers(1, 40),
)
def test_after_any_rotation_the_pair_is_usable_and_not_yet_due(
    serving_days: int, ca_days: int, fraction: float, first_run: int, step: int
) -> None:
    wanted = issuing.Spec(
        dns_names=NAMES,
        serving_validity=timedelta(days=serving_days),
        ca_validity=timedelta(days=ca_days),
        renew_fraction=fraction,
    )
    material = renewal.issue((), wanted, T0)
    for run in range(5):
        now = T0 + timedelta(days=first_run + run * step)
        _plan, material = renewal.rotate(
            material.ca, material.serving, material.bundle, wanted, now
        )
        assert checking.problems(material.serving.cert, material.bundle, now, NAMES) == []
        assert not renewal.due(material.serving.cert, now, fraction)
        assert not renewal.due(material.ca.cert, now, fraction)
        assert bundles.prune(material.bundle, now) == material.bundle
