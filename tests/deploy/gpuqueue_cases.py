"""GpuQueue objects the API server must accept, and ones it must refuse, each with the part
of the refusal that says why: one table for the parser (gpuplace.cluster.gpuqueues), the
CRD's schema and CEL rules evaluated here (test_gpuqueue_crd.py) and the real
kube-apiserver (test_gpuqueue_apiserver.py)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]


def queue(name: str = "team-a", **spec: Any) -> Obj:
    body: Obj = {"resources": [{"name": "gpus", "nominal": 8}], **spec}
    return {
        "apiVersion": "gpuplace.io/v1alpha1",
        "kind": "GpuQueue",
        "metadata": {"name": name},
        "spec": body,
    }


GOOD: dict[str, Obj] = {
    "smallest": queue(),
    "cohort with limits": queue(
        cohort="research",
        weight=2,
        resources=[
            {"name": "gpus", "nominal": 8, "borrowingLimit": "4", "lendingLimit": 2},
            {"name": "gpu-memory", "model": "NVIDIA-H100-80GB-HBM3", "nominal": "640Gi"},
            {"name": "gpu-compute", "nominal": "2500m", "lendingLimit": "2500m"},
        ],
    ),
    "everything": queue(
        namespaceSelector={
            "matchLabels": {"team": "a"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["gold"]},
                {"key": "frozen", "operator": "DoesNotExist"},
            ],
        },
        cohort="research",
        weight="500m",
        queueingStrategy="StrictFIFO",
        maxWait="1h30m",
        preemption={
            "reclaimWithinCohort": "LowerPriority",
            "fairSharing": "Any",
            "fairSharingStrategies": ["LessThanOrEqualToFinalShare", "LessThanInitialShare"],
        },
    ),
    "zero nominal, borrowing only": queue(
        cohort="research", resources=[{"name": "gpus", "nominal": 0}]
    ),
}


@dataclass(frozen=True)
class Bad:
    obj: Obj
    api: str
    """Part of kube-apiserver's refusal."""
    parser: str
    """Part of `gpuplace.cluster.gpuqueues.parse`'s refusal."""
    cel: bool
    """Refused by a CEL rule (else by the structural schema or the list's map keys)."""


def _with(spec_changes: dict[str, Any], **body: Any) -> Obj:
    obj = queue(**body)
    obj["spec"].update(copy.deepcopy(spec_changes))
    return obj


BAD: dict[str, Bad] = {
    "negative nominal": Bad(
        queue(resources=[{"name": "gpus", "nominal": "-1"}]),
        "nominal must be a quantity of 0 or more",
        "must be 0 or more",
        cel=True,
    ),
    "negative integer nominal": Bad(
        queue(resources=[{"name": "gpus", "nominal": -3}]),
        "nominal must be a quantity of 0 or more",
        "must be 0 or more",
        cel=True,
    ),
    "nominal not a quantity": Bad(
        queue(resources=[{"name": "gpus", "nominal": "eight"}]),
        "nominal must be a quantity",
        "not a Kubernetes quantity",
        cel=True,
    ),
    "negative borrowing limit": Bad(
        queue(cohort="c", resources=[{"name": "gpus", "nominal": 1, "borrowingLimit": "-2"}]),
        "borrowingLimit must be a quantity of 0 or more",
        "must be 0 or more",
        cel=True,
    ),
    "borrowing limit without a cohort": Bad(
        queue(resources=[{"name": "gpus", "nominal": 8, "borrowingLimit": 1}]),
        "borrowingLimit and lendingLimit need a cohort",
        "need a cohort",
        cel=True,
    ),
    "lending limit without a cohort": Bad(
        queue(resources=[{"name": "gpus", "nominal": 8, "lendingLimit": 1}]),
        "borrowingLimit and lendingLimit need a cohort",
        "need a cohort",
        cel=True,
    ),
    "lending limit above nominal": Bad(
        queue(cohort="c", resources=[{"name": "gpus", "nominal": "2", "lendingLimit": "2500m"}]),
        "lendingLimit must not exceed nominal",
        "must not exceed nominal",
        cel=True,
    ),
    "weight zero": Bad(
        queue(weight="0"),
        "weight must be a quantity above 0",
        "weight must be above 0",
        cel=True,
    ),
    "weight negative": Bad(
        queue(weight=-1),
        "weight must be a quantity above 0",
        "weight must be above 0",
        cel=True,
    ),
    "max wait zero": Bad(
        queue(maxWait="0s"),
        "maxWait must be a duration above 0",
        "maxWait must be a duration above 0",
        cel=True,
    ),
    "unknown resource": Bad(
        queue(resources=[{"name": "cpus", "nominal": 8}]),
        'Unsupported value: "cpus"',
        "resources.0.name",
        cel=False,
    ),
    "unknown strategy": Bad(
        queue(queueingStrategy="Fastest"),
        'Unsupported value: "Fastest"',
        "queueingStrategy",
        cel=False,
    ),
    "unknown fair-sharing strategy": Bad(
        queue(preemption={"fairSharing": "Any", "fairSharingStrategies": ["Greedy"]}),
        'Unsupported value: "Greedy"',
        "fairSharingStrategies",
        cel=False,
    ),
    "a fair-sharing strategy twice": Bad(
        queue(
            preemption={"fairSharingStrategies": ["LessThanInitialShare", "LessThanInitialShare"]}
        ),
        "Duplicate value",
        "must not name a strategy twice",
        cel=False,
    ),
    "no resources": Bad(
        queue(resources=[]),
        "should have at least 1 items",
        "resources",
        cel=False,
    ),
    "duplicate model": Bad(
        queue(
            resources=[
                {"name": "gpus", "model": "A100", "nominal": 4},
                {"name": "gpus", "model": "A100", "nominal": 2},
            ]
        ),
        "Duplicate value",
        "given twice",
        cel=False,
    ),
    "duplicate default model": Bad(
        queue(
            resources=[{"name": "gpus", "nominal": 4}, {"name": "gpus", "model": "*", "nominal": 2}]
        ),
        "Duplicate value",
        "given twice",
        cel=False,
    ),
    "In without values": Bad(
        queue(namespaceSelector={"matchExpressions": [{"key": "team", "operator": "In"}]}),
        "In and NotIn need values",
        "namespaceSelector",
        cel=True,
    ),
}
"""A `namespaceSelector` is not parsed by `gpuplace.cluster.gpuqueues` (the controller
matches it as Kubernetes does): the parser's fragment for it is only where it would look."""
