"""The composed node agent's idle cost on an 8-GPU node, as its own process.

`gpuplace node-agent` runs as a subprocess exactly as the DaemonSet runs it, with NVML
replayed from 8 GPUs derived from the H100 capture (shared/fixtures/gpu/nvml-idle.json,
marked derived), one MPS daemon per GPU from the stand-in control binary of the tests,
registered with the kubelet stand-in (real gRPC on unix sockets), publishing to the local
API server as its own ServiceAccount (RBAC enforced), all defaults otherwise (discovery
every 5 s, heartbeat every 30 s, a probe of each daemon every 5 s). Once it is ready and a
warm-up has passed, it is left idle for `--seconds`; prints JSON: the agent process's CPU
(percent of one core) and resident memory, and, apart, its children's (the daemons and the
probe clients: Python stand-ins here, far heavier than the real C binaries, so not a
figure for a real node).

    .venv/bin/python bench/agent_process_idle.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from gpuplace.agent import nvml  # noqa: E402
from gpuplace.dev import localapi  # noqa: E402
from gpuplace.dev.localapi import objects  # noqa: E402
from tests.agent import kubelet as standin  # noqa: E402

FIXTURES = REPO.parent / "shared" / "fixtures" / "gpu"
STANDIN = REPO / "tests" / "agent" / "mps_standin.py"
NODE = "h100-0"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of `pid`, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return (utime + stime) / TICKS, (cutime + cstime) / TICKS


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def live_children_cpu(pid: int) -> float:
    total = 0.0
    for child in children(pid):
        try:
            own, reaped = cpu_seconds(child)
        except FileNotFoundError:
            continue
        total += own + reaped
    return total


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def measure(seconds: float, warmup: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="idle", dir="/tmp"))
    reading = nvml.Replay.load(FIXTURES / "nvml-idle.json").reading
    replay = work / "nvml-8.json"
    replay.write_text(json.dumps(nvml.derived(reading, 8, nvlink_domains=[range(8)])))
    devices = work / "dp"
    devices.mkdir()
    kubelet = standin.Kubelet(devices)
    await kubelet.start()
    api = localapi.FakeApi(access=localapi.Access.shipped())
    port = free_port()
    with localapi.serve_in_thread(api) as server:
        server.call(lambda: api.create(objects.node(NODE, gpus=0)))
        kubeconfig = server.server.kubeconfig(work / "kubeconfig", localapi.NODE_AGENT)
        command = [
            sys.executable, "-m", "gpuplace.cli", "node-agent",
            f"--node-name={NODE}", f"--kubeconfig={kubeconfig}", f"--nvml-replay={replay}",
            f"--mps-root={work / 'mps'}", f"--mps-control={sys.executable} {STANDIN}",
            f"--device-plugin-dir={devices}", "--metrics-address=127.0.0.1",
            f"--metrics-port={port}", "--log-level=WARNING",
        ]  # fmt: skip
        agent = subprocess.Popen(command, cwd=REPO, stderr=subprocess.DEVNULL)
        try:
            started = time.monotonic()
            async with aiohttp.ClientSession() as http:
                while True:
                    try:
                        async with http.get(f"http://127.0.0.1:{port}/readyz") as response:
                            if response.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    if agent.poll() is not None or time.monotonic() - started > 60:
                        raise SystemExit("the agent did not become ready")
                    await asyncio.sleep(0.2)
            ready_after = time.monotonic() - started
            await asyncio.sleep(warmup)
            own0, reaped0 = cpu_seconds(agent.pid)
            live0 = live_children_cpu(agent.pid)
            t0 = time.monotonic()
            await asyncio.sleep(seconds)
            elapsed = time.monotonic() - t0
            own1, reaped1 = cpu_seconds(agent.pid)
            live1 = live_children_cpu(agent.pid)
            daemons = children(agent.pid)
            result = {
                "gpus": 8,
                "seconds": round(elapsed, 1),
                "ready_after_seconds": round(ready_after, 2),
                "agent_cpu_percent": round(100 * (own1 - own0) / elapsed, 2),
                "agent_rss_mib": round(rss_mib(agent.pid), 1),
                "standin_children": len(daemons),
                "standin_children_cpu_percent": round(
                    100 * ((reaped1 - reaped0) + (live1 - live0)) / elapsed, 2
                ),
                "standin_children_rss_mib": round(sum(rss_mib(c) for c in daemons), 1),
                "slots_listed": len(kubelet.devices),
            }
        finally:
            agent.terminate()
            agent.wait(30)
            await kubelet.stop()
            shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.seconds, args.warmup)), indent=2))


if __name__ == "__main__":
    main()
