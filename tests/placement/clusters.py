"""Hand-built clusters and requests shared by the placement tests."""

from __future__ import annotations

from gpuplace.placement.inventory import Gpu, Inventory, Node
from gpuplace.placement.ledger import Grant, Ledger, LedgerError
from gpuplace.placement.requests import GpuRequest, Topology


def node(
    name: str,
    gpus: int,
    *,
    model: str = "A100",
    memory: int = 40_960,
    cpu: int = 64_000,
    ram: int = 262_144,
    nvlink: tuple[int, ...] | None = None,
    labels: dict[str, str] | None = None,
) -> Node:
    domains = nvlink if nvlink is not None else (-1,) * gpus
    return Node(
        name=name,
        cpu_milli=cpu,
        memory_mib=ram,
        gpus=tuple(
            Gpu(index=i, model=model, memory_mib=memory, uuid=f"GPU-{name}-{i}", nvlink=domains[i])
            for i in range(gpus)
        ),
        labels=dict(labels or {}),
    )


def ledger(*nodes: Node) -> Ledger:
    return Ledger(Inventory(nodes))


def share(milli: int, memory: int = 0, cpu: int = 1000, ram: int = 1024) -> GpuRequest:
    return GpuRequest(milli=milli, memory_mib=memory, count=1, cpu_milli=cpu, host_memory_mib=ram)


def whole(
    count: int, *, topology: Topology = Topology.ANY, models: frozenset[str] = frozenset()
) -> GpuRequest:
    return GpuRequest(
        milli=1000,
        count=count,
        topology=topology,
        models=models,
        cpu_milli=1000,
        host_memory_mib=1024,
    )


def room_for(ledger: Ledger, grant: Grant) -> bool:
    """Whether `ledger` takes `grant` now (left as it was)."""
    try:
        ledger.reserve(grant)
    except LedgerError:
        return False
    ledger.release(grant.pod_uid)
    return True
