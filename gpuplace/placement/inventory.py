"""What the cluster has: nodes, their allocatable CPU/memory/pods and their GPUs.

A GPU's `memory_mib` is what the engine packs: the memory a client can get on it (where
its node agent publishes it, NVML's total less the driver's reservation and the MPS
server's own memory; docs/node-agent.md, "What a share can use"). A share with memory
takes its ask *plus* its MPS client's CUDA context (`ClientContext`), which counts
inside the client's limit (`Gpu.takes`): what the limit handed to MPS really takes.

Values only. The inventory never changes under a caller: replacing a node
returns through `Inventory.put`, which keeps the per-model index current.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from gpuplace.placement.requests import WHOLE, thread_percent
from gpuplace.placement.taints import Taint, Toleration, untolerated

NO_NVLINK = -1
"""NVLink domain of a GPU that shares NVLink with no other GPU."""


@dataclass(frozen=True, slots=True)
class ClientContext:
    """GPU memory an MPS client's CUDA context takes inside its memory limit on one GPU
    model: `base_mib` + `per_percent_mib` × the share's thread percentage (the context's
    per-SM reservations grow with the SMs it may use). O(1) to apply."""

    base_mib: int = 0
    per_percent_mib: int = 0

    def __post_init__(self) -> None:
        if self.base_mib < 0 or self.per_percent_mib < 0:
            raise ValueError(f"a CUDA context takes >= 0 MiB, got {self}")

    def mib(self, milli: int) -> int:
        """The context of a share of `milli` (0: memory-only, which MPS runs at 100 %)."""
        return self.base_mib + self.per_percent_mib * thread_percent(milli)

    def takes(self, milli: int, memory_mib: int) -> int:
        """The MiB a grant of `milli` and `memory_mib` takes of a GPU with this context: a
        share with memory (MPS-capped) its ask plus its client's CUDA context, which is
        also the limit handed to MPS (`gpuplace.cluster.mps_limits`); a whole GPU, or a
        share that asked no memory (no limit), its ask alone. O(1)."""
        if memory_mib and milli < WHOLE:
            return memory_mib + self.mib(milli)
        return memory_mib


NO_CONTEXT = ClientContext()
"""A GPU whose shares take their ask alone (hand-written inventories, tests)."""


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU of a node."""

    index: int
    model: str
    memory_mib: int
    uuid: str = ""
    numa: int = 0
    nvlink: int = NO_NVLINK
    healthy: bool = True
    """False: the node agent marked it unhealthy; no new grant goes on it (grants already
    on it stay)."""
    context: ClientContext = NO_CONTEXT
    """What each share's MPS client context takes of `memory_mib` beyond its ask."""

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"GPU index must be >= 0, got {self.index}")
        if self.memory_mib < 0:
            raise ValueError(f"GPU memory must be >= 0 MiB, got {self.memory_mib}")

    def takes(self, milli: int, memory_mib: int) -> int:
        """The MiB a grant of `milli` and `memory_mib` takes of this GPU
        (`ClientContext.takes`). O(1)."""
        return self.context.takes(milli, memory_mib)


@dataclass(frozen=True, slots=True)
class Node:
    """A node as the engine sees it: allocatable resources and its GPUs in index order."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: tuple[Gpu, ...] = ()
    max_pods: int = 110
    labels: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    closed: str = ""
    """Why no new GPU grant goes on this node ("" = open), e.g. its node agent is silent;
    grants already on it stay. Stable while the cause lasts (no clock in it)."""
    taints: tuple[Taint, ...] = ()
    """`spec.taints`: the gang planner keeps members off those they do not tolerate, as
    kube-scheduler does (`gpuplace.placement.taints`)."""
    unschedulable: bool = False
    """`spec.unschedulable` (cordoned): only members tolerating that are planned here."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("node name must not be empty")
        if self.cpu_milli < 0 or self.memory_mib < 0 or self.max_pods < 0:
            raise ValueError(f"node {self.name}: allocatable resources must be >= 0")
        for position, gpu in enumerate(self.gpus):
            if gpu.index != position:
                raise ValueError(
                    f"node {self.name}: GPUs must be listed by index 0..n-1, "
                    f"position {position} holds index {gpu.index}"
                )

    @property
    def model(self) -> str:
        """The node's GPU model ('' without GPUs; the first GPU's on a mixed node)."""
        return self.gpus[0].model if self.gpus else ""

    def admits(self, tolerations: Iterable[Toleration]) -> bool:
        """Whether kube-scheduler would let a pod with `tolerations` on this node: every
        NoSchedule/NoExecute taint tolerated, and the cordon too when cordoned.
        O(taints × tolerations)."""
        if not self.taints and not self.unschedulable:
            return True
        return untolerated(self.taints, tolerations, unschedulable=self.unschedulable) is None

    def nvlink_domains(self) -> dict[int, tuple[int, ...]]:
        """GPU indices per NVLink domain (domain -1, no NVLink, is left out). O(GPUs)."""
        domains: dict[int, list[int]] = {}
        for gpu in self.gpus:
            if gpu.nvlink != NO_NVLINK:
                domains.setdefault(gpu.nvlink, []).append(gpu.index)
        return {domain: tuple(members) for domain, members in domains.items()}


