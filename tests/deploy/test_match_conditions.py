"""What kube-apiserver sends to gpuplace's webhooks, from the shipped `rules` and
`matchConditions` (evaluated by `tests.deploy.matching`), against the AdmissionReviews a
real kube-apiserver sent (shared/fixtures/admission), a table of the requests a cluster
makes, and random pods.

The promise being kept: during a gpuplace outage only what gpuplace must check is refused
(the CREATE of a GPU pod, a change of gpuplace's annotations or of its managed label);
a label, a finalizer, a status write on a GPU pod never reach the webhook. And the other
way: whatever `/validate` would refuse is still sent, and what is not sent is what
`/validate` and `/mutate` would have allowed unchanged.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplace.cluster import keys, nodes
from gpuplace.webhook import admission, reviews
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import FixedCapabilities
from tests.deploy import matching, rendering
from tests.webhook import helpers

FIXTURES = rendering.ROOT.parent / "shared" / "fixtures" / "admission"
MUTATING, VALIDATING = matching.MUTATING, matching.VALIDATING
SIDECAR = WebhookConfig().sidecar_user
JOB_CONTROLLER = "system:serviceaccount:kube-system:job-controller"
JOB_FINALIZER = "batch.kubernetes.io/job-tracking"
Obj = dict[str, Any]


# --- the rule, said in Python -----------------------------------------------------------


def gpuplace_keys(obj: Obj | None) -> dict[tuple[str, str], str]:
    """What gpuplace owns on a pod: its gpuplace.io/ annotations and the managed label."""
    metadata = (obj or {}).get("metadata") or {}
    owned = {
        ("annotation", key): value
        for key, value in (metadata.get("annotations") or {}).items()
        if key.startswith(keys.PREFIX)
    }
    labels = metadata.get("labels") or {}
    if keys.MANAGED in labels:
        owned["label", keys.MANAGED] = labels[keys.MANAGED]
    return owned


def carries(obj: Obj | None) -> bool:
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    return any(key.startswith(keys.PREFIX) for key in annotations)


def asks_for_our_resources(obj: Obj | None) -> bool:
    spec = (obj or {}).get("spec") or {}
    for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        resources = container.get("resources") or {}
        for part in ("requests", "limits"):
            if any(name.startswith(keys.PREFIX) for name in resources.get(part) or {}):
                return True
    return False


def is_pod_write(request: Obj, subresources: tuple[str, ...]) -> bool:
    resource = request.get("resource") or {"resource": "pods"}
    return resource["resource"] == "pods" and (request.get("subResource") or "") in subresources


def should_mutate(request: Obj) -> bool:
    return (
        request["operation"] == "CREATE"
        and is_pod_write(request, ("",))
        and carries(request.get("object"))
    )


def should_validate(request: Obj) -> bool:
    if not is_pod_write(request, ("", "status")):
        return False
    if request["operation"] == "CREATE":
        obj = request.get("object")
        return carries(obj) or asks_for_our_resources(obj)
    if request["operation"] == "UPDATE":
        return gpuplace_keys(request.get("object")) != gpuplace_keys(request.get("oldObject"))
    return False


# --- requests -----------------------------------------------------------------------------


def captured() -> list[tuple[str, Obj]]:
    """The captured AdmissionRequests; empty (their tests skip) without ../shared."""
    files = sorted(FIXTURES.glob("*.json")) if FIXTURES.is_dir() else []
    return [(f.name, json.loads(f.read_text())["request"]["request"]) for f in files]


CAPTURED = captured()
NO_FIXTURES = f"captured fixtures not found in {FIXTURES}"


def request(
    operation: str,
    obj: Obj | None,
    old: Obj | None = None,
    *,
    user: str = "alice",
    subresource: str = "",
    resource: str = "pods",
) -> Obj:
    body: Obj = helpers.review(obj, operation=operation, old=old, user=user)["request"]
    body["resource"]["resource"] = resource
    if subresource:
        body["subResource"] = subresource
    return body


def reviewer() -> admission.Reviewer:
    capabilities = nodes.inventory(helpers.node_list()["items"]).capabilities()
    return admission.Reviewer(WebhookConfig(), FixedCapabilities(capabilities))


REVIEWER = reviewer()


def decide(endpoint: str, body: Obj) -> admission.Decision:
    wire = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": body}
    parsed = reviews.AdmissionReview.model_validate(wire).request
    return REVIEWER.mutate(parsed) if endpoint == "mutate" else REVIEWER.validate(parsed)


def gpu_pod() -> Obj:
    """A running GPU pod of a Job as the API server stores it: mutated by gpuplace,
    assigned by the sidecar, with the Job controller's finalizer and labels."""
    pod = helpers.pod({keys.GPU_PERCENT: "50", keys.GPU_MEMORY: "20Gi"})
    decision = decide("mutate", request("CREATE", pod))
    assert decision.allowed and decision.ops
    stored: Obj = jsonpatch.apply_patch(pod, decision.ops)
    metadata = stored["metadata"]
    metadata["annotations"].update({keys.ASSIGNED_NODE: "a100-0", keys.ASSIGNED_GPUS: "3"})
    metadata["labels"].update({"batch.kubernetes.io/job-name": "train", "app": "train"})
    metadata["finalizers"] = [JOB_FINALIZER]
    metadata["uid"] = "7b39e1c6-f58f-4605-bb3c-4e45c4a6139e"
    stored["spec"]["nodeName"] = "a100-0"
    stored["status"] = {"phase": "Running"}
    return stored


