"""filter's answers kept for repeats (gpuplace.extender.repeating): served again only while none of
the named nodes changed, never stale; and through the HTTP app as kube-scheduler repeats
filter for a pending pod while other pods come and go."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.extender.deciding import Decider
from gpuplace.extender.repeating import Answer, Repeats
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement.ledger import Grant
from tests.cluster.test_syncing import node_record
from tests.extender.conftest import harness

NODES = [f"n{index}" for index in range(4)]
PODS = [
    objects.pod("quarter", percent=25, memory="10Gi"),
    objects.pod("most", percent=90),
    objects.pod("two", percent=None, count=2),
]
NAME_SETS = [NODES, NODES[:2], [*NODES[1:], "not-a-node"]]


def answer_of(decider: Decider, pod: dict[str, Any], names: list[str]) -> Answer:
    verdict = decider.filter(pod, names)
    body = json.dumps([verdict.passed, verdict.failed, verdict.unresolvable]).encode()
    return Answer(body, "ok" if verdict.passed else "none-fit")


operation = st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 3), st.integers(0, 3), st.integers(1, 10)),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("resize"), st.integers(0, 3), st.integers(1, 4)),
    st.tuples(st.just("remove"), st.integers(0, 3)),
    st.tuples(st.just("relist")),
    st.tuples(st.just("filter"), st.integers(0, 2), st.integers(0, 2)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(operation, min_size=1, max_size=40))
def test_a_kept_answer_is_served_only_while_it_is_what_filter_would_answer(
    operations: list[tuple[Any, ...]],
) -> None:
    sync = LedgerSync()
    sync.replace_nodes([node_record(name, gpus=2) for name in NODES])
    holder = PolicyHolder(sync, "default")
    decider = Decider(sync, holder)
    repeats = Repeats(sync, registry=CollectorRegistry())
    uids = 0
    for op in operations:
        kind = op[0]
        if kind == "reserve":
            _, node, gpu, tenths = op
            state = sync.ledger.state(NODES[node])
            if state is not None and gpu < len(state.free_milli):
                uids += 1
                grant = Grant(f"g{uids}", NODES[node], (gpu,), tenths * 100, 0)
                sync.ledger.reserve(grant, overcommit=True)
        elif kind == "release":
            grants = list(sync.ledger)
            if grants:
                sync.ledger.release(grants[op[1] % len(grants)].pod_uid)
        elif kind == "resize":
            sync.put_node(node_record(NODES[op[1]], gpus=op[2]))
        elif kind == "remove":
            sync.drop_node(NODES[op[1]])
        elif kind == "relist":
            sync.ledger.restore(
                [
                    grant
                    for grant in sync.ledger
                    if (state := sync.ledger.state(grant.node)) is not None
                    and max(grant.gpus) < len(state.free_milli)
                ]
            )
        else:
            pod, names = PODS[op[1]], list(NAME_SETS[op[2]])
            request = decider.request(pod)
            assert request is not None
            fresh = answer_of(decider, pod, names)
            kept = repeats.find(request, names)
            if kept is not None:
                # the same answer; the order of a JSON object's members means nothing to
                # kube-scheduler (a Go map), so the bodies compare as JSON
                assert json.loads(kept.body) == json.loads(fresh.body)
                assert (kept.outcome, kept.failure) == (fresh.outcome, fresh.failure)
            repeats.keep(request, names, fresh, every=False)


def test_every_node_answers_go_stale_on_any_change() -> None:
    sync = LedgerSync()
    sync.replace_nodes([node_record(name, gpus=2) for name in NODES])
    holder = PolicyHolder(sync, "default")
    decider = Decider(sync, holder)
    registry = CollectorRegistry()
    repeats = Repeats(sync, registry=registry)
    pod, names = PODS[0], list(NODES)
    request = decider.request(pod)
    assert request is not None
    answer = answer_of(decider, pod, names)
    repeats.keep(request, names, answer, every=True)
    assert repeats.find(request, names) is answer
    assert repeats.find(request, list(names)) is answer  # equal names, another list
    assert repeats.find(request, names[:3]) is None
    assert sync.ledger.reserve(Grant("g", "n3", (0,), 100, 0))
    assert repeats.find(request, names) is None
    assert repeats.find(request, names) is None  # dropped
    counts = {
        sample.labels["result"]: sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == "gpuplace_filter_repeats_total"
    }
    assert counts == {"hit": 2.0, "miss": 2.0, "stale": 1.0}


async def test_repeated_filters_of_a_pending_pod_through_the_app(server: localapi.Server) -> None:
    """A pod that fits nowhere is filtered again and again while other pods' events come:
    the answer is kept while its nodes are unchanged, and a freed GPU makes it fit at once."""
    api = server.api
    for index in range(2):
        api.create(objects.node(f"gpu-{index}", gpus=1))
    async with harness(server) as h:
        await asyncio.wait_for(h.sidecar.sync.ready.wait(), 5)
        holders = []
        for index in range(2):
            pod = api.create(objects.pod(f"half-{index}", percent=60))
            holders.append(await h.schedule(pod))
        pending = api.create(objects.pod("pending", percent=50))
        twin = api.create(objects.pod("twin", percent=50))
        names = ["gpu-0", "gpu-1"]
        first = await h.filter(pending, names)
        assert first["NodeNames"] == []
        registry = h.sidecar.registry

        def hits() -> float | None:
            return registry.get_sample_value("gpuplace_filter_repeats_total", {"result": "hit"})

        before = hits() or 0.0
        # other pods' events that change no named node: the answer kept is sent
        api.create(objects.pod("cpu-only", percent=None, managed=False))
        assert await h.filter(pending, names) == first
        assert await h.filter(twin, names) == first
        assert hits() == before + 2

        def twin_failed() -> list[dict[str, Any]]:
            return [
                event
                for event in api.objects("events", "default")
                if event["reason"] == "FailedGpuPlacement"
                and event["involvedObject"]["name"] == "twin"
            ]

        await h.synced(lambda: bool(twin_failed()))
        assert "gpuplace explain default/twin" in twin_failed()[0]["message"]
        # a GPU freed on a named node: not the kept answer
        api.delete("pods", "half-0", "default")
        await h.synced(lambda: len(h.sidecar.sync.ledger) == 1)
        after = await h.filter(pending, names)
        assert after["NodeNames"] == [holders[0]]
        assert hits() == before + 2
