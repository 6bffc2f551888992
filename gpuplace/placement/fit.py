"""Whether a request fits a node, why not, and which GPU sets it could take there.

A request never spans GPUs unless it asks for several whole ones. A closed node (its
node agent silent) and an unhealthy GPU take no new grant: their `NodeState` offers
nothing (`gpuplace.placement.ledger`), and the misfit names the cause. A misfit says
why in words a person reads ("gpu 3: 40% free, needs 50%") and whether any future
change of the node's load could help (`resolvable`): a wrong model or too few GPUs
never will, and the scheduler should not try to preempt for them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from gpuplace.placement.inventory import NO_NVLINK
from gpuplace.placement.ledger import NodeState
from gpuplace.placement.requests import WHOLE, GpuRequest, Topology


class MisfitKind(enum.Enum):
    """Reason kinds, phrased for the one-line summary of an Event ("3 wrong model")."""

    WRONG_MODEL = "wrong GPU model"
    TOO_FEW_GPUS = "too few GPUs"
    GPU_TOO_SMALL = "GPU memory too small"
    NO_NVLINK_DOMAIN = "no NVLink domain large enough"
    CPU = "not enough CPU"
    MEMORY = "not enough memory"
    PODS = "no pod slot left"
    GPU_SHARE = "no GPU with enough share free"
    GPU_MEMORY = "no GPU with enough memory free"
    MEMORY_ONLY_BUSY = "no GPU free of compute shares"
    WHOLE_GPUS = "not enough whole GPUs free"
    NVLINK_BUSY = "no NVLink domain with enough GPUs free"
    UNKNOWN_NODE = "node not managed by gpuplace"
    AGENT_SILENT = "node agent silent"
    GPU_UNHEALTHY = "too few healthy GPUs"


UNRESOLVABLE = frozenset(
    {
        MisfitKind.WRONG_MODEL,
        MisfitKind.TOO_FEW_GPUS,
        MisfitKind.GPU_TOO_SMALL,
        MisfitKind.NO_NVLINK_DOMAIN,
        MisfitKind.UNKNOWN_NODE,
        MisfitKind.AGENT_SILENT,
        MisfitKind.GPU_UNHEALTHY,
    }
)


@dataclass(frozen=True, slots=True)
class Misfit:
    kind: MisfitKind
    message: str
    resolvable: bool = field(init=False, compare=False, repr=False)
    """False when no change of load on the node could ever make the request fit."""
    summary: str = field(init=False, compare=False, repr=False)
    """The kind's phrase (`kind.value`)."""

    def __post_init__(self) -> None:
        # Read per failed node on every filter (10,000 nodes): plain slots, not an enum
        # lookup and a set test each time.
        object.__setattr__(self, "resolvable", self.kind not in UNRESOLVABLE)
        object.__setattr__(self, "summary", self.kind.value)


def _allowed(state: NodeState, request: GpuRequest) -> list[int]:
    return [gpu.index for gpu in state.node.gpus if request.allows(gpu.model)]


def static_misfit(state: NodeState, request: GpuRequest) -> Misfit | None:
    """Why the node could never hold the request, whatever its load. O(GPUs)."""
    if request.count == 0:
        return None
    node = state.node
    if node.closed:
        return Misfit(MisfitKind.AGENT_SILENT, node.closed)
    allowed = _allowed(state, request)
    if not allowed:
        have = node.model or "none"
        want = ", ".join(sorted(request.models))
        return Misfit(MisfitKind.WRONG_MODEL, f"GPU model {have}, needs one of {want}")
    if len(allowed) < request.count:
        return Misfit(
            MisfitKind.TOO_FEW_GPUS,
            f"{len(allowed)} suitable GPUs, needs {request.count}",
        )
    sick = [i for i in allowed if not node.gpus[i].healthy]
    if len(allowed) - len(sick) < request.count:
        return Misfit(
            MisfitKind.GPU_UNHEALTHY,
            f"{len(allowed) - len(sick)} healthy suitable GPUs, needs {request.count} "
            f"(unhealthy: gpu {', '.join(map(str, sick))})",
        )
    if request.memory_mib:
        roomy = [i for i in allowed if node.gpus[i].memory_mib >= _need(state, i, request)]
        if len(roomy) < request.count:
            largest = max(allowed, key=lambda i: node.gpus[i].memory_mib)
            return Misfit(
                MisfitKind.GPU_TOO_SMALL,
                f"GPUs have {node.gpus[largest].memory_mib} MiB, needs "
                f"{_need_text(state, largest, request)}",
            )
    if request.count > 1 and request.topology is Topology.REQUIRED:
        largest_domain = _largest_domain(state, allowed, free_only=False)
        if largest_domain < request.count:
            return Misfit(
                MisfitKind.NO_NVLINK_DOMAIN,
                f"largest NVLink domain has {largest_domain} GPUs, needs {request.count}",
            )
    return None


