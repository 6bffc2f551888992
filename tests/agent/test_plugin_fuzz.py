"""Fuzzing the device plugin as a hostile caller on its socket would: every call of the
DevicePlugin service with random, malformed and oversized requests, as messages and as raw
bytes, over the real gRPC server on a unix socket (registered with the kubelet stand-in).

Whatever comes in: never UNKNOWN or INTERNAL (a crash), an answer within the wait plus a
margin, memory that does not grow with the number of calls, and a refusal changes nothing
(`answered`, the plugin's one record of what it gave). An Allocate that is answered gives
each container the GPUs of a pod granted here that was waiting for them, never while a pod
without a grant asks for as many slots (issue 30).

The plugin runs in a thread with its own event loop so that hypothesis drives it from
ordinary (synchronous) tests over one channel.
"""

from __future__ import annotations

import asyncio
import resource
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpuplace.agent import allocating, plugin
from gpuplace.agent.deviceplugin import api_pb2, api_pb2_grpc
from tests.agent import kubelet as standin

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
WAIT = 0.1
"""The plugin's wait for its pod view; every call must end well within WAIT + MARGIN."""
MARGIN = 2.0
SLOTS = 4
GPUS = standin.eight_gpus()
STRANGER_COUNT = 4
"""A pod with no grant asks for this many slots: no Allocate of that size is answered."""
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
SERVICE = "/v1beta1.DevicePlugin/"
METHODS = ["GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate",
           "PreStartContainer"]  # fmt: skip


def node_pods() -> list[dict[str, Any]]:
    """Waiting whole GPUs (0-3), a waiting share (4), a waiting pair (5, 6), a running pod
    (7), a pod with no grant asking for STRANGER_COUNT slots, one with no grant that runs."""
    pods = [standin.pod(f"whole-{i}", [i], [GPUS[i].uuid]) for i in range(4)]
    pods.append(standin.pod("share", [4], [GPUS[4].uuid], milli=250, memory_mib=2048))
    pods.append(standin.pod("pair", [5, 6], [GPUS[5].uuid, GPUS[6].uuid]))
    running = standin.pod("running", [7], [GPUS[7].uuid])
    running["status"] = {
        "phase": "Running",
        "containerStatuses": [{"name": "train", "containerID": "containerd://r"}],
    }
    pods.append(running)
    pods.append(
        standin.pod(
            "stranger",
            [0, 1, 2, 3],
            [g.uuid for g in GPUS[:4]],
            assigned=False,
        )
    )
    loose = standin.pod("loose", [7], [GPUS[7].uuid], assigned=False)
    loose["status"] = dict(running["status"])
    pods.append(loose)
    return pods


WAITING = {  # pod UID → the GPUs it was granted, for the pods that wait for their Allocate
    pod["metadata"]["uid"]: set(pod["metadata"]["annotations"]["gpuplace.io/assigned-uuids"]
                                .split(","))
    for pod in node_pods()[:6]
}  # fmt: skip


class Plugin:
    """The plugin and the kubelet stand-in on a loop of their own, and a client channel."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="dz", dir="/tmp"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stop = asyncio.Event()
        self.server: plugin.PluginServer = self.call(self._start)
        self.channel = grpc.insecure_channel(f"unix://{self.server.socket_path}")
        self.stub = api_pb2_grpc.DevicePluginStub(self.channel)

    def call(self, make: Callable[[], Any]) -> Any:
        """Run the coroutine `make()` on the plugin's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout=30)

    async def _start(self) -> plugin.PluginServer:
        server = standin.plugin_server(
            GPUS,
            node_pods(),
            self.directory,
            slots_per_gpu=SLOTS,
            wait_seconds=WAIT,
            poll_seconds=0.05,
        )
        self.kubelet = standin.Kubelet(self.directory)
        await self.kubelet.start()
        self.running = asyncio.ensure_future(server.run(self.stop))
        await asyncio.wait_for(server.registered.wait(), 10)
        return server

    def answered(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        async def read() -> dict[str, tuple[str, tuple[str, ...]]]:
            return dict(self.server.answered)

        result: dict[str, tuple[str, tuple[str, ...]]] = self.call(read)
        return result

    def forget(self) -> None:
        """Every pod waits again (each example starts from the same node)."""

        async def clear() -> None:
            self.server.answered.clear()

        self.call(clear)

    def close(self) -> None:
        self.channel.close()

        async def end() -> None:
            self.stop.set()
            await self.running
            await self.kubelet.stop()

        self.call(end)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="module")
