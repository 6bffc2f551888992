"""The extender's HTTP contract: bad input gets 400 with a reason, never a 500 or a hang;
answers before the first sync say so; placement failures become one readable Event."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import yarl
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry

from gpuplace.cluster import kube
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.extender import app as extender_app
from gpuplace.extender import c_helpers
from gpuplace.extender.node_names import EveryNode
from gpuplace.wiring.sidecar import Sidecar
from tests import c_helpers_built
from tests.cluster.conftest import eventually
from tests.extender import conftest
from tests.extender.conftest import Harness, harness, scored


async def ready(h: Harness) -> None:
    await asyncio.wait_for(h.sidecar.sync.ready.wait(), 5)


@pytest.mark.parametrize(
    ("verb", "body"),
    [
        ("filter", b"not json"),
        ("filter", b"{}"),
        ("filter", b'{"Pod": {"metadata": {}}, "NodeNames": []}'),
        ("filter", b'{"Pod": [], "NodeNames": ["a"]}'),
        ("prioritize", b'{"Pod": {"metadata": {"name": "p"}}, "NodeNames": "a"}'),
        ("bind", b'{"PodName": "p"}'),
        ("bind", b'{"PodName": "", "PodNamespace": "d", "PodUID": "u", "Node": "n"}'),
        ("bind", b"[1, 2]"),
    ],
)
async def test_malformed_requests_get_400_with_a_reason(
    server: localapi.Server, verb: str, body: bytes
) -> None:
    async with harness(server) as h, h.session.post(f"{h.url}/{verb}", data=body) as response:
        assert response.status == 400
        answer = await response.json()
    assert answer["Error"].startswith(f"not a kube-scheduler {verb} request")


async def test_oversized_body_gets_413(server: localapi.Server) -> None:
    async with harness(server, extender_max_body_bytes=2048) as h:
        body = {"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["n" * 100] * 50}
        status, _ = await h.post("filter", body)
    assert status == 413


@pytest.mark.parametrize("verb", ["filter", "prioritize"])
async def test_a_call_naming_too_many_nodes_gets_413(server: localapi.Server, verb: str) -> None:
    """Each node named costs the event loop a few microseconds and filter's answer ~60
    bytes: 1.5 million unknown names made a 7 s stall and an 85 MB answer. Past
    --extender-max-nodes the call is refused, and nothing of it decided."""
    async with harness(server, extender_max_nodes=3) as h:
        await ready(h)
        pod = objects.pod("p")
        ok, _ = await h.post(verb, {"Pod": pod, "NodeNames": ["a", "b", "c"]})
        status, body = await h.post(verb, {"Pod": pod, "NodeNames": ["a", "b", "c", "d"]})
        items = [objects.node(name) for name in "abcd"]
        full, _ = await h.post(verb, {"Pod": pod, "Nodes": {"items": items}})
    assert (ok, status, full) == (200, 413, 413)
    assert body == {"Error": f"the {verb} request names 4 nodes, over 3"}


SHAPES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
ANNOTATIONS = st.dictionaries(
    st.sampled_from(
        [
            "gpuplace.io/gpu-percent",
            "gpuplace.io/gpu-memory",
            "gpuplace.io/gpu-count",
            "gpuplace.io/gpu-model",
            "gpuplace.io/assigned-node",
            "x",
        ]
    ),
    st.text(max_size=12) | st.integers(),
    max_size=4,
)
SHAPE = st.fixed_dictionaries(
    {
        "annotations": ANNOTATIONS | SHAPES,
        "spec": SHAPES,
        "names": st.lists(st.text(max_size=10), max_size=4),
    }
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pods=st.lists(SHAPE, min_size=15, max_size=15))
def test_any_pod_shape_gets_an_answer_never_a_500(pods: list[dict[str, Any]]) -> None:
    async def run() -> None:
        async with localapi.serve() as server:
            server.api.create(objects.node("n0"))
            async with harness(server) as h:
                await ready(h)
                for shape in pods:
                    metadata = {"name": "p", "uid": "u", "annotations": shape["annotations"]}
                    pod = {"metadata": metadata, "spec": shape["spec"]}
                    for verb in ("filter", "prioritize"):
                        status, answer = await h.post(
                            verb, {"Pod": pod, "NodeNames": shape["names"]}
                        )
                        assert status in (200, 400), answer

    asyncio.run(run())


@contextlib.asynccontextmanager
async def unsynced(server: localapi.Server) -> AsyncIterator[Harness]:
    """A sidecar whose informers never start (the API is unreachable at first)."""
    api = kube.Kube(client.ApiClient(server.configuration(localapi.GPUPLACE)))
    sidecar = Sidecar(conftest.settings(sync_wait_seconds=0.05), CollectorRegistry(), api)
    runner = aiohttp.web.AppRunner(sidecar.app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield Harness(server, sidecar, f"http://127.0.0.1:{runner.addresses[0][1]}", session)
    finally:
        await runner.cleanup()
        await api.close()


async def test_no_decision_before_the_first_sync(
    server: localapi.Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = server.api.create(objects.pod("p"))
    async with unsynced(server) as h:
        looked: list[bool] = []
        every_node = h.sidecar.decider.every_node

        def spy() -> EveryNode | None:
            looked.append(True)
            return every_node()

        monkeypatch.setattr(h.sidecar.decider, "every_node", spy)
        status, body = await h.post("filter", {"Pod": pod, "NodeNames": ["n0"]})
        assert status == 200
        assert "syncing" in body["Error"]
        assert "syncing" in await h.bind(pod, "n0")
        assert h.sidecar.not_ready_reason() is not None
        assert h.sidecar.capabilities() is None
        assert not looked  # no set of every node's name built while nodes still arrive


async def test_no_fit_becomes_one_event_with_a_line_per_reason_kind(
    server: localapi.Server,
) -> None:
    api = server.api
    for index in range(3):
        api.create(objects.node(f"a100-{index}", gpus=1))
    api.create(objects.node("t4-0", gpus=1, model="Tesla-T4", gpu_memory_mib=15360))
    api.create(objects.node("cpu-0", gpus=0, enabled=False))
    async with harness(server) as h:
        await ready(h)
        for index in range(3):
            await h.schedule(api.create(objects.pod(f"big-{index}", percent=80)))
        pod = api.create(objects.pod("late", percent=50, memory="20Gi"))
        names = ["a100-0", "a100-1", "a100-2", "t4-0", "cpu-0"]
        verdict = await h.filter(pod, names)
        assert verdict["NodeNames"] == []
        assert verdict["FailedNodes"] == dict.fromkeys(
            ["a100-0", "a100-1", "a100-2"], "gpuplace: no GPU with enough share free"
        )
        assert set(verdict["FailedAndUnresolvableNodes"]) == {"t4-0", "cpu-0"}
        await h.filter(pod, names)  # a retry: the same Event, counted
        await h.synced(
            lambda: any(
                e["reason"] == "FailedGpuPlacement" and e.get("count") == 2
                for e in api.objects("events", "default")
            )
        )
        [event] = [
            e for e in api.objects("events", "default") if e["reason"] == "FailedGpuPlacement"
        ]
        message = event["message"]
        assert message.startswith(
            "0/5 nodes: 3 no GPU with enough share free, 1 GPU memory too small, "
            "1 node not managed by gpuplace (for 50% of one GPU with 20480 MiB); e.g. "
            "a100-0: gpu 0: 20% free, needs 50%"
        )
        assert message.endswith("gpuplace explain default/late")
        assert event["type"] == "Warning"
        assert event["involvedObject"]["uid"] == pod["metadata"]["uid"]


async def test_prioritize_gives_ten_only_to_the_policys_best(server: localapi.Server) -> None:
    api = server.api
    for index in range(4):
        api.create(objects.node(f"n{index}", gpus=2))
    async with harness(server) as h:
        await ready(h)
        await h.schedule(api.create(objects.pod("seed", percent=30)), random.Random(1))
        pod = api.create(objects.pod("next", percent=30))
        scores = await h.prioritize(pod, ["n0", "n1", "n2", "n3"])
        best = [name for name, score in scores.items() if score == 10]
        assert len(best) == 1
        seed_node = h.pod("default", "seed")["spec"]["nodeName"]
        assert best == [seed_node]  # packing: the partly used GPU's node
        assert all(0 <= score < 10 for name, score in scores.items() if name != seed_node)


@contextlib.asynccontextmanager
async def seeded(server: localapi.Server, **overrides: Any) -> AsyncIterator[Harness]:
    """Four 2-GPU nodes, one pod placed (it replaces the fallback workload: a new policy
    version), and the warmer done: what prioritize answered ahead needs. With
    `policy="random"` every node ties, so filter passes several and prioritize follows
    (a profile that names it); the default policy's best node is unique."""
    api = server.api
    for index in range(4):
        api.create(objects.node(f"n{index}", gpus=2))
    async with harness(server, workload_refresh_seconds=3600.0, **overrides) as h:
        await ready(h)
        await h.schedule(api.create(objects.pod("seed", percent=30)), random.Random(1))
        await h.sidecar.warmer.warm.wait()
        yield h


