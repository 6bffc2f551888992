"""A gated pod's update rules, refereed (KEP-3838, kube-apiserver's `ValidatePodUpdate`):
each case creates a pod, sends one JSON patch of its spec, and asserts the answer the
real kube-apiserver gives, on it and on the local API (`tests.dev.servers`): accepted,
or 422 Invalid naming the same field with the same cause reason and the same rule's
words. The gang controller narrows gated members' node affinity (`gpuplace.gangs.
pinning`) and the webhook writes gates and affinity: the local API must refuse exactly
what a cluster refuses, or their tests pass on a server no cluster matches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.dev.servers import JSON_PATCH, Served, pod

GATE = "referee.gpuplace.io/wait"
TERMS = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
TERMS += ".nodeSelectorTerms"
ZONE = {"key": "zone", "operator": "In", "values": ["a"]}
GPU = {"key": "gpu", "operator": "Exists"}
HERE = {"key": "metadata.name", "operator": "In", "values": ["n1"]}


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }


def preferred(weight: int) -> dict[str, Any]:
    term = {"weight": weight, "preference": {"matchExpressions": [ZONE]}}
    return {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [term]}}


@dataclass(frozen=True, slots=True)
class Case:
    id: str
    gated: bool
    affinity: dict[str, Any] | None
    selector: dict[str, str] | None
    patch: list[dict[str, Any]]
    refused: tuple[str, str, str] | None
    """(field, cause reason, the end of the cause's message), or None: accepted."""


def put(path: str, value: Any) -> list[dict[str, Any]]:
    return [{"op": "add", "path": path, "value": value}]


ONLY_ADDITIONS = "only additions are allowed (no mutations or deletions)"
FORBIDDEN_SPEC = "pod updates may not change fields other than"

NO_TERMS_CHANGE = "no additions/deletions to non-empty NodeSelectorTerms list are allowed"
SELECTOR_ADDITIONS = "only additions to spec.nodeSelector are allowed (no mutations or deletions)"
ONE_TERM = required({"matchExpressions": [ZONE]})
BOTH = {"nodeAffinity": {**ONE_TERM["nodeAffinity"], **preferred(1)["nodeAffinity"]}}
ANTI = {"weight": 1, "podAffinityTerm": {"topologyKey": "zone", "labelSelector": {}}}
CASES = [
    Case("gate-added", True, None, None, put("/spec/schedulingGates/-", {"name": "x.io/b"}),
         ("spec.schedulingGates[1].name", "FieldValueForbidden",
          "only deletion is allowed, but found new scheduling gate 'x.io/b'")),
    Case("gate-removed", True, None, None,
         [{"op": "remove", "path": "/spec/schedulingGates"}], None),
    Case("gate-re-added", False, None, None, put("/spec/schedulingGates", [{"name": GATE}]),
         ("spec.schedulingGates[0].name", "FieldValueForbidden",
          f"only deletion is allowed, but found new scheduling gate '{GATE}'")),
    Case("selector-added", True, None, {"zone": "a"}, put("/spec/nodeSelector/gpu", "1"), None),
    Case("selector-set", True, None, None, put("/spec/nodeSelector", {"gpu": "1"}), None),
    Case("selector-changed", True, None, {"zone": "a"}, put("/spec/nodeSelector/zone", "b"),
         ("spec.nodeSelector", "FieldValueInvalid", SELECTOR_ADDITIONS)),
    Case("selector-removed", True, None, {"zone": "a"},
         [{"op": "remove", "path": "/spec/nodeSelector"}],
         ("spec.nodeSelector", "FieldValueInvalid", SELECTOR_ADDITIONS)),
    Case("selector-ungated", False, None, {"zone": "a"}, put("/spec/nodeSelector/gpu", "1"),
         ("spec", "FieldValueForbidden", "")),
    Case("required-from-none", True, None, None,
         put("/spec/affinity", required({"matchFields": [HERE]})), None),
    Case("required-narrowed", True, ONE_TERM, None,
         put("/spec/affinity",
             required({"matchExpressions": [ZONE, GPU], "matchFields": [HERE]})), None),
    Case("required-term-added", True, ONE_TERM, None,
         put("/spec/affinity", required({"matchExpressions": [ZONE]}, {"matchFields": [HERE]})),
         (TERMS, "FieldValueInvalid", NO_TERMS_CHANGE)),
    Case("required-widened", True, required({"matchExpressions": [ZONE, GPU]}), None,
         put("/spec/affinity", required({"matchExpressions": [ZONE]})),
         (TERMS + "[0]", "FieldValueInvalid", ONLY_ADDITIONS)),
    Case("required-reordered", True, required({"matchExpressions": [ZONE, GPU]}), None,
         put("/spec/affinity", required({"matchExpressions": [GPU, ZONE]})),
         (TERMS + "[0]", "FieldValueInvalid", ONLY_ADDITIONS)),
    Case("required-dropped", True, ONE_TERM, None,
         [{"op": "remove", "path": "/spec/affinity"}],
         (TERMS, "FieldValueInvalid", NO_TERMS_CHANGE)),
    Case("preferred-changed", True, BOTH, None,
         put("/spec/affinity/nodeAffinity/preferredDuringSchedulingIgnoredDuringExecution",
             preferred(5)["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]),
         None),
    Case("pod-anti-affinity", True, ONE_TERM, None,
         put("/spec/affinity/podAntiAffinity",
             {"preferredDuringSchedulingIgnoredDuringExecution": [ANTI]}),
         ("spec", "FieldValueForbidden", "")),
    # the planner's affinity pin and the queue's admission: the last gate removed and the
    # affinity narrowed in the same update (judged against the old, gated pod)
    Case("ungated-and-narrowed", True, ONE_TERM, None,
         [{"op": "remove", "path": "/spec/schedulingGates"},
          *put("/spec/affinity", required({"matchExpressions": [ZONE], "matchFields": [HERE]}))],
         None),
    Case("affinity-ungated", False, None, None,
         put("/spec/affinity", required({"matchFields": [HERE]})),
         ("spec", "FieldValueForbidden", "")),
]  # fmt: skip


def _refusal(body: Any) -> tuple[str, str, str]:
    """(field, reason, message) of a 422's first cause."""
    causes = (body.get("details") or {}).get("causes") or [{}]
    cause = causes[0]
    return (cause.get("field", ""), cause.get("reason", ""), cause.get("message", ""))


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
async def test_a_gated_pods_update_is_judged_as_kube_apiserver_judges_it(
    server: Served, case: Case
) -> None:
    made = pod(
        "p",
        gates=(GATE,) if case.gated else (),
        affinity=case.affinity,
        node_selector=case.selector,
    )
    await server.create(made)
    answer = await server.patch(server.path("pods", "p"), case.patch, content_type=JSON_PATCH)
    if case.refused is None:
        assert answer.status == 200, answer.body
        return
    assert (answer.status, answer.reason) == (422, "Invalid"), answer.body
    assert answer.message.startswith('Pod "p" is invalid: ')
    field, reason, message = _refusal(answer.body)
    wanted_field, wanted_reason, wanted_end = case.refused
    assert (field, reason) == (wanted_field, wanted_reason), answer.body
    if wanted_end:
        assert message.endswith(wanted_end), message
    else:
        assert FORBIDDEN_SPEC in message, message


async def test_a_gated_pods_nominated_node_may_be_set_then_its_gate_removed(
    server: Served,
) -> None:
    """The planner's nominate pin: `status.nominatedNodeName` written through pods/status
    while the pod is gated (with its resourceVersion as precondition), then the gate
    removed; the nomination stays."""
    made = await server.create(pod("p", gates=(GATE,)))
    rv = made["metadata"]["resourceVersion"]
    status = {"metadata": {"resourceVersion": rv}, "status": {"nominatedNodeName": "n1"}}
    answer = await server.patch(server.path("pods", "p", "status"), status)
    nominated = answer.ok(200)
    assert nominated["status"]["nominatedNodeName"] == "n1"
    assert nominated["spec"]["schedulingGates"] == [{"name": GATE}]
    stale = await server.patch(server.path("pods", "p", "status"), status)
    assert stale.status == 409, stale.body
    ungate = {
        "metadata": {"resourceVersion": nominated["metadata"]["resourceVersion"]},
        "spec": {"schedulingGates": None},
    }
    released = (await server.patch(server.path("pods", "p"), ungate)).ok(200)
    assert not released["spec"].get("schedulingGates")
    assert released["status"]["nominatedNodeName"] == "n1"