class Inventory:
    """All nodes by name, with an index of node names by GPU model.

    `put` and `remove` are O(1) amortised; lookups by name or model are O(1).
    """

    __slots__ = ("_by_model", "_nodes", "membership")

    def __init__(self, nodes: Iterable[Node] = ()) -> None:
        self._nodes: dict[str, Node] = {}
        self._by_model: dict[str, dict[str, None]] = {}
        self.membership = 0
        """Counts every node added or removed (not replaced): equal counts, same names."""
        for node in nodes:
            self.put(node)

    def put(self, node: Node) -> Node | None:
        """Add or replace a node; returns the node it replaced. O(GPUs of the node)."""
        old = self._nodes.get(node.name)
        if old is not None:
            self._unindex(old)
        else:
            self.membership += 1
        self._nodes[node.name] = node
        for model in {gpu.model for gpu in node.gpus}:
            self._by_model.setdefault(model, {})[node.name] = None
        return old

    def remove(self, name: str) -> Node | None:
        """Forget a node; returns it, or None when unknown. O(GPUs of the node)."""
        old = self._nodes.pop(name, None)
        if old is not None:
            self._unindex(old)
            self.membership += 1
        return old

    def _unindex(self, node: Node) -> None:
        for model in {gpu.model for gpu in node.gpus}:
            names = self._by_model.get(model)
            if names is not None:
                names.pop(node.name, None)
                if not names:
                    del self._by_model[model]

    def get(self, name: str) -> Node | None:
        return self._nodes.get(name)

    def __getitem__(self, name: str) -> Node:
        return self._nodes[name]

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def names(self) -> Iterable[str]:
        return self._nodes.keys()

    def models(self) -> tuple[str, ...]:
        """GPU models present, sorted. O(models)."""
        return tuple(sorted(self._by_model))

    def nodes_with_model(self, model: str) -> Iterable[str]:
        """Names of nodes having at least one GPU of `model`. O(1) to obtain."""
        return self._by_model.get(model, {}).keys()

    def gpu_count(self) -> int:
        """Total GPUs of the cluster. O(nodes)."""
        return sum(len(node.gpus) for node in self._nodes.values())

    def capabilities(self) -> Capabilities:
        """The largest things any node could ever hold, per GPU model. O(GPUs)."""
        per_model: dict[str, ModelCapability] = {}
        for node in self._nodes.values():
            counts: dict[str, int] = {}
            for gpu in node.gpus:
                counts[gpu.model] = counts.get(gpu.model, 0) + 1
            for gpu in node.gpus:
                known = per_model.get(gpu.model)
                count = counts[gpu.model]
                domain = _largest_domain(node, gpu.model)
                if known is None:
                    per_model[gpu.model] = ModelCapability(gpu.memory_mib, count, domain)
                else:
                    per_model[gpu.model] = ModelCapability(
                        max(known.max_memory_mib, gpu.memory_mib),
                        max(known.max_gpus_per_node, count),
                        max(known.max_nvlink_domain, domain),
                    )
        return Capabilities(per_model, tuple(self._nodes.values()))


def _largest_domain(node: Node, model: str) -> int:
    by_domain: dict[int, int] = {}
    for gpu in node.gpus:
        if gpu.model == model and gpu.nvlink != NO_NVLINK:
            by_domain[gpu.nvlink] = by_domain.get(gpu.nvlink, 0) + 1
    return max(by_domain.values(), default=1 if node.gpus else 0)


@dataclass(frozen=True, slots=True)
class ModelCapability:
    """The most one node offers of one GPU model."""

    max_memory_mib: int
    max_gpus_per_node: int
    max_nvlink_domain: int


@dataclass(frozen=True, slots=True)
class Capabilities:
    """Per GPU model, the most any node offers: what admission checks a request against;
    and the nodes themselves, for what no one node says (how much a topology domain of
    nodes could hold: `gpuplace.placement.gangs.domain_room`, kept in `memo`)."""

    per_model: Mapping[str, ModelCapability]
    nodes: tuple[Node, ...] = ()
    memo: dict[object, object] = field(default_factory=dict, compare=False, repr=False)
    """Answers computed from `nodes`, by question (they hold while this object does)."""

    def max_memory_mib(self, models: Iterable[str] = ()) -> int:
        chosen = self._select(models)
        return max((cap.max_memory_mib for cap in chosen), default=0)

    def max_gpus_per_node(self, models: Iterable[str] = ()) -> int:
        chosen = self._select(models)
        return max((cap.max_gpus_per_node for cap in chosen), default=0)

    def _select(self, models: Iterable[str]) -> list[ModelCapability]:
        wanted = set(models)
        if not wanted:
            return list(self.per_model.values())
        return [cap for model, cap in self.per_model.items() if model in wanted]
