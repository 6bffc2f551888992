"""The GpuQueue custom resource (gpuqueues.gpuplace.io/v1alpha1) at the edge: its wire shape
(pydantic, as the API server stores it: camelCase, quantities as strings or integers) and its
conversion into the engine's `gpuplace.placement.queueing.quotas.QueueSpec`.

The CRD (deploy/base/gpuqueue-crd.yaml) refuses nonsense on the API server; this module
checks the same again, so that a queue read from a file (`gpuplace simulate --queues`) or an
API server without the CRD's rules gets the same refusal, with the queue's name in it.

Units: `gpus` and `gpu-compute` in milli-GPU, `gpu-memory` in MiB, each rounded down (a
quota is never more than it says). No I/O: the caller reads the objects.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuplace.cluster import grammar, quantities
from gpuplace.placement.queueing import quotas
from gpuplace.placement.requests import WHOLE

GROUP = "gpuplace.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GpuQueue"
PLURAL = "gpuqueues"

Quantity = str | int
PreemptionPolicy = Literal["Never", "LowerPriority", "Any"]
FairStrategyName = Literal["LessThanOrEqualToFinalShare", "LessThanInitialShare"]


def _final_share_only() -> list[FairStrategyName]:
    return ["LessThanOrEqualToFinalShare"]


class QueueError(ValueError):
    """A GpuQueue that cannot be used; the message names it and the field at fault."""


class _Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)


class QuotaLine(_Model):
    name: Literal["gpus", "gpu-compute", "gpu-memory"]
    model: str = Field(default=quotas.ANY_MODEL, min_length=1, max_length=63)
    nominal: Quantity
    borrowing_limit: Quantity | None = Field(default=None, alias="borrowingLimit")
    lending_limit: Quantity | None = Field(default=None, alias="lendingLimit")


class Preemption(_Model):
    reclaim_within_cohort: PreemptionPolicy = Field(default="Any", alias="reclaimWithinCohort")
    fair_sharing: PreemptionPolicy = Field(default="Never", alias="fairSharing")
    fair_sharing_strategies: list[FairStrategyName] = Field(
        default_factory=_final_share_only,
        alias="fairSharingStrategies",
        min_length=1,
        max_length=2,
    )

    @model_validator(mode="after")
    def _strategies_are_distinct(self) -> Self:
        if len(set(self.fair_sharing_strategies)) != len(self.fair_sharing_strategies):
            raise ValueError("fairSharingStrategies must not name a strategy twice")
        return self


class Requirement(_Model):
    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _values_fit_the_operator(self) -> Self:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError("In and NotIn need values; Exists and DoesNotExist take none")
        return self

    def matches(self, labels: Mapping[str, str]) -> bool:
        """As Kubernetes' label selectors match. O(values)."""
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        inside = labels.get(self.key) in self.values
        return inside if self.operator == "In" else not inside


class LabelSelector(_Model):
    match_labels: dict[str, str] = Field(default_factory=dict, alias="matchLabels")
    match_expressions: list[Requirement] = Field(
        default_factory=list, alias="matchExpressions", max_length=32
    )

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Every label and every requirement holds (an empty selector matches all)."""
        return all(labels.get(key) == value for key, value in self.match_labels.items()) and all(
            requirement.matches(labels) for requirement in self.match_expressions
        )


class Spec(_Model):
    namespace_selector: LabelSelector | None = Field(default=None, alias="namespaceSelector")
    """Namespaces whose pods may use the queue; None (absent): none, as Kueue's."""
    cohort: str | None = Field(default=None, max_length=63)
    weight: Quantity = "1"
    queueing_strategy: Literal["BestEffortFIFO", "StrictFIFO"] = Field(
        default="BestEffortFIFO", alias="queueingStrategy"
    )
    max_wait: str | None = Field(default=None, alias="maxWait", max_length=32)
    preemption: Preemption = Preemption()
    resources: list[QuotaLine] = Field(min_length=1, max_length=32)


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(min_length=1, max_length=253)