def agent() -> Iterator[Plugin]:
    running = Plugin()
    yield running
    running.close()


def invoke(agent: Plugin, method: str, request: Any) -> tuple[grpc.StatusCode, Any, float]:
    """Call `method` with `request` (a message, or raw bytes sent as they are): the status,
    the answer (the first ListAndWatch list) and the seconds it took."""
    raw = isinstance(request, bytes)
    identity: Callable[[bytes], bytes] = lambda data: data  # noqa: E731
    began = time.monotonic()
    try:
        if method == "ListAndWatch":
            stream = (
                agent.channel.unary_stream(SERVICE + method, identity, identity)(request)
                if raw
                else agent.stub.ListAndWatch(request)
            )
            answer = next(iter(stream))
            stream.cancel()
        elif raw:
            answer = agent.channel.unary_unary(SERVICE + method, identity, identity)(
                request, timeout=WAIT + MARGIN * 2
            )
        else:
            answer = getattr(agent.stub, method)(request, timeout=WAIT + MARGIN * 2)
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code, answer = error.code(), error.details()
    return code, answer, time.monotonic() - began


# --- what the requests are made of ---------------------------------------------------------

SLOT_IDS = [allocating.device_id(gpu.uuid, slot) for gpu in GPUS for slot in range(SLOTS)]
device_ids = st.one_of(
    st.sampled_from(SLOT_IDS),
    st.sampled_from(SLOT_IDS).map(lambda slot: slot + "0"),  # a slot never listed
    st.sampled_from(SLOT_IDS).map(lambda slot: slot.replace("::", "::\u00b2")),
    st.builds(
        allocating.device_id, st.sampled_from([g.uuid for g in GPUS]), st.integers(-(2**70), 2**70)
    ),
    st.just("GPU-" + "f" * 5000 + "::1"),
    st.text(max_size=40),
)
id_lists = st.lists(device_ids, max_size=6)
sizes = st.one_of(st.integers(-3, 9), st.sampled_from([-(2**31), 2**31 - 1]))


def allocate_requests() -> st.SearchStrategy[api_pb2.AllocateRequest]:
    containers = st.builds(lambda ids: api_pb2.ContainerAllocateRequest(devices_ids=ids), id_lists)
    return st.builds(
        lambda items: api_pb2.AllocateRequest(container_requests=items),
        st.lists(containers, max_size=plugin.MAX_CONTAINERS + 2),
    )


def preferred_requests() -> st.SearchStrategy[api_pb2.PreferredAllocationRequest]:
    container = st.builds(
        lambda available, must, size: api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
        ),
        st.lists(device_ids, max_size=40),
        id_lists,
        sizes,
    )
    return st.builds(
        lambda items: api_pb2.PreferredAllocationRequest(container_requests=items),
        st.lists(container, max_size=plugin.MAX_CONTAINERS + 2),
    )


def requests() -> st.SearchStrategy[tuple[str, Any]]:
    return st.one_of(
        st.tuples(st.just("Allocate"), allocate_requests()),
        st.tuples(st.just("GetPreferredAllocation"), preferred_requests()),
        st.tuples(
            st.just("PreStartContainer"),
            st.builds(lambda ids: api_pb2.PreStartContainerRequest(devices_ids=ids), id_lists),
        ),
        st.tuples(st.just("GetDevicePluginOptions"), st.just(api_pb2.Empty())),
        st.tuples(st.just("ListAndWatch"), st.just(api_pb2.Empty())),
    )


