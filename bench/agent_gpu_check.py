"""The node agent on a real GPU machine (no kubelet there): what CI, without a GPU, cannot
show. Not run in this repository's CI; written for the check on a lent GPU.

1. discovery (`gpuplace.agent.discovery` over the real NVML) equals `nvidia-smi`: index, UUID,
   model, memory (MiB), PCI bus id;
2. the agent's own supervisor (`gpuplace.agent.mps`) starts the real `nvidia-cuda-mps-control` for
   the first GPU, with its per-GPU pipe directory, and it answers;
3. the device plugin's Allocate answer for a share of that GPU (`bench/agent_answer.py`:
   the real plugin over real gRPC, the kubelet stand-in admitting it), turned into the env
   of a host process; a client started with exactly that env allocates device memory
   through the CUDA driver API (ctypes, no framework needed): half the granted memory and
   the whole grant must succeed (the limit covers the client's CUDA context, issue 43),
   the grant plus 512 MiB must fail;
4. the daemon is killed (SIGKILL); the supervisor starts it again, it answers again, and a
   new client is capped again;
5. what a pod uses (`gpuplace.agent.usage_sampling` over the real NVML): a client under the
   daemon holds half the granted memory and keeps the GPU busy (memsets) for a few
   seconds, its PID written into a temporary proc root as a pod's; NVML must list it among
   the MPS clients under the PID it has here (host PIDs: the agent's hostPID), and the
   pod's memory must be at least what it holds. Reported, not judged: its SM share, and
   whose PIDs the driver's per-process samples name under MPS (the client's, the server's,
   none, or Not Supported), which decides whether the pods' SM series exist on this driver;
6. the compute share: a client with the grant's env runs bf16 matrix products (PyTorch, where
   the machine has it) for a few seconds, and so does one without MPS: the share's kernels
   must get no more SMs than its fraction of the GPU (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`;
   MPS hands out whole TPCs of two SMs, so rounded up to an even count) and less throughput.
   Reported, not judged: the throughput ratio and the SM clock of each (fewer SMs draw less
   power, so they run at a higher clock), then the share and a client of the rest of the
   GPU running at once.

Prints JSON; exit status 1 when a check fails. Needs the NVIDIA driver (libcuda,
libnvidia-ml, nvidia-smi, nvidia-cuda-mps-control on PATH).

    .venv/bin/python bench/agent_gpu_check.py [--milli 250] [--memory-mib 2048]
        [--busy-seconds 6] [--compute-seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prometheus_client import CollectorRegistry  # noqa: E402

from bench import agent_answer  # noqa: E402
from gpuplace.agent import cgroups, discovery, mps, nvml, usage_sampling  # noqa: E402

CLIENT = r"""
import ctypes, json, sys
cuda = ctypes.CDLL("libcuda.so.1")
def check(code, what):
    if code != 0:
        print(json.dumps({"error": what, "code": code})); sys.exit(0)
check(cuda.cuInit(0), "cuInit")
device, context = ctypes.c_int(), ctypes.c_void_p()
check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
check(cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device), "cuCtxCreate")
free, total = ctypes.c_size_t(), ctypes.c_size_t()
check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
results = {}
for mib in map(int, sys.argv[1:]):
    pointer = ctypes.c_uint64()
    code = cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(mib << 20))
    results[mib] = code
    if code == 0:
        cuda.cuMemFree_v2(pointer)
print(json.dumps({"free_mib": free.value >> 20, "total_mib": total.value >> 20,
                  "alloc_result_by_mib": results}))