def _need(state: NodeState, index: int, request: GpuRequest) -> int:
    """The MiB `request` takes of GPU `index`: its ask, plus its CUDA context for a share
    (`inventory.Gpu.takes`). O(1)."""
    return state.memory_taken(index, request.milli, request.memory_mib)


def _need_text(state: NodeState, index: int, request: GpuRequest) -> str:
    """'2317 MiB (2048 asked + 269 for its CUDA context under MPS)', or '2048 MiB'."""
    need = _need(state, index, request)
    if need == request.memory_mib:
        return f"{need} MiB"
    return (
        f"{need} MiB ({request.memory_mib} asked + {need - request.memory_mib} for its CUDA "
        "context under MPS)"
    )


def _largest_domain(state: NodeState, allowed: list[int], *, free_only: bool) -> int:
    sizes: dict[int, int] = {}
    for index in allowed:
        gpu = state.node.gpus[index]
        if gpu.nvlink == NO_NVLINK:
            continue
        if free_only and state.free_milli[index] != WHOLE:
            continue
        sizes[gpu.nvlink] = sizes.get(gpu.nvlink, 0) + 1
    return max(sizes.values(), default=1 if allowed else 0)


def host_misfit(state: NodeState, request: GpuRequest) -> Misfit | None:
    """CPU, memory and pod slots. O(1)."""
    if state.pods < 1:
        return Misfit(MisfitKind.PODS, "no pod slot left")
    if request.cpu_milli > state.cpu:
        return Misfit(
            MisfitKind.CPU,
            f"{max(state.cpu, 0)}m CPU free, needs {request.cpu_milli}m",
        )
    if request.host_memory_mib > state.memory:
        return Misfit(
            MisfitKind.MEMORY,
            f"{max(state.memory, 0)} MiB memory free, needs {request.host_memory_mib} MiB",
        )
    return None


def gpu_sets(state: NodeState, request: GpuRequest) -> list[tuple[int, ...]]:
    """Distinct candidate GPU sets for the request on this node, best topology first.

    Sharing requests: one candidate per distinct (free share, free memory, CUDA context)
    class of GPUs, the lowest index of each (GPUs in one class are interchangeable); a
    share's memory counts with its CUDA context (`inventory.Gpu.takes`).
    Memory-only shares: the GPUs already holding memory-only shares with room, the
    least free memory first (binpacking by memory); only when none has room, one empty
    GPU per class (`_memory_only_sets`).
    Whole GPUs: per NVLink domain that can hold all of them, the domain with the
    fewest free GPUs first (keeps large domains whole); then, unless the domain is
    required, the free GPUs with the fewest domains broken. O(GPUs log GPUs).
    """
    if request.count == 0:
        return [()]
    node = state.node
    free_milli = state.free_milli
    free_memory = state.free_memory
    if request.milli == 0:
        return _memory_only_sets(state, request)
    if request.milli < WHOLE:
        seen: set[tuple[int, int, object]] = set()
        sets: list[tuple[int, ...]] = []
        for gpu in node.gpus:
            i = gpu.index
            if free_milli[i] < request.milli:
                continue
            if free_memory[i] < gpu.takes(request.milli, request.memory_mib):
                continue
            if not request.allows(gpu.model):
                continue
            key = (free_milli[i], free_memory[i], gpu.context)
            if key not in seen:
                seen.add(key)
                sets.append((i,))
        return sets
    free = [
        gpu.index
        for gpu in node.gpus
        if free_milli[gpu.index] == WHOLE
        and request.allows(gpu.model)
        and gpu.memory_mib >= request.memory_mib
    ]
    if len(free) < request.count:
        return []
    if request.count == 1:
        return [(free[0],)]
    by_domain: dict[int, list[int]] = {}
    loose: list[int] = []
    for index in free:
        domain = node.gpus[index].nvlink
        if domain == NO_NVLINK:
            loose.append(index)
        else:
            by_domain.setdefault(domain, []).append(index)
    sets = [
        tuple(members[: request.count])
        for members in sorted(by_domain.values(), key=lambda m: (len(m), m[0]))
        if len(members) >= request.count
    ]
    if request.topology is not Topology.REQUIRED:
        # Span as few domains as possible: largest free domains first, then loose GPUs.
        ordered = [i for m in sorted(by_domain.values(), key=lambda m: -len(m)) for i in m]
        spanning = tuple(sorted((ordered + loose)[: request.count]))
        if spanning not in sets:
            sets.append(spanning)
    return sets


