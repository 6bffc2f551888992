"""What a pod on the DRA path names and what its claim asks (`gpuplace.cluster.dra_claims`),
checked against the claims a real kube-apiserver stored and kube-scheduler allocated
(tests/cluster/fixtures/dra-claims) and, with a CEL evaluator, against the devices of the
slice they were allocated from."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import celpy
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuplace.cluster import dra, dra_claims, keys, mps_limits
from gpuplace.placement.inventory import ClientContext, Gpu
from gpuplace.placement.requests import GpuRequest, Topology

FIXTURES = Path(__file__).parent / "fixtures" / "dra-claims"
H100 = "NVIDIA-H100-80GB-HBM3"
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return loaded


@given(st.text(max_size=300), st.text(min_size=1, max_size=64))
def test_a_claim_name_is_always_a_dns_subdomain(base: str, seed: str) -> None:
    name = dra_claims.claim_name(base, seed)
    assert len(name) <= 253 and DNS_SUBDOMAIN.fullmatch(name), name


def test_a_claim_name_is_the_pods_then_the_review_s() -> None:
    assert dra_claims.claim_name("train-", "a") == dra_claims.claim_name("train-", "a")
    assert dra_claims.claim_name("train-", "a") != dra_claims.claim_name("train-", "b")
    assert dra_claims.claim_name("train-", "a").startswith("train-gpu-")
    assert dra_claims.claim_name("Job.Worker-0", "a").startswith("job-worker-0-gpu-")


@pytest.mark.parametrize(
    ("name", "request_", "context"),
    [
        ("share", GpuRequest(milli=300, memory_mib=8192, count=1, models=frozenset({H100})), 294),
        ("memory-only", GpuRequest(milli=0, memory_mib=4096, count=1), 644),
        ("whole-preferred", GpuRequest(milli=1000, count=2, topology=Topology.PREFERRED), 0),
        ("whole-required", GpuRequest(milli=1000, count=2, topology=Topology.REQUIRED), 0),
    ],
)
def test_the_claims_written_are_what_the_api_server_stored(
    name: str, request_: GpuRequest, context: int
) -> None:
    stored = fixture(f"claim-{name}")
    assert stored["spec"]["devices"] == dra_claims.devices(request_, context)
    pod = fixture(f"pod-{name}")
    body = dra_claims.claim(
        "e1",
        dra_claims.named(pod),
        pod=pod["metadata"]["name"],
        pod_uid=pod["metadata"]["uid"],
        request=request_,
        context=context,
    )
    assert body["metadata"]["ownerReferences"] == stored["metadata"]["ownerReferences"]
    assert body["metadata"]["labels"] == {keys.MANAGED: "true"}
    assert dra_claims.owner(stored) == (pod["metadata"]["name"], pod["metadata"]["uid"])


def test_a_share_without_memory_and_a_whole_gpu_with_memory() -> None:
    no_memory = dra_claims.devices(GpuRequest(milli=250, count=1))
    assert no_memory["requests"][0]["exactly"]["capacity"] == {
        "requests": {"compute": "250", "memory": "0Mi"}
    }
    whole = dra_claims.devices(GpuRequest(milli=1000, memory_mib=40960, count=1))["requests"][0]
    assert "capacity" not in whole["exactly"]  # it consumes the whole GPU
    assert whole["exactly"]["selectors"] == [{"cel": {"expression": dra.memory_selector(40960)}}]


def test_the_context_is_the_largest_of_the_gpus_it_may_land_on() -> None:
    request = GpuRequest(milli=300, memory_mib=8192, count=1, models=frozenset({H100}))
    gpus = [
        Gpu(0, H100, 80960, context=ClientContext(144, 5)),
        Gpu(1, H100, 80960, context=ClientContext(200, 5)),
        Gpu(2, "NVIDIA-L4", 22000, context=ClientContext(999, 9)),
    ]
    assert dra_claims.context_mib(request, gpus) == 200 + 5 * 30
    assert dra_claims.context_mib(request, []) == 144 + 5 * 30  # its model's figures
    anywhere = GpuRequest(milli=300, memory_mib=8192, count=1)
    assert dra_claims.context_mib(anywhere, []) == mps_limits.UNMEASURED.context.mib(300)
    assert dra_claims.context_mib(anywhere, gpus) == 999 + 9 * 30
    assert dra_claims.context_mib(GpuRequest(milli=300, count=1), gpus) == 0  # no memory: no cap
    assert dra_claims.context_mib(GpuRequest(milli=1000, count=1, memory_mib=10), gpus) == 0


def test_every_claim_a_pod_uses() -> None:
    pod = fixture("pod-share")
    pod["status"]["resourceClaimStatuses"] = [{"name": "t", "resourceClaimName": "p-t-x1"}]
    pod["status"]["extendedResourceClaimStatus"] = {"resourceClaimName": "p-extended"}
    assert dra_claims.claim_names(pod) == (dra_claims.named(pod), "p-t-x1", "p-extended")
    assert dra_claims.named({"spec": {}}) == ""


# --- the selectors on the devices they were allocated from --------------------------------------


def holds(expression: str, device: dict[str, Any]) -> bool:
    """`expression` on a slice device (its attributes, as the allocator's CEL sees them)."""
    attributes = {name: next(iter(value.values())) for name, value in device["attributes"].items()}
    environment = celpy.Environment()
    program = environment.program(environment.compile(expression))
    seen = {"driver": dra.DRIVER, "attributes": {dra.DRIVER: attributes}}
    return bool(program.evaluate({"device": celpy.json_to_cel(seen)}))  # type: ignore[attr-defined]


DEVICES = fixture("slice-written")["spec"]["devices"]


def test_the_model_and_nvlink_selectors_on_the_slice_devices() -> None:
    model = dra.model_selector([H100])
    nvlink = dra.nvlink_selector()
    assert [holds(model, device) for device in DEVICES] == [
        True,
        True,
        True,
        False,
    ]  # gpu-3 has none
    assert [holds(nvlink, device) for device in DEVICES] == [True, True, False, False]


def test_a_claim_pinned_to_the_planned_gpus_asks_those_alone() -> None:
    """What a planner (plan, then pin) writes: the planned GPUs' UUIDs a selector on every
    alternative of the request, beside the model's; on the slice it holds for those only,
    and for no device without a UUID."""
    assert [holds(dra.uuids_selector(["GPU-1"]), device) for device in DEVICES] == [
        False, True, False, False,
    ]  # fmt: skip
    pair = dra.uuids_selector(["GPU-2", "GPU-0", "GPU-2"])
    assert [holds(pair, device) for device in DEVICES] == [True, False, True, False]
    bare = {
        **DEVICES[0],
        "attributes": {k: v for k, v in DEVICES[0]["attributes"].items() if k != dra.UUID},
    }
    assert not holds(pair, bare)
    assert dra.uuids_selector([]) == "false"
    share = GpuRequest(milli=300, memory_mib=8192, count=1, models=frozenset({H100}))
    pinned = dra_claims.devices(share, 294, ["GPU-1"])["requests"][0]["exactly"]
    assert pinned["selectors"] == [
        {"cel": {"expression": dra.uuids_selector(["GPU-1"])}},
        {"cel": {"expression": dra.model_selector([H100])}},
    ]
    assert (
        pinned["capacity"] == dra_claims.devices(share, 294)["requests"][0]["exactly"]["capacity"]
    )
    preferred = GpuRequest(milli=1000, count=2, topology=Topology.PREFERRED)
    alternatives = dra_claims.devices(preferred, 0, ["GPU-0", "GPU-1"])["requests"][0]
    assert all(
        {"cel": {"expression": dra.uuids_selector(["GPU-0", "GPU-1"])}} in item["selectors"]
        for item in alternatives["firstAvailable"]
    )
    body = dra_claims.claim(
        "e1", "p-gpu-1", pod="p", pod_uid="u", request=share, context=294, pinned=["GPU-1"]
    )
    assert body["spec"]["devices"] == dra_claims.devices(share, 294, ["GPU-1"])
