"""kube-scheduler's extender v1 JSON (k8s.io/kube-scheduler/extender/v1), as pydantic models.

The Go types have no JSON tags, so the keys are the Go field names (`Pod`, `NodeNames`,
`FailedNodes`, ...); Go's decoder matches keys case-insensitively, so lower-camel
spellings are accepted too. The pod stays the raw dict kube-scheduler sent. With
`nodeCacheCapable: true` the scheduler sends `NodeNames` and `Nodes: null`; without it,
a full `Nodes` list, and the answer must then be a `Nodes` list too (both handled).
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from collections.abc import Sequence
from typing import Annotated, Any

import pydantic_core
from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, RootModel

from gpuplace.extender import c_helpers, wire_objects
from gpuplace.extender.node_names import EveryNode
from gpuplace.placement import choosing
from gpuplace.placement.choosing import Choice

MAX_SCORE = choosing.MAX_EXTENDER_SCORE
"""kube-scheduler's extender scores are 0-10 (MaxExtenderPriority)."""


def _alias(name: str) -> AliasChoices:
    return AliasChoices(name, name[0].lower() + name[1:])


class _In(BaseModel):
    """What kube-scheduler sends: strict (no coercion: Go's decoder reads no `"5"` into
    an int either); the Kubernetes objects inside are checked by
    `gpuplace.extender.wire_objects`."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


class _Out(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


WirePod = Annotated[dict[str, Any], AfterValidator(wire_objects.checked_pod)]
"""A verb's `Pod`: the raw dict, checked (`gpuplace.extender.wire_objects.Pod`)."""
WireNode = Annotated[dict[str, Any], AfterValidator(wire_objects.checked_node)]
"""A full node: the raw dict, checked (`gpuplace.extender.wire_objects.Node`)."""


class NodeList(_In):
    items: list[WireNode] = Field(default_factory=list)

    def names(self) -> list[str]:
        return [str(item["metadata"]["name"]) for item in self.items]


_NAMES_KEY = b'"NodeNames":'


class ExtenderArgs(_In):
    """What `filter` and `prioritize` receive."""

    pod: WirePod = Field(validation_alias=_alias("Pod"))
    nodes: NodeList | None = Field(default=None, validation_alias=_alias("Nodes"))
    node_names: list[str] | None = Field(default=None, validation_alias=_alias("NodeNames"))

    @classmethod
    def with_names(cls, raw: bytes, names: list[str], names_json: bytes) -> ExtenderArgs | None:
        """`model_validate_json(raw)` without parsing `NodeNames` when the body ends with
        it and it is `names_json` byte for byte (the encoding of `names`, which become
        the arguments' `node_names` as they are); None otherwise (parse it whole).

        kube-scheduler encodes ExtenderArgs in Go's field order (Pod, Nodes, NodeNames)
        and sends prioritize the nodes filter answered, in their order: the very list
        we encoded (DNS names encode alike in Go and here). One comparison of bytes
        then stands for a parse of ~10,000 strings and a comparison of lists.
        O(len(raw)) byte comparisons plus the parse of the rest (see `_rest`)."""
        body = raw.rstrip()
        start = len(body) - 1 - len(names_json)
        if not body.endswith(b"}") or not body.startswith(names_json, start):
            return None
        return cls._rest(body, start, names)

    @classmethod
    def with_every_name(cls, raw: bytes, every: EveryNode) -> ExtenderArgs | None:
        """`model_validate_json(raw)` without parsing `NodeNames` when the body ends with
        it and it names each node of `every` once, in any order (compared as bytes, no
        str per name: `EveryNode.listed_by`); the arguments' `node_names` are then
        `every.names` itself, which tells the engine they are every node. None
        otherwise (parse it whole).

        kube-scheduler's filter usually names every node (all passed its own filters);
        at 10,000 nodes this stands for a parse of ~10,000 strings and as many lookups.
        O(len(raw)) plus the parse of the rest (see `_rest`)."""
        body = raw.rstrip()
        start = body.rfind(_NAMES_KEY) + len(_NAMES_KEY)
        if (
            start < len(_NAMES_KEY)
            or not body.endswith(b"}")
            or not every.listed_by(body, start, len(body) - 1)
        ):
            return None
        return cls._rest(body, start, every.names)

    @classmethod
    def _rest(cls, body: bytes, start: int, names: list[str]) -> ExtenderArgs | None:
        """The arguments of `body` (stripped, ending with `}`) whose `NodeNames` value is
        the complete JSON array `body[start:-1]` (checked by the caller), with `names`
        for it; None when `"NodeNames":` does not come right before it after a `,` or
        `{`, or the rest is not valid.

        Sound for any input: that quote then opens a key (inside a string a quote is
        escaped), and the rest, with `null` for the array, is parsed and validated as
        usual, so in valid JSON this is the outermost object's last `NodeNames` (the
        one a parse keeps). O(len(body))."""
        key = start - len(_NAMES_KEY)
        if (
            key <= 0
            or not body.startswith(_NAMES_KEY, key)
            or not body[:key].rstrip().endswith((b",", b"{"))
        ):
            return None
        try:
            rest = cls.model_validate_json(body[:start] + b"null}")
        except ValueError:
            return None
        return rest.model_copy(update={"node_names": names})

    def names(self) -> list[str]:
        """The candidate node names, from NodeNames or else from Nodes. `node_names`
        itself, not a copy (its identity may matter, see `with_every_name`): read only."""
        if self.node_names is not None:
            return self.node_names
        if self.nodes is not None:
            return [name for name in self.nodes.names() if name]
        return []

    def node_objects(self) -> dict[str, dict[str, Any]] | None:
        """Node objects by name when the scheduler sent full nodes (not cache-capable)."""
        if self.node_names is not None or self.nodes is None:
            return None
        return {str(item["metadata"]["name"]): item for item in self.nodes.items}