def edited(pod: Obj, edit: Any) -> Obj:
    copied = copy.deepcopy(pod)
    edit(copied)
    return copied


def _succeed(pod: Obj) -> None:
    pod["status"] = {"phase": "Succeeded", "conditions": [{"type": "Ready", "status": "False"}]}


def _unfinalize(pod: Obj) -> None:
    pod["metadata"]["finalizers"] = []


def _debug(pod: Obj) -> None:
    pod["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "busybox:1.36"}]


BOTH, VAL, NONE = "validate and mutate", "validate only", "neither"


def _table() -> list[tuple[str, Obj, bool, bool]]:
    """(case, AdmissionRequest, sent to /validate, sent to /mutate)."""
    running = gpu_pod()
    plain = helpers.pod()
    bare = {"metadata": {"name": "bare", "namespace": "default"}, "spec": plain["spec"]}
    by_hand = helpers.pod()
    by_hand["spec"]["containers"][0]["resources"] = {"limits": {keys.RESOURCE_PERCENT: "50"}}
    labelled_only = edited(plain, lambda p: p["metadata"].update(labels={keys.MANAGED: "true"}))
    forged = helpers.pod({keys.ASSIGNED_GPUS: "0"})
    gated = edited(
        helpers.pod({keys.GANG_NAME: "g", keys.GANG_SIZE: "2", keys.GPU_COUNT: "1"}),
        lambda p: p["spec"].update(schedulingGates=[{"name": keys.GANG_GATE}]),
    )

    def change(edit: Any, **kwargs: Any) -> Obj:
        return request("UPDATE", edited(running, edit), running, **kwargs)

    def annotate(key: str, value: str | None) -> Any:
        def apply(pod: Obj) -> None:
            if value is None:
                del pod["metadata"]["annotations"][key]
            else:
                pod["metadata"]["annotations"][key] = value

        return apply

    def label(value: str | None) -> Any:
        def apply(pod: Obj) -> None:
            if value is None:
                del pod["metadata"]["labels"][keys.MANAGED]
            else:
                pod["metadata"]["labels"][keys.MANAGED] = value

        return apply

    no_gpuplace_annotations = edited(running, lambda p: p["metadata"].pop("annotations"))
    ungated = edited(gated, lambda p: p["spec"].pop("schedulingGates"))
    binding = {"kind": "Binding", "metadata": {"name": "p"}, "target": {"name": "a100-0"}}
    forge = annotate(keys.ASSIGNED_GPUS, "0,1")
    kubelet = "system:node:a100-0"
    rows: list[tuple[str, Obj, str]] = [
        ("create a GPU pod", request("CREATE", helpers.pod({keys.GPU_PERCENT: "5"})), BOTH),
        ("create a plain pod", request("CREATE", plain), NONE),
        ("create a pod with no annotations or labels", request("CREATE", bare), NONE),
        ("create a pod asking for gpuplace resources by hand", request("CREATE", by_hand), VAL),
        ("create a pod with only the managed label", request("CREATE", labelled_only), NONE),
        ("create a pod with a forged assignment only", request("CREATE", forged), BOTH),
        (
            "kubectl label on a GPU pod",
            change(lambda p: p["metadata"]["labels"].update(a="x")),
            NONE,
        ),
        (
            "kubectl annotate, not ours",
            change(lambda p: p["metadata"]["annotations"].update(a="")),
            NONE,
        ),
        ("Job controller removes its finalizer", change(_unfinalize, user=JOB_CONTROLLER), NONE),
        ("kubelet writes pods/status", change(_succeed, user=kubelet, subresource="status"), NONE),
        ("status written through the pod itself", change(_succeed), NONE),
        ("gang controller lifts the gate", request("UPDATE", ungated, gated, user=SIDECAR), NONE),
        ("change a gpuplace annotation", change(annotate(keys.GPU_PERCENT, "60")), VAL),
        ("remove a gpuplace annotation", change(annotate(keys.GPU_MEMORY, None)), VAL),
        ("remove every annotation", request("UPDATE", no_gpuplace_annotations, running), VAL),
        (
            "add a gpuplace annotation",
            request("UPDATE", helpers.pod({keys.GPU_COUNT: "1"}), plain),
            VAL,
        ),
        ("forge an assignment", change(forge), VAL),
        ("forge an assignment through pods/status", change(forge, subresource="status"), VAL),
        (
            "sidecar writes an assignment",
            change(annotate(keys.ASSIGNED_AT, "now"), user=SIDECAR),
            VAL,
        ),
        ("remove the managed label", change(label(None)), VAL),
        ("set the managed label to false", change(label("false")), VAL),
        ("add the managed label", request("UPDATE", labelled_only, plain), VAL),
        ("a lookalike annotation changes", change(annotate("x.io/gpuplace.io-x", "1")), NONE),
        ("update a pod with no annotations or labels", request("UPDATE", bare, bare), NONE),
        ("pods/ephemeralcontainers", change(_debug, subresource="ephemeralcontainers"), NONE),
        ("pods/resize", change(_succeed, subresource="resize"), NONE),
        ("pods/binding", request("CREATE", binding, subresource="binding"), NONE),
        ("delete a GPU pod", request("DELETE", None, running), NONE),
    ]
    return [(case, body, sent_to in (BOTH, VAL), sent_to == BOTH) for case, body, sent_to in rows]


TABLE = _table()


@pytest.mark.parametrize(
    ("case", "body", "validated", "mutated"), TABLE, ids=[case for case, *_ in TABLE]
)
def test_what_is_sent(case: str, body: Obj, validated: bool, mutated: bool) -> None:
    assert matching.sent(VALIDATING, body) is validated
    assert matching.sent(MUTATING, body) is mutated
    assert (should_validate(body), should_mutate(body)) == (validated, mutated)


NOT_SENT = [
    (case, body)
    for case, body, validated, _ in TABLE
    if not validated and body["object"] and body["object"].get("kind") != "Binding"
]


@pytest.mark.parametrize(("case", "body"), NOT_SENT, ids=[case for case, _ in NOT_SENT])
def test_what_is_not_sent_would_have_been_allowed(case: str, body: Obj) -> None:
    """The outage blocks nothing the validator would have allowed: each request the API
    server keeps away from /validate is one it allows, unpatched."""
    assert decide("validate", body).allowed
    assert decide("mutate", body).ops == []


def test_forgeries_are_refused_when_sent() -> None:
    """Soundness: what a non-sidecar user may not do is still sent, and refused."""
    for case, body, validated, _ in TABLE:
        if case.startswith(("forge", "remove the managed", "set the managed", "change a")):
            assert validated, case
            decision = decide("validate", body)
            assert not decision.allowed, case
            assert decision.reason in (admission.FORGED, admission.UNMANAGED, admission.CHANGED)


@pytest.mark.skipif(not CAPTURED, reason=NO_FIXTURES)
@pytest.mark.parametrize(
    ("name", "body"), CAPTURED or [("none", {})], ids=[n for n, _ in CAPTURED] or ["none"]
)
def test_captured_requests(name: str, body: Obj) -> None:
    assert matching.sent(MUTATING, body) is should_mutate(body)
    assert matching.sent(VALIDATING, body) is should_validate(body)
    if "plain" in name:
        assert not matching.sent(VALIDATING, body)  # the case the conditions exist for
    if name.startswith(("014-", "015-")):
        # affinity added and gate removed, annotations untouched: /validate would allow it
        assert not matching.sent(VALIDATING, body)
        assert decide("validate", body).allowed
    if name.startswith(("022-", "023-")):
        # `kubectl annotate` adds gpuplace.io/gpu-uuids: sent, and refused
        assert matching.sent(VALIDATING, body)
        assert not decide("validate", body).allowed


@pytest.mark.skipif(not CAPTURED, reason=NO_FIXTURES)
def test_removing_every_gpuplace_annotation_is_still_validated() -> None:
    update = next(r for _, r in CAPTURED if r["operation"] == "UPDATE" and carries(r["object"]))
    stripped = copy.deepcopy(update)
    annotations = stripped["object"]["metadata"]["annotations"]
    for key in [k for k in annotations if k.startswith(keys.PREFIX)]:
        del annotations[key]
    assert not matching.sent(MUTATING, stripped)
    assert matching.sent(VALIDATING, stripped)


def test_the_conditions_name_our_keys() -> None:
    """The prefix and the label are spelled as gpuplace.cluster.keys spells them; the validating
    webhook sees pods and pods/status only, the mutating one only pod CREATEs."""
    for kind in (MUTATING, VALIDATING):
        for condition in matching.webhook(kind)["matchConditions"]:
            text = condition["expression"]
            quoted = set(text.split("'")[1::2])
            assert quoted <= {keys.PREFIX, keys.MANAGED}, quoted
    assert matching.webhook(MUTATING)["rules"][0]["operations"] == ["CREATE"]
    assert matching.webhook(MUTATING)["rules"][0]["resources"] == ["pods"]
    assert matching.webhook(VALIDATING)["rules"][0]["resources"] == ["pods", "pods/status"]
    assert len(matching.webhook(VALIDATING)["matchConditions"]) <= 64


# --- random pods -------------------------------------------------------------------------

_KEYS = st.sampled_from(
    [
        keys.GPU_PERCENT,
        keys.GPU_MEMORY,
        keys.ASSIGNED_GPUS,
        keys.GANG_PLAN,
        keys.PREFIX + "unknown",
        keys.MANAGED,
        keys.GANG_LABEL,
        "gpuplace.io",
        "example.com/gpuplace.io-x",
        "app",
    ]
)
_VALUES = st.sampled_from(["true", "false", "", "50", "20Gi"])
_MAPS = st.one_of(st.none(), st.dictionaries(_KEYS, _VALUES, max_size=4))
_RESOURCES = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "requests": st.dictionaries(
                st.sampled_from([keys.RESOURCE_PERCENT, keys.RESOURCE_MEMORY, "cpu"]),
                st.just("1"),
                max_size=2,
            ),
            "limits": st.dictionaries(
                st.sampled_from([keys.RESOURCE_PERCENT, "nvidia.com/gpu", "memory"]),
                st.just("1"),
                max_size=2,
            ),
        },
    ),
)