def mangled(message: bytes, draw: st.DrawFn) -> bytes:
    """A valid message cut short, with bytes flipped, or with bytes added."""
    how = draw(st.sampled_from(["cut", "flip", "append", "prepend"]))
    if how == "cut" and message:
        return message[: draw(st.integers(0, len(message) - 1))]
    if how == "flip" and message:
        at = draw(st.integers(0, len(message) - 1))
        return message[:at] + bytes([message[at] ^ draw(st.integers(1, 255))]) + message[at + 1 :]
    extra = draw(st.binary(min_size=1, max_size=64))
    return message + extra if how == "append" else extra + message


@st.composite
def raw_calls(draw: st.DrawFn) -> tuple[str, bytes]:
    method = draw(st.sampled_from(METHODS))
    if draw(st.booleans()):
        return method, draw(st.binary(max_size=512))
    _, request = draw(requests())
    return method, mangled(request.SerializeToString(), draw)


# --- the properties -------------------------------------------------------------------------


def check(
    agent: Plugin,
    method: str,
    request: Any,
    before: dict[str, tuple[str, tuple[str, ...]]],
    outcome: tuple[grpc.StatusCode, Any, float],
) -> None:
    """The properties of the module docstring for one call and its `outcome` (`invoke`)."""
    code, answer, took = outcome
    event(f"{method} {code.name}")
    assert code is grpc.StatusCode.OK or code in REFUSALS, (method, code, answer)
    assert took < WAIT + MARGIN, (method, took)
    after = agent.answered()
    if code is not grpc.StatusCode.OK or method != "Allocate":
        assert after == before, (method, code)
        return
    if isinstance(request, bytes):
        request = api_pb2.AllocateRequest.FromString(request)
        answer = api_pb2.AllocateResponse.FromString(answer)
    containers = list(request.container_requests)
    assert len(answer.container_responses) == len(containers)
    new = {uid: value for uid, value in after.items() if uid not in before}
    assert len(new) == len(containers), "each container is answered for a pod of its own"
    assert all(len(ids) != STRANGER_COUNT for _, ids in new.values())
    by_slots = {ids: uid for uid, (_, ids) in new.items()}
    for asked, given_ in zip(containers, answer.container_responses, strict=True):
        uid = by_slots[tuple(asked.devices_ids)]
        assert uid in WAITING, f"{uid} was not waiting for a GPU"
        assert allocating.granted_in(given_, agent.server.options) == WAITING[uid]


@FUZZ
@given(requests())
def test_every_call_with_any_message(agent: Plugin, call: tuple[str, Any]) -> None:
    checked(agent, *call)


def checked(agent: Plugin, method: str, request: Any) -> tuple[grpc.StatusCode, Any]:
    """`invoke` on a node where every pod waits again, then `check`: the status and answer."""
    agent.forget()
    before = agent.answered()
    code, answer, took = invoke(agent, method, request)
    check(agent, method, request, before, (code, answer, took))
    return code, answer


PARSERS: dict[str, Any] = {
    "Allocate": api_pb2.AllocateRequest,
    "GetPreferredAllocation": api_pb2.PreferredAllocationRequest,
    "PreStartContainer": api_pb2.PreStartContainerRequest,
}


@FUZZ
@given(raw_calls())
def test_every_call_with_any_bytes(agent: Plugin, call: tuple[str, bytes]) -> None:
    method, raw = call
    code, answer = checked(agent, method, raw)
    try:
        parsed = PARSERS.get(method, api_pb2.Empty).FromString(raw)
    except message.DecodeError:  # the parser's verdict is what the server must follow
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (method, code, answer)
    else:
        assert parsed is not None
        assert code is not grpc.StatusCode.INVALID_ARGUMENT, (method, answer)


