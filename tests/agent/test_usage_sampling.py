"""What pods use of their GPUs, from the real NVML captures as they are (idle, one plain
client, two MPS clients beside their server) with the processes' cgroups written into a
temporary proc root; per-process SM samples only from synthetic readings (no capture has
them, and each test that adds them says so); the series as Prometheus renders them."""

from __future__ import annotations

import asyncio
import copy
import re
import threading
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuplace.agent import cgroups, nvml, preparing, usage_sampling
from gpuplace.cluster import dra_claims
from gpuplace.placement.inventory import ClientContext
from gpuplace.usage import names
from tests.agent.kubelet import gpu_fixture
from tests.agent.kubelet import pod as granted_pod

NODE = "h100-0"
H100 = "GPU-73fa5a53-ad78-0389-6c40-cf23e8e3170c"
H100_MEMORY = 85520809984
MIB = 1 << 20


def reading(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = nvml.Replay.load(gpu_fixture(f"nvml-{name}.json")).reading  # type: ignore[assignment]
    return loaded


def uid_of(number: int) -> str:
    return f"00000000-0000-4000-8000-{number:012d}"


def pod(
    name: str, number: int, *, milli: int | None = None, memory_mib: int = 0, **extra: Any
) -> dict[str, Any]:
    """A pod of this node: a gpuplace grant on the H100 when `milli` is given, else a plain
    pod (e.g. the agent's own, or one with another device plugin's GPU)."""
    if milli is not None:
        made = granted_pod(name, [0], [H100], milli=milli, memory_mib=memory_mib, node=NODE)
    else:
        made = {"metadata": {"name": name, "namespace": "research"}, "spec": {"nodeName": NODE}}
    made["metadata"]["uid"] = uid_of(number)
    made["status"] = {"phase": "Running"}
    for key, value in extra.items():
        made["metadata"][key] = value
    return made


def in_pod(proc: Path, pid: int, number: int) -> None:
    """Process `pid` in the pod `uid_of(number)`, as containerd + systemd write it."""
    (proc / str(pid)).mkdir()
    slice_ = f"kubepods-burstable-pod{uid_of(number).replace('-', '_')}.slice"
    (proc / str(pid) / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-burstable.slice/{slice_}/cri-containerd-{'a' * 64}.scope\n"
    )


def meter(source: Mapping[str, Any], proc: Path) -> usage_sampling.Meter:
    return usage_sampling.Meter(nvml.Replay(source), NODE, cgroups.Proc(proc))


def by_pod(sample: usage_sampling.Sample) -> dict[str, usage_sampling.PodUse]:
    return {use.name: use for use in sample.pods}


def test_idle_gpu_has_totals_and_no_pod_series(tmp_path: Path) -> None:
    sample = meter(reading("idle"), tmp_path).measure([pod("agent", 1)])
    (gpu,) = sample.gpus
    assert gpu == usage_sampling.GpuUse(0, H100, 503316480, H100_MEMORY, 0.0)
    assert sample.pods == () and sample.attributed == sample.unattributed == 0
    # no capture holds per-process samples: Replay answers Not Supported there (as a
    # driver without the call would), and the failed call is counted
    assert ("process_utilization", "Not Supported") in sample.errors


def test_plain_client_memory_goes_to_its_pod(tmp_path: Path) -> None:
    """nvml-plain-client.json: pid 590 holds 3.6 GiB; in tmp_path's proc it is in pod 5."""
    in_pod(tmp_path, 590, 5)
    sample = meter(reading("plain-client"), tmp_path).measure([pod("train", 5), pod("other", 6)])
    assert by_pod(sample) == {
        "train": usage_sampling.PodUse(
            uid_of(5), "research", "train", 0, H100, memory_used=3860856832, sm=None, processes=1
        )
    }
    assert (sample.attributed, sample.unattributed) == (1, 0)
    (gpu,) = sample.gpus
    assert gpu.memory_used == 4373413888  # the device's figure, context overheads included


def test_mps_clients_go_to_their_pods_and_the_server_to_none(tmp_path: Path) -> None:
    """nvml-mps-clients.json: clients 629 and 630, server 663 (in compute_processes only).
    The server runs in the agent's own pod (its per-GPU daemon starts it): it must not be
    charged there. Grants as the capture's limits: 30 %/8192M and 20 %/4096M."""
    in_pod(tmp_path, 629, 1)
    in_pod(tmp_path, 630, 2)
    in_pod(tmp_path, 663, 9)
    pods = [
        pod("big", 1, milli=300, memory_mib=8192),
        pod("small", 2, milli=200, memory_mib=4096),
        pod("gpuplace-node-agent-x7k2p", 9),
    ]
    sample = meter(reading("mps-clients"), tmp_path).measure(pods)
    assert by_pod(sample) == {
        "big": usage_sampling.PodUse(
            uid_of(1), "research", "big", 0, H100, 2353004544, None, 8192 * MIB, 0.3, 1, 300
        ),
        "small": usage_sampling.PodUse(
            uid_of(2), "research", "small", 0, H100, 1224736768, None, 4096 * MIB, 0.2, 1, 200
        ),
    }
    assert (sample.attributed, sample.unattributed) == (2, 0)


def test_the_real_clients_cgroups_are_in_no_pod(tmp_path: Path) -> None:
    """The capture's own /proc/<pid>/cgroup (mps-control.txt): `0::/process_api/...`."""
    text = (gpu_fixture("mps-control.txt")).read_text()
    for section in text.split("== /proc/")[1:]:
        header, _, body = section.partition("\n")
        pid = header.split("/")[0]
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cgroup").write_text(body)
    pods = [pod("big", 1, milli=300, memory_mib=8192)]
    sample = meter(reading("mps-clients"), tmp_path).measure(pods)
    # the granted pod has no process on the GPU: 0 used (the list was read), its grant shown
    assert by_pod(sample) == {
        "big": usage_sampling.PodUse(
            uid_of(1), "research", "big", 0, H100, 0, None, 8192 * MIB, 0.3, 0, 300
        )
    }
    assert (sample.attributed, sample.unattributed) == (0, 2)
    (gpu,) = sample.gpus
    assert gpu.memory_used == 4160487424  # still in the GPU's totals


def test_a_whole_gpu_grant_is_its_memory_and_share_one(tmp_path: Path) -> None:
    in_pod(tmp_path, 590, 5)
    sample = meter(reading("plain-client"), tmp_path).measure([pod("whole", 5, milli=1000)])
    use = by_pod(sample)["whole"]
    assert (use.memory_granted, use.share_granted, use.memory_used) == (
        H100_MEMORY,
        1.0,
        3860856832,
    )


def test_a_memory_only_share_has_share_zero(tmp_path: Path) -> None:
    sample = meter(reading("idle"), tmp_path).measure([pod("mem", 3, milli=0, memory_mib=2048)])
    use = by_pod(sample)["mem"]
    assert (use.memory_granted, use.share_granted) == (2048 * MIB, 0.0)


def test_a_process_of_a_pod_not_known_here_is_unattributed(tmp_path: Path) -> None:
    in_pod(tmp_path, 590, 5)  # its pod is gone from the API, or not yet seen
    sample = meter(reading("plain-client"), tmp_path).measure([pod("other", 6)])
    assert sample.pods == () and (sample.attributed, sample.unattributed) == (0, 1)


def test_a_static_pod_is_found_through_its_mirror(tmp_path: Path) -> None:
    in_pod(tmp_path, 590, 5)  # the cgroup carries the static pod's UID
    mirror = pod("static-train", 77, annotations={usage_sampling.MIRROR: uid_of(5)})
    sample = meter(reading("plain-client"), tmp_path).measure([mirror])
    assert by_pod(sample)["static-train"].uid == uid_of(77)


# --- per-process SM samples: synthetic (no capture has them) ---------------------------


def with_samples(name: str, samples: list[dict[str, int]]) -> dict[str, Any]:
    """A capture with per-process samples ADDED BY THIS TEST (synthetic, NVML's fields)."""
    made = copy.deepcopy(reading(name))
    made["gpus"][0]["process_utilization"] = samples
    made["synthetic"] = "process_utilization added by tests/agent/test_usage_sampling.py"
    return made


def test_sm_is_the_mean_of_the_samples_since_the_last_one(tmp_path: Path) -> None:
    in_pod(tmp_path, 590, 5)
    source = with_samples(
        "plain-client",
        [
            {"pid": 590, "timeStamp": 1000, "smUtil": 40},
            {"pid": 590, "timeStamp": 2000, "smUtil": 60},
            {"pid": 590, "timeStamp": 2500, "smUtil": 2147483632},  # garbage a driver gave
        ],
    )
    taking = meter(source, tmp_path)
    assert by_pod(taking.measure([pod("train", 5)]))["train"].sm == pytest.approx(0.5)
    # nothing newer: the process ran no kernel since, 0 (the driver answered)
    assert by_pod(taking.measure([pod("train", 5)]))["train"].sm == 0.0
    assert taking.since == {H100: 2500}


def test_under_mps_the_clients_samples_add_up_per_pod(tmp_path: Path) -> None:
    in_pod(tmp_path, 629, 1)
    in_pod(tmp_path, 630, 1)  # two clients of one pod
    source = with_samples(
        "mps-clients",
        [
            {"pid": 629, "timeStamp": 10, "smUtil": 30},
            {"pid": 630, "timeStamp": 11, "smUtil": 20},
            {"pid": 663, "timeStamp": 12, "smUtil": 50},  # the server's own: nobody's
        ],
    )
    sample = meter(source, tmp_path).measure([pod("both", 1)])
    use = by_pod(sample)["both"]
    assert use.sm == pytest.approx(0.5) and use.memory_used == 2353004544 + 1224736768


def test_under_mps_samples_charged_to_the_server_leave_the_pods_sm_absent(
    tmp_path: Path,
) -> None:
    in_pod(tmp_path, 629, 1)
    in_pod(tmp_path, 630, 2)
    source = with_samples("mps-clients", [{"pid": 663, "timeStamp": 10, "smUtil": 80}])
    sample = meter(source, tmp_path).measure([pod("a", 1), pod("b", 2)])
    assert [use.sm for use in sample.pods] == [None, None]
    assert all(use.memory_used for use in sample.pods)


def test_a_failing_gpu_is_left_out_and_counted_never_raised(tmp_path: Path) -> None:
    source = copy.deepcopy(reading("plain-client"))
    source["gpus"].append({"nvml_error": "GPU is lost"})
    source["count"] = 2
    in_pod(tmp_path, 590, 5)
    sample = meter(source, tmp_path).measure([pod("train", 5)])
    assert [gpu.index for gpu in sample.gpus] == [0]
    assert ("uuid", "GPU is lost") in sample.errors
    assert by_pod(sample)["train"].memory_used == 3860856832
    broken = usage_sampling.Meter(nvml.Replay({"count": {"nvml_error": "Driver Not Loaded"}}), NODE)
    assert broken.measure([]) == usage_sampling.Sample(errors=(("gpu_count", "Driver Not Loaded"),))


# --- the exported series --------------------------------------------------------------


def scrape(registry: CollectorRegistry) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = generate_latest(registry).decode()
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(text)
    }


