"""Capacity holds for a starving gang or queued workload: nodes other pods are kept off
while it waits.

The anti-starvation rule (docs/gangs.md): when the gang at the head of the queue
(highest priority, then oldest) has been complete but unplaceable for
`starve_after_seconds`, and its timeout has not passed, the controller *fences* the
nodes that would hold it once drained (`gpuplace.placement.gangs.fence`); a gang that
preempts fences the nodes of its eviction plan the same way (`gpuplace.gangs.evicting`).
A fence holds no GPU: nothing is reserved and pods already there keep running. It only
keeps *new* placements off those nodes, so they drain towards the gang:

- the extender's filter fails a fenced node for every pod that is not a member of
  the fenced gang (`Fences.blocks`; a resolvable failure: the node is fine, just held);
- the gang controller (`gpuplace.gangs`) does not plan other gangs onto fenced nodes.

At most one gang is fenced at a time (so two fences can never deadlock), and the
fence is lifted when the gang starts, times out, or another gang becomes the head.

The queue controller holds the same one fence for a starving queued workload
(`gpuplace.placement.queueing.holds`, `kind` `QUEUED`) while no gang holds it; a gang that
starves takes it over (the gang controller replaces a queue's fence, never the
reverse), and each controller lifts only a fence of its own kind.

Synchronous and tiny: `blocks` is O(1) and is meant to be called from the filter verb.
Pure, like the rest of the engine: the gang controller writes the fence, the extender's
filter reads it, and neither knows the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuplace.placement.gangs import GangKey

GANG = "gang"
QUEUED = "queued workload"


@dataclass(frozen=True, slots=True)
class Fence:
    owner: GangKey
    """(namespace, name) of the gang, or of the queued workload (its pod or gang)."""
    nodes: frozenset[str]
    members: frozenset[str]
    """UIDs of the gang's members (never blocked)."""
    since: float
    """POSIX seconds the gang has been waiting since."""
    kind: str = GANG
    """`GANG` (the gang controller's) or `QUEUED` (the queue controller's)."""


class Fences:
    """The current fence, if any; see the module docstring."""

    __slots__ = ("current", "version")

    def __init__(self) -> None:
        self.current: Fence | None = None
        self.version = 0
        """Grows whenever the fence changes (plans made against one fence stay valid)."""

    @property
    def nodes(self) -> frozenset[str]:
        return self.current.nodes if self.current is not None else frozenset()

    @property
    def owner(self) -> GangKey | None:
        """The gang the fence holds for (None without a fence or for a queue's)."""
        fence = self.current
        return fence.owner if fence is not None and fence.kind == GANG else None

    def hold(self, fence: Fence) -> None:
        if fence != self.current:
            self.current = fence
            self.version += 1

    def release(self) -> Fence | None:
        released, self.current = self.current, None
        if released is not None:
            self.version += 1
        return released

    def blocks(self, pod_uid: str, node: str) -> str | None:
        """Why `node` is not offered to pod `pod_uid` (None: it may be). O(1)."""
        fence = self.current
        if fence is None or node not in fence.nodes or pod_uid in fence.members:
            return None
        namespace, name = fence.owner
        return f"gpuplace: node held for {fence.kind} {namespace}/{name}, which waits for room"
