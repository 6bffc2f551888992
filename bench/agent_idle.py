"""The node agent's idle cost on an 8-GPU node: its discovery + publishing loop alone.

An 8-GPU reading derived from the captured H100 (`gpuplace.agent.nvml.derived`: two NVLink
domains of four, NUMA 0/1, marked derived) is replayed through the NVML seam, and a
`gpuplace.agent.publishing.Publisher` runs its loop at the defaults (NVML read every 5 s, a
heartbeat write every 30 s) for `--seconds` against the fake API server in a forked
process (so the server's work is not counted). Replayed NVML answers from memory: on a
real node each NVML call is a driver ioctl (tens of microseconds), which this leaves
out; the device plugin and the MPS supervisor are not part of this loop.

Prints one JSON document: CPU seconds used by this process over the window and as a
percentage of one core, resident memory (MiB) at the end and at its peak, node writes,
passes, NVML calls per pass, and a pass's time (p50/p99/max, ms) measured separately.

    .venv/bin/python -m bench.agent_idle [--seconds 60] [--gpus 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

from bench.extender_latency import quantiles
from gpuplace.agent import nvml, publishing
from gpuplace.cluster import connecting, kube
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects

FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "gpu" / "nvml-idle.json"


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(server: localapi.Server, seconds: float, gpus: int) -> dict[str, Any]:
    base = nvml.Replay.load(FIXTURE).reading
    half = gpus // 2
    reading = nvml.derived(
        base, gpus, nvlink_domains=[range(half), range(half, gpus)], numa=[0] * half + [1] * half
    )
    replay = nvml.Replay(reading)
    api = kube.Kube(connecting.client_for(server.configuration(localapi.GPUPLACE)), timeout=5.0)
    publisher = publishing.Publisher(api, "gpu-node", replay)
    try:
        # a pass's own time, apart from the idle window
        timings = []
        for _ in range(200):
            started = time.perf_counter()
            publisher.beat_at = None  # every timed pass writes: the costlier case
            await publisher.publish_once()
            timings.append(time.perf_counter() - started)
        calls_before, writes_before = replay.calls, publisher.writes.labels("ok")._value.get()
        publisher.beat_at = None
        cpu_before, wall_before = cpu_seconds(), time.monotonic()
        task = asyncio.create_task(publisher.run())
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        cpu = cpu_seconds() - cpu_before
        wall = time.monotonic() - wall_before
        passes = int(wall // publisher.discover_seconds) + 1
        return {
            "gpus": gpus,
            "seconds": round(wall, 1),
            "cpu_seconds": round(cpu, 4),
            "cpu_percent_of_one_core": round(100 * cpu / wall, 3),
            "rss_mib": round(rss_mib(), 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "node_writes": int(publisher.writes.labels("ok")._value.get() - writes_before),
            "passes": passes,
            "nvml_calls_per_pass": round((replay.calls - calls_before) / passes),
            "pass": quantiles(timings),
            "derived": reading["derived"],
        }
    finally:
        await api.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    api = localapi.FakeApi()
    api.create(objects.node("gpu-node", gpus=0))
    with localapi.serve_in_subprocess(api) as server:
        print(json.dumps(asyncio.run(measure(server, args.seconds, args.gpus)), indent=1))


if __name__ == "__main__":
    main()