async def test_prioritize_answered_ahead_only_while_nothing_changed(
    server: localapi.Server,
) -> None:
    """A policy's tie: filter passes several nodes and prepares prioritize's answer."""
    api = server.api
    async with seeded(server, policy="random") as h:
        registry = h.sidecar.registry

        def ahead(result: str) -> float:
            value = registry.get_sample_value("gpuplace_prioritize_ahead_total", {"result": result})
            return value or 0.0

        used, stale = ahead("used"), ahead("stale")
        names = ["n0", "n1", "n2", "n3"]
        pod = api.create(objects.pod("next", percent=30))
        passed = (await h.filter(pod, names))["NodeNames"]
        assert len(passed) > 1
        await asyncio.sleep(0)
        fresh = h.sidecar.decider.prioritize(pod, passed)
        assert await h.prioritize(pod, passed) == dict(zip(passed, fresh, strict=True))
        assert (ahead("used"), ahead("stale")) == (used + 1, stale)
        # Another pod is placed between this pod's filter and prioritize: scored again.
        passed = (await h.filter(pod, names))["NodeNames"]
        await h.schedule(api.create(objects.pod("other", percent=60)), random.Random(2))
        scores = await h.prioritize(pod, passed)
        assert (ahead("used"), ahead("stale")) == (used + 1, stale + 1)
        fresh = h.sidecar.decider.prioritize(pod, passed)
        assert scores == dict(zip(passed, fresh, strict=True))
        # Fewer nodes than filter passed (another extender removed some): scored again.
        await h.filter(pod, names)
        assert len(await h.prioritize(pod, passed[:2])) == 2
        assert ahead("stale") == stale + 2


