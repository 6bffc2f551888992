"""Discovery and health through the NVML seam, replayed from the real H100 readings in
../shared/fixtures/gpu/ (and readings derived from them, marked so)."""

from __future__ import annotations

import copy
import xml.etree.ElementTree as ET
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuplace.agent import discovery, nvml
from gpuplace.placement.inventory import NO_NVLINK
from tests.agent.kubelet import gpu_fixture

READINGS = ("nvml-idle.json", "nvml-plain-client.json", "nvml-mps-clients.json")


def reading(name: str = "nvml-idle.json") -> dict[str, Any]:
    return nvml.Replay.load(gpu_fixture(name)).reading  # type: ignore[return-value]


@pytest.mark.parametrize("name", READINGS)
def test_discovery_equals_nvidia_smi_on_the_real_h100(name: str) -> None:
    """The same machine's `nvidia-smi -q -x`: UUID, model, memory, bus id, MIG mode."""
    smi = ET.parse(gpu_fixture("nvidia-smi-q.xml")).getroot()
    gpus = smi.findall("gpu")
    found = discovery.discover(nvml.Replay.load(gpu_fixture(name)))
    assert len(found.gpus) == len(gpus) == 1
    gpu, xml_gpu = found.gpus[0], gpus[0]
    assert gpu.index == 0
    assert gpu.uuid == xml_gpu.findtext("uuid")
    assert gpu.model == xml_gpu.findtext("product_name")
    total = str(xml_gpu.findtext("fb_memory_usage/total"))
    assert f"{gpu.memory_mib} MiB" == total
    assert gpu.pci_bus_id == xml_gpu.findtext("pci/pci_bus_id")
    assert gpu.mig is (xml_gpu.findtext("mig_mode/current_mig") == "Enabled")
    assert found.driver == smi.findtext("driver_version")


def test_what_nvml_cannot_answer_is_unknown_not_guessed() -> None:
    """The real H100 answers Not Supported for NUMA and NVLink: both stay None, and a
    GPU with no answer there is still healthy."""
    gpu = discovery.discover(nvml.Replay(reading())).gpus[0]
    assert gpu.numa is None
    assert gpu.nvlink_peers is None
    assert gpu.nvlink_domain is None
    assert gpu.health == discovery.Health(True, ())


