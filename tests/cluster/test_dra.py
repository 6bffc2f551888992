"""The DRA device model (gpuplace.cluster.dra): the slice validates against Kubernetes'
own schema, the names are what the shipped DeviceClass says, consumedCapacity reads back
as the grant it was asked for, bad results are refused with a reason, and the silence taint
is added and dropped without touching anything else."""

from __future__ import annotations

import copy
import json
import random
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.cluster import dra
from gpuplace.placement import choosing, policies
from gpuplace.placement.ledger import Grant
from gpuplace.placement.requests import WHOLE, GpuRequest
from tests.placement.clusters import ledger, node

ROOT = Path(__file__).resolve().parents[2]
DEVICE_CLASS = ROOT / "deploy" / "components" / "dra" / "deviceclass.yaml"
SCHEMA_VERSION = "1.36.0"
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
H100_MIB = 81559


def h100(index: int = 0, **values: Any) -> dra.GpuDevice:
    fields: dict[str, Any] = {
        "index": index,
        "uuid": f"GPU-73fa5a53-ad78-0389-6c40-cf23e8e3170{index}",
        "memory_mib": H100_MIB,
        "model": "NVIDIA H100 80GB HBM3",
        "numa": None,
        "nvlink_domain": -1,
        "mig": False,
    }
    fields.update(values)
    return dra.GpuDevice(**fields)


def test_the_slice_validates_against_the_clusters_schema() -> None:
    body = dra.resource_slice("gpu-node-1", "0d3e1f5a-2b4c-4d6e-8f00-112233445566", [
        h100(0), h100(1, healthy=False, numa=1, nvlink_domain=0), h100(2, model=None, mig=None),
    ])  # fmt: skip
    kubernetes_validate.validate(body, SCHEMA_VERSION, strict=True)
    first = body["spec"]["devices"][0]
    assert first["name"] == "gpu-0" and first["allowMultipleAllocations"] is True
    assert first["attributes"] == {
        "uuid": {"string": "GPU-73fa5a53-ad78-0389-6c40-cf23e8e3170" + "0"},
        "index": {"int": 0},
        "memory": {"int": H100_MIB},
        "model": {"string": "NVIDIA-H100-80GB-HBM3"},  # GFD's product string
        "nvlinkDomain": {"int": -1},
        "migMode": {"bool": False},
    }
    assert first["capacity"]["compute"] == {
        "value": "1000",
        "requestPolicy": {
            "default": "1000",
            "validRange": {"min": "0", "max": "1000", "step": "1"},
        },
    }
    assert "taints" not in first
    sick = body["spec"]["devices"][1]
    assert sick["taints"] == [{"key": "gpu.gpuplace.io/unhealthy", "effect": "NoSchedule"}]
    assert sick["attributes"]["numaNode"] == {"int": 1}
    assert set(body["spec"]["devices"][2]["attributes"]) == {
        "uuid",
        "index",
        "memory",
        "nvlinkDomain",
    }


def test_the_shipped_device_class_names_this_driver() -> None:
    shipped = yaml.safe_load(DEVICE_CLASS.read_text())
    kubernetes_validate.validate(shipped, SCHEMA_VERSION, strict=True)
    assert shipped["metadata"]["name"] == dra.DEVICE_CLASS
    assert shipped["spec"]["extendedResourceName"] == dra.EXTENDED_RESOURCE
    assert shipped["spec"]["selectors"] == [
        {"cel": {"expression": f'device.driver == "{dra.DRIVER}"'}}
    ]
    # the extended resource is not the device plugin's (issue 42: shares never served whole)
    assert not dra.EXTENDED_RESOURCE.startswith("gpuplace.io/")


@given(st.from_regex(DNS_SUBDOMAIN, fullmatch=True).filter(lambda name: len(name) <= 253))
def test_slice_names_are_dns_subdomains(node: str) -> None:
    name = dra.slice_name(node)
    assert len(name) <= 253 and DNS_SUBDOMAIN.fullmatch(name), name
    assert name.endswith(f"-{dra.DRIVER}")
    if len(node) <= 253 - len(dra.DRIVER) - 1:
        assert name == f"{node}-{dra.DRIVER}"


def test_long_node_names_keep_distinct_slices() -> None:
    first, second = "a" * 250 + "x", "a" * 250 + "y"
    assert dra.slice_name(first) != dra.slice_name(second)


@given(st.integers(min_value=0, max_value=9999))
def test_device_names_read_back_as_their_index(index: int) -> None:
    assert dra.gpu_index(dra.device_name(index)) == index


