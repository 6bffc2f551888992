"""What a pod asks for, in the engine's units.

`milli` is the share of one GPU in milli-GPU (1000 = a whole GPU); the
`gpu-percent` annotation maps onto it (percent × 10). A request for more than one
GPU always asks for whole GPUs. Memory is per GPU, in MiB; 0 means "no memory
limit asked" and, for a whole GPU, the grant takes all of that GPU's memory.

A *memory-only* share (`milli == 0`, one GPU, memory > 0; the `gpu-memory`
annotation alone) reserves GPU memory and no compute: it is time-sliced with the
other memory-only shares of its GPU, and never shares a GPU with a compute share or
a whole GPU (docs/placement.md, "Memory-only shares").

`describe(request)` is how a request reads wherever gpuplace words one for a person:
filter's reasons and the FailedGpuPlacement Event, a gang's shortfall, the preemption
Events of a pod or a gang.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

WHOLE = 1000
"""milli-GPU of one whole GPU."""


class Topology(enum.Enum):
    """What a multi-GPU request wants of its GPUs' NVLink domain."""

    ANY = "any"
    PREFERRED = "preferred"
    REQUIRED = "required"


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """A pod's demand. `count == 0` is a CPU-only pod (it still uses CPU and memory)."""

    milli: int = 0
    memory_mib: int = 0
    count: int = 0
    models: frozenset[str] = frozenset()
    cpu_milli: int = 0
    host_memory_mib: int = 0
    topology: Topology = Topology.ANY

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"GPU count must be >= 0, got {self.count}")
        if self.cpu_milli < 0 or self.host_memory_mib < 0 or self.memory_mib < 0:
            raise ValueError("CPU, memory and GPU memory must be >= 0")
        if self.count == 0:
            if self.milli != 0 or self.memory_mib != 0:
                raise ValueError("a request for 0 GPUs cannot ask for a GPU share or memory")
            return
        if self.milli == 0 and self.count == 1 and self.memory_mib > 0:
            return  # a memory-only share
        if not 1 <= self.milli <= WHOLE:
            raise ValueError(
                f"GPU share must be 1..{WHOLE} milli-GPU (0 only for a memory-only share of "
                f"one GPU with memory), got {self.milli}"
            )
        if self.count > 1 and self.milli != WHOLE:
            raise ValueError("a request for several GPUs must ask for whole GPUs")

    @property
    def shares(self) -> bool:
        """True for a fractional single-GPU request (the GPU may be shared)."""
        return self.count == 1 and self.milli < WHOLE

    @property
    def memory_only(self) -> bool:
        """True for a memory-only share: GPU memory on one GPU, no compute reserved."""
        return self.milli == 0 and self.count == 1

    @property
    def total_milli(self) -> int:
        """milli-GPU over all GPUs asked for."""
        return self.milli * self.count

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


def thread_percent(milli: int) -> int:
    """The compute a share of `milli` per GPU may use, in percent of the GPU's SMs, as MPS
    caps it (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`): ceil(milli / 10); 100 for a memory-only
    share (milli 0: no compute of its own to cap) and for a whole GPU. O(1)."""
    return -(-milli // 10) if 0 < milli < WHOLE else 100


def share_text(milli: int) -> str:
    """One GPU's share as a person reads it: `50%`, `whole` or `memory only`. O(1)."""
    if milli >= WHOLE:
        return "whole"
    return f"{milli / 10:g}%" if milli else "memory only"


def describe(request: GpuRequest) -> str:
    """The request as a person reads it, the one wording every message uses: `no GPU`,
    `50% of one GPU with 20480 MiB`, `memory only (no compute) of one GPU with 8192 MiB`,
    `1 whole GPU of Tesla-T4`, `4 whole GPUs in one NVLink domain with 81920 MiB each`.
    O(models)."""
    if request.count == 0:
        return "no GPU"
    if request.memory_only:
        text = "memory only (no compute) of one GPU"
    elif request.shares:
        text = f"{request.milli / 10:g}% of one GPU"
    else:
        text = f"{request.count} whole GPU{'s' if request.count > 1 else ''}"
        if request.count > 1 and request.topology is Topology.REQUIRED:
            text += " in one NVLink domain"
    if request.memory_mib:
        text += f" with {request.memory_mib} MiB" + (" each" if request.count > 1 else "")
    if request.models:
        text += f" of {'/'.join(sorted(request.models))}"
    return text
