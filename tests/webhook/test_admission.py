"""Decisions of `/mutate` and `/validate` beyond the captured fixtures."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest

from gpuplace.cluster import keys, nodes
from gpuplace.dev.localapi import objects
from gpuplace.placement.inventory import Capabilities
from gpuplace.webhook import admission, reviews
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import FixedCapabilities
from tests.webhook import helpers

SIDECAR = WebhookConfig().sidecar_user
SHARE = {keys.GPU_PERCENT: "50", keys.GPU_MEMORY: "20Gi"}


@pytest.fixture
def reviewer(capabilities: Capabilities) -> admission.Reviewer:
    return admission.Reviewer(WebhookConfig(), FixedCapabilities(capabilities))


def request(body: dict[str, Any]) -> reviews.AdmissionRequest:
    return reviews.AdmissionReview.model_validate(body).request


def mutated(reviewer: admission.Reviewer, pod: dict[str, Any]) -> dict[str, Any]:
    decision = reviewer.mutate(request(helpers.review(pod)))
    assert decision.allowed, decision.message
    result: dict[str, Any] = jsonpatch.apply_patch(pod, decision.ops)
    return result


def test_mutated_pod_validates(reviewer: admission.Reviewer) -> None:
    pod = mutated(reviewer, helpers.pod(SHARE))
    decision = reviewer.validate(request(helpers.review(pod)))
    assert (decision.allowed, decision.reason) == (True, admission.VALID)


def test_pod_changed_after_mutation_is_caught(reviewer: admission.Reviewer) -> None:
    pod = mutated(reviewer, helpers.pod(SHARE))
    pod["spec"]["schedulerName"] = "default-scheduler"  # a later webhook undid ours
    decision = reviewer.validate(request(helpers.review(pod)))
    assert (decision.allowed, decision.reason, decision.code) == (False, admission.NOT_MUTATED, 403)
    assert "(still to set: schedulerName)" in decision.message


def unsatisfiable(reviewer: admission.Reviewer, annotations: dict[str, str]) -> str:
    """The message of the webhook's refusal of a pod that could never run (422)."""
    pod = mutated(reviewer, helpers.pod(annotations))
    decision = reviewer.validate(request(helpers.review(pod)))
    assert (decision.allowed, decision.reason, decision.code) == (
        False,
        admission.UNSATISFIABLE,
        422,
    )
    return decision.message


def test_unsatisfiable_request(reviewer: admission.Reviewer) -> None:
    message = unsatisfiable(reviewer, {keys.GPU_PERCENT: "50", keys.GPU_MEMORY: "100Gi"})
    assert message == (
        "no GPU in the cluster has 100Gi of memory (gpuplace.io/gpu-memory); the largest has 79Gi"
    )