@pytest.mark.parametrize(
    "name", ["gpu-", "gpu-01", "gpu--1", "GPU-0", "gpu-0x", "mig-0", "gpu-10000", ""]
)
def test_other_names_are_no_gpu(name: str) -> None:
    assert dra.gpu_index(name) is None


# --- consumedCapacity ------------------------------------------------------------------


@given(
    milli=st.integers(min_value=0, max_value=WHOLE),
    memory=st.integers(min_value=0, max_value=1 << 20),
)
def test_what_a_claim_asks_reads_back_as_the_grant(milli: int, memory: int) -> None:
    asked = dra.capacity_requests(milli, memory)
    consumed = {"compute": str(milli), "memory": f"{memory}Mi"}
    if not asked:  # a whole GPU asks nothing: the defaults are the whole device
        assert (milli, memory) == (WHOLE, 0)
        consumed = {"compute": "1k", "memory": f"{H100_MIB}Mi"}
        assert dra.consumption(consumed) == (WHOLE, H100_MIB)
        return
    assert dra.consumption(asked) == (milli, memory)
    assert dra.consumption(consumed) == (milli, memory)


@pytest.mark.parametrize(
    ("consumed", "grant"),
    [
        ({"compute": "1k", "memory": "81559Mi"}, (1000, 81559)),  # as the API server writes it
        ({"compute": "300", "memory": "8Gi"}, (300, 8192)),
        ({"compute": "0", "memory": "20Gi"}, (0, 20480)),  # memory-only
        ({"compute": "500", "memory": "0"}, (500, 0)),
        ({"compute": "600", "memory": "17179869184"}, (600, 16384)),  # bytes
    ],
)
def test_consumed_capacity_in_the_engines_units(consumed: dict[str, str], grant: Any) -> None:
    assert dra.consumption(consumed) == grant


@pytest.mark.parametrize(
    ("consumed", "why"),
    [
        ({"memory": "1Gi"}, "no compute"),
        ({"compute": "1"}, "no memory"),
        ({"compute": "1001", "memory": "0"}, "over a whole GPU"),
        ({"compute": "-1", "memory": "0"}, "negative"),
        ({"compute": "0.5", "memory": "0"}, "not a whole number"),
        ({"compute": "500m", "memory": "0"}, "not a whole number"),
        ({"compute": "1", "memory": "1Ki"}, "not a whole number"),
        ({"compute": "abc", "memory": "0"}, "not a Kubernetes quantity"),
        ({"compute": True, "memory": "0"}, "no compute"),
        ({"compute": "1", "memory": ["1Gi"]}, "no memory"),
        ({"compute": "1" * 100, "memory": "0"}, "not a quantity"),
    ],
)
def test_bad_consumed_capacity_is_refused_with_a_reason(consumed: Any, why: str) -> None:
    with pytest.raises(dra.DraError, match=why):
        dra.consumption(consumed)


@given(
    st.dictionaries(
        st.text(max_size=12),
        st.one_of(st.text(max_size=20), st.integers(), st.none(), st.booleans()),
    )
)
@settings(max_examples=300)
def test_any_consumed_capacity_is_a_grant_or_a_refusal(consumed: dict[str, Any]) -> None:
    try:
        milli, memory = dra.consumption(consumed)
    except dra.DraError as error:
        assert str(error)
        return
    assert 0 <= milli <= WHOLE and memory >= 0


# --- claims ---------------------------------------------------------------------------


def claim_with(*results: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": dra.API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns", "uid": "1f0e5e4c-8a39-4d58-9d0a-5a6f1d1f2e3b"},
        "status": {"allocation": {"devices": {"results": list(results)}}},
    }


def result(device: str = "gpu-0", **values: Any) -> dict[str, Any]:
    body = {
        "request": "gpu",
        "driver": dra.DRIVER,
        "pool": "node-1",
        "device": device,
        "shareID": "5a1f6f0e-5b65-4a49-9d3b-7c7d2f0a8e11",
        "consumedCapacity": {"compute": "300", "memory": "8Gi"},
    }
    body.update(values)
    return body


def test_a_claims_results_of_this_driver_are_read() -> None:
    claim = claim_with(
        result(),
        result("gpu-1", driver="gpu.nvidia.com"),  # another driver's: not ours to read
        result("gpu-1", consumedCapacity={"compute": "1k", "memory": "81559Mi"}, shareID=None),
    )
    assert dra.allocated(claim) == (
        dra.Allocated("gpu", "node-1", "gpu-0", "5a1f6f0e-5b65-4a49-9d3b-7c7d2f0a8e11", 300, 8192),
        dra.Allocated("gpu", "node-1", "gpu-1", None, 1000, 81559),
    )


