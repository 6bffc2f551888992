"""A gpuplace pod on the DRA path and the ResourceClaim it names (docs/dra.md, "The
annotations on DRA nodes"): the one place that says what both look like.

At admission the webhook cannot create objects, and the node is not known yet. It gives a
pod it sends to DRA nodes (`gpuplace.webhook.mutating`):

- a `spec.resourceClaims` entry named `ENTRY` with `resourceClaimName` = `claim_name(...)`
  (the pod's name, or its generateName, then `-gpu-` and 8 hex digits of the admission
  request's UID: unique per pod, so a claim of a deleted pod of the same name that the
  garbage collector has not removed yet is never taken for the new one's);
- `resources.claims: [{name: ENTRY}]` on its GPU container;
- the scheduling gate `keys.DRA_GATE`, so that kube-scheduler does not see it before its
  claim exists (it would keep a pod whose claim is missing out of its queue without an
  Event or a condition: seen on v1.36.2).

The sidecar (`gpuplace.claims`) then creates the claim, `claim(...)`: owned by the pod
(`controller: true`, so the garbage collector deletes it with the pod, and
kube-controller-manager's resourceclaim controller deletes it once the pod has finished:
seen on v1.36.2), labelled `gpuplace.io/managed=true`, its devices from the pod's parsed
request (`devices`), and removes the gate. kube-scheduler's DRA allocator allocates it
(first fit) and binds the pod; a planner pins the claim to the GPUs the engine plans
(`pinned`: `dra.uuids_selector`) before the gate goes.

What a claim asks, from the annotations (`devices`):

- a share (`gpu-percent` < 100, `gpu-memory`): one device, `capacity.requests: {compute:
  <milli>, memory: <MiB + CUDA context>Mi}`; a memory-only share (`gpu-memory` alone)
  asks `compute: "0"` and consumes no compute; a share without `gpu-memory` `memory: 0Mi`;
- N whole GPUs: `allocationMode: ExactCount, count: N` and no capacity (each consumes its
  whole GPU); a whole GPU with `gpu-memory`: a selector on the `memory` capacity (at least
  that much: `dra.memory_selector`);
- `gpu-model`: a selector on the `model` attribute (`dra.model_selector`);
- `gpu-topology: required`: GPUs in an NVLink domain (`dra.nvlink_selector`) and a
  `matchAttribute` constraint on `dra.NVLINK_CONSTRAINT`; `preferred`: `firstAvailable`,
  the subrequest `nvlink` (as required) first, then `any`.

A claim's consumed memory is its container's whole MPS memory limit, the CUDA context inside
(docs/dra.md), so the claim asks the pod's memory plus the context of the GPU it will land
on: where the model is not known yet, the largest context among the DRA GPUs it may land on
(`context_mib`), and `mps_limits.UNMEASURED`'s where no such GPU is published. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpuplace.cluster import dra, keys, mps_limits
from gpuplace.placement.inventory import Gpu
from gpuplace.placement.requests import WHOLE, GpuRequest, Topology

ENTRY = "gpuplace-gpu"
"""The name of gpuplace's entry in a pod's `spec.resourceClaims` (and in its GPU
container's `resources.claims`)."""
REQUEST = "gpu"
"""The name of the claim's one request."""
NVLINK = "nvlink"
ANY = "any"
"""The `firstAvailable` subrequests of `gpu-topology: preferred`, in the order tried."""
SUFFIX = "-gpu-"
MAX_NAME = dra.MAX_NAME
_DIGITS = 8
_OTHER = re.compile(r"[^a-z0-9]+")


def claim_name(base: str, seed: str) -> str:
    """The claim a pod names: `<base>-gpu-<8 hex digits of sha256(seed)>`, a DNS subdomain of
    at most 253 characters (`base` lowercased, other characters than letters and digits
    made `-`). `base`: the pod's name, or its generateName (the API server
    has not made the name yet when the webhook sees the pod); `seed`: the admission
    request's UID. O(len(base))."""
    digest = hashlib.sha256(seed.encode()).hexdigest()[:_DIGITS]
    words = _OTHER.sub("-", base.lower()).strip("-")
    keep = words[: MAX_NAME - len(SUFFIX) - _DIGITS].rstrip("-") or "pod"
    return f"{keep}{SUFFIX}{digest}"


def entry(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's `spec.resourceClaims` entry named `ENTRY`, if any."""
    spec = pod.get("spec")
    claims = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
    if not isinstance(claims, list):
        return None
    for item in claims:
        if isinstance(item, Mapping) and item.get("name") == ENTRY:
            return item
    return None


def named(pod: Mapping[str, Any]) -> str:
    """The claim gpuplace's entry names (`resourceClaimName`); "" when the pod has no such
    entry (it is not on the DRA path)."""
    found = entry(pod)
    name = found.get("resourceClaimName") if found is not None else None
    return name if isinstance(name, str) else ""


def claim_names(pod: Mapping[str, Any]) -> tuple[str, ...]:
    """Every ResourceClaim the pod uses: those its `spec.resourceClaims` name, those
    kube-controller-manager made from its templates (`status.resourceClaimStatuses`), and
    the one kube-scheduler made for its extended resources
    (`status.extendedResourceClaimStatus`). O(claims)."""
    found: list[str] = []
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    status = pod.get("status") if isinstance(pod.get("status"), Mapping) else {}
    for item in (spec or {}).get("resourceClaims") or []:
        if isinstance(item, Mapping) and isinstance(item.get("resourceClaimName"), str):
            found.append(item["resourceClaimName"])
    for item in (status or {}).get("resourceClaimStatuses") or []:
        if isinstance(item, Mapping) and isinstance(item.get("resourceClaimName"), str):
            found.append(item["resourceClaimName"])
    extended = (status or {}).get("extendedResourceClaimStatus")
    if isinstance(extended, Mapping) and isinstance(extended.get("resourceClaimName"), str):
        found.append(extended["resourceClaimName"])
    return tuple(dict.fromkeys(name for name in found if name))


def context_mib(request: GpuRequest, gpus: Iterable[Gpu]) -> int:
    """The CUDA context a share's claim adds to its memory (0 for whole GPUs and shares
    without memory): the largest among `gpus` (the DRA nodes' GPUs, as their agents
    publish them) of a model the request accepts; without one, the largest of its models'
    figures (`mps_limits`), or `mps_limits.UNMEASURED`'s when it names none. O(GPUs)."""
    if not request.memory_mib or request.milli >= WHOLE:
        return 0
    milli = request.milli
    contexts = [
        gpu.context.mib(milli) for gpu in gpus if not request.models or gpu.model in request.models
    ]
    if contexts:
        return max(contexts)
    if request.models:
        return max(mps_limits.figures(model).context.mib(milli) for model in request.models)
    return mps_limits.UNMEASURED.context.mib(milli)


def _exactly(request: GpuRequest, context: int, selectors: list[str]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "deviceClassName": dra.DEVICE_CLASS,
        "allocationMode": "ExactCount",
        "count": max(request.count, 1),
    }
    if request.shares:
        memory = request.memory_mib + context if request.memory_mib else 0
        body["capacity"] = {"requests": dra.capacity_requests(request.milli, memory)}
    if selectors:
        body["selectors"] = [{"cel": {"expression": expression}} for expression in selectors]
    return body


def devices(request: GpuRequest, context: int = 0, pinned: Sequence[str] = ()) -> dict[str, Any]:
    """The claim's `spec.devices` for `request` (the table of the module docstring);
    `context`: the CUDA context MiB added to a share's memory (`context_mib`); `pinned`:
    the UUIDs of the GPUs a planner chose, a selector on every alternative (none: any GPU
    that fits, kube-scheduler's first fit). O(models + pinned)."""
    selectors = [dra.model_selector(sorted(request.models))] if request.models else []
    if pinned:
        selectors.insert(0, dra.uuids_selector(pinned))
    if not request.shares and request.memory_mib:
        selectors.append(dra.memory_selector(request.memory_mib))
    linked = request.count > 1 and request.topology is not Topology.ANY
    if not linked:
        return {"requests": [{"name": REQUEST, "exactly": _exactly(request, context, selectors)}]}
    nvlink = _exactly(request, context, [*selectors, dra.nvlink_selector()])
    if request.topology is Topology.REQUIRED:
        return {
            "requests": [{"name": REQUEST, "exactly": nvlink}],
            "constraints": [{"requests": [REQUEST], "matchAttribute": dra.NVLINK_CONSTRAINT}],
        }
    return {
        "requests": [
            {
                "name": REQUEST,
                "firstAvailable": [
                    {"name": NVLINK, **nvlink},
                    {"name": ANY, **_exactly(request, context, selectors)},
                ],
            }
        ],
        "constraints": [
            {"requests": [f"{REQUEST}/{NVLINK}"], "matchAttribute": dra.NVLINK_CONSTRAINT}
        ],
    }


def claim(
    namespace: str,
    name: str,
    *,
    pod: str,
    pod_uid: str,
    request: GpuRequest,
    context: int = 0,
    pinned: Sequence[str] = (),
) -> dict[str, Any]:
    """The ResourceClaim `namespace/name` for the pod `pod` (UID `pod_uid`) asking
    `request`: owned by the pod, labelled `gpuplace.io/managed=true`; `pinned`: the GPUs'
    UUIDs it must get (`devices`), also kept in its annotation `gpuplace.io/pinned-gpus`."""
    return {
        "apiVersion": dra.API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {keys.MANAGED: "true"},
            **({"annotations": {keys.CLAIM_PINNED: ",".join(pinned)}} if pinned else {}),
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": pod_uid, "controller": True}
            ],
        },
        "spec": {"devices": devices(request, context, pinned)},
    }


def owner(claim_body: Mapping[str, Any]) -> tuple[str, str]:
    """(name, UID) of the Pod that controls a claim (its `controller: true` owner
    reference); ("", "") for none."""
    metadata = claim_body.get("metadata")
    references = metadata.get("ownerReferences") if isinstance(metadata, Mapping) else None
    for item in references if isinstance(references, list) else ():
        if (
            isinstance(item, Mapping)
            and item.get("kind") == "Pod"
            and item.get("apiVersion") == "v1"
            and item.get("controller") is True
        ):
            return str(item.get("name") or ""), str(item.get("uid") or "")
    return "", ""