def test_memory_only_pod_is_admitted_with_its_warning_and_validates(
    reviewer: admission.Reviewer,
) -> None:
    pod = helpers.pod({keys.GPU_MEMORY: "8Gi"})
    decision = reviewer.mutate(request(helpers.review(pod)))
    assert decision.allowed, decision.message
    assert any(w.startswith("memory-only share: 8192 MiB") for w in decision.warnings)
    patched = jsonpatch.apply_patch(pod, decision.ops)
    limits = patched["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {keys.RESOURCE_MEMORY: "8192"}
    verdict = reviewer.validate(request(helpers.review(patched)))
    assert (verdict.allowed, verdict.reason) == (True, admission.VALID)


def test_memory_only_beyond_every_gpu_is_refused(reviewer: admission.Reviewer) -> None:
    pod = mutated(reviewer, helpers.pod({keys.GPU_MEMORY: "100Gi"}))
    decision = reviewer.validate(request(helpers.review(pod)))
    assert (decision.allowed, decision.reason) == (False, admission.UNSATISFIABLE)
    assert decision.message == (
        "no GPU in the cluster has 100Gi of memory (gpuplace.io/gpu-memory); the largest has 79Gi"
    )


def test_unknown_inventory_refuses_gpu_pods_only(capabilities: Capabilities) -> None:
    source = FixedCapabilities(None)
    reviewer = admission.Reviewer(WebhookConfig(), source)
    pod = mutated(reviewer, helpers.pod(SHARE))
    decision = reviewer.validate(request(helpers.review(pod)))
    assert (decision.allowed, decision.reason, decision.code) == (
        False,
        admission.INVENTORY_UNKNOWN,
        503,
    )
    assert decision.status_reason == "ServiceUnavailable"
    plain = reviewer.validate(request(helpers.review(helpers.pod())))
    assert plain.allowed
    source.set(capabilities)
    assert reviewer.validate(request(helpers.review(pod))).allowed


@pytest.mark.parametrize("user", ["alice", "system:serviceaccount:gpuplace:default"])
def test_forged_assignment_at_create(reviewer: admission.Reviewer, user: str) -> None:
    pod = mutated(reviewer, helpers.pod(SHARE))
    pod["metadata"]["annotations"][keys.ASSIGNED_GPUS] = "0"
    decision = reviewer.validate(request(helpers.review(pod, user=user)))
    assert (decision.allowed, decision.reason, decision.code) == (False, admission.FORGED, 403)
    assert decision.message.startswith("gpuplace.io/assigned-gpus may only be set")


def test_assignment_alone_on_a_plain_pod_is_forged(reviewer: admission.Reviewer) -> None:
    pod = helpers.pod({keys.VISIBLE_DEVICES: "GPU-1"})
    decision = reviewer.validate(request(helpers.review(pod)))
    assert decision.reason == admission.FORGED
    sidecar = reviewer.validate(request(helpers.review(pod, user=SIDECAR)))
    assert sidecar.allowed


def _update(old: dict[str, Any], new: dict[str, Any], user: str = "alice") -> dict[str, Any]:
    return helpers.review(new, old=old, operation="UPDATE", user=user)


def test_sidecar_may_write_assignment_on_update(reviewer: admission.Reviewer) -> None:
    old = mutated(reviewer, helpers.pod(SHARE))
    new = copy.deepcopy(old)
    new["metadata"]["annotations"].update(
        {keys.ASSIGNED_NODE: "a100-0", keys.ASSIGNED_GPUS: "3", keys.VISIBLE_DEVICES: "GPU-3"}
    )
    assert reviewer.validate(request(_update(old, new, SIDECAR))).allowed
    refused = reviewer.validate(request(_update(old, new)))
    assert (refused.allowed, refused.reason) == (False, admission.FORGED)
    assert "gpuplace.io/assigned-gpus, gpuplace.io/assigned-node, gpuplace.io/visible-devices" in (
        refused.message
    )
    # removing an assignment is a change too
    removed = reviewer.validate(request(_update(new, old)))
    assert removed.reason == admission.FORGED


def test_other_updates_of_an_assigned_pod_are_allowed(reviewer: admission.Reviewer) -> None:
    old = mutated(reviewer, helpers.pod(SHARE))
    old["metadata"]["annotations"][keys.ASSIGNED_GPUS] = "1"
    new = copy.deepcopy(old)
    new["metadata"]["labels"]["team"] = "vision"
    new["metadata"]["annotations"]["note"] = "hi"
    decision = reviewer.validate(request(_update(old, new)))
    assert (decision.allowed, decision.reason) == (True, admission.UPDATE)


def test_user_annotations_are_immutable(reviewer: admission.Reviewer) -> None:
    old = mutated(reviewer, helpers.pod(SHARE))
    new = copy.deepcopy(old)
    new["metadata"]["annotations"][keys.GPU_PERCENT] = "60"
    decision = reviewer.validate(request(_update(old, new, SIDECAR)))
    assert (decision.allowed, decision.reason) == (False, admission.CHANGED)
    assert decision.message.startswith("gpuplace.io/gpu-percent cannot change once the pod exists")
    plain_old = helpers.pod()
    plain_new = helpers.pod(SHARE)
    assert reviewer.validate(request(_update(plain_old, plain_new))).reason == admission.CHANGED


def test_update_is_never_patched(reviewer: admission.Reviewer) -> None:
    old = helpers.pod(SHARE)
    decision = reviewer.mutate(request(_update(old, copy.deepcopy(old))))
    assert (decision.allowed, decision.ops) == (True, [])


@pytest.mark.parametrize(
    ("annotations", "spec", "fragment"),
    [
        (
            {keys.GPU_COUNT: "1", keys.CONTAINER: "nope"},
            {},
            "gpuplace.io/container: the pod has no container named 'nope'; "
            "its containers are: main",
        ),
        ({keys.GPU_COUNT: "1"}, {"nodeName": "n1"}, "spec.nodeName is set"),
    ],
)
def test_pod_level_problems(
    reviewer: admission.Reviewer, annotations: dict[str, str], spec: dict[str, Any], fragment: str
) -> None:
    pod = helpers.pod(annotations, **spec)
    for decide in (reviewer.mutate, reviewer.validate):
        decision = decide(request(helpers.review(pod)))
        assert not decision.allowed and decision.code == 422
        assert fragment in decision.message


def test_our_resources_outside_the_gpu_container(reviewer: admission.Reviewer) -> None:
    sneaky = {"name": "side", "image": "x", "resources": {"limits": {keys.RESOURCE_PERCENT: "100"}}}
    main = {"name": "main", "image": "x"}
    pod = helpers.pod({keys.GPU_COUNT: "1", keys.CONTAINER: "main"}, containers=[main, sneaky])
    decision = reviewer.mutate(request(helpers.review(pod)))
    assert decision.reason == admission.INVALID_POD
    assert "spec.containers[1] (side) requests gpuplace.io/gpu-percent" in decision.message
    plain = helpers.pod(containers=[sneaky])
    decision = reviewer.validate(request(helpers.review(plain)))
    assert (decision.allowed, decision.reason) == (False, admission.FOREIGN_RESOURCE)
    assert reviewer.mutate(request(helpers.review(plain))).allowed


def test_non_pod_and_other_operations_pass(reviewer: admission.Reviewer) -> None:
    body = helpers.review(helpers.pod({keys.GPU_PERCENT: "nonsense"}))
    body["request"]["kind"] = {"group": "apps", "version": "v1", "kind": "Deployment"}
    assert reviewer.validate(request(body)).reason == admission.NOT_A_POD
    delete = helpers.review(None, old=helpers.pod(SHARE), operation="DELETE")
    assert reviewer.validate(request(delete)).reason == admission.IGNORED_OPERATION
    assert reviewer.mutate(request(delete)).reason == admission.IGNORED_OPERATION


def test_missing_object_is_malformed(reviewer: admission.Reviewer) -> None:
    with pytest.raises(reviews.ReviewError, match=r"request\.object is required for CREATE"):
        reviewer.mutate(request(helpers.review(None)))


@pytest.mark.parametrize(
    "breakage",
    [
        lambda pod: pod["metadata"].update(annotations=["x"]),
        lambda pod: pod["metadata"]["annotations"].update({keys.GPU_PERCENT: 5}),
        lambda pod: pod["spec"].update(containers={"a": 1}),
        lambda pod: pod["spec"].update(containers=[{"image": "x"}]),
        lambda pod: pod["spec"]["containers"][0].update(env={"A": "b"}),
        lambda pod: pod["spec"]["containers"][0].update(resources={"limits": []}),
        lambda pod: pod.update(spec=[]),
    ],
)
def test_malformed_pods_are_review_errors(reviewer: admission.Reviewer, breakage: Any) -> None:
    pod = helpers.pod({keys.GPU_PERCENT: "5"})
    breakage(pod)
    for decide in (reviewer.mutate, reviewer.validate):
        with pytest.raises(reviews.ReviewError):
            decide(request(helpers.review(pod)))


def test_unnamed_gpu_container_is_the_one_already_carrying_our_resources(
    reviewer: admission.Reviewer,
) -> None:
    carrying = {"name": "b", "image": "x", "resources": {"limits": {keys.RESOURCE_PERCENT: "1"}}}
    pod = mutated(
        reviewer,
        helpers.pod({keys.GPU_COUNT: "1"}, containers=[{"name": "a", "image": "x"}, carrying]),
    )
    assert "resources" not in pod["spec"]["containers"][0]
    assert pod["spec"]["containers"][1]["resources"]["limits"] == {keys.RESOURCE_PERCENT: "100"}


def test_reinvocation_after_a_container_was_put_first(reviewer: admission.Reviewer) -> None:
    pod = mutated(reviewer, helpers.pod(SHARE))
    injected = {"name": "injected-proxy", "image": "proxy:1"}
    pod["spec"]["containers"].insert(0, injected)
    decision = reviewer.mutate(request(helpers.review(pod)))
    assert (decision.allowed, decision.ops) == (True, [])
    assert reviewer.validate(request(helpers.review(pod))).allowed


def test_the_managed_label_cannot_be_dropped_from_a_gpuplace_pod(
    reviewer: admission.Reviewer,
) -> None:
    """Without it the sidecar's informer would see the pod as gone and free its GPUs."""
    old = mutated(reviewer, helpers.pod(SHARE))
    old["metadata"]["annotations"][keys.ASSIGNED_GPUS] = "1"
    assert old["metadata"]["labels"][keys.MANAGED] == "true"
    for change in ("remove", "false"):
        new = copy.deepcopy(old)
        if change == "remove":
            del new["metadata"]["labels"][keys.MANAGED]
        else:
            new["metadata"]["labels"][keys.MANAGED] = "false"
        refused = reviewer.validate(request(_update(old, new)))
        assert (refused.allowed, refused.reason, refused.code) == (
            False,
            admission.UNMANAGED,
            403,
        )
        assert "gpuplace.io/managed=true cannot be removed" in refused.message
        assert reviewer.validate(request(_update(old, new, SIDECAR))).allowed


def test_with_the_node_agent_mutated_pods_validate(capabilities: Capabilities) -> None:
    reviewer = admission.Reviewer(WebhookConfig(node_agent=True), FixedCapabilities(capabilities))
    pod = mutated(reviewer, helpers.pod(SHARE))
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"][keys.RESOURCE_GPU] == "1"
    assert "env" not in container
    decision = reviewer.validate(request(helpers.review(pod)))
    assert (decision.allowed, decision.reason) == (True, admission.VALID)
    # a pod mutated without the agent lacks the slots: the agent-mode validator says so
    verdict = reviewer.validate(request(helpers.review(plainly_mutated(capabilities))))
    assert (verdict.allowed, verdict.reason) == (False, admission.NOT_MUTATED)


def plainly_mutated(capabilities: Capabilities) -> dict[str, Any]:
    """A share as the default configuration's webhook mutates it."""
    return mutated(
        admission.Reviewer(WebhookConfig(), FixedCapabilities(capabilities)), helpers.pod(SHARE)
    )


def test_an_init_container_may_not_ask_for_slots(reviewer: admission.Reviewer) -> None:
    """It would reach the node agent's Allocate with the pod's grant."""
    pod = helpers.pod(SHARE)
    other = {"name": "other", "image": "x", "resources": {"limits": {keys.RESOURCE_GPU: "1"}}}
    pod["spec"]["initContainers"] = [other]
    decision = reviewer.mutate(request(helpers.review(pod)))
    assert not decision.allowed
    assert keys.RESOURCE_GPU in decision.message and "(other)" in decision.message


def racked(gpus: dict[str, tuple[int, str | None]]) -> admission.Reviewer:
    """A reviewer over A100 nodes named by `gpus`: name -> (GPUs, rack label or None)."""
    listed = []
    for name, (count, rack) in gpus.items():
        node = objects.node(name, gpus=count)
        if rack is not None:
            node["metadata"]["labels"]["example.com/rack"] = rack
        listed.append(node)
    return admission.Reviewer(
        WebhookConfig(), FixedCapabilities(nodes.inventory(listed).capabilities())
    )


def gang_member(size: int, **extra: str) -> dict[str, str]:
    return {
        keys.GPU_COUNT: "1",
        keys.GANG_NAME: "train",
        keys.GANG_SIZE: str(size),
        keys.GANG_DOMAIN: "example.com/rack",
        **extra,
    }


def test_a_gang_no_domain_could_ever_hold_is_refused_at_admission() -> None:
    """Issue 45: racks of 3 and 4 GPUs; a required gang of 5 one-GPU members could never
    fit in one: refused, naming what each rack holds; 4 members pass, and so do 5 that
    only prefer one rack."""
    reviewer = racked({"a1": (3, "a"), "b1": (2, "b"), "b2": (2, "b"), "x": (8, None)})
    assert unsatisfiable(reviewer, gang_member(5)) == (
        "gpuplace.io/gang-domain=example.com/rack (gpuplace.io/gang-domain-policy: required): "
        "no example.com/rack could ever hold the gang's 5 members of 1 whole GPU each: with "
        "every node idle the most one holds is 4 (b 4, a 3); use "
        "gpuplace.io/gang-domain-policy: preferred to let it span domains, or fewer members"
    )
    for fits in (
        gang_member(4),
        gang_member(5, **{keys.GANG_DOMAIN_POLICY: "preferred"}),
        gang_member(5, **{keys.GANG_MIN: "4"}),
    ):
        pod = mutated(reviewer, helpers.pod(fits))
        decision = reviewer.validate(request(helpers.review(pod)))
        assert decision.allowed, decision.message


def test_a_gang_domain_no_node_carries_is_refused_saying_how_to_label() -> None:
    reviewer = racked({"x": (8, None)})
    pod = mutated(reviewer, helpers.pod(gang_member(2)))
    decision = reviewer.validate(request(helpers.review(pod)))
    assert not decision.allowed
    assert "no gpuplace node carries the label example.com/rack" in decision.message
    assert "kubectl label node NODE example.com/rack=VALUE" in decision.message


def test_with_the_planner_mutated_pods_are_gated_and_validate(capabilities: Capabilities) -> None:
    """`--plan-pin`: the pod is stored behind the planner's gate; one the mutating webhook
    did not gate (it failed open) is refused, since a gate can be added only at CREATE."""
    reviewer = admission.Reviewer(WebhookConfig(place_gate=True), FixedCapabilities(capabilities))
    pod = mutated(reviewer, helpers.pod(SHARE))
    assert pod["spec"]["schedulingGates"] == [{"name": keys.PLACE_GATE}]
    decision = reviewer.validate(request(helpers.review(pod)))
    assert (decision.allowed, decision.reason) == (True, admission.VALID)
    verdict = reviewer.validate(request(helpers.review(plainly_mutated(capabilities))))
    assert (verdict.allowed, verdict.reason) == (False, admission.NOT_MUTATED)
    assert "schedulingGates" in verdict.message
