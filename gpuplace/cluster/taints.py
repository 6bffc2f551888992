"""A Node's taints and cordon, and a Pod's tolerations, as the API sends them → the
engine's values (`gpuplace.placement.taints`), for the gang planner to judge nodes as
kube-scheduler does.

Careful reads: an entry that is not an object, or a field of the wrong type, is skipped
or read as empty (what the API server's validation makes impossible is never a reason to
fail a node or a pod). O(taints) and O(tolerations).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuplace.placement.taints import EQUAL, Taint, Toleration


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def of_node(node: Mapping[str, Any]) -> tuple[tuple[Taint, ...], bool]:
    """(`spec.taints`, `spec.unschedulable`) of a Node object."""
    spec = node.get("spec")
    if not isinstance(spec, Mapping):
        return (), False
    raw = spec.get("taints")
    found = tuple(
        Taint(_text(item.get("key")), _text(item.get("value")), _text(item.get("effect")))
        for item in (raw if isinstance(raw, list) else [])
        if isinstance(item, Mapping)
    )
    return found, spec.get("unschedulable") is True


def of_pod(pod: Mapping[str, Any]) -> tuple[Toleration, ...]:
    """`spec.tolerations` of a Pod object (operator defaults to Equal, as the API's)."""
    spec = pod.get("spec")
    raw = spec.get("tolerations") if isinstance(spec, Mapping) else None
    return tuple(
        Toleration(
            key=_text(item.get("key")),
            operator=_text(item.get("operator")) or EQUAL,
            value=_text(item.get("value")),
            effect=_text(item.get("effect")),
        )
        for item in (raw if isinstance(raw, list) else [])
        if isinstance(item, Mapping)
    )