"""


BUSY_CLIENT = r"""
import ctypes, json, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
device, context, pointer = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device) == 0
size = int(sys.argv[1]) << 20
assert cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size)) == 0
print("holding", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for _ in range(50):
        cuda.cuMemsetD8_v2(pointer, 7, ctypes.c_size_t(size))
    cuda.cuCtxSynchronize()
print(json.dumps({"done": True}), flush=True)
"""


def smi() -> list[dict[str, Any]]:
    fields = "index,uuid,name,memory.total,pci.bus_id"
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = []
    for line in out.strip().splitlines():
        index, uuid, name, memory, bus = (part.strip() for part in line.split(","))
        rows.append(
            {"index": int(index), "uuid": uuid, "model": name, "memory_mib": int(memory),
             "pci": nvml.bus_id(bus)}
        )  # fmt: skip
    return rows


def discovered() -> list[dict[str, Any]]:
    reading = nvml.Real()
    try:
        found = discovery.discover(reading)
    finally:
        reading.close()
    return [
        {"index": gpu.index, "uuid": gpu.uuid, "model": gpu.model,
         "memory_mib": gpu.memory_mib, "pci": gpu.pci_bus_id}
        for gpu in found.gpus
    ]  # fmt: skip


COMPUTE_CLIENT = r"""
import json, sys, time
try:
    import pynvml, torch
except ImportError as error:
    print(json.dumps({"error": f"no PyTorch here: {error}"})); sys.exit(0)
seconds, size = float(sys.argv[1]), 8192
pynvml.nvmlInit()
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
products, clocks, start = 0, [], time.perf_counter()
while time.perf_counter() - start < seconds:
    for _ in range(10):
        a @ b
    clocks.append(pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_SM))
    torch.cuda.synchronize()
    products += 10
elapsed = time.perf_counter() - start
print(json.dumps({"sms": torch.cuda.get_device_properties(0).multi_processor_count,
                  "tflops": round(2 * size**3 * products / elapsed / 1e12, 1),
                  "sm_clock_mhz": round(sum(clocks) / len(clocks))}))
