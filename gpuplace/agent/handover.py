"""What a container gets from its grant, whichever kubelet API asks: pure, no I/O.

One rule for both paths to a GPU: the device plugin's Allocate answer
(`gpuplace.agent.allocating.answer` renders it as a ContainerAllocateResponse) and the DRA
kubelet plugin's CDI spec (`gpuplace.agent.preparing` renders it as CDI container edits)
are the same `Edits`, built here from the granted GPUs (by UUID), the grant's milli and
memory, and the node's options:

- the GPUs, by the runtime's strategy (`Strategy`): CDI names (`nvidia.com/gpu=<UUID>`,
  NVIDIA_VISIBLE_DEVICES=void), or `/dev/null` mounted at
  /var/run/nvidia-container-devices/<UUID> (the NVIDIA runtime's volume-mount list), or
  NVIDIA_VISIBLE_DEVICES=<UUIDs>; plus the device nodes when their minor numbers are known
  (not with CDI, whose spec has them);
- for a share (milli < 1000, memory-only included): the GPU's MPS pipe directory mounted,
  `CUDA_MPS_PIPE_DIRECTORY`, and the limits of `gpuplace.cluster.mps_limits.environment`.

It never names a GPU that is not granted, nor one the node does not have; a share whose
GPU has no ready MPS daemon, and a granted GPU that is missing or unhealthy, are refused
(`Refusal`): a container never runs with a GPU it was not granted, nor a share uncapped.
O(granted GPUs).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuplace.cluster import mps_limits
from gpuplace.placement.inventory import NO_CONTEXT, ClientContext

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
"""Where the NVIDIA runtime looks for its device list in the volume-mounts strategy."""
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


class Strategy(enum.StrEnum):
    """How the container runtime is told which GPUs the container gets."""

    CDI = "cdi"
    """CDI device names (`nvidia.com/gpu=<UUID>`), for runtimes with CDI (containerd ≥ 1.7,
    CRI-O ≥ 1.23) and `nvidia-ctk cdi generate` specs; NVIDIA_VISIBLE_DEVICES=void."""
    VOLUME_MOUNTS = "volume-mounts"
    """`/dev/null` mounted at /var/run/nvidia-container-devices/<UUID>: what the NVIDIA
    runtime reads when it ignores NVIDIA_VISIBLE_DEVICES from unprivileged containers."""
    ENVVAR = "envvar"
    """NVIDIA_VISIBLE_DEVICES=<UUIDs>: only safe where nothing else can set that variable."""


@dataclass(frozen=True, slots=True)
class NodeGpu:
    """One GPU of this node as the kubelet plugins need it (from discovery)."""

    index: int
    uuid: str
    healthy: bool = True
    numa: int | None = None
    """NUMA node; None = unknown (never guessed)."""
    minor: int | None = None
    """/dev/nvidia<minor>; None = unknown (then no device nodes are passed)."""
    memory_mib: int | None = None
    """The memory a share can get of it (the agent's packable figure, else NVML's total);
    None = unknown (the device plugin does not need it)."""
    context: ClientContext = mps_limits.UNMEASURED.context
    """What an MPS client's CUDA context takes on it, as the agent publishes it (the
    share's memory limit is its ask plus this: `mps_limits`)."""
    reasons: tuple[str, ...] = ()
    """Why it is unhealthy (NVML's words), for the DRA plugin's health stream."""


@dataclass(frozen=True, slots=True)
class Mps:
    """Where the MPS control daemon's pipe (and shared-memory) directories are."""

    pipe_dir: str
    """Host path of the daemon's CUDA_MPS_PIPE_DIRECTORY."""
    container_pipe_dir: str = "/tmp/nvidia-mps"
    shm_dir: str | None = None
    """Host path of the daemon's /dev/shm, mounted at /dev/shm; None: not shared."""


