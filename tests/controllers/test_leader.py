"""The gang and queue controllers' leadership gate: it follows kube-scheduler's Lease
(`gpuplace.controllers.leader`), reads it through the API, and is loud when the API refuses."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry

from gpuplace.cluster import kube, refusals
from gpuplace.controllers import leader
from gpuplace.dev import localapi


def lease(holder: str, renewed: datetime, seconds: int = 15) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "gpuplace-scheduler", "namespace": "gpuplace"},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": seconds,
            "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        },
    }


def test_leadership_follows_the_scheduler_lease() -> None:
    now = datetime.now(UTC)
    stamp = now.timestamp()
    assert leader.leads(lease("gpuplace-7f9_1b2c", now), "gpuplace-7f9", stamp)
    assert leader.leads(lease("gpuplace-7f9", now), "gpuplace-7f9", stamp)
    assert not leader.leads(lease("gpuplace-7f9x_1b2c", now), "gpuplace-7f9", stamp)
    assert not leader.leads(lease("other_1", now), "gpuplace-7f9", stamp)
    old = now - timedelta(seconds=20)
    assert not leader.leads(lease("gpuplace-7f9_1", old), "gpuplace-7f9", stamp)
    assert not leader.leads({}, "gpuplace-7f9", stamp)


async def test_the_lease_follower_reads_the_api() -> None:
    async with localapi.serve(localapi.FakeApi(access=localapi.Access.shipped())) as server:
        api = kube.Kube(
            client.ApiClient(server.configuration(localapi.GPUPLACE)),
            timeout=5.0,
            refusals=refusals.Refusals(missing_grace=0.0),
        )
        try:
            follower = leader.LeaseFollower(api, identity="me")
            await follower.read()
            assert not follower()  # no Lease yet: not leading
            assert "cannot find kube-scheduler's Lease" in str(follower.blocked_reason())
            server.api.create(lease("me_123", datetime.now(UTC)))
            await follower.read()
            assert follower()
            assert follower.blocked_reason() is None
            assert api.refusals.in_force() == []  # found again: recovered
            held_by(server, "them_9")
            await follower.read()
            assert not follower()
            # one failed read (not a refusal) keeps the last answer; a second forgets it
            held_by(server, "me_123")
            await follower.read()
            assert follower()
            server.api.fail("GET", r"/leases/gpuplace-scheduler$", 503, times=2)
            await follower.read()
            assert follower()
            await follower.read()
            assert not follower()
            await follower.read()
            assert follower()
        finally:
            await api.close()


def held_by(server: localapi.Server, identity: str) -> None:
    holder = {"spec": {"holderIdentity": identity}}
    server.api.patch("coordination.k8s.io/leases", "gpuplace-scheduler", holder, "gpuplace")


def without_lease_rule(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["metadata"]["name"] != "gpuplace-read-scheduler-lease"]


async def test_a_refused_lease_read_is_loud(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 18: without `get` on the Lease the follower never leads, and says why."""
    access = localapi.Access.shipped(edit=without_lease_rule)
    async with localapi.serve(localapi.FakeApi(access=access)) as server:
        server.api.create(lease("me_123", datetime.now(UTC)))
        api = kube.Kube(client.ApiClient(server.configuration(localapi.GPUPLACE)), timeout=5.0)
        registry = CollectorRegistry()
        registry.register(api.refusals)
        try:
            follower = leader.LeaseFollower(api, identity="me")
            with caplog.at_level(logging.INFO, logger="gpuplace.cluster.refusals"):
                for _ in range(3):
                    await follower.read()
            assert not follower()
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1  # once per transition, not once per read
            assert (errors[0].verb, errors[0].resource, errors[0].code) == (  # type: ignore[attr-defined]
                "get",
                "leases.coordination.k8s.io",
                403,
            )
            assert "cannot get resource" in errors[0].detail  # type: ignore[attr-defined]
            labels = {"verb": "get", "resource": "leases.coordination.k8s.io", "code": "403"}
            assert registry.get_sample_value("gpuplace_api_refusals_total", labels) == 3
            refused = api.refusals.current("get", refusals.LEASES)
            assert refused is not None
            assert "get leases.coordination.k8s.io gpuplace/gpuplace-scheduler: 403" in (
                refusals.describe(refused)
            )
            assert api.refusals.not_ready_reason() is None  # gangs only: an Event, not /readyz
            reason = str(follower.blocked_reason())
            assert "get on leases.coordination.k8s.io gpuplace-scheduler" in reason
            assert "gpuplace-read-scheduler-lease" in reason
            # the rule comes back (as after `kubectl apply`): INFO, ready, leading
            server.api.access = localapi.Access.shipped()
            api.api_client.configuration.api_key = {
                "BearerToken": f"Bearer {server.token(localapi.GPUPLACE)}"
            }
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="gpuplace.cluster.refusals"):
                await follower.read()
            assert follower() and follower.blocked_reason() is None
            assert api.refusals.not_ready_reason() is None
            assert [r.levelno for r in caplog.records] == [logging.INFO]
        finally:
            await api.close()
