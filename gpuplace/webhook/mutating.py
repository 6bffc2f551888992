"""What the mutating webhook makes of a GPU pod at CREATE: the patch and its warnings.

Given the raw pod and its parsed `PodGpuSpec`, `build` declares what the pod must hold and
returns the minimal JSON Patch to get there:

- the GPU container's requests and limits carry `gpuplace.io/gpu-percent` (percent ×
  count; absent for a memory-only share, which reserves no compute) and
  `gpuplace.io/gpu-memory` (MiB × count, absent when no memory was asked);
- `spec.schedulerName` is the gpuplace profile;
- required node affinity from static node properties only (opt-in label, GPU count,
  model, per-GPU memory, NVLink domain size when required), ANDed into every term the
  user wrote (terms stay ORed);
- env vars: `NVIDIA_VISIBLE_DEVICES` from the assignment annotation via the downward API,
  and for a shared GPU the MPS limits (the memory limit, which covers the CUDA context of
  the GPU model the pod lands on, from the bind's `gpuplace.io/mps-memory-limit` through the
  downward API too); *unless* the GPU nodes run the node agent
  (`node_agent`): then the GPU container requests `gpuplace.io/gpu` = its GPU count
  instead, and the webhook writes no GPU env at all: the agent's device plugin answers
  the kubelet with the container's GPUs, MPS pipe directory and limits, read from the
  grant on the node (one source of truth; see docs/node-agent.md, "Allocate");
- the label `gpuplace.io/managed=true`; for a gang member the gang label and the
  scheduling gate;
- for a queued pod (`queue`: the GpuQueue `gpuplace.io/queue` or its namespace's label
  names, docs/queues.md) the label `gpuplace.io/queue=<queue>` and the scheduling gate
  `gpuplace.io/queue`, which the queue controller removes when the queue admits it;
- for every other pod, when the sidecar plans them (`place_gate`, `--plan-pin`), the
  scheduling gate `gpuplace.io/place`, which the planner removes once it has handed
  kube-scheduler the node it planned (`gpuplace.planning`): every gpuplace pod is gated at
  admission, since a gate can be set only then;
- for a member of an elastic gang (`gang-min` below `gang-size`) the env var
  `GPUPLACE_GANG_COUNT`, the gang's member count when this member starts, read through the
  downward API from the annotation `gpuplace.io/gang-count` its plan carries.

On the DRA path (`claim`: the pod goes to DRA nodes, `gpuplace.cluster.dra_claims`) the pod
gets instead: no extended resources and no GPU env (the DRA kubelet plugin's CDI spec
gives the container its GPU and MPS limits from its claim's allocation); the
`spec.resourceClaims` entry `gpuplace-gpu` naming the claim `claim` (unless it names one
already) and `resources.claims` on the GPU container; the DRA gate, which the sidecar
removes once it has created the claim; `spec.schedulerName` = the cluster's DRA allocator
(`dra_scheduler_name`); required node affinity `gpuplace.io/enabled=true` and
`gpuplace.io/dra=true` only (what the GPUs must be is the claim's: its selectors and
capacity). Where DRA nodes exist (`dra_nodes`), a pod on the device-plugin path gets
`gpuplace.io/dra NotIn [true]` in its affinity, so that no plan (a gang's, a queue's) puts
it on a DRA node, whose GPUs only claims hold.

Applying `build` to its own output yields no operation (the webhook is reinvoked with
`reinvocationPolicy: IfNeeded`, and the validating webhook uses this to tell a mutated pod
from one the mutating webhook never saw). Never used on UPDATE: most of a pod's spec is
immutable once it exists. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import dra_claims, grammar, keys, mps_limits
from gpuplace.webhook import patches

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
GANG_COUNT_ENV = "GPUPLACE_GANG_COUNT"
"""An elastic gang member's count of running members at its start (docs/gangs.md)."""
DEFAULT_SCHEDULER = "default-scheduler"
MEMORY_ONLY_WARNING = (
    "memory-only share: {memory} MiB of GPU memory and no compute reserved; it is time-sliced "
    f"with the other memory-only pods of its GPU (never with {keys.GPU_PERCENT} pods)"
)
REQUIRED_AFFINITY = (
    "spec",
    "affinity",
    "nodeAffinity",
    "requiredDuringSchedulingIgnoredDuringExecution",
)


