"""gpuplace.cluster.refusals: what counts as a refusal, when it is loud, and what fails /readyz."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from gpuplace.cluster import refusals


def test_a_missing_lease_is_a_refusal_only_once_it_lasts() -> None:
    """kube-scheduler creates its Lease just after it starts: a 404 at first is no alarm."""
    now = [0.0]
    found = refusals.Refusals(missing_grace=30.0, clock=lambda: now[0])
    lease = ("get", refusals.LEASES)
    found.answered(*lease, 404, "NotFound", missing=True)
    now[0] = 29.0
    found.answered(*lease, 404, "NotFound", missing=True)
    assert found.current(*lease) is None and found.not_ready_reason() is None
    now[0] = 31.0
    found.answered(*lease, 404, "NotFound", missing=True)
    refused = found.current(*lease)
    assert refused is not None
    assert "get leases.coordination.k8s.io: 404 NotFound" in refusals.describe(refused)
    # gangs only: reported by the gang controller's Events, never by /readyz
    assert found.not_ready_reason() is None
    found.answered("list", "pods", 403, "Forbidden")
    assert "list pods: 403 Forbidden" in str(found.not_ready_reason())
    found.answered("list", "pods", 200)
    found.answered(*lease, 200)
    assert found.current(*lease) is None
    # a 404 of a pod that was deleted is no refusal at all; a 403 is one at once
    found.answered("get", "pods", 404, "NotFound")
    found.answered("patch", "nodes/status", 403, "Forbidden")
    assert found.current("get", "pods") is None
    assert found.current("patch", "nodes/status") is not None
    assert found.not_ready_reason() is None  # Events and capacity only: not blocking
    denied = 'admission webhook "validate.gpuplace.io" denied the request: no'
    found.answered("patch", "pods", 403, "Forbidden", denied)
    assert found.current("patch", "pods") is None  # a verdict on one pod, not RBAC
    # kube-apiserver v1.36.2's words for an eviction and an Event in a namespace being
    # deleted (seen on the real tier): an answer about the namespace, not RBAC
    for resource, name in (("pods/eviction", "pods"), ("events", "events")):
        going = (
            f'{name} "tolerant-3" is forbidden: unable to create new content in namespace '
            "rc-gang-plans-skip-cordon-b796 because it is being terminated"
        )
        found.answered("create", resource, 403, "Forbidden", going)
        assert found.current("create", resource) is None


def test_a_refusal_is_logged_once_and_its_end_at_info(caplog: pytest.LogCaptureFixture) -> None:
    found = refusals.Refusals()
    registry = CollectorRegistry()
    registry.register(found)
    with caplog.at_level(logging.INFO, logger="gpuplace.cluster.refusals"):
        for _ in range(5):
            found.answered("list", "pods", 403, "Forbidden", "pods is forbidden: ...")
        found.answered("list", "pods", 401, "Unauthorized", "Unauthorized")  # a new code
        found.answered("list", "pods", 200)
        found.answered("list", "pods", 200)
    logged = [(r.levelname, getattr(r, "code", None)) for r in caplog.records]
    assert logged == [("ERROR", 403), ("ERROR", 401), ("INFO", None)]
    labels = {"verb": "list", "resource": "pods"}
    assert registry.get_sample_value("gpuplace_api_refusals_total", {**labels, "code": "403"}) == 5
    assert registry.get_sample_value("gpuplace_api_refusals_total", {**labels, "code": "401"}) == 1
    assert found.not_ready_reason() is None