async def test_prioritize_takes_filters_list_back_without_parsing_it(
    server: localapi.Server,
) -> None:
    """kube-scheduler sends prioritize the nodes filter answered, encoded as Go does
    (Pod, Nodes, NodeNames; no spaces): the list prepared ahead is taken as it is, and
    the answer is the one scoring now gives."""
    async with seeded(server, policy="random") as h:
        pod = server.api.create(objects.pod("next", percent=30))
        passed = (await h.filter(pod, ["n0", "n1", "n2", "n3"]))["NodeNames"]
        await asyncio.sleep(0)  # the answer ahead
        service = h.sidecar.service
        prepared = service.ahead[pod["metadata"]["uid"]]
        go = {"Pod": pod, "Nodes": None, "NodeNames": passed}
        raw = json.dumps(go, separators=(",", ":")).encode()
        assert service.prioritize_args(raw).node_names is prepared.passed
        spaced = service.prioritize_args(json.dumps(go).encode())  # another client: parsed
        assert spaced.node_names == passed and spaced.node_names is not prepared.passed
        fewer = json.dumps({**go, "NodeNames": passed[:-1]}, separators=(",", ":")).encode()
        assert service.prioritize_args(fewer).node_names == passed[:-1]
        fresh = h.sidecar.decider.prioritize(pod, passed)
        async with h.session.post(f"{h.url}/prioritize", data=raw) as response:
            answer = await response.json(content_type=None)
        assert scored(answer, passed) == dict(zip(passed, fresh, strict=True))
        used = h.sidecar.registry.get_sample_value(
            "gpuplace_prioritize_ahead_total", {"result": "used"}
        )
        assert used is not None and used >= 1


