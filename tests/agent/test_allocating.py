"""The device plugin's decisions, pure: never a GPU that was not granted, whatever the pods
and whatever slots the kubelet names; the answer for each runtime strategy; and the pod
view fed by a real informer of the node's pods (field selector) from the fake API."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.agent import allocating, handover, plugin
from gpuplace.agent.deviceplugin import api_pb2
from gpuplace.cluster import keys, kube
from gpuplace.dev import localapi
from tests.agent import kubelet as standin
from tests.cluster.conftest import api, eventually, server

__all__ = ["api", "server"]  # fixtures

GPUS = standin.eight_gpus()
OPTIONS = [
    handover.Options(strategy, mps=handover.Mps("/run/gpuplace/mps/pipe"))
    for strategy in handover.Strategy
]


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    """A pod as it may be found on the node: granted here or elsewhere or not at all,
    whole or share, asking for the right slot count or not, started or not, finished."""
    count = draw(st.sampled_from([1, 1, 1, 2, 4]))
    indices = draw(st.lists(st.integers(0, 9), min_size=count, max_size=count, unique=True))
    share = count == 1 and draw(st.booleans())
    uuids = [GPUS[i].uuid if i < len(GPUS) else f"GPU-gone-{i}" for i in indices]
    pod = standin.pod(
        f"p{draw(st.integers(0, 10**6))}",
        indices,
        uuids,
        milli=draw(st.sampled_from([0, 100, 250, 990])) if share else 1000,
        memory_mib=draw(st.integers(1, 80000)) if share else 0,
        node=draw(st.sampled_from([standin.NODE, standin.NODE, "gpu-node-2"])),
        created=f"2026-11-24T08:{draw(st.integers(0, 59)):02d}:00Z",
        request=draw(st.sampled_from([None, None, None, count + 1])),
        assigned=draw(st.booleans()) or draw(st.booleans()),
    )
    if draw(st.booleans()):
        pod["metadata"]["annotations"].pop(keys.ASSIGNED_UUIDS, None)  # indices only
    pod["status"] = draw(
        st.sampled_from(
            [
                {"phase": "Pending"},
                {"phase": "Succeeded"},
                {
                    "phase": "Running",
                    "containerStatuses": [{"name": "train", "containerID": "containerd://x"}],
                },
            ]
        )
    )
    return pod


slot_ids = st.lists(
    st.builds(
        allocating.device_id,
        st.sampled_from([gpu.uuid for gpu in GPUS] + ["GPU-elsewhere"]),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=4,
    unique=True,
)


def granted_here(pod: dict[str, Any]) -> set[str]:
    """What the pod's assignment grants on this node, read independently of the plugin."""
    annotations = pod["metadata"]["annotations"]
    if pod["spec"]["nodeName"] != standin.NODE or annotations.get(keys.ASSIGNED_NODE) != (
        standin.NODE
    ):
        return set()
    raw = annotations.get(keys.ASSIGNED_UUIDS) or ""
    if raw:
        return set(raw.split(","))
    by_index = {str(gpu.index): gpu.uuid for gpu in GPUS}
    return {by_index.get(index, "?") for index in annotations[keys.ASSIGNED_GPUS].split(",")}


def could_ask(pod: dict[str, Any], size: int) -> bool:
    """The kubelet may be allocating `size` slots for `pod`: bound here, not finished, and
    a container that has not started asks for that many (read independently of the plugin)."""
    if pod["spec"]["nodeName"] != standin.NODE or pod["status"]["phase"] in (
        "Succeeded",
        "Failed",
    ):
        return False
    started = {
        entry["name"]
        for field in ("containerStatuses", "initContainerStatuses")
        for entry in pod["status"].get(field, [])
        if entry.get("containerID")
    }
    return any(
        container.get("resources", {}).get("limits", {}).get(keys.RESOURCE_GPU) == str(size)
        and container["name"] not in started
        for field in ("containers", "initContainers")
        for container in pod["spec"].get(field, [])
    )