def test_admin_access_consumes_nothing() -> None:
    admin = result(adminAccess=True, consumedCapacity=None, shareID=None)
    assert dra.allocated(claim_with(admin)) == (
        dra.Allocated("gpu", "node-1", "gpu-0", None, 0, 0, admin=True),
    )


@pytest.mark.parametrize(
    ("claim", "why"),
    [
        ({}, "not allocated"),
        ({"status": {"allocation": None}}, "not allocated"),
        ({"status": "allocated"}, "not allocated"),
        (claim_with(result(consumedCapacity=None)), "no consumedCapacity"),
        (
            claim_with(result(consumedCapacity={"compute": "1"})),
            "gpu-0: consumedCapacity has no memory",
        ),
        (claim_with({**result(), "device": 7}), "device"),
        (claim_with({"driver": dra.DRIVER}), "request"),
        ({"status": {"allocation": {"devices": {"results": "all"}}}}, "results"),
        (claim_with(*[result()] * 33), "results"),
    ],
)
def test_a_malformed_allocation_is_refused_with_a_reason(claim: Any, why: str) -> None:
    with pytest.raises(dra.DraError, match=why):
        dra.allocated(claim)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(
    st.fixed_dictionaries(
        {"status": st.fixed_dictionaries({"allocation": st.fixed_dictionaries(
            {"devices": st.fixed_dictionaries({"results": st.lists(
                st.fixed_dictionaries({}, optional={
                    "request": JSON | st.just("gpu"), "driver": JSON | st.just(dra.DRIVER),
                    "pool": JSON | st.just("node-1"), "device": JSON | st.just("gpu-0"),
                    "shareID": JSON,
                    "consumedCapacity": JSON | st.just({"compute": "1", "memory": "1Mi"}),
                    "adminAccess": JSON,
                }), max_size=4)})})})}
    )
)  # fmt: skip
@settings(max_examples=300)
def test_any_allocation_reads_or_is_refused(claim: dict[str, Any]) -> None:
    try:
        found = dra.allocated(claim)
    except dra.DraError as error:
        assert str(error)
        return
    for item in found:
        assert 0 <= item.milli <= WHOLE and item.memory_mib >= 0


# --- comparing and tainting stored slices ---------------------------------------------------


def stored_slice() -> dict[str, Any]:
    """The slice as kube-apiserver v1.36.2 gives it back (seen there): quantities in
    canonical form, taint times set, resourceVersion and generation."""
    body = dra.resource_slice(
        "node-1", "0d3e1f5a-2b4c-4d6e-8f00-112233445566", [h100(0), h100(1, healthy=False)]
    )
    spec = body["spec"]
    for device in spec["devices"]:
        compute = device["capacity"]["compute"]
        compute["value"] = compute["requestPolicy"]["default"] = "1k"
        compute["requestPolicy"]["validRange"]["max"] = "1k"
        for taint in device.get("taints", []):
            taint["timeAdded"] = "2026-12-01T14:00:44Z"
    body["metadata"].update({"resourceVersion": "312", "generation": 1, "uid": "3b15ef59"})
    return body


def test_what_the_api_server_rewrites_compares_equal() -> None:
    desired = dra.slice_spec("node-1", [h100(0), h100(1, healthy=False)], generation=7)
    assert dra.same_devices(stored_slice()["spec"], desired)
    assert not dra.same_devices(
        stored_slice()["spec"], dra.slice_spec("node-1", [h100(0), h100(1)])
    )
    assert not dra.same_devices({"devices": "garbage"}, desired)
    assert dra.generation(stored_slice()["spec"]) == 1
    assert dra.generation({"pool": {"generation": True}}) == 0


def test_the_silence_taint_is_added_once_and_dropped_alone() -> None:
    stored = stored_slice()
    assert not dra.silenced(stored)
    silent = dra.with_silence(stored, "2026-12-01T15:00:00Z")
    assert dra.silenced(silent) and stored == stored_slice()  # a copy
    assert dra.with_silence(silent, "2026-12-01T16:00:00Z") == silent  # once
    first, second = silent["spec"]["devices"]
    assert first["taints"] == [
        {"key": dra.SILENT_TAINT, "effect": "NoSchedule", "timeAdded": "2026-12-01T15:00:00Z"}
    ]
    assert [taint["key"] for taint in second["taints"]] == [dra.UNHEALTHY_TAINT, dra.SILENT_TAINT]
    assert silent["metadata"]["resourceVersion"] == "312"  # the write is conditional on it
    assert dra.without_silence(silent) == stored
    untouched = copy.deepcopy(silent)
    for device in untouched["spec"]["devices"]:
        device.pop("taints")
    assert dra.same_devices(dra.without_silence(silent)["spec"], stored["spec"])


