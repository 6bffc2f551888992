"""Gang member constraints: node filters as kube-scheduler reads them, narrowing that obeys
the gated-pod rules of kube-apiserver ≥ 1.30, plan marks, and the leadership gate."""

from __future__ import annotations

import copy
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry

from gpuplace.cluster import kube, refusals
from gpuplace.dev import localapi
from gpuplace.extender import gang_affinity, gang_leader
from gpuplace.extender.gang_affinity import NodeFilter, narrowed, narrows
from gpuplace.extender.gang_members import PlanMark

WEBHOOK_AFFINITY: dict[str, Any] = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {
                    "matchExpressions": [
                        {
                            "key": "nvidia.com/gpu.product",
                            "operator": "In",
                            "values": ["NVIDIA-A100-SXM4-80GB"],
                        },
                        {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["1"]},
                    ]
                },
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
            ]
        },
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [{"key": "x", "operator": "Exists"}]}}
        ],
    },
    "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
}


def pod_with(affinity: Any = None, selector: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main"}]}
    if affinity is not None:
        spec["affinity"] = affinity
    if selector is not None:
        spec["nodeSelector"] = selector
    return {"metadata": {"name": "p"}, "spec": spec}


def test_a_pod_without_required_affinity_gets_one_term_pinning_it() -> None:
    new = narrowed(None, "gpu-3")
    assert new == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [gang_affinity.pin("gpu-3")]}]
            }
        }
    }
    assert narrows(None, new) is None
    assert NodeFilter.of(pod_with(new)).pinned_to() == "gpu-3"
    preferred_only: dict[str, Any] = {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}
    }
    pinned = narrowed(preferred_only, "gpu-3")
    assert pinned is not None
    assert pinned["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == []


def test_existing_terms_only_gain_a_requirement_at_their_end() -> None:
    before = copy.deepcopy(WEBHOOK_AFFINITY)
    new = narrowed(WEBHOOK_AFFINITY, "gpu-3")
    assert before == WEBHOOK_AFFINITY  # not mutated
    assert new is not None
    assert narrows(WEBHOOK_AFFINITY, new) is None
    terms = new["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    old_terms = before["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert len(terms) == len(old_terms)
    for term, old in zip(terms, old_terms, strict=True):
        assert term["matchExpressions"] == old["matchExpressions"]
        assert term["matchFields"] == [gang_affinity.pin("gpu-3")]
    assert (
        new["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        == (before["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"])
    )
    assert new["podAntiAffinity"] == before["podAntiAffinity"]
    assert narrowed(new, "gpu-3") is None  # idempotent


def test_narrows_refuses_what_the_api_server_refuses() -> None:
    new = narrowed(WEBHOOK_AFFINITY, "n")
    assert new is not None
    terms = new["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    dropped = copy.deepcopy(new)
    dropped["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ] = terms[:1]
    assert narrows(WEBHOOK_AFFINITY, dropped) is not None
    added = copy.deepcopy(new)
    added["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ].append({"matchFields": [gang_affinity.pin("n")]})
    assert narrows(WEBHOOK_AFFINITY, added) is not None
    changed = copy.deepcopy(new)
    changed["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][
        0
    ]["matchExpressions"][0]["values"] = ["other"]
    assert narrows(WEBHOOK_AFFINITY, changed) is not None
    prepended = copy.deepcopy(WEBHOOK_AFFINITY)
    prepended["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][1]["matchExpressions"].insert(0, {"key": "k", "operator": "Exists"})
    assert narrows(WEBHOOK_AFFINITY, prepended) is not None


def test_empty_terms_match_nothing_and_are_left_alone() -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {},
                    {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
                ]
            }
        }
    }
    new = narrowed(affinity, "n")
    assert new is not None and narrows(affinity, new) is None
    assert (
        new["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][
            0
        ]
        == {}
    )
    assert not NodeFilter.of(
        pod_with(
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}
                }
            }
        )
    ).matches("n", {})


def test_node_filters_read_every_operator_and_the_node_selector() -> None:
    def term(*expressions: dict[str, Any], fields: list[dict[str, Any]] | None = None) -> Any:
        body: dict[str, Any] = {"matchExpressions": list(expressions)}
        if fields:
            body["matchFields"] = fields
        return {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [body]}
            }
        }

    labels = {"a": "1", "count": "8", "zone": "z1"}
    cases: list[tuple[dict[str, Any], bool]] = [
        ({"key": "a", "operator": "In", "values": ["1", "2"]}, True),
        ({"key": "a", "operator": "NotIn", "values": ["1"]}, False),
        ({"key": "b", "operator": "NotIn", "values": ["1"]}, True),
        ({"key": "a", "operator": "Exists"}, True),
        ({"key": "a", "operator": "DoesNotExist"}, False),
        ({"key": "count", "operator": "Gt", "values": ["4"]}, True),
        ({"key": "count", "operator": "Lt", "values": ["4"]}, False),
        ({"key": "zone", "operator": "Gt", "values": ["4"]}, False),
        ({"key": "a", "operator": "Bogus", "values": ["1"]}, False),
    ]
    for expression, expected in cases:
        assert NodeFilter.of(pod_with(term(expression))).matches("n", labels) is expected
    pinned = pod_with(term(fields=[gang_affinity.pin("n")]))
    assert NodeFilter.of(pinned).matches("n", labels)
    assert not NodeFilter.of(pinned).matches("m", labels)
    assert NodeFilter.of(pod_with(selector={"zone": "z1"})).matches("n", labels)
    assert not NodeFilter.of(pod_with(selector={"zone": "z2"})).matches("n", labels)
    assert NodeFilter.of(pod_with()).trivial
    assert NodeFilter.of(pod_with()).allowed([("n", labels)]) is None