class GpuQueue(BaseModel):
    """A GpuQueue object; `status` and unknown metadata are ignored."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)

    api_version: Literal["gpuplace.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["GpuQueue"]
    metadata: Metadata
    spec: Spec


def _amount(name: str, value: Quantity, what: str, queue: str) -> int:
    """A quota quantity in the engine's units, rounded down; refuses a negative one."""
    try:
        parsed = quantities.parse(value)
    except quantities.QuantityError as error:
        raise QueueError(f"GpuQueue {queue}: {what} of {name}: {error}") from None
    if parsed < 0:
        raise QueueError(f"GpuQueue {queue}: {what} of {name} must be 0 or more, got {value}")
    if name == quotas.GPU_MEMORY:
        return math.floor(parsed / quantities.MIB)
    return math.floor(parsed * WHOLE)


def to_spec(queue: GpuQueue) -> quotas.QueueSpec:
    """The engine's view of `queue`; raises `QueueError` for what the CRD's rules refuse."""
    name = queue.metadata.name
    spec = queue.spec
    lines: dict[quotas.Bucket, quotas.Quota] = {}
    for line in spec.resources:
        bucket = (line.name, line.model)
        if bucket in lines:
            raise QueueError(f"GpuQueue {name}: {line.name} on model {line.model} given twice")
        if not spec.cohort and (line.borrowing_limit is not None or line.lending_limit is not None):
            raise QueueError(
                f"GpuQueue {name}: borrowingLimit and lendingLimit need a cohort (without one "
                "a queue neither borrows nor lends)"
            )
        nominal = _amount(line.name, line.nominal, "nominal", name)
        borrowing = (
            None
            if line.borrowing_limit is None
            else _amount(line.name, line.borrowing_limit, "borrowingLimit", name)
        )
        lending = (
            None
            if line.lending_limit is None
            else _amount(line.name, line.lending_limit, "lendingLimit", name)
        )
        if lending is not None and lending > nominal:
            raise QueueError(
                f"GpuQueue {name}: lendingLimit of {line.name} must not exceed nominal "
                "(a queue lends at most its own quota)"
            )
        lines[bucket] = quotas.Quota(nominal, borrowing, lending)
    try:
        weight = float(quantities.parse(spec.weight))
    except quantities.QuantityError as error:
        raise QueueError(f"GpuQueue {name}: weight: {error}") from None
    if not weight > 0:
        raise QueueError(f"GpuQueue {name}: weight must be above 0, got {spec.weight}")
    max_wait = None
    if spec.max_wait is not None:
        max_wait = grammar.duration_seconds(spec.max_wait)
        if not max_wait:
            raise QueueError(
                f"GpuQueue {name}: maxWait must be a duration above 0 with units h, m, s or ms "
                f'(e.g. "30m", "2h"), got {spec.max_wait[:32]!r}'
            )
    return quotas.QueueSpec(
        name,
        lines,
        cohort=spec.cohort or "",
        weight=weight,
        reclaim=quotas.Preemption(spec.preemption.reclaim_within_cohort),
        fair_sharing=quotas.Preemption(spec.preemption.fair_sharing),
        fair_strategies=tuple(
            quotas.FairStrategy(name) for name in spec.preemption.fair_sharing_strategies
        ),
        queueing=quotas.Queueing(spec.queueing_strategy),
        max_wait=max_wait,
    )


def read(obj: Mapping[str, Any]) -> GpuQueue:
    """A GpuQueue object (a dict as the API server or a YAML file has it), checked;
    raises `QueueError` naming the field."""
    try:
        return GpuQueue.model_validate(obj)
    except ValidationError as error:
        metadata = obj.get("metadata")
        shown = metadata.get("name") if isinstance(metadata, dict) else None
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise QueueError(
            f"GpuQueue {str(shown or '(unnamed)')[:63]}: {where}: {first['msg']}"
        ) from None


def parse(obj: Mapping[str, Any]) -> quotas.QueueSpec:
    """`read`, then `to_spec`; raises `QueueError`."""
    return to_spec(read(obj))


def parse_all(objects: Iterable[Mapping[str, Any]]) -> list[quotas.QueueSpec]:
    """Every GpuQueue of `objects` (other kinds are refused); names must be unique."""
    found: list[quotas.QueueSpec] = []
    for obj in objects:
        if obj.get("kind") != KIND:
            raise QueueError(f"expected kind {KIND}, got {str(obj.get('kind'))[:40]!r}")
        spec = parse(obj)
        if any(other.name == spec.name for other in found):
            raise QueueError(f"GpuQueue {spec.name} given twice")
        found.append(spec)
    return found