async def test_series_carry_the_names_labels_and_end_with_the_pod(tmp_path: Path) -> None:
    in_pod(tmp_path, 629, 1)
    in_pod(tmp_path, 630, 2)
    pods = {
        uid_of(1): pod("big", 1, milli=300, memory_mib=8192),
        uid_of(2): pod("small", 2, milli=200, memory_mib=4096),
    }
    registry = CollectorRegistry()
    sampler = usage_sampling.Sampler(
        meter(reading("mps-clients"), tmp_path), lambda: list(pods.values()), registry=registry
    )
    registry.register(
        usage_sampling.UsageCollector(NODE, sampler, usage_sampling.live_in(lambda: pods, NODE))
    )
    assert all(not values for name, values in scrape(registry).items() if "gpuplace_pod" in name)
    await sampler.sample_once()
    series = scrape(registry)
    gpu_labels = {"node": NODE, "gpu": "0", "uuid": H100}
    assert series[names.GPU_MEMORY_TOTAL] == [(gpu_labels, float(H100_MEMORY))]
    assert series[names.GPU_MEMORY_USED] == [(gpu_labels, 4160487424.0)]
    assert series[names.GPU_UTILIZATION] == [(gpu_labels, 0.0)]
    big = {**gpu_labels, "namespace": "research", "pod": "big"}
    small = {**gpu_labels, "namespace": "research", "pod": "small"}
    assert sorted(series[names.POD_MEMORY_USED], key=str) == sorted(
        [(big, 2353004544.0), (small, 1224736768.0)], key=str
    )
    assert series[names.POD_SM_UTILIZATION] == []  # no per-process samples: absent
    assert {labels["pod"]: value for labels, value in series[names.POD_SHARE_GRANTED]} == {
        "big": 0.3,
        "small": 0.2,
    }
    for name in (names.POD_MEMORY_USED, names.POD_MEMORY_GRANTED, names.POD_SHARE_GRANTED):
        assert all(set(labels) == set(names.POD_LABELS) for labels, _ in series[name])
    assert all(set(labels) == set(names.GPU_LABELS) for labels, _ in series[names.GPU_MEMORY_USED])
    # the errors are counted
    text = generate_latest(registry).decode()
    assert re.search(
        r'gpuplace_agent_usage_errors_total\{call="process_utilization",error="Not Supported"\} 1',
        text,
    )

    # "small" finishes (its grant released) and "big" is deleted: both series end at the
    # next scrape, before the next sample
    pods[uid_of(2)]["status"]["phase"] = "Succeeded"
    del pods[uid_of(1)]
    series = scrape(registry)
    for name in (names.POD_MEMORY_USED, names.POD_MEMORY_GRANTED, names.POD_SHARE_GRANTED):
        assert series[name] == [], name
    assert series[names.GPU_MEMORY_USED] == [(gpu_labels, 4160487424.0)]
    await sampler.sample_once()
    assert scrape(registry)[names.POD_MEMORY_USED] == []


