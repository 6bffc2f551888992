"""Who holds which share of which GPU, and what every node has left.

Grants are keyed by pod UID. A grant is first *reserved* (capacity taken, pod not
yet bound: a bind in flight or a gang being planned) and then *confirmed* (the pod
is bound). Reserving the same UID again with the same grant is a no-op, so a grant
is never counted twice; reserving it with a different grant is refused.

The ledger keeps, per node, the free milli-GPU and free memory of every GPU and
the free CPU, memory and pod slots, so that a fit check never sums grants. A share's
memory counts with its MPS client's CUDA context (`inventory.Gpu.takes`).

Memory-only shares (`Grant.milli == 0`) reserve memory and no compute, and keep
their GPU to themselves: the first one on a GPU takes all of its free compute
(`free_milli` drops by a whole GPU, so no compute share and no whole GPU fits
there), the last one to leave gives it back; `NodeState.memory_only` counts them. Every
change sets the node's `version` from a ledger-wide clock (never reused, even
for a node removed and added again), which caches key on.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from gpuplace.placement.inventory import Inventory, Node
from gpuplace.placement.requests import WHOLE


class GrantState(enum.Enum):
    RESERVED = "reserved"
    CONFIRMED = "confirmed"


@dataclass(frozen=True, slots=True)
class Grant:
    """A pod's hold on `gpus` of `node`: `milli` and `memory_mib` on each of them."""

    pod_uid: str
    node: str
    gpus: tuple[int, ...]
    milli: int
    memory_mib: int
    cpu_milli: int = 0
    host_memory_mib: int = 0
    state: GrantState = GrantState.RESERVED

    @property
    def memory_only(self) -> bool:
        """True for a memory-only share: memory on one GPU, no compute reserved."""
        return self.milli == 0 and bool(self.gpus)

    def same_hold(self, other: Grant) -> bool:
        """True when both grants hold exactly the same resources (state aside)."""
        return replace(self, state=other.state) == other


class LedgerError(Exception):
    """A grant the ledger refuses; the message says why, for a person."""


class Oversubscribed(LedgerError):
    pass


class Conflict(LedgerError):
    pass


