"""Fuzzing the DRA kubelet plugin as a hostile caller on its sockets would: every method of
DRAPlugin, DRAResourceHealth and Registration with random and malformed requests, as
messages and as raw bytes, over the real gRPC servers on unix sockets; and the claims the
plugin reads random too (malformed, unallocated, foreign drivers' results, other nodes').

Whatever comes in: never UNKNOWN or INTERNAL (a crash); an answer within the wait plus a
margin; every claim of a NodePrepareResources has an entry, with an error or with devices
of this node within their capacity; what is prepared has its CDI spec on disk and nothing
else is written; a claim refused leaves no file behind.

The plugin runs in a thread with its own event loop so that hypothesis drives it from
ordinary (synchronous) tests over one channel.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpuplace.agent import handover, kubeletplugin, preparing
from gpuplace.agent.draplugin import dra_pb2, dra_pb2_grpc, health_pb2, registration_pb2
from gpuplace.cluster import dra
from tests.agent.dra_kubelet import Claims
from tests.agent.test_preparing import GPUS, MPS, NODE, RESULT_FIELDS, captured
from tests.agent.test_preparing import JSON as ANY_JSON

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
WAIT = 0.1
MARGIN = 2.0
H100_MIB = 81559
CRASHES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
DRA = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/"
HEALTH = "/v1alpha1.DRAResourceHealth/"
REGISTRATION = "/pluginregistration.Registration/"
UIDS = [f"00000000-0000-4000-8000-{i:012d}" for i in range(6)]


class Plugin:
    """The plugin on a loop of its own, its claims (random per example), and channels."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="draz", dir="/tmp"))
        self.claims = Claims()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stop = asyncio.Event()
        self.plugin: kubeletplugin.KubeletPlugin = self.call(self._start)
        self.channel = grpc.insecure_channel(f"unix://{self.plugin.dra_socket}")
        self.registration = grpc.insecure_channel(f"unix://{self.plugin.registration_socket}")
        self.stub = dra_pb2_grpc.DRAPluginStub(self.channel)

    def call(self, make: Callable[[], Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout=30)

    async def _start(self) -> kubeletplugin.KubeletPlugin:
        plugin = kubeletplugin.KubeletPlugin(
            node=NODE,
            claims=self.claims,
            options=handover.Options(handover.Strategy.VOLUME_MOUNTS, mps=MPS),
            mps_ready=lambda uuid: uuid == GPUS[0].uuid,  # gpu-1's daemon never answers
            plugins_dir=str(self.root / "plugins"),
            registry_dir=str(self.root / "registry"),
            cdi_dir=str(self.root / "cdi"),
            wait_seconds=WAIT,
            poll_seconds=0.05,
            health_seconds=0.05,
        )
        plugin.set_gpus(GPUS)
        self.running = asyncio.ensure_future(plugin.run(self.stop))
        while not plugin.registration_socket.exists():
            await asyncio.sleep(0.01)
        return plugin

    def forget(self) -> None:
        """Each example starts from a node with nothing prepared."""

        async def clear() -> None:
            for uid in list(self.plugin.prepared):
                self.plugin.files.remove_spec(uid)
            self.plugin.prepared.clear()

        self.call(clear)

    def specs(self) -> set[str]:
        cdi = self.root / "cdi"
        return {path.name for path in cdi.iterdir()} if cdi.exists() else set()

    def close(self) -> None:
        self.channel.close()
        self.registration.close()

        async def end() -> None:
            self.stop.set()
            await self.running

        self.call(end)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def agent() -> Iterator[Plugin]:
    running = Plugin()
    yield running
    running.close()


def invoke(agent: Plugin, path: str, request: Any) -> tuple[grpc.StatusCode, Any, float]:
    """Call method `path` with a message or raw bytes: status, answer, seconds."""
    raw = isinstance(request, bytes)
    identity: Callable[[bytes], bytes] = lambda data: data  # noqa: E731
    channel = agent.registration if path.startswith(REGISTRATION) else agent.channel
    began = time.monotonic()
    try:
        if path.startswith(HEALTH):
            serializer = identity if raw else type(request).SerializeToString
            stream = channel.unary_stream(path, serializer, identity)(request, timeout=5)
            answer = next(iter(stream))
            stream.cancel()
        else:
            serializer = identity if raw else type(request).SerializeToString
            answer = channel.unary_unary(path, serializer, identity)(
                request, timeout=WAIT + MARGIN * 2
            )
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code, answer = error.code(), error.details()
    return code, answer, time.monotonic() - began


# --- what the requests are made of ---------------------------------------------------------

text = st.one_of(st.text(max_size=30), st.sampled_from(["team-a", "c", "", "x" * 300]))
uids = st.one_of(st.sampled_from(UIDS), st.text(max_size=40), st.just("../../etc/passwd"))
claims = st.builds(lambda n, m, u: dra_pb2.Claim(namespace=n, name=m, uid=u), text, text, uids)
claim_lists = st.lists(claims, max_size=kubeletplugin.MAX_CLAIMS + 2)
MESSAGES: list[tuple[str, st.SearchStrategy[Any]]] = [
    (DRA + "NodePrepareResources",
     st.builds(lambda c: dra_pb2.NodePrepareResourcesRequest(claims=c), claim_lists)),
    (DRA + "NodeUnprepareResources",
     st.builds(lambda c: dra_pb2.NodeUnprepareResourcesRequest(claims=c), claim_lists)),
    (HEALTH + "NodeWatchResources", st.just(health_pb2.NodeWatchResourcesRequest())),
    (REGISTRATION + "GetInfo", st.just(registration_pb2.InfoRequest())),
    (REGISTRATION + "NotifyRegistrationStatus", st.builds(
        lambda ok, why: registration_pb2.RegistrationStatus(plugin_registered=ok, error=why),
        st.booleans(), st.text(max_size=2000))),
]  # fmt: skip


@st.composite
def raw_calls(draw: st.DrawFn) -> tuple[str, bytes]:
    path, messages = draw(st.sampled_from(MESSAGES))
    if draw(st.booleans()):
        return path, draw(st.binary(max_size=512))
    data = draw(messages).SerializeToString()
    if data and draw(st.booleans()):
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    else:
        data = data + draw(st.binary(min_size=1, max_size=32))
    return path, data


def stored_claim(uid: str, results: list[dict[str, Any]], metadata: Any) -> dict[str, Any]:
    body = captured("claim-share-30.json")
    body["metadata"] = metadata if metadata is not None else {
        "name": f"c-{uid[-2:]}", "namespace": "team-a", "uid": uid
    }  # fmt: skip
    body["status"] = {"allocation": {"devices": {"results": results}}}
    return body


valid_results = st.builds(
    lambda device, capacity: {
        "request": "gpu", "driver": dra.DRIVER, "pool": NODE, "device": device,
        "shareID": "s", "consumedCapacity": capacity,
    },
    st.sampled_from(["gpu-0", "gpu-1"]),
    st.sampled_from([{"compute": "300", "memory": "8Gi"}, {"compute": "0", "memory": "1Gi"},
                     {"compute": "1k", "memory": f"{H100_MIB}Mi"}]),
)  # fmt: skip
stored = st.builds(
    stored_claim,
    st.sampled_from(UIDS),
    st.lists(valid_results | st.fixed_dictionaries({}, optional=RESULT_FIELDS), max_size=3),
    st.none() | st.none() | ANY_JSON,
)


# --- the tests --------------------------------------------------------------------------------


@FUZZ
@given(call=raw_calls())
def test_bytes_that_are_no_message_get_a_status_never_a_crash(
    agent: Plugin, call: tuple[str, bytes]
) -> None:
    agent.forget()
    before = agent.specs()
    code, _, took = invoke(agent, *call)
    assert code not in CRASHES, call
    assert took < WAIT + MARGIN * 2
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        assert agent.specs() == before  # refused unread: nothing written


@FUZZ
@given(st.sampled_from(MESSAGES).flatmap(lambda pm: st.tuples(st.just(pm[0]), pm[1])))
def test_any_message_is_answered_without_a_crash(
    agent: Plugin, path_messages: tuple[str, Any]
) -> None:
    agent.forget()
    path, message = path_messages
    code, answer, took = invoke(agent, path, message)
    assert code not in CRASHES, message
    assert took < WAIT + MARGIN * 2
    if path.endswith("Resources") and code is grpc.StatusCode.OK and not path.startswith(HEALTH):
        parsed = (
            dra_pb2.NodePrepareResourcesResponse
            if "Prepare" in path and "Unprepare" not in path
            else dra_pb2.NodeUnprepareResourcesResponse
        ).FromString(answer)
        assert set(parsed.claims) == {claim.uid for claim in message.claims}


@FUZZ
@given(claims_read=st.lists(stored, min_size=1, max_size=4))
def test_any_claim_read_is_prepared_within_its_grant_or_refused_leaving_nothing(
    agent: Plugin, claims_read: list[dict[str, Any]]
) -> None:
    """Malformed claims, missing allocations, foreign drivers' and other nodes' results."""
    agent.forget()
    agent.claims.claims.clear()
    named = []
    for index, body in enumerate(claims_read):
        meta = body["metadata"]
        if isinstance(meta, dict) and isinstance(meta.get("name"), str) and meta.get("name"):
            namespace = str(meta["namespace"]) if isinstance(meta.get("namespace"), str) else ""
            uid = str(meta["uid"]) if isinstance(meta.get("uid"), str) else UIDS[index]
            agent.claims.claims[(namespace, meta["name"])] = body
            named.append(dra_pb2.Claim(namespace=namespace, name=meta["name"], uid=uid))
    request = dra_pb2.NodePrepareResourcesRequest(claims=named)
    code, answer, took = invoke(agent, DRA + "NodePrepareResources", request)
    assert code is grpc.StatusCode.OK and took < WAIT + MARGIN * 2
    parsed = dra_pb2.NodePrepareResourcesResponse.FromString(answer)
    written = agent.specs()
    uuids = {gpu.uuid for gpu in GPUS}
    for uid, entry in parsed.claims.items():
        spec = preparing.spec_file(uid)
        if entry.error:
            assert not entry.devices
            continue
        assert spec in written
        content = json.loads((agent.root / "cdi" / spec).read_text())
        assert content["kind"] == preparing.CDI_KIND
        for device in entry.devices:
            assert device.pool_name == NODE
            assert dra.gpu_index(device.device_name) in {0, 1}
        envs = [
            dict(e.split("=", 1) for e in d["containerEdits"]["env"]) for d in content["devices"]
        ]
        for env in envs:
            percent = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            assert percent is None or 0 < int(percent) <= 100
        mounted = {
            m["containerPath"].rsplit("/", 1)[-1]
            for d in content["devices"]
            for m in d["containerEdits"].get("mounts", [])
            if m["containerPath"].startswith("/var/run/nvidia-container-devices/")
        }
        assert mounted <= uuids
    prepared = {preparing.spec_file(uid) for uid, e in parsed.claims.items() if not e.error}
    assert written == prepared  # a claim refused leaves no file behind
    event("prepared" if prepared else "all refused")
