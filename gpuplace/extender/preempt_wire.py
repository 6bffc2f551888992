"""kube-scheduler's extender `preempt` verb JSON (k8s.io/kube-scheduler/extender/v1), as
pydantic models: `ExtenderPreemptionArgs` in, `ExtenderPreemptionResult` out.

As for the other verbs (`gpuplace.extender.wire`), the Go types have no JSON tags: the keys are
the Go field names (`Pod`, `NodeNameToVictims`, `NodeNameToMetaVictims`, `Pods`, `UID`,
`NumPDBViolations`), and Go's decoder also takes them in any letter case. With
`nodeCacheCapable: true` kube-scheduler sends `NodeNameToMetaVictims` (victims by UID)
and `NodeNameToVictims: null`; without it, full pods in `NodeNameToVictims` (both read).

The answer is always `NodeNameToMetaVictims` (kube-scheduler reads only that): per node
kept, at least one victim (a node with none is an error to kube-scheduler, which then
fails the whole preemption), each a pod on that node; a node left out is no longer a
candidate. kube-scheduler keeps only the pods of the answer (`NumPDBViolations` is not
read back), and a UID not on that node fails the whole preemption.
"""

from __future__ import annotations

from typing import Annotated, Any

import pydantic_core
from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, with_config
from typing_extensions import TypedDict

from gpuplace.extender import wire_objects
from gpuplace.extender.wire import WirePod, _alias, _In


@with_config(ConfigDict(extra="ignore"))
class MetaPod(TypedDict):
    """A victim by UID. A TypedDict, not a model: a call may name 100,000 of them, and a
    dict each decodes ~5 times faster than a model object each."""

    uid: Annotated[str, Field(validation_alias=AliasChoices("UID", "uid", "Uid"), max_length=128)]


PdbViolations = Annotated[int, Field(ge=0, lt=1 << 63)]
"""kube-scheduler's count of PDB violations among a node's victims (an int64)."""
FullVictim = Annotated[dict[str, Any], AfterValidator(wire_objects.checked_victim)]
"""A victim as a full pod: the raw dict, checked (`gpuplace.extender.wire_objects.Victim`)."""


class MetaVictims(_In):
    pods: list[MetaPod] | None = Field(default=None, validation_alias=_alias("Pods"))
    num_pdb_violations: PdbViolations = Field(
        default=0, validation_alias=_alias("NumPDBViolations")
    )


class Victims(_In):
    """A node's victims as full pods (kube-scheduler not node-cache capable)."""

    pods: list[FullVictim] | None = Field(default=None, validation_alias=_alias("Pods"))
    num_pdb_violations: PdbViolations = Field(
        default=0, validation_alias=_alias("NumPDBViolations")
    )


class PreemptionArgs(_In):
    """What `preempt` receives."""

    pod: WirePod = Field(validation_alias=_alias("Pod"))
    node_name_to_victims: dict[str, Victims | None] | None = Field(
        default=None, validation_alias=_alias("NodeNameToVictims")
    )
    node_name_to_meta_victims: dict[str, MetaVictims | None] | None = Field(
        default=None, validation_alias=_alias("NodeNameToMetaVictims")
    )

    def offered(self) -> dict[str, tuple[list[str], int]]:
        """Per candidate node, the victims' UIDs in kube-scheduler's order and its count
        of PDB violations among them, from whichever form was sent. O(victims)."""
        found: dict[str, tuple[list[str], int]] = {}
        for name, meta in (self.node_name_to_meta_victims or {}).items():
            if meta is not None:
                found[name] = ([pod["uid"] for pod in meta.pods or ()], meta.num_pdb_violations)
        for name, full in (self.node_name_to_victims or {}).items():
            if full is not None and name not in found:
                uids = [str(pod["metadata"].get("uid") or "") for pod in full.pods or ()]
                found[name] = ([uid for uid in uids if uid], full.num_pdb_violations)
        return found


class PreemptionResult(BaseModel):
    """`preempt`'s answer: per node kept, the victims by UID."""

    model_config = ConfigDict(frozen=True)

    nodes: dict[str, tuple[list[str], int]] = Field(default_factory=dict)

    def dump(self) -> bytes:
        """`{"NodeNameToMetaVictims": {node: {"Pods": [{"UID"}], "NumPDBViolations"}}}`."""
        return pydantic_core.to_json(
            {
                "NodeNameToMetaVictims": {
                    name: {
                        "Pods": [{"UID": uid} for uid in uids],
                        "NumPDBViolations": violations,
                    }
                    for name, (uids, violations) in self.nodes.items()
                }
            }
        )