@st.composite
def pods(draw: st.DrawFn) -> Obj:
    pod = helpers.pod()
    metadata: Obj = {"name": "p", "namespace": "default"}
    for field in ("annotations", "labels"):
        value = draw(_MAPS)
        if value is not None:
            metadata[field] = value
    pod["metadata"] = metadata
    resources = draw(_RESOURCES)
    if resources is None:
        del pod["spec"]["containers"][0]["resources"]
    else:
        pod["spec"]["containers"][0]["resources"] = resources
    if draw(st.booleans()):
        init = {"name": "init", "image": "busybox:1.36", "resources": draw(_RESOURCES) or {}}
        pod["spec"]["initContainers"] = [init]
    return pod


@st.composite
def requests(draw: st.DrawFn) -> Obj:
    operation = draw(st.sampled_from(["CREATE", "UPDATE"]))
    new = draw(pods())
    if operation == "CREATE":
        return request("CREATE", new)
    old = draw(st.one_of(pods(), st.just(new)))
    if old is new:
        old = edited(new, lambda p: p["metadata"].update(finalizers=["x"]))
    subresource = draw(st.sampled_from(["", "status"]))
    user = draw(st.sampled_from(["alice", SIDECAR]))
    return request("UPDATE", new, old, subresource=subresource, user=user)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_sent_exactly_when_gpuplace_keys_are_written(body: Obj) -> None:
    """CREATE: sent ⇔ gpuplace annotations or resources; UPDATE: sent ⇔ a gpuplace.io/
    annotation or the managed label differs; never an error; not sent ⇒ allowed."""
    validated = matching.sent(VALIDATING, body)
    assert validated is should_validate(body)
    assert matching.sent(MUTATING, body) is should_mutate(body)
    if not validated:
        assert decide("validate", body).allowed
    if not matching.sent(MUTATING, body):
        assert decide("mutate", body).ops == []


@pytest.mark.skipif(not FIXTURES.parent.is_dir(), reason=f"{FIXTURES.parent} not present")
def test_fixtures_directory_is_where_the_readme_says() -> None:
    assert Path(FIXTURES, "..", "README.md").resolve().exists()
