"""Which pods hold more of a GPU than they were granted, read from one usage sample.

MPS caps each client *process* (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`,
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`), not a pod: a pod that starts several CUDA processes on
its share gets each of them the share's limits, so together they may hold several times
its grant. Per share (a grant below a whole GPU) and per granted GPU, in each sample
(`gpuplace.agent.usage_sampling`):

- `Kind.MEMORY`: the pod's processes together hold more than its grant plus one CUDA
  context (what the limit of one MPS client allows, `mps_limits.memory_limit_mib`) plus
  `tolerance_mib` (default `TOLERANCE_MIB`: NVML's per-process figures and MPS's own count
  differ by a few MiB). A share that asked no memory has no memory grant to exceed.
- `Kind.CLIENTS`: the pod has more than one process on the GPU (under MPS, MPS clients).
  Compute cannot be read per pod under MPS on the driver measured (580.159.04: the SM
  samples are charged to the MPS server, docs/node-agent.md, "What pods use"), so the
  clients are counted instead: each gets the share's compute cap, so more than one may use
  more than the grant, and this is reported the same way as memory.

Whole GPUs are never checked (the GPU is the pod's; it may run any number of processes),
nor pods the sample could not attribute. Pure: no I/O. O(pods × GPUs in the sample).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuplace.agent.usage_sampling import MIB, PodUse, Sample
from gpuplace.cluster import mps_limits
from gpuplace.placement.inventory import ClientContext
from gpuplace.placement.requests import WHOLE

TOLERANCE_MIB = 64
"""Default MiB a pod's processes may hold beyond its grant and one CUDA context."""


class Kind(enum.StrEnum):
    MEMORY = "memory"
    CLIENTS = "clients"


@dataclass(frozen=True, slots=True)
class Finding:
    """One pod over its grant on one GPU, in one way."""

    uid: str
    namespace: str
    name: str
    index: int
    uuid: str
    kind: Kind
    processes: int
    used_bytes: int | None
    granted_bytes: int
    """The grant's memory (its ask) on that GPU; 0 for a share that asked none."""
    allowed_bytes: int
    """`Kind.MEMORY`: what the pod may hold before it is caught (the grant, one CUDA
    context and the tolerance); 0 for `Kind.CLIENTS` (one client is allowed)."""
    message: str

    @property
    def key(self) -> tuple[str, str, Kind]:
        """The same catch in two samples has the same key."""
        return (self.uid, self.uuid, self.kind)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def find(
    sample: Sample,
    contexts: Mapping[str, ClientContext],
    *,
    tolerance_mib: int = TOLERANCE_MIB,
) -> list[Finding]:
    """Every pod over its grant in `sample`, by GPU then kind; `contexts`: GPU UUID → its
    MPS client context as the agent publishes it (a GPU missing there counts with
    `mps_limits.UNMEASURED`'s, the largest). O(pods × GPUs)."""
    found: list[Finding] = []
    for use in sample.pods:
        milli = use.milli_granted
        if milli is None or milli >= WHOLE or use.processes is None:
            continue
        context = contexts.get(use.uuid, mps_limits.UNMEASURED.context)
        found.extend(_memory(use, milli, context, tolerance_mib))
        found.extend(_clients(use, milli, context))
    return found


def _ask_mib(use: PodUse) -> int:
    return (use.memory_granted or 0) // MIB


def _where(use: PodUse) -> str:
    return f"GPU {use.index} ({use.uuid})"


def _memory(
    use: PodUse, milli: int, context: ClientContext, tolerance_mib: int
) -> Sequence[Finding]:
    ask = _ask_mib(use)
    if not ask or use.memory_used is None:
        return ()
    limit = mps_limits.memory_limit_mib(milli, ask, context)
    allowed = (limit + tolerance_mib) * MIB
    if use.memory_used <= allowed:
        return ()
    processes = use.processes or 0
    held = use.memory_used // MIB
    message = (
        f"{processes} process{'es' if processes != 1 else ''} of this pod hold {held} MiB of "
        f"{_where(use)}: more than its grant of {ask} MiB with one CUDA context ({limit} MiB, "
        f"the limit of each of its MPS clients) and the {tolerance_mib} MiB tolerance; MPS "
        "caps each process, not the pod, so the GPU's other shares may run out of memory"
    )
    return (_finding(use, Kind.MEMORY, ask * MIB, allowed, message),)


def _clients(use: PodUse, milli: int, context: ClientContext) -> Sequence[Finding]:
    processes = use.processes or 0
    if processes <= 1:
        return ()
    ask = _ask_mib(use)
    limits = f"{mps_limits.thread_percentage(milli)} % of the SMs"
    if ask:
        limits += f" and {mps_limits.memory_limit_mib(milli, ask, context)} MiB"
    message = (
        f"{processes} MPS clients of this pod on {_where(use)}: each gets the share's limits "
        f"of its own ({limits}), so together they may use {processes} times its grant; "
        "compute cannot be read per pod under MPS (the driver charges the SM samples to the "
        "MPS server), so its clients are counted instead"
    )
    return (_finding(use, Kind.CLIENTS, ask * MIB, 0, message),)


def _finding(use: PodUse, kind: Kind, granted: int, allowed: int, message: str) -> Finding:
    return Finding(
        uid=use.uid,
        namespace=use.namespace,
        name=use.name,
        index=use.index,
        uuid=use.uuid,
        kind=kind,
        processes=use.processes or 0,
        used_bytes=use.memory_used,
        granted_bytes=granted,
        allowed_bytes=allowed,
        message=message,
    )
