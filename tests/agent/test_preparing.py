"""What a claim gets on a DRA node (gpuplace.agent.preparing), without a GPU: a claim as
kube-apiserver v1.36.2 wrote its allocation (tests/agent/fixtures/dra/, captured on the
real tier) becomes the CDI spec and the kubelet's answer; the container's GPU and MPS
limits are the device plugin's for the same grant (one rule); every claim gpuplace cannot
cap is refused with a reason."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.agent import allocating, handover, preparing
from gpuplace.cluster import dra

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "dra"
NODE = "local-node"
UID = "5d0c6f0a-51e1-4c5f-9a57-2a8d3c8e6c11"
H100_MIB = 81559
GPUS = [
    handover.NodeGpu(0, "GPU-73fa5a53-ad78-0389-6c40-cf23e8e31700", memory_mib=H100_MIB),
    handover.NodeGpu(1, "GPU-73fa5a53-ad78-0389-6c40-cf23e8e31701", memory_mib=H100_MIB),
]
MPS = {
    gpu.uuid: handover.Mps(pipe_dir=f"/run/gpuplace/mps/{gpu.uuid}/pipe", shm_dir="/run/shm")
    for gpu in GPUS
}
OPTIONS = handover.Options(handover.Strategy.VOLUME_MOUNTS, mps=MPS)
REF = preparing.ClaimRef("team-a", "share-30", UID)


def captured(name: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return found


def claim(*results: dict[str, Any], ref: preparing.ClaimRef = REF) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
        "status": {"allocation": {"devices": {"results": list(results)}}},
    }


def result(device: str = "gpu-0", compute: str = "300", memory: str = "8Gi", **values: Any) -> Any:
    body = {
        "request": "gpu",
        "driver": dra.DRIVER,
        "pool": NODE,
        "device": device,
        "shareID": "0b1e1d4e-7e8b-4b0c-8f4f-6d3c1f0e2a55",
        "consumedCapacity": {"compute": compute, "memory": memory},
    }
    body.update(values)
    return body


def env_of(spec_device: dict[str, Any]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in spec_device["containerEdits"]["env"])


def test_a_captured_share_becomes_its_mps_limits_through_cdi() -> None:
    """A 30 % share as kube-scheduler v1.36.2 allocated it (first fit: gpu-0)."""
    body = captured("claim-share-30.json")
    ref = preparing.ClaimRef(
        body["metadata"]["namespace"], body["metadata"]["name"], body["metadata"]["uid"]
    )
    prepared = preparing.prepare(ref, body, NODE, GPUS, OPTIONS)
    (device,) = prepared.devices
    assert (device.device, device.milli, device.memory_mib) == ("gpu-0", 300, 8192)
    assert device.share_id == body["status"]["allocation"]["devices"]["results"][0]["shareID"]
    assert device.cdi_ids == (f"gpu.gpuplace.io/claim=gpu-0-{ref.uid}",)
    spec = prepared.spec
    assert (spec["cdiVersion"], spec["kind"]) == ("0.3.0", "gpu.gpuplace.io/claim")
    (edits,) = spec["devices"]
    assert edits["name"] == f"gpu-0-{ref.uid}"
    assert env_of(edits) == {
        "NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices",
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M",
    }
    assert edits["containerEdits"]["mounts"] == [
        {
            "hostPath": "/dev/null",
            "containerPath": f"/var/run/nvidia-container-devices/{GPUS[0].uuid}",
            "options": ["ro", "nosuid", "nodev", "bind"],
        },
        {
            "hostPath": MPS[GPUS[0].uuid].pipe_dir,
            "containerPath": "/tmp/nvidia-mps",
            "options": ["rw", "nosuid", "nodev", "bind"],
        },
        {
            "hostPath": "/run/shm",
            "containerPath": "/dev/shm",
            "options": ["rw", "nosuid", "nodev", "bind"],
        },
    ]


def test_a_captured_whole_gpu_of_the_extended_resource_gets_no_mps() -> None:
    """The claim kube-scheduler wrote for `gpu.gpuplace.io/gpu: 1` (DRAExtendedResource)."""
    body = captured("claim-extended-resource.json")
    meta = body["metadata"]
    prepared = preparing.prepare(
        preparing.ClaimRef(meta["namespace"], meta["name"], meta["uid"]), body, NODE, GPUS, OPTIONS
    )
    (device,) = prepared.devices
    assert (device.milli, device.memory_mib) == (1000, H100_MIB)
    assert env_of(prepared.spec["devices"][0]) == {
        "NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"
    }


@given(
    milli=st.integers(min_value=0, max_value=1000),
    memory=st.integers(min_value=0, max_value=H100_MIB),
    strategy=st.sampled_from([handover.Strategy.VOLUME_MOUNTS, handover.Strategy.CDI]),
)
@settings(max_examples=200)
def test_the_container_gets_what_the_device_plugin_gives_the_same_grant(
    milli: int, memory: int, strategy: handover.Strategy
) -> None:
    """One rule: the DRA spec's edits and the device plugin's Allocate answer agree, for
    every grant the engine could make (a whole GPU takes all its memory). What a claim
    consumes of the slice's memory is its whole limit, the CUDA context inside
    (docs/dra.md), so the claim for a grant of `memory` consumes what the engine packs for
    it: the ask plus the context."""
    if milli == 0 and memory == 0:
        return
    if milli == 1000:
        memory = H100_MIB
    consumed = GPUS[0].context.takes(milli, memory)
    if consumed > H100_MIB:
        return
    options = handover.Options(strategy, mps=MPS)
    body = claim(result(compute=str(milli), memory=f"{consumed}Mi"))
    prepared = preparing.prepare(REF, body, NODE, GPUS, options)
    candidate = allocating.Candidate(
        uid="u", namespace="n", name="p", created="", container="c", count=1,
        uuids=(GPUS[0].uuid,), milli=milli, memory_mib=memory, started=False,
    )  # fmt: skip
    answer = allocating.answer(candidate, GPUS, options)
    (edits,) = prepared.spec["devices"]
    assert env_of(edits) == dict(answer.envs)
    mounts = edits["containerEdits"].get("mounts", [])
    assert [(m["containerPath"], m["hostPath"], "ro" in m["options"]) for m in mounts] == [
        (m.container_path, m.host_path, m.read_only) for m in answer.mounts
    ]
    assert prepared.devices[0].cdi_ids[1:] == tuple(d.name for d in answer.cdi_devices)


def test_whole_gpus_of_one_claim_are_one_cdi_device_each() -> None:
    body = claim(
        result("gpu-0", "1k", f"{H100_MIB}Mi", shareID=None),
        result("gpu-1", "1k", f"{H100_MIB}Mi", shareID=None, request="pair/first"),
    )
    prepared = preparing.prepare(REF, body, NODE, GPUS, OPTIONS)
    assert [device.device for device in prepared.devices] == ["gpu-0", "gpu-1"]
    assert [device.request for device in prepared.devices] == ["gpu", "pair/first"]
    assert [item["name"] for item in prepared.spec["devices"]] == [f"gpu-0-{UID}", f"gpu-1-{UID}"]
    mounted = [
        [m["containerPath"] for m in item["containerEdits"]["mounts"]]
        for item in prepared.spec["devices"]
    ]
    assert mounted == [[f"/var/run/nvidia-container-devices/{gpu.uuid}"] for gpu in GPUS]


def test_with_cdi_the_gpu_is_nvidias_spec_and_ours_carries_the_limits() -> None:
    options = handover.Options(handover.Strategy.CDI, mps=MPS)
    prepared = preparing.prepare(REF, claim(result()), NODE, GPUS, options)
    assert prepared.devices[0].cdi_ids == (
        f"gpu.gpuplace.io/claim=gpu-0-{UID}",
        f"nvidia.com/gpu={GPUS[0].uuid}",
    )
    assert env_of(prepared.spec["devices"][0])["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_admin_access_gets_the_whole_gpu_uncapped() -> None:
    admin = result(adminAccess=True, consumedCapacity=None, shareID=None)
    prepared = preparing.prepare(REF, claim(admin), NODE, GPUS, OPTIONS)
    assert (prepared.devices[0].milli, prepared.devices[0].memory_mib) == (1000, 0)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in env_of(prepared.spec["devices"][0])


def test_a_device_of_another_driver_is_not_ours_to_prepare() -> None:
    body = claim(result(driver="gpu.nvidia.com"), result("gpu-1"))
    prepared = preparing.prepare(REF, body, NODE, GPUS, OPTIONS)
    assert [device.device for device in prepared.devices] == ["gpu-1"]


REFUSED = [
    (claim(), "no device of gpu.gpuplace.io"),
    (claim(result(driver="gpu.nvidia.com")), "no device of gpu.gpuplace.io"),
    ({**claim(result()), "status": {}}, "not allocated"),
    (claim(result(pool="other-node")), "in another node's pool"),
    (claim(result("gpu-7")), "gpu-7 is no GPU of local-node"),
    (claim(result("nvidia-0")), "nvidia-0 is no GPU"),
    (claim(result(compute="0", memory="0")), "neither compute nor memory"),
    (claim(result(compute="1k", memory="40Gi")), "caps memory only for a share"),
    (claim(result(compute="1k", memory="0")), "caps memory only for a share"),
    (claim(result(), result("gpu-1")), "a share is one GPU"),
    (claim(result(), result("gpu-1", "1k", f"{H100_MIB}Mi")), "a share is one GPU"),
    (claim(result(), result()), "allocated to it twice"),
    (claim(result(consumedCapacity={"compute": "2k", "memory": "0"})), "over a whole GPU"),
    (claim(result(consumedCapacity=None)), "no consumedCapacity"),
    ({**claim(result()), "metadata": {**claim()["metadata"], "uid": "x"}}, "was replaced"),
    ({**claim(result()), "metadata": {**claim()["metadata"], "name": "other"}}, "another one"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "why"), REFUSED)
def test_what_cannot_be_capped_is_refused_with_a_reason(body: dict[str, Any], why: str) -> None:
    with pytest.raises(handover.Refusal, match=why) as refused:
        preparing.prepare(REF, body, NODE, GPUS, OPTIONS)
    assert str(refused.value).startswith(f"claim {REF.namespace}/{REF.name}: ")


def test_an_unhealthy_gpu_or_a_share_without_its_daemon_is_refused() -> None:
    sick = [handover.NodeGpu(0, GPUS[0].uuid, healthy=False, memory_mib=H100_MIB), GPUS[1]]
    with pytest.raises(handover.Refusal, match="is unhealthy"):
        preparing.prepare(REF, claim(result()), NODE, sick, OPTIONS)
    with pytest.raises(handover.MpsNotReady, match="MPS control daemon"):
        preparing.prepare(REF, claim(result()), NODE, GPUS, OPTIONS.without_mps())
    # a whole GPU needs no daemon
    whole = claim(result(compute="1k", memory=f"{H100_MIB}Mi"))
    assert preparing.prepare(REF, whole, NODE, GPUS, OPTIONS.without_mps()).devices


@pytest.mark.parametrize(
    ("namespace", "name", "uid", "why"),
    [
        ("", "c", UID, "required"),
        ("ns", "", UID, "required"),
        ("n" * 64, "c", UID, "required"),
        ("ns", "c", "", "not a claim UID"),
        ("ns", "c", "../../etc/passwd", "not a claim UID"),
        ("ns", "c", UID.upper(), "not a claim UID"),
    ],
)
def test_the_kubelets_reference_is_checked(namespace: str, name: str, uid: str, why: str) -> None:
    with pytest.raises(handover.Refusal, match=why):
        preparing.checked_ref(namespace, name, uid)


def test_spec_file_names_read_back_as_their_claim() -> None:
    assert preparing.uid_of_spec(preparing.spec_file(UID)) == UID
    assert preparing.uid_of_spec("gpu.gpuplace.io-claim_x.json") is None
    assert preparing.uid_of_spec("nvidia.yaml") is None
    assert preparing.uid_of_spec(f".{preparing.spec_file(UID)}.tmp1") is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=15,
)
RESULT_FIELDS = {
    "request": JSON | st.just("gpu"),
    "driver": st.just(dra.DRIVER) | JSON,
    "pool": st.just(NODE) | JSON,
    "device": st.sampled_from(["gpu-0", "gpu-1", "gpu-9"]) | JSON,
    "shareID": JSON,
    "consumedCapacity": st.fixed_dictionaries(
        {}, optional={"compute": st.sampled_from(["0", "300", "1k", "2k", "-1"]) | JSON,
                      "memory": st.sampled_from(["0", "8Gi", f"{H100_MIB}Mi", "1Ki"]) | JSON}
    ) | JSON,
    "adminAccess": st.booleans() | JSON,
}  # fmt: skip


@given(
    results=st.lists(st.fixed_dictionaries({}, optional=RESULT_FIELDS), max_size=4),
    metadata=st.just(claim()["metadata"]) | JSON,
)
@settings(max_examples=400)
def test_any_claim_is_prepared_within_its_grant_or_refused(
    results: list[dict[str, Any]], metadata: Any
) -> None:
    """Malformed claims, missing allocations, foreign results: a `Refusal` with a reason,
    never another exception; what is prepared is this node's GPUs within their capacity."""
    body = copy.deepcopy(claim(*results))
    body["metadata"] = metadata
    try:
        prepared = preparing.prepare(REF, body, NODE, GPUS, OPTIONS)
    except handover.Refusal as refusal:
        assert str(refusal).startswith(str(REF))
        return
    uuids = {gpu.uuid for gpu in GPUS}
    for device in prepared.devices:
        assert device.uuid in uuids and 0 <= device.milli <= 1000
        assert 0 <= device.memory_mib <= H100_MIB
    json.dumps(prepared.spec)  # it can be written
