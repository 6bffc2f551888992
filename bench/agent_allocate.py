"""Allocate latency of the node agent's device plugin, as the kubelet sees it.

A real `gpuplace.agent.plugin.PluginServer` on a unix socket, registered with the kubelet stand-in
of the tests (real gRPC, v1beta1), for an 8-GPU node (derived from the H100 fixture) with
100 slots per GPU. The node already holds `--resident` running pods (their containers
started); then `--pods` new pods are bound one after another, a mix of shares (one GPU,
10–50%, with memory) and whole-GPU pods (1, 2 or 4 GPUs), each admitted as the kubelet
does: GetPreferredAllocation, then Allocate. Prints JSON: p50/p99/max of Allocate alone
and of the whole admission (both RPCs), measured at the caller, in milliseconds.

    .venv/bin/python bench/agent_allocate.py [--pods 2000] [--resident 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuplace.agent import allocating  # noqa: E402
from gpuplace.agent.deviceplugin import api_pb2  # noqa: E402
from tests.agent import kubelet as standin  # noqa: E402


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(values) * 1000, 3),
        "p99_ms": round(percentile(values, 0.99) * 1000, 3),
        "max_ms": round(max(values) * 1000, 3),
    }


def started(pod: dict[str, Any]) -> dict[str, Any]:
    pod["status"] = {
        "phase": "Running",
        "containerStatuses": [{"name": "train", "containerID": "containerd://bench"}],
    }
    return pod


async def measure(pods: int, resident: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    gpus = standin.eight_gpus()
    directory = Path(tempfile.mkdtemp(prefix="dpb", dir="/tmp"))
    server = standin.plugin_server(
        gpus,
        [
            started(standin.pod(f"resident-{i}", [i % 8], [gpus[i % 8].uuid], milli=100))
            for i in range(resident)
        ],
        directory,
        slots_per_gpu=100,
    )
    view = server.pods
    kubelet = standin.Kubelet(directory)
    await kubelet.start()
    stop = asyncio.Event()
    running = asyncio.ensure_future(server.run(stop))
    allocate: list[float] = []
    admission: list[float] = []
    try:
        await asyncio.wait_for(server.registered.wait(), 10)
        await kubelet.listed(1)
        stub = kubelet._stub()
        for number in range(pods):
            count = rng.choice([1, 1, 1, 1, 2, 4])
            indices = rng.sample(range(8), count)
            share = count == 1 and rng.random() < 0.7
            pod = standin.pod(
                f"new-{number}",
                indices,
                [gpus[i].uuid for i in indices],
                milli=rng.choice([100, 250, 500]) if share else 1000,
                memory_mib=rng.choice([2048, 8192]) if share else 0,
            )
            view.upsert(pod)
            kubelet.allocated.clear()  # the slots of earlier pods are not the point here
            began = time.perf_counter()
            preferred = await stub.GetPreferredAllocation(
                api_pb2.PreferredAllocationRequest(
                    container_requests=[
                        api_pb2.ContainerPreferredAllocationRequest(
                            available_deviceIDs=[d.ID for d in kubelet.devices],
                            allocation_size=count,
                        )
                    ]
                )
            )
            chosen = list(preferred.container_responses[0].deviceIDs)
            asked = time.perf_counter()
            answer = await stub.Allocate(
                api_pb2.AllocateRequest(
                    container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=chosen)]
                )
            )
            done = time.perf_counter()
            granted = allocating.granted_in(answer.container_responses[0], server.options)
            assert granted == {gpus[i].uuid for i in indices}, "answered the wrong GPUs"
            allocate.append(done - asked)
            admission.append(done - began)
            view.delete(pod)  # it ran and ended: the node stays at `resident` + 1 pods
    finally:
        stop.set()
        await running
        await kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "node": "8 GPUs (derived from the H100 fixture), 100 slots each",
        "resident_pods": resident,
        "allocations": pods,
        "allocate": summary(allocate),
        "get_preferred_then_allocate": summary(admission),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--resident", type=int, default=100)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.pods, args.resident, args.seed)), indent=2))


if __name__ == "__main__":
    main()