@pytest.mark.parametrize("policy", ["default", "random"])
async def test_background_work_waits_for_the_verb_that_follows(
    server: localapi.Server, policy: str
) -> None:
    """kube-scheduler's bind follows a filter that passed one node; with several (the
    random policy's tie) prioritize follows, then bind: until it comes (or the
    expectation lapses) nothing starts in the background. After bind, nothing is
    expected."""
    async with seeded(server, policy=policy) as h:
        activity = h.sidecar.service.activity
        activity.expect_seconds = 30.0
        pod = server.api.create(objects.pod("next", percent=30))
        passed = (await h.filter(pod, ["n0", "n1", "n2", "n3"]))["NodeNames"]
        assert passed and activity.in_flight == 0 and not activity.idle.is_set()
        assert len(passed) == (1 if policy == "default" else 4)
        node = passed[0]
        if len(passed) > 1:
            scores = await h.prioritize(pod, passed)
            assert activity.in_flight == 0 and not activity.idle.is_set()
            node = max(scores, key=scores.__getitem__)
        assert await h.bind(pod, node) == ""
        assert activity.idle.is_set()
        # A filter that passes no node: kube-scheduler stops there.
        big = server.api.create(objects.pod("too-big", percent=100, count=8))
        assert not (await h.filter(big, ["n0", "n1", "n2", "n3"]))["NodeNames"]
        assert activity.idle.is_set()


DURATION = "gpuplace_extender_request_duration_seconds"


