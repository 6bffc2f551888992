"""`gpuplace node-agent` composed as it runs on a node: the real API client against the
fake API server as the agent's own ServiceAccount (the RBAC deploy/ ships is enforced),
NVML replayed from the captured H100 readings (8 GPUs derived from it), MPS daemons from
the stand-in control binary, the kubelet stand-in speaking the device-plugin gRPC on unix
sockets, the ops endpoints on a real port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gpuplace import cli
from gpuplace.agent import nvml
from gpuplace.cluster import keys
from gpuplace.commands import node_agent
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.usage import names, prometheus
from gpuplace.wiring.agent_settings import AgentSettings
from tests.agent import kubelet as standin
from tests.agent.kubelet import gpu_fixture
from tests.usage import harness as usage_harness

STANDIN = Path(__file__).resolve().parents[1] / "agent" / "mps_standin.py"
NODE = "h100-0"
UUID = "GPU-73fa5a53-ad78-0389-6c40-cf23e8e3170c"
"""The captured H100's."""


@pytest.fixture
def mps_root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))  # short: socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet() -> AsyncIterator[standin.Kubelet]:
    directory = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))  # short: socket paths
    made = standin.Kubelet(directory)
    await made.start()
    yield made
    await made.stop()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def api() -> AsyncIterator[localapi.Server]:
    # enforcing the RBAC deploy/ ships: the agent may make exactly its calls
    enforced = localapi.FakeApi(bookmark_interval=0.2, access=localapi.Access.shipped())
    async with localapi.serve(enforced) as running:
        running.api.create(objects.node(NODE, gpus=0))
        yield running


def eight_gpus(tmp_path: Path) -> Path:
    reading = nvml.Replay.load(gpu_fixture("nvml-idle.json")).reading
    path = tmp_path / "nvml-8.json"
    path.write_text(json.dumps(nvml.derived(reading, 8, nvlink_domains=[range(8)])))
    return path


def agent_settings(
    api: localapi.Server, tmp_path: Path, mps_root: Path, kubelet: standin.Kubelet, **values: Any
) -> Any:
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig", localapi.NODE_AGENT)
    defaults: dict[str, Any] = {
        "device_plugin_dir": kubelet.directory,
        "allocate_wait_seconds": 1.0,
        "node_name": NODE,
        "kubeconfig": kubeconfig,
        "metrics_address": "127.0.0.1",
        "metrics_port": 0,
        "mps_root": mps_root,
        "mps_control": f"{sys.executable} {STANDIN}",
        "mps_probe_seconds": 0.05,
        "mps_start_timeout_seconds": 5.0,
        "discover_seconds": 0.1,
    }
    if "nvml_replay" not in values:
        defaults["nvml_replay"] = eight_gpus(tmp_path)
    return AgentSettings(**{**defaults, **values})


@contextlib.asynccontextmanager
async def serving(
    config: AgentSettings, base_env: dict[str, str] | None = None
) -> AsyncIterator[tuple[node_agent.AgentProcess, str]]:
    """The agent composed from `config` and running; its ops endpoints' base URL."""
    process = await node_agent.compose(config, CollectorRegistry(), base_env=base_env or {})
    stop = asyncio.Event()
    running = asyncio.create_task(process.server.run(stop))
    try:
        await asyncio.wait_for(process.server.started.wait(), 20)
        yield process, f"http://127.0.0.1:{process.server.port('ops')}"
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)


def plain_client_settings(
    api: localapi.Server,
    tmp_path: Path,
    mps_root: Path,
    kubelet: standin.Kubelet,
    proc: Path,
    **values: Any,
) -> Any:
    """The agent on the captured plain client's reading (pid 590, 3.6 GiB), without MPS,
    reading processes' cgroups under `proc` (the test's own proc root)."""
    (proc / "590").mkdir(parents=True)
    return agent_settings(
        api,
        tmp_path,
        mps_root,
        kubelet,
        mps=False,
        nvml_replay=gpu_fixture("nvml-plain-client.json"),
        proc_root=proc,
        **values,
    )