@FUZZ
@given(st.lists(st.sampled_from(SLOT_IDS), min_size=1, max_size=4, unique=True))
def test_no_answer_while_a_pod_without_a_grant_asks_as_many(agent: Plugin, ids: list[str]) -> None:
    """Issue 30, 1, as a property: whatever slots the kubelet names, an Allocate of the
    size the pod without a grant asks for is refused, and one of another size goes to a
    pod granted here that was waiting."""
    agent.forget()
    request = api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
    )
    code, answer, took = invoke(agent, "Allocate", request)
    if len(ids) == STRANGER_COUNT:
        assert code is grpc.StatusCode.FAILED_PRECONDITION
        assert "research/stranger" in answer
    check(agent, "Allocate", request, {}, (code, answer, took))


def big(method: str, megabytes: float) -> bytes:
    """A well-formed request of about `megabytes` MiB, mostly slot IDs."""
    count = int(megabytes * 1024 * 1024 / 48)
    ids = [allocating.device_id(GPUS[i % 8].uuid, i) for i in range(count)]
    if method == "Allocate":
        return api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
        ).SerializeToString()
    if method == "GetPreferredAllocation":
        return api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=ids, must_include_deviceIDs=ids[:10], allocation_size=2
                )
            ]
        ).SerializeToString()
    return api_pb2.PreStartContainerRequest(devices_ids=ids).SerializeToString()


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize(
    ("method", "cut"),
    [("Allocate", 0), ("Allocate", 3), ("GetPreferredAllocation", 0), ("PreStartContainer", 0)],
    ids=["Allocate", "Allocate-undecodable", "GetPreferredAllocation", "PreStartContainer"],
)
def test_oversized_requests_are_refused_and_big_ones_cost_bounded_time_and_memory(
    agent: Plugin, method: str, cut: int
) -> None:
    """Over gRPC's 4 MiB: RESOURCE_EXHAUSTED before any of the plugin's code. Just under
    it, call after call: an answer in bounded time, and memory that does not grow with
    the calls (a refusal by `context.abort` kept each request in a reference cycle until a
    full collection: ~5 MiB a call)."""
    code, answer, took = invoke(agent, method, big(method, 5))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, (code, answer)
    assert took < MARGIN
    payload = big(method, 3.5)
    payload = payload[: len(payload) - cut]
    for _ in range(3):  # the first calls set the high-water mark
        invoke(agent, method, payload)
    before, high = agent.answered(), max_rss_mib()
    for _ in range(20):
        code, answer, took = invoke(agent, method, payload)
        assert code is grpc.StatusCode.OK or code in REFUSALS, (code, str(answer)[:200])
        if code is not grpc.StatusCode.OK:
            assert len(answer) < 1024, "the refusal echoes the request"
        assert took < WAIT + MARGIN
    assert agent.answered() == before
    assert max_rss_mib() - high < 32, "memory grows with the number of calls"


@pytest.mark.parametrize("containers", [plugin.MAX_CONTAINERS + 1, 100_000, 900_000])
@pytest.mark.parametrize("method", ["Allocate", "GetPreferredAllocation"])
def test_a_call_naming_more_containers_than_a_kubelet_would_is_refused_at_once(
    agent: Plugin, method: str, containers: int
) -> None:
    """The kubelet names one container a call; 900,000 empty ones fit in 4 MiB and took
    seconds when each was read against every pod."""
    if method == "Allocate":
        raw = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest()] * containers
        ).SerializeToString()
    else:
        item = api_pb2.ContainerPreferredAllocationRequest(allocation_size=1)
        raw = api_pb2.PreferredAllocationRequest(
            container_requests=[item] * containers
        ).SerializeToString()
    before = agent.answered()
    code, answer, took = invoke(agent, method, raw)
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, answer)
    assert "one container a call" in answer
    assert took < MARGIN
    assert agent.answered() == before
