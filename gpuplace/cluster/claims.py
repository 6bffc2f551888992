"""ResourceClaims as the sidecar keeps them: what a claim holds of gpuplace's GPUs, in the
ledger's terms (docs/dra.md, "One ledger").

`record(raw)` is the transform of the sidecar's informer of ResourceClaims: the claim's
identity, the Pod that controls it, whether gpuplace made it (label
`gpuplace.io/managed=true`: the claim of a pod the webhook sent to DRA nodes), and its
allocation results of gpuplace's driver (`dra.allocated`: device, consumed compute and
memory). A claim of other drivers only, or not allocated, holds nothing; one whose results
do not read is kept with `problem` saying why, and holds nothing either (it cannot be on a
GPU the kubelet plugin would prepare: the agent refuses the same results).

`grants(record, node)` turns an allocated claim into ledger grants (`Grant`), keyed by
`key`: the UID of its pod for a claim gpuplace made (so that the pod's grant, its explain,
its victim selection and its queue's usage are the claim's), `claim:<UID>` for any other
(a claim a user wrote, shared by pods or not; one kube-scheduler made for an extended
resource; one made from a template) — the capacity is counted once per claim, however
many pods share it. A claim's results on one node with the same consumption make one
grant (N whole GPUs: one grant of N GPUs); results that differ, a GPU named twice, or a
second memory-only share make one grant each (`key/2`, `key/3`, ...); a result that
consumes nothing holds nothing. A result's consumed memory is the whole MPS limit, its CUDA
context inside; the ledger counts a share as its ask plus its GPU's context
(`Gpu.takes`), so the grant's memory is the consumed memory less the context of its GPU
(at least 1 MiB: never less than what the claim holds). A whole GPU's compute (1000) is a
whole GPU, memory 0, as the extender grants it. Admin-access results hold nothing.
CPU and host memory are kube-scheduler's to count for DRA pods: the grants carry none.
Pure: no I/O. O(results) each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import dra, dra_claims, keys
from gpuplace.placement.inventory import Node
from gpuplace.placement.ledger import Grant, GrantState
from gpuplace.placement.requests import WHOLE

PREFIX = "claim:"
"""Ledger keys of claims gpuplace did not make: `claim:<UID>`."""


@dataclass(frozen=True, slots=True)
class Held:
    """What one allocation result holds, in the engine's units."""

    gpu: int
    milli: int
    memory_mib: int
    """Consumed memory: the whole MPS limit, the CUDA context inside."""


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    uid: str
    namespace: str
    name: str
    resource_version: str
    owner: str = ""
    """UID of the Pod that controls it ("" for none)."""
    owner_name: str = ""
    managed: bool = False
    """gpuplace made it for its pod (label `gpuplace.io/managed=true` and a Pod owner)."""
    node: str = ""
    """The node of its results of gpuplace's driver ("" when it holds none)."""
    held: tuple[Held, ...] = ()
    """Its allocation results of gpuplace's driver, in their order (none: not allocated,
    another driver's, admin access only, or unreadable)."""
    allocated: bool = False
    """`status.allocation` is set (any driver's)."""
    reserved: tuple[str, ...] = ()
    """UIDs of the pods in `status.reservedFor`."""
    deleting: bool = False
    pinned: tuple[str, ...] = ()
    """The GPU UUIDs the engine pinned it to (annotation `gpuplace.io/pinned-gpus`, on the
    claims gpuplace makes; none: first fit)."""
    problem: str = ""
    """Why its results cannot be read ("" when fine)."""

    @property
    def key(self) -> str:
        """The ledger key of its grant (module docstring)."""
        return self.owner if self.managed and self.owner else f"{PREFIX}{self.uid}"

    def __str__(self) -> str:
        return f"claim {self.namespace}/{self.name}"


def _reserved(status: Mapping[str, Any]) -> tuple[str, ...]:
    found = status.get("reservedFor")
    if not isinstance(found, list):
        return ()
    return tuple(
        str(item.get("uid") or "")
        for item in found
        if isinstance(item, Mapping) and item.get("resource") == "pods"
    )