def run_plain_client_in_pod(api: localapi.Server, proc: Path) -> None:
    """research/train, granted the captured GPU whole, running; pid 590 in its cgroup."""
    created = api.api.create(standin.pod("train", [0], [UUID], milli=1000, node=NODE))
    slice_ = f"kubepods-pod{created['metadata']['uid'].replace('-', '_')}.slice"
    (proc / "590" / "cgroup").write_text(
        f"0::/kubepods.slice/{slice_}/cri-containerd-{'c' * 64}.scope\n"
    )
    api.api.set_phase("research", "train", "Running")


async def until(condition: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_the_agent_publishes_runs_mps_serves_the_kubelet_and_reports(
    api: localapi.Server, tmp_path: Path, mps_root: Path, kubelet: standin.Kubelet
) -> None:
    config = agent_settings(api, tmp_path, mps_root, kubelet)
    process = await node_agent.compose(config, CollectorRegistry(), base_env={})
    stop = asyncio.Event()
    running = asyncio.create_task(process.server.run(stop))
    try:
        await asyncio.wait_for(process.server.started.wait(), 20)
        base = f"http://127.0.0.1:{process.server.port('ops')}"
        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                async with http.get(f"{base}/readyz") as response:
                    return response.status == 200

            async def get(path: str) -> str:
                async with http.get(f"{base}{path}") as response:
                    return await response.text()

            await until(ready)
            # published as the agent's own identity: the RBAC allows exactly that
            node = api.api.get("nodes", NODE)
            gpus = json.loads(node["metadata"]["annotations"][keys.NODE_GPUS])
            uuids = [gpu["uuid"] for gpu in gpus]
            assert len(uuids) == 8 and keys.AGENT_HEARTBEAT in node["metadata"]["annotations"]
            # one daemon per GPU, each answering through its own pipe directory
            assert process.supervisor is not None
            assert sorted(process.supervisor.daemons) == sorted(uuids)
            for uuid in uuids:
                assert (mps_root / uuid / "pipe" / "control").is_socket()
            metrics = await get("/metrics")
            for uuid in uuids:
                assert f'gpuplace_mps_daemon_ready{{gpu="{uuid}"}} 1.0' in metrics
            assert 'gpuplace_agent_gpus{health="healthy"} 8.0' in metrics
            assert json.loads(await get("/healthz")) == {"status": "ok"}

            # the kubelet: 100 slots per GPU, and a share gets its own GPU's daemon
            async def listed() -> bool:
                return len(kubelet.devices) == 800

            await until(listed)
            share = standin.pod("share", [3], [uuids[3]], milli=250, memory_mib=2048, node=NODE)
            api.api.create(share)
            answer = await kubelet.admit(1)
            mounts = {m.container_path: m.host_path for m in answer.mounts}
            assert mounts == {
                f"/var/run/nvidia-container-devices/{uuids[3]}": "/dev/null",
                "/tmp/nvidia-mps": str(mps_root / uuids[3] / "pipe"),
                "/dev/shm": str(mps_root / "shm"),
            }
            assert dict(answer.envs) == {
                "NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices",
                "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                # the ask and the H100's CUDA context at 25 %, as the agent publishes it
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2317M",
            }
            # a container with no grant gets nothing
            with pytest.raises(grpc.aio.AioRpcError):
                await kubelet.admit(1)
            api.api.set_phase("research", "share", "Running")

            # per GPU: while GPU 5 has no daemon, a share there is refused (it would run
            # unlimited); a share on GPU 2, whose daemon answers, is served meanwhile
            supervisor = process.supervisor
            await supervisor.set_gpus([u for u in uuids if u != uuids[5]])
            api.api.create(standin.pod("on-5", [5], [uuids[5]], milli=500, node=NODE))
            with pytest.raises(grpc.aio.AioRpcError, match="MPS"):
                await kubelet.admit(1)
            api.api.set_phase("research", "on-5", "Failed")
            api.api.create(standin.pod("on-2", [2], [uuids[2]], milli=500, node=NODE))
            answer = await kubelet.admit(1)
            assert answer.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
            await supervisor.set_gpus(uuids)
            assert await supervisor.wait_ready(10)

            # a daemon killed on the node: /readyz says so, then it is back
            daemon = process.supervisor.daemons[uuids[3]]
            assert daemon.pid is not None
            os.kill(daemon.pid, signal.SIGKILL)

            async def not_ready() -> bool:
                return not await ready()

            await until(not_ready)
            async with http.get(f"{base}/readyz") as response:
                body = await response.json()
            assert uuids[3] in body["reasons"]["mps"]
            await until(ready)
            metrics = await get("/metrics")
            assert f'gpuplace_mps_daemon_restarts_total{{gpu="{uuids[3]}"}} 1.0' in metrics
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
    # stopped: every daemon quit
    assert all(d.process and d.process.returncode == 0 for d in process.supervisor.daemons.values())


async def test_without_mps_shares_are_refused_and_whole_gpus_served(
    api: localapi.Server, tmp_path: Path, mps_root: Path, kubelet: standin.Kubelet
) -> None:
    config = agent_settings(api, tmp_path, mps_root, kubelet, mps=False)
    process = await node_agent.compose(config, CollectorRegistry(), base_env={})
    assert process.supervisor is None
    assert set(process.server.readiness) == {"publishing", "device plugin"}
    stop = asyncio.Event()
    running = asyncio.create_task(process.server.run(stop))
    try:
        await asyncio.wait_for(process.server.started.wait(), 20)
        await kubelet.listed(1)
        assert process.plugin is not None
        uuids = [gpu.uuid for gpu in process.plugin.gpus]
        api.api.create(standin.pod("share", [0], [uuids[0]], milli=500, node=NODE))
        with pytest.raises(grpc.aio.AioRpcError, match="MPS"):  # it would run unlimited
            await kubelet.admit(1)
        # the kubelet fails a pod whose admission was refused
        api.api.set_phase("research", "share", "Failed")
        api.api.create(standin.pod("whole", [5], [uuids[5]], node=NODE))

        plugin = process.plugin

        async def seen() -> bool:
            return any(p["metadata"]["name"] == "whole" for p in plugin.pods.pods.values())

        await until(seen)
        answer = await kubelet.admit(1)
        assert [m.container_path for m in answer.mounts] == [
            f"/var/run/nvidia-container-devices/{uuids[5]}"  # no MPS for a whole GPU
        ]
        assert not any(name.startswith("CUDA_MPS_") for name in answer.envs)
        assert process.server.not_ready() == {}
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
    assert list(mps_root.iterdir()) == []


async def test_a_stalled_heartbeat_makes_the_agent_not_ready_and_leaves_it_alive(
    api: localapi.Server, tmp_path: Path, mps_root: Path, kubelet: standin.Kubelet
) -> None:
    """Issue 46: `Publisher.healthy()` is wired into /readyz. Node writes that keep
    failing (here: the Node is gone, every patch a 404) turn /readyz 503 once the
    heartbeat is two periods old, naming why; /healthz, the liveness probe's, stays 200
    (a restart would end every share's MPS server); a write that succeeds again makes
    the agent ready again."""
    config = agent_settings(
        api, tmp_path, mps_root, kubelet, mps=False, heartbeat_seconds=0.5, discover_seconds=0.1
    )
    async with serving(config) as (process, base), aiohttp.ClientSession() as http:

        async def ready(expected: int) -> dict[str, Any]:
            deadline = time.monotonic() + 20
            while True:
                async with http.get(f"{base}/readyz") as response:
                    body: dict[str, Any] = await response.json()
                    if response.status == expected:
                        return body
                assert time.monotonic() < deadline, body
                await asyncio.sleep(0.05)

        await ready(200)
        node = api.api.delete("nodes", NODE)
        stalled = await ready(503)
        why = stalled["reasons"]["publishing"]
        assert why.startswith("the node's heartbeat was last written "), why
        assert "over two --heartbeat-seconds (0.5 s)" in why and "404" in why, why
        async with http.get(f"{base}/healthz") as response:
            assert response.status == 200
        node["metadata"] = {
            k: v for k, v in node["metadata"].items() if k not in ("resourceVersion", "uid")
        }
        api.api.create(node)
        await ready(200)
        assert process.publisher.healthy()


async def test_the_metrics_endpoint_shows_what_pods_use_until_they_go(
    api: localapi.Server, tmp_path: Path, mps_root: Path, kubelet: standin.Kubelet
) -> None:
    """The captured plain client (pid 590, 3.6 GiB) in a granted pod's cgroup, written into
    a proc root of the test's; /metrics scraped over 127.0.0.1 and parsed as Prometheus
    does; the pod's series end once it is deleted."""
    proc = tmp_path / "proc"
    config = plain_client_settings(api, tmp_path, mps_root, kubelet, proc, usage_seconds=0.05)
    async with serving(config) as (_, base):
        uuid = nvml.Replay.load(gpu_fixture("nvml-plain-client.json")).uuid(0)
        run_plain_client_in_pod(api, proc)
        async with aiohttp.ClientSession() as http:

            async def families() -> dict[str, list[tuple[dict[str, str], float]]]:
                async with http.get(f"{base}/metrics") as response:
                    text = await response.text()
                return {
                    family.name: [(s.labels, s.value) for s in family.samples]
                    for family in text_string_to_metric_families(text)
                }

            async def used() -> bool:
                return bool((await families()).get(names.POD_MEMORY_USED))

            await until(used)
            series = await families()
            labels = {"node": NODE, "gpu": "0", "uuid": uuid}
            pod_labels = {**labels, "namespace": "research", "pod": "train"}
            assert series[names.POD_MEMORY_USED] == [(pod_labels, 3860856832.0)]
            assert series[names.POD_MEMORY_PEAK] == [(pod_labels, 3860856832.0)]
            assert series[names.POD_MEMORY_GRANTED] == [(pod_labels, 85520809984.0)]
            assert series[names.POD_SHARE_GRANTED] == [(pod_labels, 1.0)]
            assert series[names.POD_SM_UTILIZATION] == []  # not in the capture: absent
            assert series[names.GPU_MEMORY_USED] == [(labels, 4373413888.0)]
            assert series[names.GPU_MEMORY_TOTAL] == [(labels, 85520809984.0)]
            assert series[names.GPU_UTILIZATION] == [(labels, 0.0)]
            # what the engine packs there, as the agent published it (issue 43): 81,559 MiB
            # less the driver's ~489 and the MPS server's 66, in 64 MiB steps
            assert series[names.GPU_MEMORY_PACKABLE] == [(labels, 80960.0 * (1 << 20))]
            assert series[names.POD_PROCESSES] == [(pod_labels, 1.0)]
            for name, values in series.items():
                if name.startswith(("gpuplace_pod_gpu_", "gpuplace_gpu_")):
                    wanted = names.POD_LABELS if "_pod_" in name else names.GPU_LABELS
                    assert all(set(found) == set(wanted) for found, _ in values), name

            api.api.delete("pods", "train", "research")

            async def gone() -> bool:
                found = await families()
                return not any(
                    found[name]
                    for name in (
                        names.POD_MEMORY_USED,
                        names.POD_MEMORY_PEAK,
                        names.POD_MEMORY_GRANTED,
                        names.POD_SHARE_GRANTED,
                    )
                )

            await until(gone)
            # the process lingers in the capture: counted, on no pod
            assert (await families())[names.GPU_MEMORY_USED] == [(labels, 4373413888.0)]


@pytest.mark.parametrize("known_by", ["pod uid", "server list"])
async def test_an_idle_mps_server_in_the_agents_pod_is_charged_to_no_pod(
    api: localapi.Server, tmp_path: Path, mps_root: Path, kubelet: standin.Kubelet, known_by: str
) -> None:
    """nvml-mps-clients.json after its clients exited (EDITED here: the server, pid 663,
    alone in the compute list, no MPS client), the server in the agent's own pod's cgroup
    as its daemon's child. Known as the agent's by its pod UID (the DaemonSet's
    GPUPLACE_POD_UID), or as a server by the daemons' get_server_list answer."""
    reading = json.loads((gpu_fixture("nvml-mps-clients.json")).read_text())
    gpu = reading["gpus"][0]
    gpu["mps_processes"] = []
    gpu["compute_processes"] = [p for p in gpu["compute_processes"] if p["pid"] == 663]
    replay = tmp_path / "nvml-idle-server.json"
    replay.write_text(json.dumps(reading))
    agent = api.api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "gpuplace-node-agent-x", "namespace": "kube-system"},
            "spec": {"nodeName": NODE, "containers": [{"name": "node-agent", "image": "g"}]},
        }
    )
    api.api.set_phase("kube-system", "gpuplace-node-agent-x", "Running")
    uid = agent["metadata"]["uid"]
    proc = tmp_path / "proc"
    (proc / "663").mkdir(parents=True)
    (proc / "663" / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-{'d' * 64}"
        ".scope\n"
    )
    by_uid = known_by == "pod uid"
    config = agent_settings(
        api,
        tmp_path,
        mps_root,
        kubelet,
        mps=not by_uid,
        nvml_replay=replay,
        proc_root=proc,
        usage_seconds=0.05,
        pod_uid=uid if by_uid else None,
    )
    async with (
        serving(config, {} if by_uid else {"STANDIN_SERVERS": "663"}) as (process, base),
        aiohttp.ClientSession() as http,
    ):

        async def ready() -> bool:
            servers = process.supervisor.server_pids() if process.supervisor else {663}
            assert process.plugin is not None
            return uid in process.plugin.pods.pods and servers == {663}

        await until(ready)
        await asyncio.sleep(0.3)  # samples (every 0.05 s) taken since
        async with http.get(f"{base}/metrics") as response:
            text = await response.text()
        series = {
            family.name: [(s.labels, s.value) for s in family.samples]
            for family in text_string_to_metric_families(text)
        }
        assert series[names.GPU_MEMORY_USED]  # sampled
        assert series[names.POD_MEMORY_USED] == []
        assert 'gpuplace_agent_usage_processes{attribution="pod"} 0.0' in text