def readings(
    found: list[dict[str, Any]],
) -> tuple[list[allocating.Candidate], list[allocating.Stranger]]:
    read = [allocating.read(pod, standin.NODE, GPUS) for pod in found]
    return (
        [item for item in read if isinstance(item, allocating.Candidate)],
        [item for item in read if isinstance(item, allocating.Stranger)],
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(pods(), max_size=8, unique_by=lambda pod: pod["metadata"]["uid"]),
    slot_ids,
    st.booleans(),
    st.sampled_from(OPTIONS),
)
def test_never_a_gpu_that_was_not_granted(
    found: list[dict[str, Any]], device_ids: list[str], settled: bool, options: handover.Options
) -> None:
    candidates, strangers = readings(found)
    match = allocating.choose(device_ids, candidates, strangers, set(), allow_mismatch=settled)
    if match is None:
        return
    pod = next(pod for pod in found if pod["metadata"]["uid"] == match.candidate.uid)
    assert pod["status"]["phase"] != "Succeeded"
    assert len(device_ids) == match.candidate.count == len(match.candidate.uuids)
    if match.tier is not allocating.Tier.MISMATCH:
        assert {allocating.gpu_of(device) for device in device_ids} == set(match.candidate.uuids)
    # whichever pod the kubelet is allocating for, it holds a grant here
    for other in found:
        if could_ask(other, len(device_ids)):
            assert granted_here(other), f"{other['metadata']['name']} has no grant here"
    try:
        response = allocating.answer(match.candidate, GPUS, options)
    except handover.Refusal:
        return
    handed = allocating.granted_in(response, options)
    assert handed == set(match.candidate.uuids)
    assert handed <= granted_here(pod)
    assert handed <= {gpu.uuid for gpu in GPUS}


def test_a_pod_without_a_grant_is_never_a_candidate() -> None:
    bare = standin.pod("bare", [0], [GPUS[0].uuid], assigned=False)
    assert allocating.candidate(bare, standin.NODE, GPUS) is None
    forged = standin.pod("forged", [0], ["GPU-not-on-this-node"])
    assert allocating.candidate(forged, standin.NODE, GPUS) is None


def test_a_pod_without_a_grant_is_a_stranger_until_it_starts_or_ends() -> None:
    bare = standin.pod("bare", [0, 1], [GPUS[0].uuid, GPUS[1].uuid], assigned=False)
    assert allocating.read(bare, standin.NODE, GPUS) == allocating.Stranger(
        "research", "bare", frozenset({2})
    )
    choice = allocating.choose(
        [allocating.device_id(GPUS[0].uuid, 0), allocating.device_id(GPUS[1].uuid, 0)],
        [],
        [allocating.Stranger("research", "bare", frozenset({2}))],
        set(),
        allow_mismatch=True,
    )
    assert choice is None
    bare["status"] = {"containerStatuses": [{"name": "train", "containerID": "containerd://x"}]}
    assert allocating.read(bare, standin.NODE, GPUS) is None
    bare["status"] = {"phase": "Failed"}
    assert allocating.read(bare, standin.NODE, GPUS) is None
    assert allocating.read(bare, "gpu-node-2", GPUS) is None


def test_an_init_container_asking_for_slots_makes_a_stranger() -> None:
    """The webhook lets only the GPU container ask; an init container asking too would get
    an Allocate of its own, and the kubelet hands its slots on to the app container."""
    pod = standin.pod("init", [0], [GPUS[0].uuid])
    pod["spec"]["initContainers"] = [
        {"name": "warm", "resources": {"limits": {keys.RESOURCE_GPU: "1"}}}
    ]
    assert allocating.candidate(pod, standin.NODE, GPUS) is None
    assert allocating.read(pod, standin.NODE, GPUS) == allocating.Stranger(
        "research", "init", frozenset({1})
    )


@pytest.mark.parametrize("slot", ["\u00b2", "\u0661", "1" * 5000, "-1", "", " 1"])
def test_slot_ids_no_kubelet_sends_are_nobodys_and_never_raise(slot: str) -> None:
    """ "²".isdigit() is True and int("1" * 5000) raises: neither reaches `int`."""
    device = f"{GPUS[0].uuid}::{slot}"
    assert allocating.gpu_of(device) == (GPUS[0].uuid if slot == "1" * 5000 else "")
    request = api_pb2.ContainerPreferredAllocationRequest(
        available_deviceIDs=[device, allocating.device_id(GPUS[0].uuid, 2)], allocation_size=1
    )
    assert len(allocating.prefer(request, [], set())) == 1


