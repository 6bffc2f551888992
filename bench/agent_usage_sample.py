"""Cost of one usage sample of the node agent, and of one scrape of its series.

8 GPUs derived from the H100 capture (`nvml-plain-client.json`), each given `--processes`
compute processes and one per-process SM sample each (both SYNTHETIC: no capture holds
50 processes or per-process samples); every process's `/proc/<pid>/cgroup` written into a
temporary proc root (systemd driver, cgroup v2), the processes spread over `--pods` pods
of this node that hold gpuplace shares. Measures `gpuplace.agent.usage_sampling.Meter.measure` (NVML
replayed, so the driver's own call cost is not in it: `nvml_calls` says how many a real
sample makes) and `generate_latest` of the registry with the usage collector (the memory
peak over a full default window: 6 samples). Prints JSON.

    .venv/bin/python bench/agent_usage_sample.py [--gpus 8] [--processes 50] [--pods 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from bench.agent_allocate import summary  # noqa: E402
from gpuplace.agent import cgroups, nvml, usage_sampling  # noqa: E402
from tests.agent import kubelet as standin  # noqa: E402

FIXTURES = REPO.parent / "shared" / "fixtures" / "gpu"
NODE = "bench-node"


def uid_of(number: int) -> str:
    return f"00000000-0000-4000-8000-{number:012d}"


def node(gpus: int, processes: int, pods: int, proc: Path) -> tuple[dict[str, Any], list[Any]]:
    source = nvml.Replay.load(FIXTURES / "nvml-plain-client.json").reading
    reading = nvml.derived(source, gpus)
    reading["synthetic"] = "compute_processes and process_utilization made by the benchmark"
    made_pods: list[dict[str, Any]] = []
    for number in range(pods):
        index = number % gpus
        uuid = reading["gpus"][index]["uuid"]
        pod = standin.pod(f"p{number}", [index], [uuid], milli=100, memory_mib=4096, node=NODE)
        pod["metadata"]["uid"] = uid_of(number)
        pod["status"] = {"phase": "Running"}
        made_pods.append(pod)
    pid = 1000
    for index, gpu in enumerate(reading["gpus"]):
        gpu["compute_processes"], gpu["process_utilization"] = [], []
        on_gpu = [number for number in range(pods) if number % gpus == index] or [0]
        for slot in range(processes):
            pid += 1
            number = on_gpu[slot % len(on_gpu)]
            gpu["compute_processes"].append({"pid": pid, "usedGpuMemory": 256 << 20})
            gpu["process_utilization"].append({"pid": pid, "timeStamp": pid, "smUtil": 10})
            (proc / str(pid)).mkdir()
            slice_ = f"kubepods-burstable-pod{uid_of(number).replace('-', '_')}.slice"
            (proc / str(pid) / "cgroup").write_text(
                f"0::/kubepods.slice/kubepods-burstable.slice/{slice_}"
                f"/cri-containerd-{'b' * 64}.scope\n"
            )
    return reading, made_pods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=50, help="per GPU")
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        proc = Path(root)
        reading, pods = node(args.gpus, args.processes, args.pods, proc)
        replay = nvml.Replay(reading)
        meter = usage_sampling.Meter(replay, NODE, cgroups.Proc(proc))
        by_uid = {pod["metadata"]["uid"]: pod for pod in pods}
        sampler = usage_sampling.Sampler(meter, lambda: pods)
        registry = CollectorRegistry()
        registry.register(
            usage_sampling.UsageCollector(
                NODE, sampler, usage_sampling.live_in(lambda: by_uid, NODE)
            )
        )
        took: list[float] = []
        scraped: list[float] = []
        sample = meter.measure(pods)
        calls = replay.calls
        for _ in range(args.samples):
            meter.since.clear()  # every sample sees the samples again, as a busy node would
            started = time.perf_counter()
            sample = meter.measure(pods)
            took.append(time.perf_counter() - started)
            # as the loop keeps them: the last sample, and the window of the memory peak
            now = time.monotonic()
            sampler.last, sampler.last_at = sample, now
            sampler.recent.append((now, sample))
            while len(sampler.recent) > sampler.peak_seconds / sampler.seconds:
                sampler.recent.popleft()
            started = time.perf_counter()
            body = generate_latest(registry)
            scraped.append(time.perf_counter() - started)
        print(
            json.dumps(
                {
                    "gpus": args.gpus,
                    "processes_per_gpu": args.processes,
                    "pods": args.pods,
                    "samples": args.samples,
                    "nvml_calls_per_sample": calls,
                    "attributed": sample.attributed,
                    "pod_gpu_rows": len(sample.pods),
                    "sample": summary(took),
                    "scrape": summary(scraped),
                    "scrape_bytes": len(body),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