class NodeState:
    """What one node has left. Mutated only by the ledger (and scratch copies of it).

    `free_milli[i]` is the compute of GPU i still open to compute shares and whole GPUs:
    a GPU that holds memory-only shares has none left (see the module docstring);
    `memory_only[i]` counts the memory-only shares on it.
    """

    __slots__ = (
        "cpu",
        "free_memory",
        "free_milli",
        "memory",
        "memory_only",
        "node",
        "pods",
        "version",
    )

    def __init__(self, node: Node) -> None:
        self.node = node
        # A closed node or an unhealthy GPU offers nothing to new grants: every rule that
        # reads the free state (fit, scoring, gangs, metrics) then leaves it alone, and
        # the grants already on it still count against it.
        offered = [gpu.healthy and not node.closed for gpu in node.gpus]
        self.free_milli = [WHOLE if open_ else 0 for open_ in offered]
        self.free_memory = [
            gpu.memory_mib if open_ else 0 for gpu, open_ in zip(node.gpus, offered, strict=True)
        ]
        self.memory_only = [0] * len(node.gpus)
        self.cpu = node.cpu_milli
        self.memory = node.memory_mib
        self.pods = node.max_pods
        self.version = 0

    def copy(self) -> NodeState:
        """An independent copy (same version), for plans that try placements. O(GPUs)."""
        copy = NodeState(self.node)
        copy.free_milli = list(self.free_milli)
        copy.free_memory = list(self.free_memory)
        copy.memory_only = list(self.memory_only)
        copy.cpu = self.cpu
        copy.memory = self.memory
        copy.pods = self.pods
        copy.version = self.version
        return copy

    def signature(self) -> tuple[object, ...]:
        """The node's type and free state: two nodes with equal signatures score alike. O(GPUs)."""
        return (
            self.node.model,
            self.node.closed,
            tuple(gpu.healthy for gpu in self.node.gpus),
            frozenset(gpu.context for gpu in self.node.gpus),
            self.cpu,
            self.memory,
            tuple(
                sorted(
                    zip(
                        self.free_milli,
                        self.free_memory,
                        [held > 0 for held in self.memory_only],
                        strict=True,
                    )
                )
            ),
        )

    def milli_taken(self, index: int, milli: int) -> int:
        """How much `free_milli[index]` drops when a grant of `milli` joins GPU `index`:
        `milli`, or for a memory-only share (0) the whole GPU's compute when it is the
        first memory-only share there, else nothing. O(1)."""
        if milli:
            return milli
        return 0 if self.memory_only[index] else WHOLE

    def open_to_memory_only(self, index: int) -> bool:
        """True when GPU `index` holds nothing but memory-only shares (or nothing): no
        compute share, no whole GPU. O(1)."""
        pooled = WHOLE if self.memory_only[index] else 0
        return self.free_milli[index] + pooled == WHOLE

    def hold(self, gpus: Iterable[int], milli: int, memory_mib: int, sign: int) -> None:
        """Take (`sign` -1) or give back (+1) `milli` and the memory a grant of `memory_mib`
        takes (`Gpu.takes`: a share's CUDA context included) on each of `gpus`; GPU
        resources only (the caller counts CPU, memory and pods). O(GPUs of the hold)."""
        for index in gpus:
            if milli:
                self.free_milli[index] += sign * milli
            else:
                held = self.memory_only[index]
                self.memory_only[index] = held - sign
                if (held == 0 and sign < 0) or (held == 1 and sign > 0):
                    self.free_milli[index] += sign * WHOLE
            self.free_memory[index] += sign * self.node.gpus[index].takes(milli, memory_mib)

    def memory_taken(self, index: int, milli: int, memory_mib: int) -> int:
        """What a grant of `milli` and `memory_mib` takes of GPU `index`'s memory (its ask,
        plus its CUDA context for a share: `Gpu.takes`). O(1)."""
        return self.node.gpus[index].takes(milli, memory_mib)

    def free_whole(self) -> int:
        """GPUs nobody holds any share of. O(GPUs)."""
        return sum(1 for milli in self.free_milli if milli == WHOLE)

    def free_total(self) -> int:
        """Free milli-GPU over all GPUs of the node. O(GPUs)."""
        return sum(milli for milli in self.free_milli if milli > 0)