@dataclass(frozen=True, slots=True)
class Mutation:
    """The patch for one pod, the pod after it, and what the kubectl user should know."""

    patch: patches.Patch
    warnings: tuple[str, ...]

    @property
    def ops(self) -> list[dict[str, Any]]:
        return self.patch.ops


DRA_EXPRESSIONS = (
    {"key": keys.NODE_ENABLED, "operator": "In", "values": ["true"]},
    {"key": keys.NODE_DRA, "operator": "In", "values": ["true"]},
)
"""The required node affinity of a pod on the DRA path."""
NOT_DRA = {"key": keys.NODE_DRA, "operator": "NotIn", "values": ["true"]}
"""... and what keeps a pod on the device-plugin path off DRA nodes."""
DRA_MEMORY_ONLY_WARNING = (
    "on a DRA node kube-scheduler's allocator may place this memory-only share beside "
    "compute shares of the same GPU (it allocates first fit, not by gpuplace's rules)"
)


def node_expressions(spec: grammar.PodGpuSpec) -> list[dict[str, Any]]:
    """Node selector requirements every node that could ever hold `spec` meets.

    Only properties that never change while a node exists: free capacity is the
    extender's business at scheduling time (affinity is immutable once the pod exists).
    """
    expressions: list[dict[str, Any]] = [
        {"key": keys.NODE_ENABLED, "operator": "In", "values": ["true"]},
        {"key": keys.GFD_COUNT, "operator": "Gt", "values": [str(spec.count - 1)]},
    ]
    if spec.models:
        expressions.append({"key": keys.GFD_PRODUCT, "operator": "In", "values": list(spec.models)})
    if spec.memory_mib:
        expressions.append(
            {"key": keys.GFD_MEMORY, "operator": "Gt", "values": [str(spec.memory_mib - 1)]}
        )
    if spec.count > 1 and spec.topology is grammar.GpuTopology.REQUIRED:
        expressions.append(
            {"key": keys.NVLINK_DOMAIN_SIZE, "operator": "Gt", "values": [str(spec.count - 1)]}
        )
    return expressions


def _annotation_ref(name: str, key: str) -> dict[str, Any]:
    """Env var `name` from the pod's annotation `key`, resolved by the kubelet at start."""
    field_path = f"metadata.annotations['{key}']"
    return {
        "name": name,
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": field_path}},
    }


def env_vars(spec: grammar.PodGpuSpec) -> list[dict[str, Any]]:
    """The GPU container's env vars: the assignment through the downward API, MPS limits.

    The compute cap depends on the ask alone; the memory limit also on the GPU model's CUDA
    context (`mps_limits`), unknown until the pod is placed: it is read through the
    downward API from `gpuplace.io/mps-memory-limit`, which the sidecar writes at bind
    (before the Binding, like `gpuplace.io/visible-devices`)."""
    env: list[dict[str, Any]] = [_annotation_ref(VISIBLE_DEVICES_ENV, keys.VISIBLE_DEVICES)]
    if spec.shares:
        milli = spec.percent * 10
        env.append(
            {"name": mps_limits.THREADS_ENV, "value": str(mps_limits.thread_percentage(milli))}
        )
        if spec.memory_mib:
            env.append(_annotation_ref(mps_limits.MEMORY_ENV, keys.MPS_MEMORY_LIMIT))
    return env


def gang_count_env() -> dict[str, Any]:
    """`GPUPLACE_GANG_COUNT` from the plan's `gpuplace.io/gang-count`, downward API."""
    field_path = f"metadata.annotations['{keys.GANG_COUNT}']"
    return {
        "name": GANG_COUNT_ENV,
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": field_path}},
    }