def _pinned(metadata: Mapping[str, Any]) -> tuple[str, ...]:
    annotations = metadata.get("annotations")
    found = annotations.get(keys.CLAIM_PINNED) if isinstance(annotations, Mapping) else None
    return tuple(part for part in str(found or "").split(",") if part)


def record(raw: Mapping[str, Any]) -> ClaimRecord:
    """A ResourceClaim as the API sends it → ClaimRecord; never raises for an object.
    O(results)."""
    metadata = raw.get("metadata") if isinstance(raw.get("metadata"), Mapping) else {}
    metadata = metadata or {}
    status = raw.get("status") if isinstance(raw.get("status"), Mapping) else {}
    status = status or {}
    labels = metadata.get("labels") if isinstance(metadata.get("labels"), Mapping) else {}
    owner_name, owner = dra_claims.owner(raw)
    held: list[Held] = []
    node = problem = ""
    if isinstance(status.get("allocation"), Mapping):
        try:
            results = dra.allocated(raw)
        except dra.DraError as error:
            results, problem = (), str(error)
        for result in results:
            index = dra.gpu_index(result.device)
            if result.admin:
                continue
            if index is None:
                problem = f"device {result.device[:63]!r} is not one of gpuplace's"
                held = []
                break
            if node and result.pool != node:
                problem = f"its results are on two nodes ({node}, {result.pool[:63]})"
                held = []
                break
            node = result.pool
            held.append(Held(index, result.milli, result.memory_mib))
    return ClaimRecord(
        uid=str(metadata.get("uid") or ""),
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        resource_version=str(metadata.get("resourceVersion") or ""),
        owner=owner,
        owner_name=owner_name,
        managed=str((labels or {}).get(keys.MANAGED) or "") == "true" and bool(owner),
        node=node if held else "",
        held=tuple(held),
        allocated=isinstance(status.get("allocation"), Mapping),
        reserved=_reserved(status),
        deleting=bool(metadata.get("deletionTimestamp")),
        pinned=_pinned(metadata),
        problem=problem,
    )


def _ask(held: Held, node: Node | None) -> int:
    """The ledger memory of a result: consumed less its GPU's CUDA context for a share
    (at least 1 MiB), 0 for a whole GPU's compute, the consumed memory else."""
    if held.milli >= WHOLE:
        return 0
    if not held.memory_mib:
        return 0
    gpus = node.gpus if node is not None else ()
    context = gpus[held.gpu].context.mib(held.milli) if held.gpu < len(gpus) else 0
    return max(held.memory_mib - context, 1)


def grants(claim: ClaimRecord, node: Node | None, *, bound: bool = True) -> list[Grant]:
    """The ledger grants of an allocated claim (module docstring); `node`: its node as the
    ledger has it (for its GPUs' contexts; None when unknown: no context is taken off);
    `bound`: a pod using it is bound (CONFIRMED), else RESERVED. O(results)."""
    groups: list[tuple[int, int, list[int]]] = []
    for held in claim.held:
        milli = WHOLE if held.milli >= WHOLE else held.milli
        memory = _ask(held, node)
        if not milli and not memory:
            continue  # consumes nothing (the agent refuses to prepare it)
        group = next(
            (
                gpus
                for m, mib, gpus in groups
                if (m, mib) == (milli, memory) and held.gpu not in gpus and (milli or not gpus)
            ),
            None,
        )
        if group is None:
            groups.append((milli, memory, [held.gpu]))
        else:
            group.append(held.gpu)
    state = GrantState.CONFIRMED if bound else GrantState.RESERVED
    return [
        Grant(
            claim.key if number == 1 else f"{claim.key}/{number}",
            claim.node,
            tuple(gpus),
            milli,
            memory,
            state=state,
        )
        for number, (milli, memory, gpus) in enumerate(groups, start=1)
    ]


def is_claim_key(key: str) -> bool:
    """A ledger key of a claim gpuplace did not make (no pod of its own)."""
    return key.startswith(PREFIX)
