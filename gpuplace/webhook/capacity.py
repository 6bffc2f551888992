""" "Could any GPU in the cluster ever hold this?" — checked against static capabilities.

Only what never changes while the nodes exist (model, per-GPU memory, GPUs per node,
NVLink domain size); today's free space is the extender's question, at scheduling time.
A request that fails here would wait Pending forever, so admission refuses it with a
message saying what the cluster does have. Pure.
"""

from __future__ import annotations

from gpuplace.cluster import grammar, keys
from gpuplace.placement import gangs, requests
from gpuplace.placement.inventory import Capabilities, ModelCapability
from gpuplace.placement.requests import GpuRequest

MAX_DOMAINS_SHOWN = 6


def memory_text(mib: int) -> str:
    """MiB in the unit a user wrote it in: `81920` → `80Gi`, `1500` → `1500Mi`."""
    if mib and mib % (1024 * 1024) == 0:
        return f"{mib // (1024 * 1024)}Ti"
    if mib and mib % 1024 == 0:
        return f"{mib // 1024}Gi"
    return f"{mib}Mi"


def _holds(spec: grammar.PodGpuSpec, capability: ModelCapability) -> bool:
    if capability.max_memory_mib < spec.memory_mib:
        return False
    if capability.max_gpus_per_node < spec.count:
        return False
    needs_nvlink = spec.count > 1 and spec.topology is grammar.GpuTopology.REQUIRED
    return not needs_nvlink or capability.max_nvlink_domain >= spec.count


def misfit(spec: grammar.PodGpuSpec, capabilities: Capabilities) -> str | None:
    """None when some node could hold `spec`, else why not (naming what the cluster has)."""
    present = {model: cap for model, cap in capabilities.per_model.items() if cap.max_gpus_per_node}
    if not present:
        return (
            f"no gpuplace node has GPUs: nodes take part once labelled {keys.NODE_ENABLED}=true "
            f"and carry the GPU Feature Discovery labels ({keys.GFD_COUNT}, {keys.GFD_PRODUCT})"
        )
    if spec.models:
        candidates = {model: present[model] for model in spec.models if model in present}
        if not candidates:
            return (
                f"no GPU in the cluster is a {' or a '.join(spec.models)} ({keys.GPU_MODEL}); "
                f"the models present are: {', '.join(sorted(present))}"
            )
        of = f" of model {' or '.join(candidates)}"
    else:
        candidates, of = present, ""
    if any(_holds(spec, cap) for cap in candidates.values()):
        return None
    largest = max(cap.max_memory_mib for cap in candidates.values())
    if spec.memory_mib > largest:
        return (
            f"no GPU{of} in the cluster has {memory_text(spec.memory_mib)} of memory "
            f"({keys.GPU_MEMORY}); the largest has {memory_text(largest)}"
        )
    most = max(cap.max_gpus_per_node for cap in candidates.values())
    if spec.count > most:
        return (
            f"no node in the cluster has {spec.count} GPUs{of} ({keys.GPU_COUNT}); "
            f"the most on one node is {most}"
        )
    memory_ok = {m: c for m, c in candidates.items() if c.max_memory_mib >= spec.memory_mib}
    domain = max((cap.max_nvlink_domain for cap in memory_ok.values()), default=0)
    if spec.topology is grammar.GpuTopology.REQUIRED and all(
        cap.max_gpus_per_node >= spec.count for cap in memory_ok.values()
    ):
        return (
            f"no node has {spec.count} GPUs{of} joined by NVLink ({keys.GPU_TOPOLOGY}: required); "
            f"the largest NVLink domain has {domain}; use {keys.GPU_TOPOLOGY}: preferred to "
            "accept GPUs without NVLink"
        )
    return (
        f"no node in the cluster has {spec.count} GPUs{of} with {memory_text(spec.memory_mib)} "
        "of memory each"
    )


def domain_misfit(
    spec: grammar.PodGpuSpec, request: GpuRequest, capabilities: Capabilities
) -> str | None:
    """None unless the pod's gang requires one topology domain (`gang-domain`, policy
    `required`) and no value of that node label could ever hold it: the members it must
    start with (`gang-size`, or an elastic gang's `gang-min`), each asking `request`, on
    that domain's nodes when idle. Then why, naming what each domain holds. O(nodes × G)
    once per label and request (`Capabilities.memo`), O(1) after."""
    gang = spec.gang
    if (
        gang is None
        or gang.domain is None
        or gang.domain_policy is not grammar.DomainPolicy.REQUIRED
    ):
        return None
    question = ("domain_room", gang.domain, request)
    room = capabilities.memo.get(question)
    if not isinstance(room, dict):
        room = gangs.domain_room(capabilities.nodes, gang.domain, request)
        capabilities.memo[question] = room
    need = gang.elastic_minimum or gang.size
    where = f"{keys.GANG_DOMAIN}={gang.domain} ({keys.GANG_DOMAIN_POLICY}: required)"
    if not room:
        return (
            f"{where}: no gpuplace node carries the label {gang.domain}, so no domain could "
            f"ever hold the gang; label each node with its domain (kubectl label node NODE "
            f"{gang.domain}=VALUE) or use {keys.GANG_DOMAIN_POLICY}: preferred"
        )
    best = max(room.values())
    if best >= need:
        return None
    ranked = sorted(room.items(), key=lambda item: (-item[1], item[0]))
    shown = ", ".join(f"{value} {count}" for value, count in ranked[:MAX_DOMAINS_SHOWN])
    if len(ranked) > MAX_DOMAINS_SHOWN:
        shown += f" and {len(ranked) - MAX_DOMAINS_SHOWN} more"
    members = f"{need} members" + (f" ({keys.GANG_MIN})" if gang.elastic_minimum else "")
    return (
        f"{where}: no {gang.domain} could ever hold the gang's {members} of "
        f"{requests.describe(request)} each: with every node idle the most one holds is "
        f"{best} ({shown}); use {keys.GANG_DOMAIN_POLICY}: preferred to let it span domains, "
        f"or fewer members"
    )