def _memory_only_sets(state: NodeState, request: GpuRequest) -> list[tuple[int, ...]]:
    """A memory-only share's candidates: see `gpu_sets`. O(GPUs log GPUs)."""
    joining: list[tuple[int, int]] = []
    opening: list[int] = []
    seen: set[tuple[int, str, bool]] = set()
    for gpu in state.node.gpus:
        i = gpu.index
        if state.free_memory[i] < gpu.takes(0, request.memory_mib):
            continue
        if not request.allows(gpu.model):
            continue
        if not state.open_to_memory_only(i):
            continue
        key = (state.free_memory[i], gpu.model, state.memory_only[i] > 0)
        if key in seen:
            continue
        seen.add(key)
        if state.memory_only[i]:
            joining.append((state.free_memory[i], i))
        elif not joining:
            opening.append(i)
    if joining:
        joining.sort()
        return [(i,) for _, i in joining]
    return [(i,) for i in opening]


def _memory_only_misfit(state: NodeState, allowed: list[int], request: GpuRequest) -> Misfit:
    open_ = [i for i in allowed if state.open_to_memory_only(i)]
    if not open_:
        return Misfit(
            MisfitKind.MEMORY_ONLY_BUSY,
            f"every GPU holds compute shares or a whole-GPU grant; a memory-only share "
            f"({request.memory_mib} MiB) only joins GPUs without them",
        )
    return _memory_misfit(state, open_, request)


def _memory_misfit(state: NodeState, gpus: list[int], request: GpuRequest) -> Misfit:
    """'gpu 2: 4096 MiB free, needs 8192 MiB', for the roomiest of `gpus`."""
    roomy = max(gpus, key=lambda i: state.free_memory[i])
    return Misfit(
        MisfitKind.GPU_MEMORY,
        f"gpu {roomy}: {max(state.free_memory[roomy], 0)} MiB free, needs "
        f"{_need_text(state, roomy, request)}",
    )


def dynamic_misfit(state: NodeState, request: GpuRequest) -> Misfit:
    """Why a statically possible request finds no GPU set now; names the unhealthy GPUs
    that would otherwise be candidates. O(GPUs)."""
    found = _dynamic_misfit(state, request)
    sick = [gpu.index for gpu in state.node.gpus if not gpu.healthy and request.allows(gpu.model)]
    if not sick:
        return found
    return Misfit(found.kind, f"{found.message} (unhealthy: gpu {', '.join(map(str, sick))})")


def _dynamic_misfit(state: NodeState, request: GpuRequest) -> Misfit:
    allowed = _allowed(state, request)
    free_milli = state.free_milli
    if request.milli == 0:
        return _memory_only_misfit(state, allowed, request)
    if request.milli < WHOLE:
        best = max(allowed, key=lambda i: (free_milli[i], state.free_memory[i]))
        if free_milli[best] < request.milli:
            return Misfit(
                MisfitKind.GPU_SHARE,
                f"gpu {best}: {max(free_milli[best], 0) / 10:g}% free, "
                f"needs {request.milli / 10:g}%",
            )
        return _memory_misfit(state, allowed, request)
    whole = sum(1 for i in allowed if free_milli[i] == WHOLE)
    if whole < request.count:
        return Misfit(MisfitKind.WHOLE_GPUS, f"{whole} whole GPUs free, needs {request.count}")
    domain = _largest_domain(state, allowed, free_only=True)
    return Misfit(
        MisfitKind.NVLINK_BUSY,
        f"largest NVLink domain has {domain} GPUs free, needs {request.count}",
    )


def misfit(state: NodeState, request: GpuRequest) -> Misfit | None:
    """The first reason the request cannot go on this node now, or None. O(GPUs)."""
    reason = static_misfit(state, request) or host_misfit(state, request)
    if reason is not None:
        return reason
    if request.count and not gpu_sets(state, request):
        return dynamic_misfit(state, request)
    return None