class Ledger:
    """Grants by pod UID over an inventory, with per-node free state."""

    __slots__ = (
        "_base",
        "_changes",
        "_clock",
        "_epoch",
        "_grants",
        "_states",
        "inventory",
        "relabelled",
    )

    CHANGE_LOG_LIMIT = 1 << 16
    """Changes the log holds at most; when full it drops its older half, so a reader
    that looks at least every `CHANGE_LOG_LIMIT // 2` changes never has to start over."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self._grants: dict[str, Grant] = {}
        self._clock = 0
        self.relabelled = 0
        """Grows on every `relabel`: what reads nodes' labels (node affinity, topology
        domains) compares it beside `generation`."""
        self._epoch = 0
        self._base = 0
        """Position (since the epoch began) of the log's first entry."""
        self._changes: list[str] = []
        self._states: dict[str, NodeState] = {}
        for node in inventory:
            self._states[node.name] = self._new_state(node)

    def _new_state(self, node: Node) -> NodeState:
        state = NodeState(node)
        self._clock += 1
        state.version = self._clock
        self._changed(node.name)
        return state

    def _changed(self, name: str) -> None:
        """Log a change of `name`. O(1) amortised: a full log drops its older half
        (O(`CHANGE_LOG_LIMIT`) every `CHANGE_LOG_LIMIT // 2` changes)."""
        if len(self._changes) >= self.CHANGE_LOG_LIMIT:
            dropped = self.CHANGE_LOG_LIMIT // 2
            del self._changes[:dropped]
            self._base += dropped
        self._changes.append(name)

    def changes(self, epoch: int, cursor: int) -> tuple[int, int, list[str] | None]:
        """Names of nodes changed since (`epoch`, `cursor`), and the new position.

        None instead of names when those changes are no longer all in the log (the
        reader is more than `CHANGE_LOG_LIMIT // 2` changes behind, or the ledger was
        restored): the caller must look at every node again. O(changes).

        Dropping only the older half matters at scale: readers (a kept evaluation per
        request shape, each worth a pass over every node) that keep up never start
        over, where emptying the whole log would send them all back to the start at once.
        """
        end = self._base + len(self._changes)
        if epoch != self._epoch or cursor < self._base:
            return self._epoch, end, None
        return epoch, end, self._changes[cursor - self._base :]

    @property
    def generation(self) -> int:
        """Grows on every change of any node: equal generations mean nothing changed."""
        return self._clock

    # --- reading -----------------------------------------------------------

    def state(self, node: str) -> NodeState | None:
        return self._states.get(node)

    def states(self) -> Iterable[NodeState]:
        return self._states.values()

    def get(self, pod_uid: str) -> Grant | None:
        return self._grants.get(pod_uid)

    def __contains__(self, pod_uid: object) -> bool:
        return pod_uid in self._grants

    def __iter__(self) -> Iterator[Grant]:
        return iter(self._grants.values())

    def __len__(self) -> int:
        return len(self._grants)

    def grants_on(self, node: str) -> list[Grant]:
        """Grants on one node. O(grants): for explanations, never for decisions."""
        return [grant for grant in self._grants.values() if grant.node == node]

    def overcommitted(self, grant: Grant) -> tuple[int, ...]:
        """GPUs of `grant` (a grant in this ledger) whose share or memory is granted beyond
        what they have: a preemptor's hold while its victims still run. O(GPUs of it)."""
        state = self._states.get(grant.node)
        if state is None:
            return ()
        return tuple(
            index
            for index in grant.gpus
            if 0 <= index < len(state.free_milli)
            and (state.free_milli[index] < 0 or state.free_memory[index] < 0)
        )

    def allocated_milli(self) -> int:
        """milli-GPU held over the whole cluster. O(grants)."""
        return sum(grant.milli * len(grant.gpus) for grant in self._grants.values())

    # --- changing ----------------------------------------------------------

    def reserve(self, grant: Grant, *, overcommit: bool = False) -> bool:
        """Take `grant`'s resources for its pod. O(GPUs of the grant).

        Returns False when the pod already holds exactly this grant (nothing
        changes), True when it was taken. Raises `Conflict` when the pod holds a
        different grant and `Oversubscribed` when the node cannot hold it, unless
        `overcommit` (used when the API already says the pod runs there: the
        ledger must record reality, and the node then fits nothing more; a grant
        naming a GPU the node no longer publishes is then recorded and taken from
        no state, as `put_node` keeps such grants).
        """
        held = self._grants.get(grant.pod_uid)
        if held is not None:
            if held.same_hold(grant):
                if grant.state is GrantState.CONFIRMED and held.state is GrantState.RESERVED:
                    self._grants[grant.pod_uid] = grant
                return False
            raise Conflict(
                f"pod {grant.pod_uid} already holds GPUs {list(held.gpus)} on {held.node}"
            )
        state = self._states.get(grant.node)
        if state is None:
            if not overcommit:
                raise LedgerError(f"unknown node {grant.node}")
        elif overcommit and not _on(state.node, grant):
            # reality names a GPU the node no longer publishes (republished with fewer): the
            # grant is recorded and taken from no state, as put_node keeps it, and counts
            # again if the GPU returns; a relist must not fail on it
            pass
        else:
            self._check(state, grant, overcommit)
            self._apply(state, grant, -1)
        self._grants[grant.pod_uid] = grant
        return True

    def confirm(self, pod_uid: str) -> Grant:
        """Mark a reserved grant as bound. O(1). Raises KeyError when absent."""
        grant = self._grants[pod_uid]
        if grant.state is not GrantState.CONFIRMED:
            grant = replace(grant, state=GrantState.CONFIRMED)
            self._grants[pod_uid] = grant
        return grant

    def release(self, pod_uid: str) -> Grant | None:
        """Give a pod's resources back; None when it held nothing. O(GPUs of the grant)."""
        grant = self._grants.pop(pod_uid, None)
        if grant is not None:
            state = self._states.get(grant.node)
            if state is not None and _on(state.node, grant):
                self._apply(state, grant, +1)
        return grant

    def put_node(self, node: Node) -> None:
        """Add or replace a node, keeping the grants already on it. O(grants)."""
        self.inventory.put(node)
        state = self._new_state(node)
        self._states[node.name] = state
        for grant in self._grants.values():
            if grant.node == node.name and _on(node, grant):
                self._apply(state, grant, -1)

    def relabel(self, node: Node) -> None:
        """Replace a node by one that differs only in its labels (`Node`'s equality leaves
        them out): the free state, its version and `generation` stay, for nothing the
        ledger counts changed; `relabelled` grows. O(GPUs of the node)."""
        state = self._states.get(node.name)
        if state is None or state.node != node:
            raise LedgerError(f"node {node.name}: relabel changes more than its labels")
        self.inventory.put(node)
        state.node = node
        self.relabelled += 1

    def remove_node(self, name: str) -> None:
        """Forget a node; grants on it stay recorded until their pods go. O(1)."""
        self.inventory.remove(name)
        self._states.pop(name, None)
        self._clock += 1
        self._changed(name)

    def snapshot(self) -> tuple[Grant, ...]:
        """Every grant, sorted by pod UID: equal snapshots mean equal ledgers. O(g log g)."""
        return tuple(sorted(self._grants.values(), key=lambda grant: grant.pod_uid))

    def restore(self, grants: Iterable[Grant]) -> None:
        """Replace all grants by `grants` (overcommitting where reality did). O(g)."""
        self._grants.clear()
        self._changes.clear()
        self._base = 0
        self._epoch += 1
        self._states = {node.name: self._new_state(node) for node in self.inventory}
        for grant in grants:
            self.reserve(grant, overcommit=True)

    # --- internals ---------------------------------------------------------

    @staticmethod
    def _check(state: NodeState, grant: Grant, overcommit: bool) -> None:
        node = state.node
        if len(set(grant.gpus)) != len(grant.gpus):
            raise LedgerError(f"grant for {grant.pod_uid} names a GPU twice: {list(grant.gpus)}")
        for index in grant.gpus:
            if not 0 <= index < len(node.gpus):
                raise LedgerError(f"node {node.name} has no GPU {index}")
        if grant.milli == 0 and grant.gpus and (len(grant.gpus) != 1 or grant.memory_mib <= 0):
            raise LedgerError(
                f"grant for {grant.pod_uid}: a memory-only share holds memory on one GPU"
            )
        if overcommit:
            return
        if grant.cpu_milli > state.cpu or grant.host_memory_mib > state.memory or state.pods < 1:
            raise Oversubscribed(f"node {node.name} lacks CPU, memory or pod slots")
        for index in grant.gpus:
            if grant.milli == 0 and not state.open_to_memory_only(index):
                raise Oversubscribed(
                    f"gpu {index} of {node.name} holds compute shares or a whole-GPU grant: "
                    "a memory-only share never joins those"
                )
            if grant.milli > state.free_milli[index]:
                raise Oversubscribed(
                    f"gpu {index} of {node.name}: {state.free_milli[index] / 10:g}% free, "
                    f"needs {grant.milli / 10:g}%"
                )
            taken = state.memory_taken(index, grant.milli, grant.memory_mib)
            if taken > state.free_memory[index]:
                raise Oversubscribed(
                    f"gpu {index} of {node.name}: {state.free_memory[index]} MiB free, "
                    f"needs {taken} MiB"
                )

    def _apply(self, state: NodeState, grant: Grant, sign: int) -> None:
        state.hold(grant.gpus, grant.milli, grant.memory_mib, sign)
        state.cpu += sign * grant.cpu_milli
        state.memory += sign * grant.host_memory_mib
        state.pods += sign
        self._clock += 1
        state.version = self._clock
        self._changed(state.node.name)


def _on(node: Node, grant: Grant) -> bool:
    """Whether `node` has every GPU `grant` names: only then is the grant taken from
    its state (a node republished with fewer GPUs keeps the grants recorded on the
    others, and gets them back if the GPUs return). O(GPUs of the grant)."""
    return all(index < len(node.gpus) for index in grant.gpus)