def test_mig_gpus_and_unknown_uuids_get_no_daemon() -> None:
    reading = nvml.derived(nvml.Replay.load(gpu_fixture("nvml-idle.json")).reading, 3)
    reading["gpus"][1]["mig_mode"] = [1, 1]
    reading["gpus"][2]["uuid"] = {"nvml_error": "Unknown Error"}
    from gpuplace.agent import discovery

    found = discovery.discover(nvml.Replay(reading))
    assert node_agent.shareable(found) == [found.gpus[0].uuid]
    assert node_agent.shareable(None) == []


def test_help_lists_every_setting_with_its_env() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpuplace.cli", "node-agent", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for name in AgentSettings.model_fields:
        assert f"--{name.replace('_', '-')}" in done.stdout
        assert f"GPUPLACE_{name.upper()}" in done.stdout.replace("\n", "").replace(" ", "")


def test_invalid_settings_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.build_parser().parse_args(["node-agent", "--mps-root", "/" + "x" * 70])
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert "--node-name" in err and "--mps-root" in err


async def test_a_real_prometheus_scraping_the_agent_reads_back_asked_vs_used(
    api: localapi.Server, tmp_path: Path, mps_root: Path, kubelet: standin.Kubelet
) -> None:
    """The whole chain of issue 22 with nothing stood in between: the agent (captured plain
    client, pid 590, in a granted pod's cgroup) serves /metrics; Debian's Prometheus scrapes
    it every second; `gpuplace.usage.prometheus.Reader` reads the pod's use beside its grant,
    and the
    GPU's load, back under the agent's names."""
    proc = tmp_path / "proc"
    config = plain_client_settings(api, tmp_path, mps_root, kubelet, proc, usage_seconds=0.2)
    async with serving(config) as (_, base):
        run_plain_client_in_pod(api, proc)
        target = base.removeprefix("http://").rstrip("/")
        with contextlib.ExitStack() as stack:
            # the launcher and its waits block: off the loop that serves the agent
            prom = await asyncio.to_thread(
                stack.enter_context,
                usage_harness.run_prometheus(
                    tmp_path / "prom", {"agent": {"static": {"targets": [target]}}}
                ),
            )
            await asyncio.to_thread(
                prom.wait_for, f"count_over_time({names.POD_MEMORY_USED}[1m])", 5
            )
            # scraped every second: so is the step of the p95s and counts
            source = prometheus.Source(url=prom.url, metrics="gpuplace", step_seconds=1)
            async with prometheus.Reader(source) as reader:
                usage = await reader.read(60)
                loads = await reader.gpu_loads(60)
    [train] = [use for use in usage.pods if use.pod == "train"]
    assert (train.namespace, train.node, train.gpu) == ("research", NODE, 0)
    assert train.memory_peak_bytes == train.memory_p95_bytes == 3860856832
    assert train.granted_memory_bytes == 85520809984 and train.granted_share == 1.0
    assert train.util_peak is None  # no per-process samples in the capture: not measured
    assert train.samples >= 3 and not train.gpu_reading
    assert loads[NODE][0].memory_used_bytes == 4373413888
    assert loads[NODE][0].utilization == 0.0