class FilterResult(_Out):
    """`filter`'s answer: the nodes that fit, and why the others do not."""

    nodes: dict[str, Any] | None = Field(default=None, alias="Nodes")
    node_names: list[str] | None = Field(default=None, alias="NodeNames")
    failed_nodes: dict[str, str] = Field(default_factory=dict, alias="FailedNodes")
    failed_and_unresolvable: dict[str, str] = Field(
        default_factory=dict, alias="FailedAndUnresolvableNodes"
    )
    error: str = Field(default="", alias="Error")

    def dump(self) -> bytes:
        """The JSON kube-scheduler reads: `Nodes` when full nodes were sent, else
        `NodeNames`. Written from the fields as they are (str-to-str maps and lists of
        str, by construction), by pydantic-core's encoder: the model's own
        `model_dump_json` takes twice as long on 10,000 nodes. O(nodes)."""
        return self.dump_with_names()[0]

    def dump_with_names(self) -> tuple[bytes, bytes | None]:
        """`dump`, and the encoding of `NodeNames` within it (None when it has `Nodes`)
        for `ExtenderArgs.with_names`: each part encoded once. O(nodes)."""
        rest = pydantic_core.to_json(
            {
                "FailedNodes": self.failed_nodes,
                "FailedAndUnresolvableNodes": self.failed_and_unresolvable,
                "Error": self.error,
            }
        )
        if self.nodes is not None:
            return b'{"Nodes":' + pydantic_core.to_json(self.nodes) + b"," + rest[1:], None
        names = pydantic_core.to_json(self.node_names)
        return b"{" + _NAMES_KEY + names + b"," + rest[1:], names


class HostPriority(_Out):
    host: str = Field(alias="Host")
    score: int = Field(alias="Score", ge=0, le=MAX_SCORE)


class HostPriorityList(RootModel[list[HostPriority]]):
    def dump(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()


def priorities_json(hosts: list[str], scores: list[int]) -> bytes:
    """`[{"Host", "Score"}]` for scores we computed (ints 0-10 by construction), host by
    host, *leaving out the hosts that score 0*: the same JSON as `HostPriorityList.dump`
    of the others, without a model object per node (10,000 nodes). O(n).

    kube-scheduler adds an extender's scores to the nodes' totals by name
    (`combinedScores[host] += score * weight` in prioritizeNodes), so a node left out
    counts exactly as one scored 0; at 10,000 nodes a third of the answer and of the
    scheduler's decoding is saved. Node names are written as they are when JSON needs
    no escape for them (DNS names never do), else through `json.dumps`."""
    if len(hosts) != len(scores):
        raise ValueError(f"{len(hosts)} hosts but {len(scores)} scores")
    if 0 in scores:
        hosts = list(itertools.compress(hosts, scores))
        scores = list(filter(None, scores))
    if not hosts:
        return b"[]"
    if len(hosts) > 1 and _PLAIN.fullmatch("".join(hosts)) and min(scores) >= 0:
        try:  # each score's tail, picked in C (an int 0-10 or nothing)
            tails = operator.itemgetter(*scores)(_TAILS)
        except (IndexError, TypeError):
            tails = None
        if tails is not None:
            out = [""] * (2 * len(hosts))
            out[::2] = hosts
            out[1::2] = tails
            return ('[{"Host":"' + "".join(out)[: -len(_NEXT)] + "]").encode()
    parts = [
        f'{{"Host":{json.dumps(host)},"Score":{int(score)}}}'
        for host, score in zip(hosts, scores, strict=True)
    ]
    return ("[" + ",".join(parts) + "]").encode()


def ranked_priorities_json(hosts: list[str], chosen: Sequence[Choice | None]) -> bytes:
    """`priorities_json(hosts, choosing.ranked_found(chosen))`: prioritize's answer given
    each host's choice (None: none). One pass in C where the helper is in use
    (`gpuplace/extender/_priorities.c`, `c_helpers.RANKED_JSON`; the same bytes, ~9 times
    faster at 10,000 nodes), else in Python. O(n)."""
    ranked_json = c_helpers.RANKED_JSON
    if ranked_json is not None:
        listed = chosen if isinstance(chosen, list) else list(chosen)
        answer = ranked_json(hosts, listed, choosing.MAX_EXTENDER_SCORE)
        if answer is not None:
            return answer
    return priorities_json(hosts, choosing.ranked_found(chosen))


_NEXT = ',{"Host":"'
_TAILS = tuple(f'","Score":{score}}}{_NEXT}' for score in range(MAX_SCORE + 1))
"""After a host: its score, the end of its entry and the start of the next one."""
_PLAIN = re.compile(r"[A-Za-z0-9._:-]*")


class BindingArgs(_In):
    """What `bind` receives."""

    pod_name: str = Field(validation_alias=_alias("PodName"), min_length=1, max_length=253)
    pod_namespace: str = Field(validation_alias=_alias("PodNamespace"), min_length=1, max_length=63)
    pod_uid: str = Field(validation_alias=_alias("PodUID"), min_length=1, max_length=128)
    node: str = Field(validation_alias=_alias("Node"), min_length=1, max_length=253)


class BindingResult(_Out):
    error: str = Field(default="", alias="Error")

    def dump(self) -> bytes:
        return self.model_dump_json().encode()
