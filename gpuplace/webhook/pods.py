"""Careful reads of the raw pod dict in a review, and the pod-level rules of a GPU pod.

The API server only sends well-formed pods, but a review body is untrusted input: every
accessor checks the shape it reads and raises `reviews.ReviewError` (→ HTTP 400) instead
of failing with a KeyError or TypeError. Nothing here modifies the pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuplace.cluster import grammar, keys
from gpuplace.webhook.reviews import ReviewError

OUR_RESOURCES = (keys.RESOURCE_PERCENT, keys.RESOURCE_MEMORY, keys.RESOURCE_GPU)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ReviewError(f"{where} must be an object")
    return value


def metadata(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return _mapping(pod.get("metadata"), "object.metadata")


def spec(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return _mapping(pod.get("spec"), "object.spec")


def string_map(pod: Mapping[str, Any], field: str) -> dict[str, str]:
    """`metadata.annotations` or `metadata.labels`, checked to map strings to strings."""
    values = _mapping(metadata(pod).get(field), f"object.metadata.{field}")
    for key, value in values.items():
        if not isinstance(value, str):
            raise ReviewError(f"object.metadata.{field}[{key[:63]!r}] must be a string")
    return dict(values)


def annotations_of(pod: Mapping[str, Any] | None) -> dict[str, str]:
    return {} if pod is None else string_map(pod, "annotations")


def is_ours(key: str) -> bool:
    return key.startswith(keys.PREFIX)


def has_gpuplace_key(values: Mapping[str, str]) -> bool:
    """Whether any key is under `gpuplace.io/`. O(keys), no allocation: the fast path."""
    prefix = keys.PREFIX
    return any(key.startswith(prefix) for key in values)


def gpuplace_annotations(values: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in values.items() if key.startswith(keys.PREFIX)}


def system_annotations(values: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in values.items() if key in keys.SYSTEM_ANNOTATIONS}


def containers(pod: Mapping[str, Any], field: str = "containers") -> list[Mapping[str, Any]]:
    """`spec.containers` or `spec.initContainers`, each checked to be an object with a name."""
    raw = spec(pod).get(field)
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ReviewError(f"object.spec.{field} must be a list")
    for index, container in enumerate(raw):
        if not isinstance(container, Mapping) or not isinstance(container.get("name"), str):
            raise ReviewError(f"object.spec.{field}[{index}] must be an object with a name")
        for part in ("resources", "env"):
            value = container.get(part)
            if value is not None and not isinstance(value, dict if part == "resources" else list):
                raise ReviewError(f"object.spec.{field}[{index}].{part} has the wrong type")
        resources = container.get("resources") or {}
        for part in ("requests", "limits"):
            if not isinstance(resources.get(part) or {}, Mapping):
                raise ReviewError(
                    f"object.spec.{field}[{index}].resources.{part} must be an object"
                )
    return raw


def requests_our_resources(container: Mapping[str, Any]) -> list[str]:
    resources = container.get("resources") or {}
    found: list[str] = []
    for part in ("requests", "limits"):
        values = resources.get(part) or {}
        found.extend(name for name in OUR_RESOURCES if name in values and name not in found)
    return found


def problems(pod: Mapping[str, Any], spec_: grammar.PodGpuSpec) -> tuple[int, list[str]]:
    """Index of the GPU container and what is wrong with the pod as a whole for `spec_`.

    Raises `AnnotationError` when `gpuplace.io/container` names no container.
    """
    regular = containers(pod)
    init = containers(pod, "initContainers")
    index, _ = grammar.gpu_container(pod, spec_)
    if spec_.container is None:
        # Reinvoked after another webhook put a container first: stay on the one we chose.
        carrying = [i for i, container in enumerate(regular) if requests_our_resources(container)]
        if len(carrying) == 1:
            index = carrying[0]
    found: list[str] = []
    node_name = spec(pod).get("nodeName")
    if node_name:
        found.append(
            "spec.nodeName is set: a pod placed on a node by hand bypasses the scheduler and "
            "would get no GPU; remove spec.nodeName (use node affinity to choose nodes)"
        )
    for field, listed in (("containers", regular), ("initContainers", init)):
        for position, container in enumerate(listed):
            if field == "containers" and position == index:
                continue
            names = requests_our_resources(container)
            if names:
                found.append(
                    f"spec.{field}[{position}] ({container['name']}) requests "
                    f"{', '.join(names)}: only the GPU container "
                    f"({regular[index]['name']}) may, and gpuplace sets it from the annotations"
                )
    return index, found


def display_name(pod: Mapping[str, Any] | None, fallback: str = "") -> tuple[str, str]:
    """(name, generateName) for logs; at CREATE of a generated pod the name is still empty."""
    if pod is None:
        return fallback, ""
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping):
        return fallback, ""
    name = meta.get("name")
    generate = meta.get("generateName")
    return (
        name if isinstance(name, str) and name else fallback,
        generate if isinstance(generate, str) else "",
    )
