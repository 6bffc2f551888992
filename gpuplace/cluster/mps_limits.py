"""The MPS rule, written once: what a grant's share becomes in a container's environment.

`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` caps the share's compute: its percent of the GPU,
rounded up from the grant's milli (`ceil(milli / 10)`; 100 for a memory-only share, milli
0, which has no compute of its own to cap and is time-sliced with the other memory-only
shares of its GPU). `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` caps its memory on every GPU the
container sees, by device ordinal (relative to what the container sees, in grant order:
`0=20480M`), when the grant has memory. A whole GPU gets neither (MPS does not run there).

Both paths to a GPU use this one function: the webhook, where GPU nodes run without the
node agent (the values travel as env vars the pod carries), and the node agent's answer
to the kubelet (device plugin; the DRA kubelet plugin's CDI spec). Both limits apply per
client process, not per pod (docs/node-agent.md). Pure: no I/O.
"""

from __future__ import annotations

from gpuplace.placement.requests import WHOLE

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


def is_share(milli: int) -> bool:
    """Whether a grant of `milli` per GPU is a share (MPS-capped): less than a whole GPU."""
    return milli < WHOLE


def thread_percentage(milli: int) -> int:
    """The compute cap of a share of `milli` (1-999; 0 = memory-only): ceil(milli / 10),
    100 for a memory-only share."""
    return -(-milli // 10) if milli else 100


def environment(milli: int, memory_mib: int, gpus: int = 1) -> dict[str, str]:
    """The MPS limits of a grant of `milli` and `memory_mib` on each of `gpus` GPUs, as env
    vars; empty for whole GPUs. O(gpus)."""
    if not is_share(milli):
        return {}
    env = {THREADS_ENV: str(thread_percentage(milli))}
    if memory_mib:
        env[MEMORY_ENV] = ",".join(f"{ordinal}={memory_mib}M" for ordinal in range(gpus))
    return env