def test_eight_derived_gpus_in_two_nvlink_domains() -> None:
    made = nvml.derived(
        reading(), 8, nvlink_domains=[range(4), range(4, 8)], numa=[0] * 4 + [1] * 4
    )
    assert "derived" in made
    found = discovery.discover(nvml.Replay(made))
    assert [gpu.index for gpu in found.gpus] == list(range(8))
    assert len({gpu.uuid for gpu in found.gpus}) == 8
    assert len({gpu.pci_bus_id for gpu in found.gpus}) == 8
    assert found.domains() == {0: (0, 1, 2, 3), 4: (4, 5, 6, 7)}
    assert found.gpus[5].nvlink_peers == (4, 6, 7)
    assert [gpu.numa for gpu in found.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_gpus_joined_through_a_common_nvswitch_share_a_domain() -> None:
    """On NVSwitch systems each link's far end is a switch, not a GPU."""
    made = nvml.derived(reading(), 4)
    for gpu in made["gpus"]:
        gpu["nvlink"] = [
            {"state": 1, "remote_pci_bus_id": "00000000:A0:00.0"},
            {"state": 1, "remote_pci_bus_id": "00000000:a1:00.0"},
            {"state": 0},
        ]
    made["gpus"][3]["nvlink"] = [{"state": 0}, {"state": 0}]
    found = discovery.discover(nvml.Replay(made))
    assert found.domains() == {0: (0, 1, 2)}
    assert found.gpus[3].nvlink_domain == NO_NVLINK
    assert found.gpus[3].nvlink_peers == ()


def test_uncorrectable_ecc_and_a_lost_gpu_are_unhealthy_not_supported_is_not() -> None:
    made = nvml.derived(reading(), 3)
    made["gpus"][0]["ecc_uncorrected_volatile"] = 2
    made["gpus"][1]["uuid"] = {"nvml_error": "GPU is lost"}
    made["gpus"][2]["ecc_uncorrected_volatile"] = {"nvml_error": "Not Supported"}
    made["gpus"][2]["name"] = {"nvml_error": "Not Supported"}
    found = discovery.discover(nvml.Replay(made))
    zero, one, two = found.gpus
    assert zero.health == discovery.Health(False, ("uncorrectable ECC errors: 2",))
    assert not one.health.healthy
    assert one.uuid is None
    assert one.health.reasons == ("nvml uuid: GPU is lost",)
    assert two.health.healthy
    assert two.model is None
    assert found.unhealthy == (0, 1)


def test_critical_xids_make_a_gpu_unhealthy_until_restart_application_ones_do_not() -> None:
    made = nvml.derived(reading(), 2)
    made["xid_events"] = [{"index": 1, "xid": 13}, {"index": 0, "xid": 79}]
    replay = nvml.Replay(made)
    xids = discovery.XidLog()
    assert xids.poll(replay)
    found = discovery.discover(replay, xids)
    assert found.gpus[0].health == discovery.Health(False, ("XID 79",))
    assert found.gpus[1].health.healthy
    assert not xids.poll(replay)
    assert not discovery.discover(replay, xids).gpus[0].health.healthy


def test_xid_events_not_supported_is_recorded_and_not_asked_again() -> None:
    made = copy.deepcopy(reading())
    made["xid_events"] = {"nvml_error": "Not Supported"}
    replay = nvml.Replay(made)
    xids = discovery.XidLog()
    assert not xids.poll(replay)
    calls = replay.calls
    assert not xids.poll(replay)
    assert replay.calls == calls
    found = discovery.discover(replay, xids)
    assert found.problems == ("XID events: Not Supported",)
    assert found.gpus[0].health.healthy


def test_a_node_where_nvml_cannot_count_gpus_has_none_and_says_why() -> None:
    found = discovery.discover(nvml.Replay({"count": {"nvml_error": "Driver Not Loaded"}}))
    assert found.gpus == ()
    assert found.problems == ("nvml gpu count: Driver Not Loaded",)


def test_real_nvml_without_a_driver_raises_the_seams_error() -> None:
    """This machine has no NVIDIA driver: `Real()` fails with NVML's own message."""
    with pytest.raises(nvml.NvmlError):
        nvml.Real()


@given(
    st.integers(min_value=1, max_value=8).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n),
        )
    )
)
def test_domains_are_the_connected_components_of_the_links(
    case: tuple[int, list[tuple[int, int]]],
) -> None:
    count, edges = case
    made = nvml.derived(reading(), count)
    buses = [gpu["pci_bus_id"] for gpu in made["gpus"]]
    for gpu in made["gpus"]:
        gpu["nvlink"] = [{"state": 0}]
    for a, b in edges:
        if a != b:
            made["gpus"][a]["nvlink"].append({"state": 1, "remote_pci_bus_id": buses[b]})
    found = discovery.discover(nvml.Replay(made))
    # components by plain graph search
    neighbours: dict[int, set[int]] = {i: set() for i in range(count)}
    for a, b in edges:
        if a != b:
            neighbours[a].add(b)
            neighbours[b].add(a)
    for gpu in found.gpus:
        seen, todo = {gpu.index}, [gpu.index]
        while todo:
            for other in neighbours[todo.pop()]:
                if other not in seen:
                    seen.add(other)
                    todo.append(other)
        assert gpu.nvlink_peers == tuple(sorted(seen - {gpu.index}))
        assert gpu.nvlink_domain == (min(seen) if len(seen) > 1 else NO_NVLINK)