def build(
    pod: Mapping[str, Any],
    spec: grammar.PodGpuSpec,
    container: int,
    scheduler_name: str,
    *,
    node_agent: bool = False,
    place_gate: bool = False,
    queue: str = "",
    queue_source: str = "",
    claim: str = "",
    dra_scheduler_name: str = DEFAULT_SCHEDULER,
    dra_nodes: bool = False,
) -> Mutation:
    """The patch that makes `pod` a gpuplace pod. `container` indexes `spec.containers`
    (see `pods.problems`); `node_agent`: the GPU nodes run the node agent (slots instead
    of env vars); `queue`: the GpuQueue it waits in ("" for none), which `queue_source`
    (`annotation`, `namespace`) named; `claim`: the pod goes to DRA nodes with this claim
    ("": the device-plugin path), scheduled by `dra_scheduler_name`; `dra_nodes`: DRA nodes
    exist (a device-plugin pod is kept off them); `place_gate`: the sidecar plans the
    device-plugin pods no gang or queue does (the gate `gpuplace.io/place`; a DRA pod
    keeps the claim controller's gate, which plans it and pins its claim). Raises
    `patches.PatchError` on a pod of impossible shape."""
    patch = patches.Patch(pod)
    warnings: list[str] = []
    dra = bool(claim)
    _resources(patch, spec, container, dra=dra)
    _slots(patch, spec, container, node_agent and not dra)
    if dra:
        _claim(patch, container, claim)
        _scheduler(patch, dra_scheduler_name, warnings)
        _affinity(patch, list(DRA_EXPRESSIONS))
        _gate(patch, keys.DRA_GATE)
    else:
        _scheduler(patch, scheduler_name, warnings)
        _affinity(patch, [*node_expressions(spec), *([NOT_DRA] if dra_nodes else [])])
    if not node_agent and not dra:
        _env(patch, env_vars(spec), container, warnings)
    if spec.gang is not None and spec.gang.elastic:
        _env(patch, [gang_count_env()], container, warnings)
    patch.put(("metadata", "labels", keys.MANAGED), "true")
    if queue:
        patch.put(("metadata", "labels", keys.QUEUE_LABEL), queue)
        _gate(patch, keys.QUEUE_GATE)
        named = "its namespace's default" if queue_source == "namespace" else "asked for"
        warnings.append(
            f"queued in GpuQueue {queue} ({named}): the pod waits behind the scheduling gate "
            f"{keys.QUEUE_GATE} until its queue admits it (quota and a free GPU); "
            "`gpuplace explain` on the pod says why it waits"
        )
    if spec.gang is not None:
        patch.put(("metadata", "labels", keys.GANG_LABEL), spec.gang.name)
        _gate(patch, keys.GANG_GATE)
    elif place_gate and not queue and not dra:
        _gate(patch, keys.PLACE_GATE)
    if spec.memory_rounded:
        warnings.append(
            f"{keys.GPU_MEMORY} was rounded up to whole MiB: {spec.memory_mib}Mi per GPU"
        )
    if spec.memory_only:
        warnings.append(MEMORY_ONLY_WARNING.format(memory=spec.memory_mib))
        if dra:
            warnings.append(DRA_MEMORY_ONLY_WARNING)
    if spec.shares and not spec.memory_mib:
        warnings.append(
            f"no {keys.GPU_MEMORY}: no GPU memory is reserved for this pod; "
            "pods sharing its GPU may take it all"
        )
    if spec.count == 1 and spec.topology is not grammar.GpuTopology.NONE:
        warnings.append(f"{keys.GPU_TOPOLOGY} is ignored for a single GPU")
    return Mutation(patch, tuple(warnings))


def _gate(patch: patches.Patch, name: str) -> None:
    """Add the scheduling gate `name` unless the pod has it."""
    gates = patch.get(("spec", "schedulingGates"))
    if not isinstance(gates, list) or not any(
        isinstance(gate, Mapping) and gate.get("name") == name for gate in gates
    ):
        patch.append(("spec", "schedulingGates"), {"name": name})


