"""What a client can get of a GPU with MPS running, from the H100 captures as they are
(issue 43, point 2): NVML's total less the driver's reservation and the MPS server's
memory, published by the agent and packed by the sidecar; the same figure whatever load
the agent read it under."""

from __future__ import annotations

import copy
import json
from typing import Any

from gpuplace.agent import capacity, discovery, nvml, publishing
from gpuplace.cluster import keys, mps_limits, nodes
from gpuplace.dev.localapi import objects
from gpuplace.placement.inventory import ClientContext
from tests.agent.kubelet import gpu_fixture

MIB = 1 << 20


def reading(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(gpu_fixture(f"nvml-{name}.json").read_text())
    return loaded


def memory(source: dict[str, Any], seen: capacity.Readings | None = None) -> capacity.Memory:
    replay = nvml.Replay(source)
    figures = mps_limits.figures(replay.name(0))
    return capacity.read(
        replay, 0, replay.memory_total(0), figures.server_mib, seen or capacity.Readings()
    )


def test_the_idle_h100_packs_its_total_less_the_driver_and_the_mps_server() -> None:
    idle = reading("idle")
    assert idle["gpus"][0]["memory"]["total"] == 81559 * MIB  # the capture, as it is
    assert (
        idle["gpus"][0]["memory"]["used"] == 480 * MIB and not idle["gpus"][0]["compute_processes"]
    )
    found = memory(idle)
    # 81,559 - 480 (used with nothing running) - 66 (the model's MPS server) = 81,013 MiB,
    # published in 64 MiB steps
    assert found == capacity.Memory(
        total_mib=81559, reserved_mib=480, server_mib=66, packable_mib=80960
    )


def test_under_load_the_same_figure_is_published() -> None:
    """Beside two MPS clients the driver charges ~10 MiB more to no process (489.75 MiB
    used beyond the processes' memory); the server is seen (66 MiB). Read cold, and after
    an idle reading (whose reservation is kept), both publish 80,960 MiB."""
    loaded = reading("mps-clients")
    cold = memory(loaded)
    assert (cold.reserved_mib, cold.server_mib, cold.packable_mib) == (490, 66, 80960)
    seen = capacity.Readings()
    memory(reading("idle"), seen)
    warm = memory(loaded, seen)
    assert (warm.reserved_mib, warm.server_mib, warm.packable_mib) == (480, 66, 80960)
    assert seen.server == {0: 66 * MIB}
    plain = memory(reading("plain-client"))  # no MPS client: the model's server figure
    assert (plain.reserved_mib, plain.server_mib, plain.packable_mib) == (489, 66, 80960)


def test_the_drivers_own_reservation_wins_and_an_unknown_model_counts_a_larger_server() -> None:
    source = copy.deepcopy(reading("mps-clients"))
    source["gpus"][0]["memory"]["reserved"] = 480 * MIB  # nvmlDeviceGetMemoryInfo_v2 (added)
    assert memory(source).reserved_mib == 480
    other = copy.deepcopy(reading("idle"))
    other["gpus"][0]["name"] = "NVIDIA Example GPU"
    replay = nvml.Replay(other)
    found = capacity.read(
        replay,
        0,
        replay.memory_total(0),
        mps_limits.figures("NVIDIA Example GPU").server_mib,
        capacity.Readings(),
    )
    assert found.server_mib == mps_limits.UNMEASURED.server_mib == 128
    assert found.packable_mib == (81559 - 480 - 128) // 64 * 64


def test_unknown_process_memory_leaves_packable_unknown_and_the_sidecar_keeps_a_margin() -> None:
    source = copy.deepcopy(reading("plain-client"))
    source["gpus"][0]["compute_processes"][0]["usedGpuMemory"] = None  # no permission
    found = memory(source)
    assert found.reserved_mib is None and found.packable_mib is None
    (gpu,) = discovery.discover(nvml.Replay(source)).gpus
    entry = publishing.entry(gpu)
    assert entry["packableMiB"] is None and entry["memoryMiB"] == 81559
    assert nodes.packable(entry) == 81559 - nodes.UNPUBLISHED_MARGIN_MIB


def test_the_published_gpu_packs_80960_mib_with_the_h100s_context() -> None:
    (gpu,) = discovery.discover(nvml.Replay(reading("idle"))).gpus
    entry = publishing.entry(gpu)
    assert {key: entry[key] for key in entry if "MiB" in key} == {
        "memoryMiB": 81559,
        "packableMiB": 80960,
        "reservedMiB": 480,
        "mpsServerMiB": 66,
        "mpsContextMiB": {"base": 144, "perPercent": 5},
    }
    node = objects.node("h100-0", gpus=1)
    node["metadata"]["annotations"] = {
        keys.NODE_GPUS: json.dumps([entry]),
        keys.AGENT_HEARTBEAT: "2026-11-24T08:00:00Z",
    }
    parsed = nodes.parse(node)
    (packed,) = parsed.gpus
    assert packed.memory_mib == 80960
    assert packed.context == ClientContext(144, 5)
    assert nodes.advertisement(parsed)[keys.RESOURCE_MEMORY] == "80960"
    # the operator's own measurement wins over the model's figures
    (measured,) = discovery.discover(
        nvml.Replay(reading("idle")), context=ClientContext(100, 4)
    ).gpus
    assert publishing.entry(measured)["mpsContextMiB"] == {"base": 100, "perPercent": 4}


def test_a_node_without_the_agent_packs_gfds_figure_less_the_stated_margin() -> None:
    node = objects.node("h100-gfd", gpus=2, gpu_memory_mib=81559)
    node["metadata"]["labels"][keys.GFD_PRODUCT] = "NVIDIA-H100-80GB-HBM3"
    parsed = nodes.parse(node)
    assert [gpu.memory_mib for gpu in parsed.gpus] == [81559 - 1024] * 2
    assert all(
        gpu.context == mps_limits.MODELS["NVIDIA-H100-80GB-HBM3"].context for gpu in parsed.gpus
    )
    # the margin covers what the agent measures on that model (599 MiB), and more
    assert nodes.UNPUBLISHED_MARGIN_MIB >= 81559 - 80960