"""


def client(env: dict[str, str], sizes: list[int], program: str = CLIENT) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", program, *map(str, sizes)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def capped(result: dict[str, Any], small: int, full: int, big: int) -> bool:
    """Half the grant and the whole grant allocated, the grant + 512 MiB refused."""
    codes = result.get("alloc_result_by_mib", {})
    allocated = codes.get(str(small)) == 0 and codes.get(str(full)) == 0
    return bool(allocated and codes.get(str(big), 0) != 0)


async def usage(env: dict[str, str], hold_mib: int, seconds: float) -> dict[str, Any]:
    """Step 5: the busy client sampled by `gpuplace.agent.usage_sampling` over the real NVML."""
    report: dict[str, Any] = {}
    busy = subprocess.Popen(
        [sys.executable, "-c", BUSY_CLIENT, str(hold_mib), str(seconds)],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    proc = Path(tempfile.mkdtemp(prefix="proc"))
    uid = "00000000-0000-4000-8000-000000000001"
    pod = {"metadata": {"uid": uid, "namespace": "check", "name": "busy"}, "spec": {}}
    reading = nvml.Real()
    try:
        assert busy.stdout is not None
        report["client_holding"] = busy.stdout.readline().strip() == "holding"
        (proc / str(busy.pid)).mkdir()
        (proc / str(busy.pid) / "cgroup").write_text(
            f"0::/kubepods/besteffort/pod{uid}/{'0' * 64}\n"
        )
        meter = usage_sampling.Meter(reading, "check", cgroups.Proc(proc))
        meter.measure([pod])  # the first: samples since the driver's buffer began
        await asyncio.sleep(min(2.0, seconds / 2))
        clients = [p.pid for p in reading.mps_processes(0)]
        computing = [p.pid for p in reading.compute_processes(0)]
        try:
            named = sorted({s.pid for s in reading.process_utilization(0, 0)})
            samples: Any = (
                "client" if busy.pid in named
                else "server" if set(named) & (set(computing) - set(clients))
                else "none" if not named else f"other pids {named}"
            )  # fmt: skip
        except nvml.NvmlError as error:
            samples = str(error)
        sample = meter.measure([pod])
        use = next((u for u in sample.pods if u.uid == uid), None)
        report.update(
            nvml_lists_client_by_its_pid=busy.pid in clients,
            mps_clients=clients,
            compute_processes=computing,
            per_process_samples_name=samples,
            pod_memory_used_mib=None
            if use is None or use.memory_used is None
            else use.memory_used >> 20,
            pod_sm=None if use is None else use.sm,
            gpu_utilization=sample.gpus[0].utilization if sample.gpus else None,
            errors=[list(error) for error in sample.errors],
        )
        report["pod_memory_at_least_held"] = (report["pod_memory_used_mib"] or 0) >= hold_mib
    finally:
        busy.kill()
        busy.wait()
        reading.close()
        shutil.rmtree(proc, ignore_errors=True)
    return report


def compute(env: dict[str, str], uuid: str, milli: int, seconds: float) -> dict[str, Any]:
    """Step 6: the share's matrix-product throughput and SMs against a client without MPS,
    then the share and a client of the rest of the GPU at once."""
    alone = client({"CUDA_VISIBLE_DEVICES": uuid}, [int(seconds)], COMPUTE_CLIENT)
    shared = client(env, [int(seconds)], COMPUTE_CLIENT)
    report: dict[str, Any] = {"without_mps": alone, "share": shared}
    if "tflops" not in alone or "tflops" not in shared:
        return report
    # MPS gives a client whole TPCs (two SMs each): its share of them, rounded up.
    allowed = -(-alone["sms"] * milli // 2000) * 2
    report["ratio"] = round(shared["tflops"] / alone["tflops"], 3)
    report["sms_allowed"] = allowed
    report["capped"] = shared["sms"] <= allowed and shared["tflops"] < alone["tflops"]
    rest = {**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 - milli // 10)}
    both = [
        subprocess.Popen(
            [sys.executable, "-c", COMPUTE_CLIENT, str(int(seconds))],
            env={**os.environ, **variables},
            stdout=subprocess.PIPE,
            text=True,
        )
        for variables in (env, rest)
    ]
    results = [
        json.loads((one.communicate(timeout=120)[0] or "{}").splitlines()[-1]) for one in both
    ]
    report["together"] = {"share": results[0], "rest_of_the_gpu": results[1]}
    return report


async def check(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    seen, truth = discovered(), smi()
    report["discovery_equals_nvidia_smi"] = seen == truth
    report["gpus"] = truth
    uuid = truth[0]["uuid"]
    root = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))
    base_env = {
        name: os.environ[name] for name in ("PATH", "LD_LIBRARY_PATH") if name in os.environ
    }
    config = mps.MpsConfig(layout=mps.Layout(root), base_env=base_env, probe_interval_seconds=1.0)
    supervisor = mps.Supervisor(config, CollectorRegistry())
    small, full, big = args.memory_mib // 2, args.memory_mib, args.memory_mib + 512
    try:
        await supervisor.set_gpus([uuid])
        report["daemon_ready"] = await supervisor.wait_ready(30)
        grant = argparse.Namespace(
            uuid=[uuid], count=1, milli=args.milli, memory_mib=args.memory_mib,
            pipe_dir=str(config.layout.pipe_directory(uuid)), strategy="envvar",
        )  # fmt: skip
        answered = await agent_answer.answer(grant)
        env: dict[str, str] = answered["host_env"]
        report["allocate_response"] = answered["allocate_response"]
        report["client_env"] = env
        first = client(env, [small, full, big])
        report["client"] = first
        report["capped"] = capped(first, small, full, big)
        unlimited = client({"CUDA_VISIBLE_DEVICES": uuid}, [small, full, big])
        report["client_without_mps"] = unlimited
        daemon = supervisor.daemons[uuid]
        killed = daemon.pid
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        started = time.monotonic()
        while not (daemon.restarts >= 1 and supervisor.ready(uuid)):
            if time.monotonic() - started > 60:
                break
            await asyncio.sleep(0.1)
        report["daemon_back_after_kill"] = daemon.restarts >= 1 and supervisor.ready(uuid)
        report["daemon_back_seconds"] = round(time.monotonic() - started, 2)
        again = client(env, [small, full, big])
        report["client_after_restart"] = again
        report["capped_after_restart"] = capped(again, small, full, big)
        report["usage"] = await usage(env, small, args.busy_seconds)
        report["compute"] = compute(env, uuid, args.milli, args.compute_seconds)
    finally:
        await supervisor.stop()
        shutil.rmtree(root, ignore_errors=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--milli", type=int, default=250)
    parser.add_argument("--memory-mib", type=int, default=2048)
    parser.add_argument("--busy-seconds", type=float, default=6.0)
    parser.add_argument("--compute-seconds", type=int, default=5)
    report = asyncio.run(check(parser.parse_args()))
    print(json.dumps(report, indent=2))
    used = report.get("usage") or {}
    computed = report.get("compute") or {}
    passed = all(
        report.get(key)
        for key in ("discovery_equals_nvidia_smi", "daemon_ready", "capped",
                    "daemon_back_after_kill", "capped_after_restart")
    ) and all(used.get(key) for key in ("nvml_lists_client_by_its_pid",
                                         "pod_memory_at_least_held"))  # fmt: skip
    if "ratio" in computed:
        passed = passed and computed["capped"]
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
