"""The MPS rule, written once: what a grant's share becomes in a container's environment,
and what MPS itself takes of a GPU, per GPU model.

`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` caps the share's compute: its percent of the GPU,
rounded up from the grant's milli (`ceil(milli / 10)`; 100 for a memory-only share, milli
0, which has no compute of its own to cap and is time-sliced with the other memory-only
shares of its GPU). `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` caps its memory on every GPU the
container sees, by device ordinal (relative to what the container sees, in grant order:
`0=20874M` for 20 GiB at 50 % on an H100), when the grant has memory. A whole GPU gets
neither (MPS does not run there).

**The memory limit covers the CUDA context.** MPS counts the client's own CUDA context
inside its limit (on an H100, a client limited to 2048M sees 1.86 GiB free and fails to
allocate 1.9 GiB: `../shared/fixtures/gpu/README.md`), so a limit of exactly the ask
leaves the pod less than it asked for. The limit is the ask plus the context of the
share's GPU model (`ClientContext`: a base plus a cost per percent of threads, since the
context's per-SM reservations grow with the SMs the client may use), and the engine packs
what the limit takes (`gpuplace.placement.inventory.Gpu.takes`, the same arithmetic).
The figures per model are in `MODELS` (measured) with `UNMEASURED` for the rest; the node
agent publishes the ones it uses per GPU, and the sidecar writes the limit for the
webhook's env path at bind (`assignments`, `gpuplace.io/mps-memory-limit`).

Both paths to a GPU use this one function, `environment`: the webhook, where GPU nodes
run without the node agent (the memory limit then travels as that annotation, read
through the downward API, since the node is not known at admission), and the node agent's
answer to the kubelet (device plugin; the DRA kubelet plugin's CDI spec). Both limits
apply per client process, not per pod (docs/node-agent.md). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuplace.placement.inventory import ClientContext
from gpuplace.placement.requests import WHOLE, thread_percent

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


@dataclass(frozen=True, slots=True)
class ModelFigures:
    """What MPS takes of one GPU model's memory: each client's CUDA context (inside its
    limit) and the MPS server's own memory (outside every limit), MiB."""

    context: ClientContext
    server_mib: int
    source: str
    """Where the figures come from, for docs and `gpuplace explain`."""


MODELS: dict[str, ModelFigures] = {
    # H100 80GB HBM3, driver 580.159.04 (../shared/fixtures/gpu/ and docs/node-agent.md,
    # "On a GPU"): a client's context took 144 MiB at 20 % of threads, 143-149 MiB at 25 %,
    # 196 MiB at 30 %, 271-274 MiB at 50 % (NVML's per-process memory less what it held,
    # and the limit less the free memory the client saw); a plain, non-MPS context 610 MiB
    # at all 132 SMs. 144 + 5 × percent is above every one of them (by 96-120 MiB at the
    # measured points, 34 MiB above the plain context at 100 %), taking the smallest
    # measured context, 144 MiB, for shares below 20 % as well. The MPS server held 66 MiB.
    "NVIDIA-H100-80GB-HBM3": ModelFigures(
        ClientContext(base_mib=144, per_percent_mib=5),
        server_mib=66,
        source="measured on an H100 80GB HBM3, driver 580.159.04",
    ),
}
UNMEASURED = ModelFigures(
    ClientContext(base_mib=256, per_percent_mib=8),
    server_mib=128,
    source="not measured for this model: gpuplace's cautious default "
    "(256 MiB and 8 MiB per percent of threads)",
)
"""Models without figures of their own: about 1.6 × the H100's context (456 MiB at 25 %,
1,056 MiB at 100 %) and about twice its server. Measure yours (docs/node-agent.md, "What a share
can use") and pass them to the node agent (`--mps-context-mib`)."""


def figures(model: str) -> ModelFigures:
    """The figures of a GPU model, by GPU Feature Discovery's product name
    (`NVIDIA-H100-80GB-HBM3`; NVML's name with spaces also reads), `UNMEASURED` for a model
    not in `MODELS`. O(1)."""
    return MODELS.get(model.strip().replace(" ", "-"), UNMEASURED)


def is_share(milli: int) -> bool:
    """Whether a grant of `milli` per GPU is a share (MPS-capped): less than a whole GPU."""
    return milli < WHOLE


def thread_percentage(milli: int) -> int:
    """The compute cap of a share of `milli` (1-999; 0 = memory-only): ceil(milli / 10),
    100 for a memory-only share."""
    return thread_percent(milli)


def memory_limit_mib(milli: int, memory_mib: int, context: ClientContext) -> int:
    """The MiB `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` gives a share of `milli` and `memory_mib`
    on a GPU whose clients' contexts take `context`: the ask plus the context, what the
    engine packs for it (`ClientContext.takes`); 0 when it asked no memory. O(1)."""
    return context.takes(milli, memory_mib) if memory_mib else 0


def memory_limit(milli: int, memory_mib: int, gpus: int, context: ClientContext) -> str:
    """The `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` value (`0=2317M`, one per GPU the container
    sees); "" for whole GPUs and shares without memory. O(gpus)."""
    if not is_share(milli) or not memory_mib:
        return ""
    limit = memory_limit_mib(milli, memory_mib, context)
    return ",".join(f"{ordinal}={limit}M" for ordinal in range(gpus))


def environment(
    milli: int, memory_mib: int, gpus: int, *, context: ClientContext
) -> dict[str, str]:
    """The MPS limits of a grant of `milli` and `memory_mib` on each of `gpus` GPUs whose
    clients' CUDA contexts take `context` (what the node publishes for those GPUs), as env
    vars; empty for whole GPUs. O(gpus)."""
    if not is_share(milli):
        return {}
    env = {THREADS_ENV: str(thread_percentage(milli))}
    limit = memory_limit(milli, memory_mib, gpus, context)
    if limit:
        env[MEMORY_ENV] = limit
    return env