def test_a_slice_without_devices_has_nothing_to_taint() -> None:
    empty = {"spec": {"driver": dra.DRIVER, "devices": []}}
    assert dra.silenced(empty) and dra.with_silence(empty, "t") == empty


# --- selectors the webhook will write ----------------------------------------------------------


def device_activation(model: str) -> Any:
    device = {
        "driver": dra.DRIVER,
        "attributes": {dra.DRIVER: {dra.MODEL: model, dra.INDEX: 0}},
    }
    return {"device": celpy.json_to_cel(device)}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("models", "model", "holds"),
    [
        (["NVIDIA H100 80GB HBM3"], "NVIDIA-H100-80GB-HBM3", True),
        (["NVIDIA-A100-SXM4-80GB", "NVIDIA-H100-80GB-HBM3"], "NVIDIA-H100-80GB-HBM3", True),
        (["NVIDIA-A100-SXM4-80GB"], "NVIDIA-H100-80GB-HBM3", False),
        (['x" || true || "'], "NVIDIA-H100-80GB-HBM3", False),  # quoted, not injected
        ([], "NVIDIA-H100-80GB-HBM3", False),
    ],
)
def test_the_model_selector_holds_for_exactly_its_models(
    models: list[str], model: str, holds: bool
) -> None:
    environment = celpy.Environment()
    program = environment.program(environment.compile(dra.model_selector(models)))
    assert bool(program.evaluate(device_activation(model))) is holds


def test_the_uuid_selector_pins_one_gpu() -> None:
    environment = celpy.Environment()
    program = environment.program(environment.compile(dra.uuid_selector("GPU-1")))

    def holds(uuid: str) -> bool:
        device = {"driver": dra.DRIVER, "attributes": {dra.DRIVER: {dra.UUID: uuid}}}
        return bool(program.evaluate({"device": celpy.json_to_cel(device)}))  # type: ignore[attr-defined]

    assert holds("GPU-1") and not holds("GPU-2")


def test_quantities_compare_by_value() -> None:
    assert dra._normal({"value": "1k"}) == dra._normal({"value": "1000"})
    assert dra._normal({"value": "1k"}, "")["value"] == Decimal(1000)
    assert json.dumps(dra.capacity_requests(250, 4096)) == '{"compute": "250", "memory": "4096Mi"}'


def test_the_slice_the_api_server_stored_is_what_was_published() -> None:
    """tests/agent/fixtures/dra/slice.json: kube-apiserver v1.36.2's copy of the slice."""
    stored = json.loads((ROOT / "tests" / "agent" / "fixtures" / "dra" / "slice.json").read_text())
    assert stored["spec"]["devices"][0]["capacity"]["compute"]["value"] == "1k"
    gpus = [h100(0), h100(1)]
    assert dra.same_devices(stored["spec"], dra.slice_spec("local-node", gpus))
    assert not dra.same_devices(stored["spec"], dra.slice_spec("local-node", gpus[:1]))


def test_dra_first_fit_replays_the_order_the_agent_publishes() -> None:
    """`gpuplace simulate --policy dra-first-fit` stands for kube-scheduler's allocator,
    which takes pools by name and a slice's devices as listed: the agent's slices list a
    node's GPUs by index (gpu-2 before gpu-10, whatever order NVML gave), one pool named
    after the node, and the policy fills GPUs and nodes in exactly that order."""
    gpus = [h100(index) for index in (10, 2, 0, 11, 1, 3, 4, 5, 6, 7, 8, 9)]
    names = ["node-b", "node-a10", "node-a2"]
    slices = {name: dra.slice_spec(name, gpus) for name in names}
    published = [
        (spec["pool"]["name"], device["attributes"][dra.INDEX]["int"])
        for spec in sorted(slices.values(), key=lambda spec: spec["pool"]["name"])
        for device in spec["devices"]
    ]
    assert [name for name, _ in published[:12]] == ["node-a10"] * 12
    assert [index for _, index in published[:12]] == list(range(12))
    book = ledger(*(node(name, 12) for name in names))
    chooser = choosing.Chooser(
        book, policies.make("dra-first-fit", rank=policies.pool_order(names))
    )
    taken = []
    for number in range(len(published)):
        chosen = chooser.choose(GpuRequest(milli=600, count=1), random.Random(0))
        assert chosen is not None
        book.reserve(Grant(f"pod-{number}", chosen.node, chosen.gpus, 600, 0))
        taken.append((dra.pool_name(chosen.node), chosen.gpus[0]))
    assert taken == published