async def test_work_after_filter_waits_until_its_answer_is_in_the_socket(
    server: localapi.Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer too large for the socket at once goes out as kube-scheduler reads it.
    Until its last byte is in the kernel the verb stays in flight (the warmer does not
    start) and prioritize's answer is not prepared ahead: either would hold back the
    rest of the answer kube-scheduler is reading."""
    send = extender_app._send

    async def small_buffer(request: web.Request, response: web.Response) -> None:
        # The kernel's send buffer grows up to net.ipv4.tcp_wmem (4 MB here, more on
        # some hosts): fixed at 64 KB, a 2 MB answer cannot all fit whatever the host.
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        await send(request, response)

    monkeypatch.setattr(extender_app, "_send", small_buffer)
    # 1,000 nodes with long names besides seeded's four, all alike to the random policy:
    # filter passes every one, ~250 KB of names.
    for index in range(1_000):
        server.api.create(objects.node(f"wide-{index:04d}-{'x' * 230}", gpus=2))
    async with seeded(server, policy="random") as h:  # several nodes passed: ahead
        pod = server.api.create(objects.pod("slow-reader", percent=30))
        uid = pod["metadata"]["uid"]
        service = h.sidecar.service
        names = sorted(h.sidecar.sync.nodes)
        body = json.dumps({"Pod": pod, "NodeNames": names}).encode()
        url = yarl.URL(h.url)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (url.host, url.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=2**16)
        registry = h.sidecar.registry

        def answered() -> float:
            key = {"verb": "filter", "result": "ok"}
            return registry.get_sample_value(f"{DURATION}_count", key) or 0.0

        before = answered()
        try:
            writer.write(
                b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            await eventually(lambda: answered() > before, 10)
            await asyncio.sleep(0.3)  # not reading: the answer waits in the socket
            assert service.activity.in_flight == 1 and not service.activity.idle.is_set()
            assert uid not in service.ahead
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"Content-Length: (\d+)", head, re.I)[1])  # type: ignore[index]
            answer = json.loads(await reader.readexactly(length))
        finally:
            writer.close()
        assert length > 200_000 and len(answer["NodeNames"]) == len(names)
        await eventually(lambda: uid in service.ahead, 5)
        assert service.ahead[uid].passed == answer["NodeNames"]
        await eventually(service.activity.idle.is_set, 5)


@pytest.fixture
def names_in_c() -> Iterator[None]:
    """filter's set of every node's name in C (skipped where it is not built), whatever
    `GPUPLACE_NO_EXTENSIONS` says."""
    with c_helpers_built.in_use(c_helpers_built.built().name_set, c_helpers.RANKED_JSON):
        yield


@pytest.mark.usefixtures("names_in_c")
async def test_filter_takes_every_node_as_bytes_and_answers_as_parsing_them(
    server: localapi.Server,
) -> None:
    """kube-scheduler's filter usually names every node (Go's encoding: NodeNames last, in
    its own order): they are compared as bytes, not parsed, and stand for every node by
    identity. The answer is the one parsing them gives (the C helper off); a list that
    is not every node once is parsed."""
    async with seeded(server) as h:
        pod = server.api.create(objects.pod("next", percent=30))
        service, every = h.sidecar.service, h.sidecar.decider.every_node()
        assert every is not None
        go = {"Pod": pod, "Nodes": None, "NodeNames": ["n2", "n0", "n3", "n1"]}
        raw = json.dumps(go, separators=(",", ":")).encode()
        assert service.filter_args(raw).node_names is every.names
        for names in (["n2", "n0", "n3"], ["n2", "n0", "n3", "n1", "n1"], ["n2", "n0", "x", "n1"]):
            other = json.dumps({**go, "NodeNames": names}, separators=(",", ":")).encode()
            assert service.filter_args(other).node_names == names

        async def answer() -> Any:
            async with h.session.post(f"{h.url}/filter", data=raw) as response:
                assert response.status == 200
                return await response.json(content_type=None)

        taken = await answer()
        with c_helpers_built.in_use(None, c_helpers.RANKED_JSON):
            assert h.sidecar.decider.every_node() is None
            assert service.filter_args(raw).node_names == go["NodeNames"]
            assert await answer() == taken
        # The policy's best alone: the node prioritize would give 10.
        scores = h.sidecar.decider.prioritize(pod, ["n0", "n1", "n2", "n3"])
        assert taken["NodeNames"] == [f"n{scores.index(max(scores))}"]
        assert scores.count(max(scores)) == 1


async def test_non_gpu_pods_pass_through_and_bind_plainly(server: localapi.Server) -> None:
    server.api.create(objects.node("n0", gpus=1))
    async with harness(server) as h:
        await ready(h)
        body = objects.pod("plain", percent=None)
        pod = server.api.create(body)
        verdict = await h.filter(pod, ["n0", "elsewhere"])
        assert verdict["NodeNames"] == ["n0", "elsewhere"]
        assert await h.bind(pod, "elsewhere") == ""
        assert h.pod("default", "plain")["spec"]["nodeName"] == "elsewhere"


async def test_unreadable_annotations_fail_every_node_unresolvably(
    server: localapi.Server,
) -> None:
    server.api.create(objects.node("n0", gpus=1))
    async with harness(server) as h:
        await ready(h)
        pod = server.api.create(
            objects.pod("bad", percent=None, annotations={"gpuplace.io/gpu-percent": "lots"})
        )
        verdict = await h.filter(pod, ["n0"])
        assert verdict["NodeNames"] == []
        assert "gpu-percent" in verdict["FailedAndUnresolvableNodes"]["n0"]
        assert "gpu-percent" in await h.bind(pod, "n0")


async def test_full_node_objects_when_not_cache_capable(server: localapi.Server) -> None:
    server.api.create(objects.node("n0", gpus=1))
    server.api.create(objects.node("n1", gpus=1, model="Tesla-T4"))
    async with harness(server) as h:
        await ready(h)
        pod = server.api.create(objects.pod("p", percent=10, model="NVIDIA-A100-SXM4-80GB"))
        nodes = {"items": [server.api.get("nodes", "n0"), server.api.get("nodes", "n1")]}
        status, verdict = await h.post("filter", {"Pod": pod, "Nodes": nodes, "NodeNames": None})
        assert status == 200
        assert [n["metadata"]["name"] for n in verdict["Nodes"]["items"]] == ["n0"]
        assert "NodeNames" not in verdict
        assert verdict["FailedAndUnresolvableNodes"] == {}  # a node passed: none listed
        one = {"items": [server.api.get("nodes", "n1")]}
        status, verdict = await h.post("filter", {"Pod": pod, "Nodes": one, "NodeNames": None})
        assert status == 200 and verdict["Nodes"]["items"] == []
        assert verdict["FailedAndUnresolvableNodes"] == {"n1": "gpuplace: wrong GPU model"}
