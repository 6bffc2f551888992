"""The node agent's Allocate answer for one grant, from the real plugin over real gRPC, to
start a client with exactly it on a GPU machine (where no kubelet runs).

Binds a pod with the grant given (GPU UUIDs as `nvidia-smi -L` prints them, milli-GPU and
MiB), lets the kubelet stand-in of the tests admit it (GetPreferredAllocation, Allocate)
against a real `gpuplace.agent.plugin.PluginServer`, and prints JSON: the ContainerAllocateResponse
as the kubelet receives it, and `host_env`: the same answer for a process started on the
host itself (no container runtime there to read NVIDIA_VISIBLE_DEVICES or CDI names, so
`CUDA_VISIBLE_DEVICES` names the GPUs; the MPS pipe directory is the host path the answer
mounts).

    .venv/bin/python bench/agent_answer.py --uuid GPU-73fa… --milli 250 --memory-mib 2048 \\
        --pipe-dir /tmp/nvidia-mps
    env $(… | jq -r '.host_env | to_entries[] | "\\(.key)=\\(.value)"') python client.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from google.protobuf import json_format  # noqa: E402

from gpuplace.agent import handover  # noqa: E402
from gpuplace.agent.deviceplugin import api_pb2  # noqa: E402
from gpuplace.cluster import mps_limits  # noqa: E402
from tests.agent import kubelet as standin  # noqa: E402


def host_env(response: api_pb2.ContainerAllocateResponse, uuids: list[str]) -> dict[str, str]:
    """The answer's env for a process on the host: GPUs by CUDA_VISIBLE_DEVICES, and the
    MPS pipe directory at its host path (the answer mounts it into the container)."""
    env = {key: value for key, value in response.envs.items() if key.startswith("CUDA_MPS_")}
    pipe = env.get(mps_limits.PIPE_ENV)
    for mount in response.mounts:
        if pipe is not None and mount.container_path == pipe:
            env[mps_limits.PIPE_ENV] = mount.host_path
    env["CUDA_VISIBLE_DEVICES"] = ",".join(uuids)
    return env


async def answer(args: argparse.Namespace) -> dict[str, Any]:
    gpus = [handover.NodeGpu(index, uuid) for index, uuid in enumerate(args.uuid)]
    granted = gpus[: args.count]
    directory = Path(tempfile.mkdtemp(prefix="dpa", dir="/tmp"))
    server = standin.plugin_server(
        gpus,
        [
            standin.pod(
                "client",
                [gpu.index for gpu in granted],
                [gpu.uuid for gpu in granted],
                milli=args.milli,
                memory_mib=args.memory_mib,
            )
        ],
        directory,
        handover.Options(handover.Strategy(args.strategy), mps=handover.Mps(args.pipe_dir)),
    )
    kubelet = standin.Kubelet(directory)
    await kubelet.start()
    stop = asyncio.Event()
    running = asyncio.ensure_future(server.run(stop))
    try:
        await asyncio.wait_for(server.registered.wait(), 10)
        await kubelet.listed(1)
        response = await kubelet.admit(len(granted))
    finally:
        stop.set()
        await running
        await kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "allocate_response": json_format.MessageToDict(response),
        "host_env": host_env(response, [gpu.uuid for gpu in granted]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uuid", action="append", required=True, help="a GPU UUID (repeat)")
    parser.add_argument("--count", type=int, default=1, help="granted GPUs (the first UUIDs)")
    parser.add_argument("--milli", type=int, default=250, help="milli-GPU (1000 = whole)")
    parser.add_argument("--memory-mib", type=int, default=2048)
    parser.add_argument("--pipe-dir", default="/tmp/nvidia-mps", help="MPS pipe dir (host)")
    parser.add_argument(
        "--strategy", default="envvar", choices=[strategy.value for strategy in handover.Strategy]
    )
    args = parser.parse_args()
    print(json.dumps(asyncio.run(answer(args)), indent=2))


if __name__ == "__main__":
    main()