@dataclass(frozen=True, slots=True)
class Options:
    strategy: Strategy = Strategy.CDI
    cdi_kind: str = "nvidia.com/gpu"
    mps: Mps | Mapping[str, Mps] | None = None
    """The MPS daemon of the node, or one per GPU (by UUID) where each GPU has its own;
    None, or a GPU missing from the map: no MPS there, so a share is refused (it would run
    unlimited)."""

    def mps_for(self, uuid: str) -> Mps | None:
        if isinstance(self.mps, Mapping):
            return self.mps.get(uuid)
        return self.mps

    def without_mps(self) -> Options:
        return Options(self.strategy, self.cdi_kind, None)


class Refusal(Exception):
    """A container cannot be handed its grant; the message says why (the kubelet shows
    it)."""


class MpsNotReady(Refusal):
    """A share whose GPU's MPS daemon is not ready: worth asking again soon."""


@dataclass(frozen=True, slots=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class Edits:
    """What the runtime must do to the container: env, bind mounts, device nodes (host
    path = container path) and CDI device names, in the order they are applied."""

    env: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    device_nodes: tuple[str, ...] = ()
    cdi_devices: tuple[str, ...] = ()


def edits(
    who: str,
    uuids: Sequence[str],
    milli: int,
    memory_mib: int,
    *,
    gpus: Sequence[NodeGpu],
    options: Options,
    context_inside: bool = False,
) -> Edits:
    """What the container of `who` (named in refusals) gets for its grant of `uuids` at
    `milli` and `memory_mib` each: see the module docstring. The memory limit is the ask
    plus the GPU's published CUDA context (`mps_limits`), or, with `context_inside` (a DRA
    claim: what it consumed of the slice's memory capacity is all the GPU gives it, so that
    kube-scheduler's accounting holds), `memory_mib` itself. Raises `Refusal`."""
    by_uuid = {gpu.uuid: gpu for gpu in gpus}
    missing = [uuid for uuid in uuids if uuid not in by_uuid]
    if missing:
        raise Refusal(f"{who}: granted GPU {missing[0]} is not on this node")
    sick = [uuid for uuid in uuids if not by_uuid[uuid].healthy]
    if sick:
        raise Refusal(f"{who}: granted GPU {sick[0]} is unhealthy")
    share = mps_limits.is_share(milli)
    mps = options.mps_for(uuids[0]) if share and uuids else None
    if share and mps is None:
        raise MpsNotReady(f"{who}: a GPU share needs the MPS control daemon, which is not ready")
    env: dict[str, str] = {}
    mounts: list[Mount] = []
    nodes: tuple[str, ...] = ()
    cdi: tuple[str, ...] = ()
    if options.strategy is Strategy.CDI:
        cdi = tuple(f"{options.cdi_kind}={uuid}" for uuid in uuids)
        env[VISIBLE_DEVICES_ENV] = "void"
    else:
        if options.strategy is Strategy.VOLUME_MOUNTS:
            env[VISIBLE_DEVICES_ENV] = VOLUME_MOUNT_ROOT
            mounts.extend(
                Mount(f"{VOLUME_MOUNT_ROOT}/{uuid}", "/dev/null", read_only=True) for uuid in uuids
            )
        else:
            env[VISIBLE_DEVICES_ENV] = ",".join(uuids)
        minors = [by_uuid[uuid].minor for uuid in uuids]
        if all(minor is not None for minor in minors):
            nodes = (*(f"/dev/nvidia{minor}" for minor in minors), *CONTROL_DEVICES)
    if mps is not None:
        mounts.append(Mount(mps.container_pipe_dir, mps.pipe_dir))
        if mps.shm_dir is not None:
            mounts.append(Mount("/dev/shm", mps.shm_dir))
        env[mps_limits.PIPE_ENV] = mps.container_pipe_dir
        context = (
            NO_CONTEXT
            if context_inside
            else max((by_uuid[uuid].context for uuid in uuids), key=lambda c: c.mib(milli))
        )
        env.update(mps_limits.environment(milli, memory_mib, len(uuids), context=context))
    return Edits(env=env, mounts=tuple(mounts), device_nodes=nodes, cdi_devices=cdi)
