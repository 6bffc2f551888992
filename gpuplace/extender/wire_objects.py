"""The Kubernetes objects inside the extender's arguments: strict shapes of the parts
gpuplace reads, checked before any use.

The `Pod` of every verb, the full `Nodes` and the victim pods kube-scheduler sends when
it is not node-cache capable are Kubernetes API objects, encoded with the API's own JSON
names (`metadata`, `spec`, `nodeName`, ...), unlike the extender types around them
(`gpuplace.extender.wire`). They stay the raw dicts kube-scheduler sent (the readers in
`gpuplace.cluster` work on them, and full nodes go back as they came); these models only
check them, through `checked_pod`, `checked_node` and `checked_victim`: a part that is
read must have the type the API gives it (metadata an object, name and uid strings,
annotations and labels strings, spec.priority an int32, containers objects whose
resources map names to quantity strings), or the request is not one kube-scheduler sends
and gets HTTP 400 naming the part. Strict: nothing is coerced (Go's decoder would not
read `"5"` into an int32 either). Parts gpuplace never reads are not looked at.

Each check is O(size of the checked parts): a pod's metadata and containers.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

INT32 = 1 << 31
MAX_NAME = 253
"""A DNS subdomain: the longest name of a pod or node."""


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, populate_by_name=True)


class Resources(_Shape):
    # resource.Quantity is always encoded as a string
    requests: dict[str, str] | None = None
    limits: dict[str, str] | None = None


class Container(_Shape):
    name: str = ""
    resources: Resources | None = None
    restart_policy: str | None = Field(default=None, alias="restartPolicy")


class PodSpec(_Shape):
    priority: int | None = Field(default=None, ge=-INT32, lt=INT32)
    node_name: str | None = Field(default=None, alias="nodeName")
    containers: list[Container] | None = None
    init_containers: list[Container] | None = Field(default=None, alias="initContainers")
    overhead: dict[str, str] | None = None


class PodMetadata(_Shape):
    name: str = Field(min_length=1, max_length=MAX_NAME)
    namespace: str = Field(default="", max_length=63)
    uid: str = Field(default="", max_length=128)
    annotations: dict[str, str] | None = None
    labels: dict[str, str] | None = None


class Pod(_Shape):
    """A pod to place or preempt for: its name, namespace, UID, annotations, labels,
    priority and containers' resources are read."""

    metadata: PodMetadata
    spec: PodSpec | None = None


class NodeMetadata(_Shape):
    name: str = Field(min_length=1, max_length=MAX_NAME)


class Node(_Shape):
    """A full node (kube-scheduler not node-cache capable): only its name is read."""

    metadata: NodeMetadata


class VictimMetadata(_Shape):
    uid: str = Field(default="", max_length=128)


class Victim(_Shape):
    """A victim as a full pod (kube-scheduler not node-cache capable): its UID is read."""

    metadata: VictimMetadata


_MODEL_NAMED = re.compile(r"a valid dictionary or instance of \w+")


def describe(error: ValidationError, most: int = 5) -> str:
    """The first `most` errors of `error` as `where: why; ...`, in the wire's words
    (an object, not a model class). O(most)."""
    parts = []
    for item in error.errors(include_url=False)[:most]:
        where = ".".join(str(part) for part in item["loc"])
        why = _MODEL_NAMED.sub("an object", item["msg"])
        parts.append(f"{where}: {why}" if where else why)
    return "; ".join(parts)


def _checked(shape: type[_Shape], value: Any) -> Any:
    """`value` itself when it has `shape`; else a validation error (of the field being
    validated) that names the parts that do not and why."""
    try:
        shape.model_validate(value)
    except ValidationError as error:
        raise PydanticCustomError("shape", "{why}", {"why": describe(error, 3)}) from None
    return value


def checked_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """`pod` (a verb's `Pod`), checked against `Pod`. O(metadata + containers)."""
    result: dict[str, Any] = _checked(Pod, pod)
    return result


def checked_node(node: dict[str, Any]) -> dict[str, Any]:
    """`node` (one of `Nodes.items`), checked against `Node`. O(1)."""
    result: dict[str, Any] = _checked(Node, node)
    return result


def checked_victim(pod: dict[str, Any]) -> dict[str, Any]:
    """`pod` (a victim of `NodeNameToVictims`), checked against `Victim`. O(1)."""
    result: dict[str, Any] = _checked(Victim, pod)
    return result
