"""The webhook on the DRA path (`--dra-claims`, docs/dra.md "The annotations on DRA nodes"):
which pods go to DRA nodes, what they get instead of extended resources, and that
/validate judges each on the path it took."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from gpuplace.cluster import dra_claims, grammar, keys, nodes
from gpuplace.webhook import admission, mutating, reviews
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import FixedCapabilities, paths_of
from tests.webhook import helpers

SHARE = {keys.GPU_PERCENT: "30", keys.GPU_MEMORY: "8Gi"}
H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"


def dra_node(name: str, **kwargs: Any) -> dict[str, Any]:
    body = helpers.node(name, **kwargs)
    body["metadata"]["labels"][keys.NODE_DRA] = "true"
    return body


def reviewer(mode: str, *items: dict[str, Any]) -> admission.Reviewer:
    inventory = nodes.inventory(items)
    source = FixedCapabilities(inventory.capabilities(), paths_of(inventory))
    return admission.Reviewer(WebhookConfig(node_agent=True, dra_claims=mode), source)


MIXED = (
    helpers.node("a100-0", gpus=8, model=A100, memory_mib=81920, nvlink=[0] * 8),
    dra_node("h100-0", gpus=2, model=H100, memory_mib=81559),
)
DRA_ONLY = (dra_node("h100-0", gpus=2, model=H100, memory_mib=81559),)


def request(pod: dict[str, Any], uid: str = "7c1d-req") -> reviews.AdmissionRequest:
    return reviews.AdmissionReview.model_validate(helpers.review(pod, uid=uid)).request


def mutate(judge: admission.Reviewer, pod: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    decision = judge.mutate(request(pod))
    assert decision.allowed, decision.message
    result: dict[str, Any] = jsonpatch.apply_patch(pod, decision.ops)
    return result, decision


def test_a_share_on_a_dra_only_cluster_names_its_claim_and_waits_behind_the_gate() -> None:
    judge = reviewer("fallback", *DRA_ONLY)
    pod, decision = mutate(judge, helpers.pod(SHARE))
    claim = dra_claims.claim_name("p", "7c1d-req")
    assert claim.startswith("p-gpu-") and len(claim) == len("p-gpu-") + 8
    spec = pod["spec"]
    assert spec["resourceClaims"] == [{"name": dra_claims.ENTRY, "resourceClaimName": claim}]
    container = spec["containers"][0]
    # no extended resource, no slot, no env: the claim and the DRA plugin's CDI spec say it all
    assert container["resources"] == {"claims": [{"name": dra_claims.ENTRY}]}
    assert "env" not in container
    assert spec["schedulingGates"] == [{"name": keys.DRA_GATE}]
    assert spec["schedulerName"] == "default-scheduler"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": list(mutating.DRA_EXPRESSIONS)}]
    assert pod["metadata"]["labels"] == {keys.MANAGED: "true"}
    assert dra_claims.named(pod) == claim
    # what the API server will take (the Pod schema)
    kubernetes_validate.validate(pod, helpers.schema_version(), strict=True)
    # a reinvocation changes nothing (another review UID: the claim it names stays)
    again = judge.mutate(request(pod, uid="other"))
    assert (again.reason, again.ops) == (admission.UNCHANGED, [])
    verdict = judge.validate(request(pod))
    assert (verdict.allowed, verdict.reason) == (True, admission.VALID), verdict.message
    assert decision.warnings == ()


def test_a_pod_of_a_controller_gets_a_claim_named_after_its_generate_name() -> None:
    judge = reviewer("prefer", *DRA_ONLY)
    raw = helpers.pod(SHARE)
    raw["metadata"].pop("name")
    raw["metadata"]["generateName"] = "train-"
    pod, _ = mutate(judge, raw)
    assert dra_claims.named(pod) == dra_claims.claim_name("train-", "7c1d-req")
    assert dra_claims.named(pod).startswith("train-gpu-")


@pytest.mark.parametrize(
    ("mode", "annotations", "path"),
    [
        # fallback: the DRA path only for what no device-plugin node could hold
        ("fallback", SHARE, admission.DEVICE_PLUGIN),
        ("fallback", {**SHARE, keys.GPU_MODEL: H100}, admission.DRA),
        ("fallback", {keys.GPU_COUNT: "4"}, admission.DEVICE_PLUGIN),
        # prefer: the DRA path for whatever a DRA node could hold
        ("prefer", SHARE, admission.DRA),
        ("prefer", {keys.GPU_COUNT: "2", keys.GPU_TOPOLOGY: "preferred"}, admission.DRA),
        ("prefer", {keys.GPU_COUNT: "4"}, admission.DEVICE_PLUGIN),
        ("prefer", {**SHARE, keys.GPU_MODEL: A100}, admission.DEVICE_PLUGIN),
        ("off", {**SHARE, keys.GPU_MODEL: H100}, admission.DEVICE_PLUGIN),
    ],
)
def test_a_mixed_cluster_sends_each_pod_one_way(
    mode: str, annotations: dict[str, str], path: str
) -> None:
    judge = reviewer(mode, *MIXED)
    pod, _ = mutate(judge, helpers.pod(annotations))
    assert judge.taken(pod) == path
    affinity = pod["spec"]["affinity"]["nodeAffinity"]
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    expressions = terms[0]["matchExpressions"]
    resources = pod["spec"]["containers"][0]["resources"]
    if path == admission.DRA:
        assert {"key": keys.NODE_DRA, "operator": "In", "values": ["true"]} in expressions
        assert keys.RESOURCE_GPU not in resources.get("limits", {})
    else:
        # kept off DRA nodes once claims are on: no plan puts it where only claims hold
        kept_off = mutating.NOT_DRA in expressions
        assert kept_off is (mode != "off")
        assert resources["limits"][keys.RESOURCE_GPU] == annotations.get(keys.GPU_COUNT, "1")
        assert "resourceClaims" not in pod["spec"]
    verdict = judge.validate(request(pod))
    assert (verdict.allowed, verdict.reason) == (True, admission.VALID), verdict.message


def test_what_neither_path_could_hold_is_refused_in_the_old_words() -> None:
    judge = reviewer("prefer", *MIXED)
    pod, _ = mutate(judge, helpers.pod({keys.GPU_PERCENT: "50", keys.GPU_MEMORY: "100Gi"}))
    verdict = judge.validate(request(pod))
    assert (verdict.allowed, verdict.reason, verdict.code) == (False, admission.UNSATISFIABLE, 422)
    assert verdict.message == (
        "no GPU in the cluster has 100Gi of memory (gpuplace.io/gpu-memory); the largest has 79Gi"
    )


def test_a_dra_pod_whose_gate_a_later_webhook_dropped_is_caught() -> None:
    judge = reviewer("prefer", *DRA_ONLY)
    pod, _ = mutate(judge, helpers.pod(SHARE))
    del pod["spec"]["schedulingGates"]
    verdict = judge.validate(request(pod))
    assert (verdict.allowed, verdict.reason) == (False, admission.NOT_MUTATED)
    assert "(still to set: schedulingGates)" in verdict.message


def test_gpuplaces_claim_entry_must_name_a_claim() -> None:
    judge = reviewer("prefer", *DRA_ONLY)
    pod, _ = mutate(judge, helpers.pod(SHARE))
    entry = pod["spec"]["resourceClaims"][0]
    entry.pop("resourceClaimName")
    entry["resourceClaimTemplateName"] = "mine"
    verdict = judge.validate(request(pod))
    assert (verdict.allowed, verdict.reason) == (False, admission.INVALID_POD)
    assert "spec.resourceClaims[gpuplace-gpu] is gpuplace's" in verdict.message


def test_with_claims_off_a_pod_carrying_the_entry_is_judged_as_the_device_plugin_wants() -> None:
    pod, _ = mutate(reviewer("prefer", *DRA_ONLY), helpers.pod(SHARE))
    verdict = reviewer("off", *DRA_ONLY).validate(request(pod))
    assert (verdict.allowed, verdict.reason) == (False, admission.NOT_MUTATED)


def test_the_users_own_claims_and_containers_stay_as_they_are() -> None:
    raw = helpers.pod(SHARE)
    raw["spec"]["resourceClaims"] = [{"name": "nic", "resourceClaimTemplateName": "rdma"}]
    raw["spec"]["containers"][0]["resources"] = {"claims": [{"name": "nic"}]}
    sidecar = copy.deepcopy(raw["spec"]["containers"][0])
    sidecar["name"] = "log"
    raw["spec"]["containers"].append(sidecar)
    pod, _ = mutate(reviewer("prefer", *DRA_ONLY), raw)
    assert [entry["name"] for entry in pod["spec"]["resourceClaims"]] == ["nic", dra_claims.ENTRY]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [
        {"name": "nic"},
        {"name": dra_claims.ENTRY},
    ]
    assert pod["spec"]["containers"][1]["resources"]["claims"] == [{"name": "nic"}]


def test_a_memory_only_share_on_dra_is_warned_of_first_fit() -> None:
    _, decision = mutate(reviewer("prefer", *DRA_ONLY), helpers.pod({keys.GPU_MEMORY: "8Gi"}))
    assert mutating.DRA_MEMORY_ONLY_WARNING in decision.warnings


def test_a_queued_gang_member_on_dra_keeps_its_gang_gate_beside_the_claims() -> None:
    annotations = {**SHARE, keys.GANG_NAME: "g", keys.GANG_SIZE: "2"}
    pod, _ = mutate(reviewer("prefer", *DRA_ONLY), helpers.pod(annotations))
    assert pod["spec"]["schedulingGates"] == [{"name": keys.DRA_GATE}, {"name": keys.GANG_GATE}]
    assert pod["metadata"]["labels"][keys.GANG_LABEL] == "g"


def test_unknown_inventory_prefers_as_told_and_validate_waits() -> None:
    judge = admission.Reviewer(WebhookConfig(dra_claims="prefer"), FixedCapabilities(None))
    pod, _ = mutate(judge, helpers.pod(SHARE))
    assert judge.taken(pod) == admission.DRA
    verdict = judge.validate(request(pod))
    assert (verdict.allowed, verdict.reason, verdict.code) == (
        False,
        admission.INVENTORY_UNKNOWN,
        503,
    )
    fallback = admission.Reviewer(WebhookConfig(dra_claims="fallback"), FixedCapabilities(None))
    spec = grammar.parse(SHARE)
    assert spec is not None and fallback.path(spec) == admission.DEVICE_PLUGIN


REFUSED = [
    {keys.GPU_PERCENT: "150"},
    {keys.GPU_PERCENT: "half"},
    {keys.GPU_PERCENT: "50", keys.GPU_MEMORY: "100Gi"},
    {keys.GPU_MEMORY: "-4Gi"},
    {keys.GPU_COUNT: "3"},
    {keys.GPU_COUNT: "2", keys.GPU_PERCENT: "50"},
    {keys.GPU_MODEL: "NVIDIA-L4", keys.GPU_COUNT: "1"},
    {keys.GPU_COUNT: "2", keys.GPU_TOPOLOGY: "required"},
    {keys.GPU_COUNT: "1", keys.GPU_TOPOLOGY: "sideways"},
]


def _verdicts(judge: admission.Reviewer, annotations: dict[str, str]) -> list[tuple[Any, ...]]:
    """(allowed, reason, message) of /mutate and, where it allowed the pod, of /validate
    on what it made."""
    pod = helpers.pod(annotations)
    decision = judge.mutate(request(pod))
    found: list[tuple[Any, ...]] = [(decision.allowed, decision.reason, decision.message)]
    if decision.allowed:
        verdict = judge.validate(request(jsonpatch.apply_patch(pod, decision.ops)))
        found.append((verdict.allowed, verdict.reason, verdict.message))
    return found


@pytest.mark.parametrize("annotations", REFUSED, ids=lambda a: ",".join(a.values()))
@pytest.mark.parametrize("mode", ["fallback", "prefer"])
def test_a_refusal_on_dra_nodes_reads_word_for_word_as_on_device_plugin_nodes(
    annotations: dict[str, str], mode: str
) -> None:
    """The same GPUs behind either path: what the webhook refuses, and how it says so, is
    the same whether the cluster's nodes are DRA nodes (--dra-claims) or device-plugin
    nodes (off); nothing of it is allowed."""
    plugin = reviewer("off", helpers.node("h100-0", gpus=2, model=H100, memory_mib=81559))
    dra = reviewer(mode, *DRA_ONLY)
    expected = _verdicts(plugin, annotations)
    assert not all(allowed for allowed, *_ in expected), expected
    assert _verdicts(dra, annotations) == expected