async def test_the_loop_survives_a_failing_sample(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    calls = 0

    def pods() -> list[dict[str, Any]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in a sample")
        return []

    sampler = usage_sampling.Sampler(
        meter(reading("idle"), tmp_path), pods, seconds=0.01, registry=registry
    )
    task = asyncio.create_task(sampler.run())
    try:
        for _ in range(200):
            if sampler.last is not None:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert sampler.last is not None and calls >= 2
    text = generate_latest(registry).decode()
    assert 'gpuplace_agent_usage_errors_total{call="sample",error="exception"} 1.0' in text


# --- the MPS server stays up idle after its clients exit --------------------------------


def idle_server() -> dict[str, Any]:
    """nvml-mps-clients.json after its clients exited, as NVIDIA's server stays up idle
    (it quits only when a client of another UID arrives): no MPS client listed, the
    server (663) alone in the compute list. The capture EDITED BY THIS TEST."""
    made = copy.deepcopy(reading("mps-clients"))
    gpu = made["gpus"][0]
    gpu["mps_processes"] = []
    gpu["compute_processes"] = [p for p in gpu["compute_processes"] if p["pid"] == 663]
    made["edited"] = "clients removed by tests/agent/test_usage_sampling.py"
    return made


def test_an_idle_mps_server_in_the_agents_pod_is_charged_to_no_pod(tmp_path: Path) -> None:
    """The server is the child of the agent's control daemon: its cgroup names the agent's
    pod, which the agent knows (the downward API's metadata.uid)."""
    in_pod(tmp_path, 663, 9)
    agent = pod("gpuplace-node-agent-x", 9, namespace="kube-system")
    taking = usage_sampling.Meter(
        nvml.Replay(idle_server()), NODE, cgroups.Proc(tmp_path), own=uid_of(9)
    )
    sample = taking.measure([agent, pod("big", 1, milli=300, memory_mib=8192)])
    assert by_pod(sample) == {
        "big": usage_sampling.PodUse(
            uid_of(1), "research", "big", 0, H100, 0, None, 8192 * MIB, 0.3, 0, 300
        )
    }
    assert (sample.attributed, sample.unattributed) == (0, 0)


def test_a_server_the_daemons_report_is_charged_to_no_pod_without_clients(
    tmp_path: Path,
) -> None:
    """Whatever cgroup it shows (from inside the agent's cgroup namespace its own is `/`),
    a PID the control daemons answer in get_server_list is never a pod's process."""
    in_pod(tmp_path, 663, 9)
    agent = pod("gpuplace-node-agent-x", 9, namespace="kube-system")
    taking = usage_sampling.Meter(
        nvml.Replay(idle_server()), NODE, cgroups.Proc(tmp_path), servers=lambda: {663}
    )
    sample = taking.measure([agent])
    assert sample.pods == () and (sample.attributed, sample.unattributed) == (0, 0)


# --- an NVML call that never returns ------------------------------------------------------


def training(
    source: nvml.Nvml, proc: Path, **options: float
) -> tuple[usage_sampling.Sampler, CollectorRegistry]:
    """A sampler of `source` and its exported series, for one whole-GPU pod "train" whose
    process is the plain client's (pid 590)."""
    in_pod(proc, 590, 5)
    pods = {uid_of(5): pod("train", 5, milli=1000)}
    registry = CollectorRegistry()
    sampler = usage_sampling.Sampler(
        usage_sampling.Meter(source, NODE, cgroups.Proc(proc)),
        lambda: list(pods.values()),
        registry=registry,
        **options,
    )
    registry.register(
        usage_sampling.UsageCollector(NODE, sampler, usage_sampling.live_in(lambda: pods, NODE))
    )
    return sampler, registry


class Hanging(nvml.Replay):
    """The captured reading, whose memory call blocks while `hung` is set: a GPU fallen off
    the bus, whose driver call does not return."""

    def __init__(self, source: Mapping[str, Any]) -> None:
        super().__init__(source)
        self.hung = threading.Event()
        self.released = threading.Event()

    def memory_used(self, index: int) -> int:
        if self.hung.is_set():
            self.released.wait()
        return super().memory_used(index)


async def test_a_sample_held_by_a_hung_nvml_call_stops_being_exported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hanging = Hanging(reading("plain-client"))
    sampler, registry = training(hanging, tmp_path, seconds=0.05)
    assert sampler.stale_after == pytest.approx(0.15)  # 3 periods

    async def exported() -> bool:
        series = scrape(registry)
        return bool(series[names.POD_MEMORY_USED]) and bool(series[names.GPU_MEMORY_USED])

    async def until(condition: Callable[[], Awaitable[bool]]) -> None:
        for _ in range(500):
            if await condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("condition not reached in time")

    async def nothing() -> bool:
        series = scrape(registry)
        return not any(
            series[name] for name in (*POD_FAMILIES, names.GPU_MEMORY_USED, names.GPU_MEMORY_TOTAL)
        )

    task = asyncio.create_task(sampler.run())
    try:
        await until(exported)
        hanging.hung.set()
        with caplog.at_level("WARNING", logger="gpuplace.agent.usage_sampling"):
            await until(nothing)
            scrape(registry)
        text = generate_latest(registry).decode()
        stale = re.search(r"^gpuplace_agent_usage_stale_scrapes_total ([0-9.]+)$", text, re.M)
        assert stale is not None and float(stale.group(1)) >= 2
        age = re.search(r"^gpuplace_agent_usage_sample_age_seconds ([0-9.]+)$", text, re.M)
        assert age is not None and float(age.group(1)) > 0.15
        said = [r for r in caplog.records if r.getMessage() == "usage sample stale, exporting none"]
        assert len(said) == 1  # once per falling behind, not once per scrape
        hanging.released.set()  # the driver answers again: the next sample is exported
        hanging.hung.clear()
        await until(exported)
    finally:
        hanging.released.set()
        task.cancel()


POD_FAMILIES = (
    names.POD_MEMORY_USED,
    names.POD_SM_UTILIZATION,
    names.POD_MEMORY_GRANTED,
    names.POD_SHARE_GRANTED,
)


async def test_the_memory_peak_of_the_window_outlives_the_sample_that_saw_it(
    tmp_path: Path,
) -> None:
    """The plain client's 3.6 GiB, then (the capture EDITED BY THIS TEST) 1 GiB: the used
    series says 1 GiB, the peak 3.6 GiB until the sample that saw it leaves the window."""
    replay = nvml.Replay(reading("plain-client"))
    sampler, registry = training(replay, tmp_path, peak_seconds=0.5)

    def value(name: str) -> float:
        ((labels, found),) = scrape(registry)[name]
        assert labels["pod"] == "train"
        return found

    await sampler.sample_once()
    assert value(names.POD_MEMORY_PEAK) == value(names.POD_MEMORY_USED) == 3860856832
    lower = copy.deepcopy(reading("plain-client"))
    lower["gpus"][0]["compute_processes"][0]["usedGpuMemory"] = 1 << 30
    replay.replace(lower)
    await sampler.sample_once()
    assert (value(names.POD_MEMORY_USED), value(names.POD_MEMORY_PEAK)) == (1 << 30, 3860856832)
    await asyncio.sleep(0.6)  # the first sample leaves the window
    await sampler.sample_once()
    assert value(names.POD_MEMORY_PEAK) == 1 << 30
    assert len(sampler.recent) == 1  # what left the window is not kept


# --- pods on a DRA node: their grants are the claims the DRA plugin prepared -------------------


def dra_pod(name: str, number: int, claim: str, **planned: Any) -> dict[str, Any]:
    """A pod of this node on the DRA path, naming `claim`; `planned`: a plan's assignment
    annotations (milli, memory_mib) on GPU 0 it may carry too."""
    made = pod(name, number, **planned) if planned else pod(name, number)
    made["spec"]["resourceClaims"] = [{"name": dra_claims.ENTRY, "resourceClaimName": claim}]
    return made


def prepared(claim: str, number: int, milli: int, memory_mib: int) -> preparing.Prepared:
    """What the DRA plugin prepared for `claim`: the H100 at `milli` and `memory_mib`
    consumed (the CUDA context inside)."""
    device = preparing.PreparedDevice(
        "gpu", NODE, "gpu-0", None, (f"gpu.gpuplace.io/claim=gpu-0-{number}",), H100, milli,
        memory_mib,
    )  # fmt: skip
    return preparing.Prepared(
        preparing.ClaimRef("research", claim, uid_of(100 + number)), (device,), {}
    )


def test_dra_pods_read_as_their_claims_the_same_grants_as_annotations(tmp_path: Path) -> None:
    """The capture's two MPS clients, their pods on the DRA path: their claims consumed
    8192 + 294 and 4096 + 244 MiB (the H100's context at 30 and 20 %, inside the limit);
    what is granted reads as on the device-plugin path. A plan's annotations on the pod
    (another GPU's, say) are not its grant: the claim is."""
    in_pod(tmp_path, 629, 1)
    in_pod(tmp_path, 630, 2)
    in_pod(tmp_path, 663, 9)
    pods = [
        dra_pod("big", 1, "big-gpu-1", milli=500, memory_mib=1),
        dra_pod("small", 2, "small-gpu-2"),
        pod("gpuplace-node-agent-x7k2p", 9),
    ]
    measured = usage_sampling.Meter(
        nvml.Replay(reading("mps-clients")),
        NODE,
        cgroups.Proc(tmp_path),
        claims=lambda: [prepared("big-gpu-1", 1, 300, 8486), prepared("small-gpu-2", 2, 200, 4340)],
        contexts=lambda: {H100: ClientContext(144, 5)},
    )
    sample = measured.measure(pods)
    assert by_pod(sample) == {
        "big": usage_sampling.PodUse(
            uid_of(1), "research", "big", 0, H100, 2353004544, None, 8192 * MIB, 0.3, 1, 300
        ),
        "small": usage_sampling.PodUse(
            uid_of(2), "research", "small", 0, H100, 1224736768, None, 4096 * MIB, 0.2, 1, 200
        ),
    }
    # without the prepared claims the DRA pods hold nothing here (their plan is no grant)
    bare = meter(reading("mps-clients"), tmp_path).measure(pods)
    assert {use.name: use.memory_granted for use in bare.pods} == {"big": None, "small": None}