LABEL_KEYS = st.sampled_from(["a", "b", "zone", "count"])
VALUES = st.sampled_from(["1", "2", "8", "z1"])
EXPRESSIONS = st.one_of(
    st.builds(
        lambda k, op, vs: {"key": k, "operator": op, "values": vs},
        LABEL_KEYS,
        st.sampled_from(["In", "NotIn"]),
        st.lists(VALUES, min_size=1, max_size=2),
    ),
    st.builds(
        lambda k, op: {"key": k, "operator": op},
        LABEL_KEYS,
        st.sampled_from(["Exists", "DoesNotExist"]),
    ),
    st.builds(
        lambda k, op, v: {"key": k, "operator": op, "values": [v]},
        LABEL_KEYS,
        st.sampled_from(["Gt", "Lt"]),
        st.sampled_from(["0", "4", "16"]),
    ),
)
TERMS = st.lists(
    st.fixed_dictionaries({}, optional={"matchExpressions": st.lists(EXPRESSIONS, max_size=3)}),
    max_size=3,
)
AFFINITIES = st.one_of(
    st.none(),
    st.just({}),
    st.builds(
        lambda terms: {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
            }
        },
        TERMS,
    ),
)
NODES = st.sampled_from(["n0", "n1", "n2"])
LABELS = st.dictionaries(LABEL_KEYS, VALUES, max_size=4)


@settings(max_examples=300, deadline=None)
@given(affinity=AFFINITIES, node=NODES, name=NODES, labels=LABELS)
def test_narrowing_is_allowed_only_tightens_and_pins(
    affinity: Any, node: str, name: str, labels: dict[str, str]
) -> None:
    new = narrowed(affinity, node)
    if new is None:
        new = affinity
    assert narrows(affinity, new) is None
    before = NodeFilter.of(pod_with(affinity))
    after = NodeFilter.of(pod_with(new))
    if after.matches(name, labels):
        assert name == node
        assert before.matches(name, labels)
    if before.matches(node, labels):
        assert after.matches(node, labels)


@given(st.text(max_size=80))
def test_unreadable_plan_marks_are_no_plan(raw: str) -> None:
    mark = PlanMark.decode(raw)
    if mark is not None:
        assert PlanMark.decode(mark.encode()) == mark


def test_plan_marks_round_trip() -> None:
    mark = PlanMark("3f9c0a1b2c4d", 4, "gpu-a100-7")
    assert PlanMark.decode(mark.encode()) == mark
    for bad in (
        "",
        "{",
        "[]",
        '{"id": "", "members": 4, "node": "n"}',
        '{"id": "x", "members": true, "node": "n"}',
        '{"id": "x", "members": 0, "node": "n"}',
    ):
        assert PlanMark.decode(bad) is None


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
    assert gang_leader.leads(lease("gpuplace-7f9_1b2c", now), "gpuplace-7f9", stamp)
    assert gang_leader.leads(lease("gpuplace-7f9", now), "gpuplace-7f9", stamp)
    assert not gang_leader.leads(lease("gpuplace-7f9x_1b2c", now), "gpuplace-7f9", stamp)
    assert not gang_leader.leads(lease("other_1", now), "gpuplace-7f9", stamp)
    old = now - timedelta(seconds=20)
    assert not gang_leader.leads(lease("gpuplace-7f9_1", old), "gpuplace-7f9", stamp)
    assert not gang_leader.leads({}, "gpuplace-7f9", stamp)


async def test_the_lease_follower_reads_the_api() -> None:
    async with localapi.serve(localapi.FakeApi(access=localapi.Access.shipped())) as server:
        api = kube.Kube(
            client.ApiClient(server.configuration(localapi.GPUPLACE)),
            timeout=5.0,
            refusals=refusals.Refusals(missing_grace=0.0),
        )
        try:
            follower = gang_leader.LeaseFollower(api, identity="me")
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
            follower = gang_leader.LeaseFollower(api, identity="me")
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
