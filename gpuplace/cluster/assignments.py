"""The assignment annotations: how a grant is written on its pod, and read back.

The only module that reads or writes `keys.ASSIGNED_*`, `keys.VISIBLE_DEVICES` and
`keys.MPS_MEMORY_LIMIT`.
The sidecar writes them at bind (before the Binding, and again on it); the ledger is
rebuilt from them at every start, so `grant_of(pod_with(annotations_for(g)))` must give
back exactly `g` (a property test holds it to that).

Format (all values strings, as annotations are):

- `gpuplace.io/assigned-node`: the node name (`gpu-a100-0`);
- `gpuplace.io/assigned-gpus`: GPU indices on that node, comma-separated, in grant
  order (`0,3`);
- `gpuplace.io/assigned-uuids`: their UUIDs in the same order (`GPU-5f…,GPU-91…`),
  empty when the node does not publish UUIDs for all of them;
- `gpuplace.io/visible-devices`: what NVIDIA_VISIBLE_DEVICES must hold: the UUIDs
  when known, else the indices;
- `gpuplace.io/assigned-milli`: milli-GPU granted on each of those GPUs (`500`;
  1000 = whole; 0 = a memory-only share, one GPU with memory, no compute reserved);
- `gpuplace.io/assigned-memory-mib`: GPU memory granted on each, MiB (`20480`; 0 =
  none asked);
- `gpuplace.io/assigned-at`: RFC 3339 UTC time of the grant, to the microsecond
  (`2026-11-21T05:44:24.048213Z`), as `Stamps` issues it: strictly later than every
  earlier grant's, so these times order admissions exactly (victims are taken "most
  recently admitted first"), also within one second and after a restart. Read
  tolerantly: whole seconds (what gpuplace wrote before) and any count of fraction
  digits (beyond 6 dropped) read too;
- `gpuplace.io/mps-memory-limit`: what `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` must hold for a
  share with memory (`0=2317M`: the ask plus the CUDA context the node publishes for the
  granted GPU, `mps_limits.memory_limit`), "" for whole GPUs and shares without memory.
  Written for the webhook's env path (nodes without the node agent, which point the env
  var here through the downward API); never read back into the grant.

CPU and host memory of a grant are not annotated: they are the pod's own requests
(`annotations.request_for`), which the API keeps. Must never do I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuplace.cluster import keys, mps_limits
from gpuplace.placement.inventory import ClientContext, Node
from gpuplace.placement.ledger import Grant, GrantState
from gpuplace.placement.requests import WHOLE, GpuRequest

KEYS = (
    keys.ASSIGNED_NODE,
    keys.ASSIGNED_GPUS,
    keys.ASSIGNED_UUIDS,
    keys.VISIBLE_DEVICES,
    keys.ASSIGNED_MILLI,
    keys.ASSIGNED_MEMORY,
    keys.ASSIGNED_AT,
    keys.MPS_MEMORY_LIMIT,
)
MAX_GPUS = 1024
_INDEX = re.compile(r"[0-9]{1,4}")
_INTEGER = re.compile(r"[0-9]{1,12}")


class AssignmentError(ValueError):
    """Assignment annotations that do not read as a grant; the message names the key."""


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def assigned(pod: Mapping[str, Any]) -> bool:
    """True when the pod carries an assignment (the node annotation)."""
    return bool(_annotations(pod).get(keys.ASSIGNED_NODE))


def _integer(annotations: Mapping[str, Any], key: str, low: int, high: int) -> int:
    raw = str(annotations.get(key, "")).strip()
    if not _INTEGER.fullmatch(raw) or not low <= int(raw) <= high:
        raise AssignmentError(f"{key}={raw[:40]!r}: must be an integer from {low} to {high}")
    return int(raw)


def grant_of(pod: Mapping[str, Any], request: GpuRequest | None = None) -> Grant | None:
    """The grant a pod's annotations record, or None when it has none.

    `state` is CONFIRMED when the pod is bound to the assigned node, else RESERVED;
    CPU and host memory come from `request` (the pod's own requests). Raises
    `AssignmentError` on unreadable values. O(GPUs).
    """
    annotations = _annotations(pod)
    node = str(annotations.get(keys.ASSIGNED_NODE) or "").strip()
    if not node:
        return None
    metadata = pod.get("metadata") or {}
    uid = str(metadata.get("uid") or "")
    if not uid:
        raise AssignmentError("the pod has no uid")
    raw_gpus = str(annotations.get(keys.ASSIGNED_GPUS, "")).strip()
    parts = [part.strip() for part in raw_gpus.split(",")] if raw_gpus else []
    if not parts or len(parts) > MAX_GPUS or not all(_INDEX.fullmatch(part) for part in parts):
        raise AssignmentError(
            f"{keys.ASSIGNED_GPUS}={raw_gpus[:40]!r}: must be comma-separated GPU indices"
        )
    gpus = tuple(int(part) for part in parts)
    if len(set(gpus)) != len(gpus):
        raise AssignmentError(f"{keys.ASSIGNED_GPUS}={raw_gpus[:40]!r}: names a GPU twice")
    milli = _integer(annotations, keys.ASSIGNED_MILLI, 0, WHOLE)
    memory = _integer(annotations, keys.ASSIGNED_MEMORY, 0, 1 << 40)
    if milli == 0 and (len(gpus) != 1 or memory == 0):
        raise AssignmentError(
            f"{keys.ASSIGNED_MILLI}=0 (a memory-only share) needs one GPU in "
            f"{keys.ASSIGNED_GPUS} and {keys.ASSIGNED_MEMORY} > 0"
        )
    bound = str((pod.get("spec") or {}).get("nodeName") or "")
    return Grant(
        pod_uid=uid,
        node=node,
        gpus=gpus,
        milli=milli,
        memory_mib=memory,
        cpu_milli=request.cpu_milli if request is not None else 0,
        host_memory_mib=request.host_memory_mib if request is not None else 0,
        state=GrantState.CONFIRMED if bound == node else GrantState.RESERVED,
    )


def uuids_of(pod: Mapping[str, Any]) -> tuple[str, ...]:
    """The granted GPUs' UUIDs in grant order (`gpuplace.io/assigned-uuids`), as written at
    bind; () when the node published no UUIDs for them (the indices then name the GPUs).
    O(GPUs granted)."""
    raw = str(_annotations(pod).get(keys.ASSIGNED_UUIDS) or "").strip()
    return tuple(part.strip() for part in raw.split(",")) if raw else ()


def assigned_at(pod: Mapping[str, Any]) -> float | None:
    """The grant's time as a POSIX timestamp (to the microsecond, whole seconds for an
    annotation written so), or None when absent or unreadable."""
    raw = str(_annotations(pod).get(keys.ASSIGNED_AT) or "")
    if not raw:
        return None
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def rfc3339(moment: datetime) -> str:
    """RFC 3339 UTC in whole seconds, as Kubernetes writes times (conditions, statuses)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def precise(moment: datetime) -> str:
    """RFC 3339 UTC to the microsecond (`2026-11-21T05:44:24.048213Z`): `assigned-at`."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
AHEAD = 60.0
"""Seconds an `assigned-at` read from the API may lie ahead of the caller's clock and
still push later stamps after it (`Stamps.next`)."""


def _micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


class Stamps:
    """The times of grants written by this process: strictly increasing, so that the
    order of `assigned-at` is the order of admission (a hybrid logical clock).

    `next(now)` is `now` (the caller's POSIX clock) to the microsecond, unless that is
    not after the latest stamp it issued or saw (`seen`: the `assigned-at` of every pod
    the ledger is rebuilt from), then one microsecond after that. So two grants within
    one microsecond, or with a wall clock that stepped back, still come out in order,
    and after a restart (or a failover to a host whose clock is a little behind) the
    new stamps follow every stamp in the API. A seen stamp more than `AHEAD` seconds
    beyond `now` is not followed: it comes from a clock that was wrong, and following it
    would date every later grant ahead of time (the reaper reads these times against
    the clock). O(1) each; no I/O.
    """

    __slots__ = ("_issued", "_seen")

    def __init__(self) -> None:
        self._issued = 0
        """The latest stamp issued, microseconds since the epoch."""
        self._seen = 0
        """The latest stamp seen in the API, microseconds since the epoch."""

    def seen(self, at: float | None) -> None:
        """An `assigned-at` read from the API (POSIX seconds; None: none)."""
        if at is not None:
            self._seen = max(self._seen, _micros(at))

    def next(self, now: float) -> datetime:
        """The stamp of a grant written now (see the class docstring)."""
        clock = _micros(now)
        seen = self._seen if self._seen <= clock + _micros(AHEAD) else 0
        self._issued = max(clock, self._issued + 1, seen + 1)
        return _EPOCH + timedelta(microseconds=self._issued)


def annotations_for(grant: Grant, node: Node | None, at: datetime) -> dict[str, str]:
    """The annotations that record `grant` (UUIDs from `node` when it publishes them)."""
    indices = ",".join(str(index) for index in grant.gpus)
    uuids = ""
    if node is not None and all(
        index < len(node.gpus) and node.gpus[index].uuid for index in grant.gpus
    ):
        uuids = ",".join(node.gpus[index].uuid for index in grant.gpus)
    return {
        keys.ASSIGNED_NODE: grant.node,
        keys.ASSIGNED_GPUS: indices,
        keys.ASSIGNED_UUIDS: uuids,
        keys.VISIBLE_DEVICES: uuids or indices,
        keys.ASSIGNED_MILLI: str(grant.milli),
        keys.ASSIGNED_MEMORY: str(grant.memory_mib),
        keys.ASSIGNED_AT: precise(at),
        keys.MPS_MEMORY_LIMIT: mps_limits.memory_limit(
            grant.milli, grant.memory_mib, len(grant.gpus), context_of(grant, node)
        ),
    }


def context_of(grant: Grant, node: Node | None) -> ClientContext:
    """The CUDA context the engine counted for `grant`'s clients: its GPUs' (the largest,
    should they differ) as `node` has them; `mps_limits.UNMEASURED`'s when the node is
    unknown. O(GPUs of the grant)."""
    if node is None or not grant.gpus or not all(index < len(node.gpus) for index in grant.gpus):
        return mps_limits.UNMEASURED.context
    contexts = [node.gpus[index].context for index in grant.gpus]
    return max(contexts, key=lambda context: context.mib(grant.milli))


def cleared() -> dict[str, None]:
    """A merge-patch `metadata.annotations` value that removes every assignment key."""
    return dict.fromkeys(KEYS)


def gpus_text(pod: Mapping[str, Any]) -> str:
    """The granted GPUs' indices as written (`gpuplace.io/assigned-gpus`: `0,3`; "" for
    none), for what Events show."""
    return str(_annotations(pod).get(keys.ASSIGNED_GPUS) or "")


def restamped(at: datetime) -> dict[str, str]:
    """A merge-patch `metadata.annotations` value that moves the grant's time to `at`
    (a gang's members, when they are ungated: their grant counts from then), to the
    microsecond as `annotations_for` writes it."""
    return {keys.ASSIGNED_AT: precise(at)}
