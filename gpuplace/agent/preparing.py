"""What a ResourceClaim prepared on this node gets: the DRA kubelet plugin's decisions,
pure (no I/O, no clock); `gpuplace.agent.kubeletplugin` does the I/O.

NodePrepareResources names a claim (namespace, name, UID) and nothing else: the plugin
reads the claim, and `prepare` turns its allocation into what the kubelet hands the
runtime. For each allocation result of this driver (`gpuplace.cluster.dra.allocated`),
its `consumedCapacity` becomes the grant (milli, memory MiB) and the grant becomes the
container's GPU, MPS limits and pipe mount by the device plugin's own rule
(`gpuplace.agent.handover.edits`), written as one CDI device per result in one CDI spec per
claim (kind `gpu.gpuplace.io/claim`, device `<device>-<claim UID>`). The kubelet gets,
per device, that CDI name (plus `nvidia.com/gpu=<UUID>` with the `cdi` strategy, whose
spec `nvidia-ctk` writes) and the result's share ID.

Refused (`handover.Refusal`, the claim's error in the answer; the kubelet retries and the
pod waits with the message in its Events, nothing runs):

- the claim read is not the one the kubelet named (another UID: it was replaced), or is
  not allocated, or its results do not parse;
- a result on another node's pool, or naming a device this node does not have;
- a result that consumes neither compute nor memory (a share of nothing), more memory than
  the GPU has, or a whole GPU's compute with part of its memory (no grant gpuplace makes:
  MPS caps memory only for shares, so the rest of the memory would go to a share beside an
  uncapped process);
- a share together with another device of this driver in one claim (a share is one GPU,
  as on the device-plugin path), or one device allocated twice to one claim;
- what `handover.edits` refuses: a GPU that is unhealthy, a share whose MPS daemon is not
  ready.

Admin-access results (a monitoring claim in an admin namespace) get their GPU whole and
consume nothing. O(results of the claim).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuplace.agent import handover
from gpuplace.cluster import dra, mps_limits
from gpuplace.placement.requests import WHOLE

CDI_KIND = f"{dra.DRIVER}/claim"
CDI_VERSION = "0.3.0"
"""The oldest CDI spec version with everything used here (env, mounts, device nodes): what
the oldest runtimes with CDI (containerd 1.7.2, CRI-O 1.23) read. Its device names start
with a letter (containerd 1.7.24 refuses a spec of 0.3.0 naming `5585…-gpu-0`: "the spec
version must be at least v0.5.0")."""
SPEC_PREFIX = f"{dra.DRIVER}-claim_"
"""Spec files are `<SPEC_PREFIX><claim UID>.json` in the CDI directory."""
MAX_REF = 253
_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"claim {self.namespace}/{self.name}"


def checked_ref(namespace: str, name: str, uid: str) -> ClaimRef:
    """The kubelet's claim reference, checked: a namespace and name of the API's lengths, a
    UID in the API server's form (it becomes a file name). Raises `handover.Refusal`."""
    if not namespace or not name or len(namespace) > 63 or len(name) > MAX_REF:
        raise handover.Refusal(
            f"claim {namespace[:63]!r}/{name[:63]!r}: namespace and name are required"
        )
    if not _UID.fullmatch(uid):
        raise handover.Refusal(f"claim {namespace}/{name}: {uid[:64]!r} is not a claim UID")
    return ClaimRef(namespace, name, uid)


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of the answer to the kubelet."""

    request: str
    pool: str
    device: str
    share_id: str | None
    cdi_ids: tuple[str, ...]
    uuid: str
    milli: int
    memory_mib: int


@dataclass(frozen=True, slots=True)
class Prepared:
    """A claim prepared: the kubelet's answer and the CDI spec that backs it."""

    claim: ClaimRef
    devices: tuple[PreparedDevice, ...]
    spec: dict[str, Any]

    @property
    def spec_file(self) -> str:
        return spec_file(self.claim.uid)


def spec_file(uid: str) -> str:
    """The CDI spec file name of the claim with UID `uid`."""
    return f"{SPEC_PREFIX}{uid}.json"


def uid_of_spec(name: str) -> str | None:
    """The claim UID a spec file of ours is for; None for any other file."""
    if not (name.startswith(SPEC_PREFIX) and name.endswith(".json")):
        return None
    uid = name[len(SPEC_PREFIX) : -len(".json")]
    return uid if _UID.fullmatch(uid) else None


def cdi_device(uid: str, device: str) -> str:
    """The CDI device of one allocated device of a claim: `gpu-0-<claim UID>` (a CDI device
    name of spec 0.3.0 starts with a letter; a UID may start with a digit)."""
    return f"{device}-{uid}"


def cdi_name(uid: str, device: str) -> str:
    return f"{CDI_KIND}={cdi_device(uid, device)}"


def _container_edits(given: handover.Edits) -> dict[str, Any]:
    edits: dict[str, Any] = {"env": [f"{name}={value}" for name, value in given.env.items()]}
    if given.mounts:
        edits["mounts"] = [
            {
                "hostPath": mount.host_path,
                "containerPath": mount.container_path,
                "options": ["ro" if mount.read_only else "rw", "nosuid", "nodev", "bind"],
            }
            for mount in given.mounts
        ]
    if given.device_nodes:
        edits["deviceNodes"] = [
            {"path": path, "hostPath": path, "permissions": "rw"} for path in given.device_nodes
        ]
    return edits


def cdi_spec(uid: str, devices: Sequence[tuple[str, handover.Edits]]) -> dict[str, Any]:
    """The CDI spec of a claim: one CDI device per (device name, edits)."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [
            {"name": cdi_device(uid, device), "containerEdits": _container_edits(given)}
            for device, given in devices
        ],
    }


def _metadata(claim: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = claim.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def prepare(
    ref: ClaimRef,
    claim: Mapping[str, Any],
    node: str,
    gpus: Sequence[handover.NodeGpu],
    options: handover.Options,
) -> Prepared:
    """What `claim` (as read from the API) gets on `node`; see the module docstring.
    Raises `handover.Refusal`."""
    metadata = _metadata(claim)
    if metadata.get("uid") != ref.uid:
        raise handover.Refusal(
            f"{ref}: its UID is {str(metadata.get('uid'))[:64]!r} now, not {ref.uid} as the "
            "kubelet asks (the claim was replaced)"
        )
    if metadata.get("namespace") != ref.namespace or metadata.get("name") != ref.name:
        raise handover.Refusal(f"{ref}: the claim read is another one")
    try:
        results = dra.allocated(claim)
    except dra.DraError as error:
        raise handover.Refusal(f"{ref}: {error}") from None
    if not results:
        raise handover.Refusal(f"{ref}: its allocation has no device of {dra.DRIVER}")
    by_index = {gpu.index: gpu for gpu in gpus}
    pool = dra.pool_name(node)
    named = [result.device for result in results]
    twice = next((device for device in named if named.count(device) > 1), None)
    if twice is not None:
        raise handover.Refusal(
            f"{ref}: {twice} is allocated to it twice; one claim takes one share of a GPU"
        )
    devices: list[PreparedDevice] = []
    edits: list[tuple[str, handover.Edits]] = []
    for result in results:
        if result.pool != pool:
            raise handover.Refusal(
                f"{ref}: device {result.pool}/{result.device} is in another node's pool, "
                f"not {node}'s"
            )
        index = dra.gpu_index(result.device)
        gpu = by_index.get(index) if index is not None else None
        if gpu is None:
            raise handover.Refusal(f"{ref}: {result.device} is no GPU of {node}")
        if result.admin:
            milli, memory = WHOLE, 0
        else:
            milli, memory = result.milli, result.memory_mib
            _check_grant(ref, result.device, milli, memory, gpu)
        if mps_limits.is_share(milli) and len(results) > 1:
            raise handover.Refusal(
                f"{ref}: a share is one GPU, and this claim has {len(results)} devices of "
                f"{dra.DRIVER} with a share among them"
            )
        given = handover.edits(
            str(ref), (gpu.uuid,), milli, memory, gpus=gpus, options=options, context_inside=True
        )
        edits.append((result.device, given))
        devices.append(
            PreparedDevice(
                request=result.request,
                pool=result.pool,
                device=result.device,
                share_id=result.share_id,
                cdi_ids=(cdi_name(ref.uid, result.device), *given.cdi_devices),
                uuid=gpu.uuid,
                milli=milli,
                memory_mib=memory,
            )
        )
    return Prepared(ref, tuple(devices), cdi_spec(ref.uid, edits))


def _check_grant(
    ref: ClaimRef, device: str, milli: int, memory: int, gpu: handover.NodeGpu
) -> None:
    if milli == 0 and memory == 0:
        raise handover.Refusal(
            f"{ref}: it consumes neither compute nor memory of {device}; ask {dra.COMPUTE} "
            f"(milli-GPU), {dra.MEMORY}, or nothing for the whole GPU"
        )
    if gpu.memory_mib is not None and memory > gpu.memory_mib:
        raise handover.Refusal(
            f"{ref}: it consumes {memory} MiB of {device}, which has {gpu.memory_mib} MiB"
        )
    if milli >= WHOLE and gpu.memory_mib is not None and memory < gpu.memory_mib:
        raise handover.Refusal(
            f"{ref}: it takes the whole compute of {device} with {memory} MiB of its "
            f"{gpu.memory_mib} MiB memory; gpuplace caps memory only for a share: ask "
            f"{dra.COMPUTE} below {WHOLE} with that memory, or nothing for the whole GPU"
        )