def _resources(
    patch: patches.Patch, spec: grammar.PodGpuSpec, container: int, *, dra: bool = False
) -> None:
    """`gpuplace.io/gpu-percent` and `gpu-memory` as the spec says (none on the DRA path)."""
    base = ("spec", "containers", container, "resources")
    for part in ("requests", "limits"):
        if spec.resource_percent and not dra:
            patch.put((*base, part, keys.RESOURCE_PERCENT), str(spec.resource_percent))
        else:
            patch.remove((*base, part, keys.RESOURCE_PERCENT))
        if spec.resource_memory_mib and not dra:
            patch.put((*base, part, keys.RESOURCE_MEMORY), str(spec.resource_memory_mib))
        else:
            patch.remove((*base, part, keys.RESOURCE_MEMORY))


def _slots(
    patch: patches.Patch, spec: grammar.PodGpuSpec, container: int, node_agent: bool
) -> None:
    """`gpuplace.io/gpu` = GPU count: the kubelet then asks the node agent (Allocate) what
    the container gets. Absent without the agent (no node would offer it)."""
    base = ("spec", "containers", container, "resources")
    for part in ("requests", "limits"):
        if node_agent:
            patch.put((*base, part, keys.RESOURCE_GPU), str(spec.count))
        else:
            patch.remove((*base, part, keys.RESOURCE_GPU))


def _claim(patch: patches.Patch, container: int, claim: str) -> None:
    """gpuplace's entry of `spec.resourceClaims` (naming `claim` unless it names one
    already) and its use by the GPU container."""
    entries = patch.get(("spec", "resourceClaims"))
    present = isinstance(entries, list) and any(
        isinstance(item, Mapping) and item.get("name") == dra_claims.ENTRY for item in entries
    )
    if not present:
        patch.append(
            ("spec", "resourceClaims"), {"name": dra_claims.ENTRY, "resourceClaimName": claim}
        )
    path = ("spec", "containers", container, "resources", "claims")
    used = patch.get(path)
    if not isinstance(used, list) or not any(
        isinstance(item, Mapping) and item.get("name") == dra_claims.ENTRY for item in used
    ):
        patch.append(path, {"name": dra_claims.ENTRY})


def _scheduler(patch: patches.Patch, scheduler_name: str, warnings: list[str]) -> None:
    current = patch.get(("spec", "schedulerName"))
    if isinstance(current, str) and current not in (DEFAULT_SCHEDULER, scheduler_name, ""):
        warnings.append(
            f"spec.schedulerName {current[:63]!r} replaced by {scheduler_name!r}: "
            "gpuplace pods are scheduled by the gpuplace profile"
        )
    patch.put(("spec", "schedulerName"), scheduler_name)


def _affinity(patch: patches.Patch, expressions: list[dict[str, Any]]) -> None:
    terms = patch.get((*REQUIRED_AFFINITY, "nodeSelectorTerms"))
    if not isinstance(terms, list) or not terms:
        patch.put((*REQUIRED_AFFINITY, "nodeSelectorTerms"), [{"matchExpressions": expressions}])
        return
    for index, term in enumerate(terms):
        if not isinstance(term, Mapping):
            raise patches.PatchError(f"nodeSelectorTerms[{index}] is not an object")
        if not term.get("matchExpressions") and not term.get("matchFields"):
            continue  # an empty term matches no node; ANDing ours would make it match some
        path = (*REQUIRED_AFFINITY, "nodeSelectorTerms", index, "matchExpressions")
        for expression in expressions:
            present = patch.get(path)
            if not isinstance(present, list) or expression not in present:
                patch.append(path, expression)


def _env(
    patch: patches.Patch, wanted: list[dict[str, Any]], container: int, warnings: list[str]
) -> None:
    path = ("spec", "containers", container, "env")
    for var in wanted:
        present = patch.get(path)
        positions = (
            [
                index
                for index, item in enumerate(present)
                if isinstance(item, Mapping) and item.get("name") == var["name"]
            ]
            if isinstance(present, list)
            else []
        )
        if not positions:
            patch.append(path, var)
            continue
        for index in positions:
            if present[index] != var:
                patch.put((*path, index), var)
                if var["name"] == VISIBLE_DEVICES_ENV:
                    warnings.append(
                        f"env {VISIBLE_DEVICES_ENV} replaced: gpuplace sets it to the GPUs "
                        "granted to the pod"
                    )