@pytest.mark.parametrize(
    ("strategy", "envs", "mounts", "devices", "cdi"),
    [
        (
            handover.Strategy.CDI,
            {"NVIDIA_VISIBLE_DEVICES": "void"},
            [],
            [],
            ["nvidia.com/gpu=U1", "nvidia.com/gpu=U3"],
        ),
        (
            handover.Strategy.VOLUME_MOUNTS,
            {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"},
            [
                ("/dev/null", "/var/run/nvidia-container-devices/U1"),
                ("/dev/null", "/var/run/nvidia-container-devices/U3"),
            ],
            ["/dev/nvidia1", "/dev/nvidia3", *handover.CONTROL_DEVICES],
            [],
        ),
        (
            handover.Strategy.ENVVAR,
            {"NVIDIA_VISIBLE_DEVICES": "U1,U3"},
            [],
            ["/dev/nvidia1", "/dev/nvidia3", *handover.CONTROL_DEVICES],
            [],
        ),
    ],
)
def test_answer_by_strategy(
    strategy: handover.Strategy,
    envs: dict[str, str],
    mounts: list[tuple[str, str]],
    devices: list[str],
    cdi: list[str],
) -> None:
    gpus = [handover.NodeGpu(i, f"U{i}", minor=i) for i in range(4)]
    chosen = allocating.candidate(standin.pod("p", [1, 3], ["U1", "U3"]), standin.NODE, gpus)
    assert chosen is not None
    response = allocating.answer(chosen, gpus, handover.Options(strategy))
    assert dict(response.envs) == envs
    assert [(m.host_path, m.container_path) for m in response.mounts] == mounts
    assert [d.container_path for d in response.devices] == devices
    assert all(d.permissions == "rw" and d.host_path == d.container_path for d in response.devices)
    assert [d.name for d in response.cdi_devices] == cdi


def test_no_device_nodes_when_a_minor_is_unknown() -> None:
    gpus = [handover.NodeGpu(0, "U0", minor=None)]
    chosen = allocating.candidate(standin.pod("p", [0], ["U0"]), standin.NODE, gpus)
    assert chosen is not None
    response = allocating.answer(chosen, gpus, handover.Options(handover.Strategy.ENVVAR))
    assert not response.devices


def test_memory_only_share_gets_all_threads_and_its_memory() -> None:
    chosen = allocating.candidate(
        standin.pod("m", [2], [GPUS[2].uuid], milli=0, memory_mib=512), standin.NODE, GPUS
    )
    assert chosen is not None
    response = allocating.answer(chosen, GPUS, OPTIONS[0])
    assert response.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    # the limit covers the H100's CUDA context at 100 % of threads (issue 43)
    assert response.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1156M"  # 512 + 144 + 500


def test_a_share_without_mps_is_refused() -> None:
    chosen = allocating.candidate(
        standin.pod("s", [2], [GPUS[2].uuid], milli=500, memory_mib=512), standin.NODE, GPUS
    )
    assert chosen is not None
    with pytest.raises(handover.Refusal, match="MPS"):
        allocating.answer(chosen, GPUS, handover.Options())


def test_indices_only_assignment_maps_through_this_nodes_uuids() -> None:
    pod = standin.pod("i", [5], [GPUS[5].uuid])
    pod["metadata"]["annotations"][keys.ASSIGNED_UUIDS] = ""
    chosen = allocating.candidate(pod, standin.NODE, GPUS)
    assert chosen is not None and chosen.uuids == (GPUS[5].uuid,)


def test_device_ids_fit_the_kubelets_limit() -> None:
    listed = allocating.devices(standin.fixture_gpus(), 100)
    assert len(listed) == 100
    assert max(len(device.ID) for device in listed) <= allocating.MAX_DEVICE_ID
    assert allocating.gpu_of(listed[-1].ID) == standin.fixture_gpus()[0].uuid
    assert allocating.gpu_of("nvidia0") == ""


async def test_pod_view_follows_only_this_nodes_pods(
    server: localapi.Server, api: kube.Kube
) -> None:
    def create(pod: dict[str, Any]) -> None:
        for key in ("uid", "creationTimestamp"):
            pod["metadata"].pop(key)  # the API server's to set
        pod.pop("status")
        server.api.create(pod)

    create(standin.pod("here", [0], [GPUS[0].uuid]))
    create(standin.pod("there", [0], [GPUS[0].uuid], node="gpu-node-2"))
    view = plugin.PodView()

    def names() -> set[str]:
        return {pod["metadata"]["name"] for pod in view.pods.values()}

    informer = plugin.pod_informer(api, standin.NODE, view)
    task = asyncio.ensure_future(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 5)
        assert names() == {"here"}
        create(standin.pod("later", [1], [GPUS[1].uuid]))
        await eventually(lambda: names() == {"here", "later"})
        server.api.delete("pods", "here", "research")
        await eventually(lambda: names() == {"later"})
        calls = [call for call in server.api.calls if call.path.endswith("/pods")]
        assert calls and all(
            call.query.get("fieldSelector") == f"spec.nodeName={standin.NODE}" for call in calls
        )
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_a_daemon_per_gpu_gives_each_share_its_own_gpus_directory() -> None:
    per_gpu = {gpu.uuid: handover.Mps(f"/run/gpuplace/mps/{gpu.index}") for gpu in GPUS[:4]}
    options = handover.Options(mps=per_gpu)
    here = allocating.candidate(
        standin.pod("here", [3], [GPUS[3].uuid], milli=500), standin.NODE, GPUS
    )
    assert here is not None
    response = allocating.answer(here, GPUS, options)
    assert [m.host_path for m in response.mounts] == ["/run/gpuplace/mps/3"]
    missing = allocating.candidate(
        standin.pod("missing", [6], [GPUS[6].uuid], milli=500), standin.NODE, GPUS
    )
    assert missing is not None
    with pytest.raises(handover.Refusal, match="MPS"):
        allocating.answer(missing, GPUS, options)
