"""What a client can get of each GPU's memory with the MPS control daemon running: the
figure the engine packs, read by the node agent from NVML.

NVML's total is not what shares can hold: the driver keeps some of it for itself, and the
MPS server, started when a share's first client connects, holds its own memory outside
every client's limit (captured on an H100, `../shared/fixtures/gpu/`: 81,559 MiB total,
480 MiB used with nothing running, the MPS server 66 MiB beside two clients). Per GPU:

- **the driver's reservation**: NVML's own figure where the driver answers it
  (`nvmlDeviceGetMemoryInfo_v2`'s `reserved`); else memory used while no compute process
  holds the GPU (the idle reading: 480 MiB on the H100), the last such reading this agent
  took when processes hold it now, and memory used less the processes' memory when it has
  never seen the GPU idle (unknown where a process's memory is);
- **the MPS server's memory**: the most NVML has shown for the GPU's compute processes
  that are not MPS clients while it had clients, never less than the GPU model's figure
  (`mps_limits.figures`; the server may not be running yet);
- **packable**: total less both, rounded down to `GRANULE_MIB` (81,559 - 480 - 66 = 81,013
  → **80,960 MiB** on the H100), so that readings taken under different loads publish one
  figure: memory used less the processes' memory grows by about 10 MiB under load on the
  capture (489.75 MiB beside the MPS clients, 488.8 beside a plain process), memory the
  driver charges to no process, which the granule and the context figures' margins cover.

Each client's CUDA context counts inside its own limit (`mps_limits`), not here.
`Readings` keeps, per GPU index, the last idle reservation and the largest server seen
(it is the publisher's, which discovers every `--discover-seconds`). Pure over the NVML
seam: no I/O but its calls, no clock. O(processes) per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuplace.agent import nvml as nvml_seam

MIB = 1 << 20
GRANULE_MIB = 64
"""Packable memory is published in whole multiples of this."""


@dataclass(frozen=True, slots=True)
class Memory:
    """One GPU's memory as packing sees it, MiB; None where NVML could not say."""

    total_mib: int
    reserved_mib: int | None
    """The driver's reservation."""
    server_mib: int
    """The MPS server's own memory (observed, or the model's figure)."""
    packable_mib: int | None
    """What the engine packs: total less both, rounded down to `GRANULE_MIB`."""


@dataclass(slots=True)
class Readings:
    """What earlier discoveries saw, per GPU index (see the module docstring)."""

    idle_reserved: dict[int, int] = field(default_factory=dict)
    """Bytes used at the last reading with no compute process on the GPU."""
    server: dict[int, int] = field(default_factory=dict)
    """The most bytes the GPU's MPS server(s) held at a reading with MPS clients."""


def _ceil_mib(value: int) -> int:
    return -(-value // MIB)


def read(
    nvml: nvml_seam.Nvml, index: int, total: int, server_figure_mib: int, seen: Readings
) -> Memory:
    """GPU `index`'s memory for packing; `total` in bytes (already read), the model's MPS
    server figure in MiB. Updates `seen`. O(processes)."""
    reserved = _reserved(nvml, index, seen)
    server = max(server_figure_mib, _ceil_mib(_server(nvml, index, seen)))
    total_mib = total // MIB
    packable = None
    if reserved is not None:
        free = total_mib - _ceil_mib(reserved) - server
        packable = max(free // GRANULE_MIB * GRANULE_MIB, 0)
    return Memory(
        total_mib=total_mib,
        reserved_mib=None if reserved is None else _ceil_mib(reserved),
        server_mib=server,
        packable_mib=packable,
    )


def _processes(call: str, nvml: nvml_seam.Nvml, index: int) -> list[nvml_seam.Process] | None:
    try:
        return list(getattr(nvml, call)(index))
    except nvml_seam.NvmlError:
        return None


def _reserved(nvml: nvml_seam.Nvml, index: int, seen: Readings) -> int | None:
    """The driver's reservation in bytes (see the module docstring); None when unknown."""
    try:
        return nvml.memory_reserved(index)
    except nvml_seam.NvmlError:
        pass
    try:
        used = nvml.memory_used(index)
    except nvml_seam.NvmlError:
        return seen.idle_reserved.get(index)
    processes = _processes("compute_processes", nvml, index)
    if processes is None:
        return seen.idle_reserved.get(index)
    if not processes:
        seen.idle_reserved[index] = used
        return used
    if index in seen.idle_reserved:
        return seen.idle_reserved[index]
    held = [process.used_bytes for process in processes]
    if any(value is None for value in held):
        return None
    return max(used - sum(value or 0 for value in held), 0)


def _server(nvml: nvml_seam.Nvml, index: int, seen: Readings) -> int:
    """The most bytes the GPU's MPS server(s) held at a reading with clients (0: never
    seen). Under MPS, NVML lists the clients in `mps_processes` and the server beside them
    in `compute_processes`."""
    clients = _processes("mps_processes", nvml, index)
    if clients:
        compute = _processes("compute_processes", nvml, index) or []
        client_pids = {process.pid for process in clients}
        held = sum(process.used_bytes or 0 for process in compute if process.pid not in client_pids)
        seen.server[index] = max(seen.server.get(index, 0), held)
    return seen.server.get(index, 0)
