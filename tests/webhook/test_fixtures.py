"""Every AdmissionReview captured from a real kube-apiserver round-trips through the real
TLS endpoints: patches apply, patched pods validate against the Kubernetes Pod schema,
pass our own validation and are a fixpoint of the mutation."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from tests.webhook import helpers
from tests.webhook.conftest import Webhook

pytestmark = pytest.mark.skipif(not helpers.fixture_files(), reason=helpers.NO_FIXTURES)

MUTATE = helpers.fixture_files("*-mutate-*.json")
VALIDATE = helpers.fixture_files("*-validate-*.json")

# What each captured request must get; the pods were captured before any mutation, so a
# GPU pod reaching /validate unmutated is the "mutating webhook skipped" case.
EXPECTED_VALIDATE = {
    "plain": (True, "no-gpuplace-annotations"),
    "share-raw": (False, "not-mutated"),
    "share-mutated": (False, "not-mutated"),
    "multi-affinity": (False, "not-mutated"),
    "gang-w0": (False, "not-mutated"),
    "dry": (False, "not-mutated"),
    "job-2vb2c": (False, "not-mutated"),
    "by-sa": (False, "not-mutated"),
    "odd-values": (False, "invalid-annotation"),
}


def _name(path: Path) -> str:
    return path.stem.split("-", 3)[3]


def _ids(paths: list[Path]) -> list[str]:
    return [path.stem for path in paths]


def _patch(answer: dict[str, Any]) -> list[dict[str, Any]]:
    response = answer["response"]
    if "patch" not in response:
        return []
    assert response["patchType"] == "JSONPatch"
    ops: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    return ops


def _decision(webhook: Webhook, uid: str) -> str:
    lines = [line for line in webhook.audit_lines() if line["uid"] == uid]
    assert len(lines) == 1
    reason: str = lines[0]["reason"]
    return reason


@pytest.mark.parametrize("path", MUTATE, ids=_ids(MUTATE))
async def test_mutate_fixture_round_trips(webhook: Webhook, path: Path) -> None:
    sent = helpers.fixture_request(path)
    request = sent["request"]
    status, answer = await webhook.post("/mutate", sent)
    assert status == 200
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == request["uid"]
    ops = _patch(answer)
    original = copy.deepcopy(request["object"])
    patched = jsonpatch.apply_patch(request["object"], ops)
    assert request["object"] == original, "the patch must not be applied in place"
    kubernetes_validate.validate(patched, helpers.schema_version(), strict=True)

    if request["operation"] == "UPDATE":
        assert answer["response"]["allowed"] and not ops, "an UPDATE is never patched"
        return
    if _name(path) == "odd-values":
        assert not answer["response"]["allowed"]
        return
    annotated = any(
        k.startswith("gpuplace.io/") for k in request["object"]["metadata"].get("annotations", {})
    )
    assert answer["response"]["allowed"]
    assert bool(ops) == annotated

    # The API server reinvokes the webhook on its own output: nothing more to do.
    again = copy.deepcopy(sent)
    again["request"]["object"] = patched
    status, answer = await webhook.post("/mutate", again)
    assert status == 200 and answer["response"]["allowed"] and not _patch(answer)

    # What the API server then sends to the validating webhook is admitted.
    status, answer = await webhook.post("/validate", again)
    assert status == 200
    assert answer["response"]["allowed"], answer["response"].get("status")


@pytest.mark.parametrize("path", VALIDATE, ids=_ids(VALIDATE))
async def test_validate_fixture(webhook: Webhook, path: Path) -> None:
    sent = helpers.fixture_request(path)
    status, answer = await webhook.post("/validate", sent)
    assert status == 200
    response = answer["response"]
    assert response["uid"] == sent["request"]["uid"]
    assert "patch" not in response
    name = _name(path)
    if sent["request"]["operation"] == "UPDATE":
        # gang-w0: affinity added and gate removed, annotations untouched → allowed;
        # update-share-raw: `kubectl annotate` adds gpuplace.io/gpu-uuids → refused.
        expected = (True, "update") if name == "gang-w0" else (False, "invalid-annotation")
    else:
        expected = EXPECTED_VALIDATE[name]
    assert (response["allowed"], _decision(webhook, sent["request"]["uid"])) == expected
    if not response["allowed"]:
        status_ = response["status"]
        assert status_["message"] and status_["code"] in (403, 422)
        assert len(status_["message"]) < 600


async def test_unknown_annotation_message(webhook: Webhook) -> None:
    (path,) = helpers.fixture_files("*-validate-update-share-raw.json")
    _, answer = await webhook.post("/validate", helpers.fixture_request(path))
    message = answer["response"]["status"]["message"]
    assert message.startswith("unknown annotation gpuplace.io/gpu-uuids")


async def test_odd_values_are_explained_and_cut(webhook: Webhook) -> None:
    (path,) = helpers.fixture_files("*-mutate-create-odd-values.json")
    _, answer = await webhook.post("/mutate", helpers.fixture_request(path))
    status = answer["response"]["status"]
    assert status["code"] == 422 and status["reason"] == "Invalid"
    assert "gpuplace.io/gpu-percent must be an integer from 1 to 100" in status["message"]
    assert "'fifty'" in status["message"]
    assert "gpuplace.io/gpu-memory must be a Kubernetes quantity" in status["message"]
    assert "x" * 41 not in status["message"]


async def test_dry_run_gets_the_same_answer(webhook: Webhook) -> None:
    (path,) = helpers.fixture_files("*-mutate-create-dry.json")
    sent = helpers.fixture_request(path)
    assert sent["request"]["dryRun"] is True
    _, dry = await webhook.post("/mutate", sent)
    wet = copy.deepcopy(sent)
    wet["request"]["dryRun"] = False
    _, real = await webhook.post("/mutate", wet)
    assert dry == real
    dry_line, wet_line = webhook.audit_lines()
    assert dry_line["dryRun"] is True and wet_line["dryRun"] is False


async def test_generate_name_is_audited(webhook: Webhook) -> None:
    (path,) = helpers.fixture_files("*-mutate-create-job-.json")
    sent = helpers.fixture_request(path)
    await webhook.post("/mutate", sent)
    (line,) = webhook.audit_lines()
    assert line["name"] == ""
    assert line["generateName"] == sent["request"]["object"]["metadata"]["generateName"]


async def test_multi_affinity_keeps_user_terms(webhook: Webhook) -> None:
    (path,) = helpers.fixture_files("*-mutate-create-multi-affinity.json")
    sent = helpers.fixture_request(path)
    _, answer = await webhook.post("/mutate", sent)
    pod = jsonpatch.apply_patch(sent["request"]["object"], _patch(answer))
    (term,) = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    keys_ = [expression["key"] for expression in term["matchExpressions"]]
    assert keys_[0] == "topology.kubernetes.io/zone"
    assert {"nvidia.com/gpu.count", "nvidia.com/gpu.product", "gpuplace.io/enabled"} <= set(keys_)
    sidecar, worker = pod["spec"]["containers"]
    assert "resources" not in sidecar or "gpuplace.io/gpu-percent" not in json.dumps(sidecar)
    assert worker["resources"]["limits"]["gpuplace.io/gpu-percent"] == "200"
    assert worker["env"][0] == {"name": "EXISTING", "value": "1"}
    assert worker["env"][1]["name"] == "NVIDIA_VISIBLE_DEVICES"
    assert "gpuplace" not in json.dumps(pod["spec"]["initContainers"])


async def test_metadata_only_updates_of_a_running_gpu_pod_are_allowed(webhook: Webhook) -> None:
    """The Job controller removing its tracking finalizer and `kubectl label` on a running
    GPU pod: /validate allows both (the shipped matchConditions do not even send them, see
    tests/deploy/test_match_conditions.py, so a gpuplace outage cannot stall them). The pod
    is the captured Job pod as gpuplace mutated it and the sidecar assigned it."""
    (path,) = helpers.fixture_files("*-mutate-create-job-.json")
    sent = helpers.fixture_request(path)
    _, answer = await webhook.post("/mutate", sent)
    pod = jsonpatch.apply_patch(sent["request"]["object"], _patch(answer))
    metadata = pod["metadata"]
    metadata["name"] = metadata["generateName"] + "2vb2c"
    metadata["finalizers"] = ["batch.kubernetes.io/job-tracking"]
    metadata["labels"]["batch.kubernetes.io/job-name"] = "job"
    metadata["annotations"].update({"gpuplace.io/assigned-node": "a100-0"})
    metadata["annotations"].update({"gpuplace.io/assigned-gpus": "2"})
    pod["spec"]["nodeName"] = "a100-0"
    pod["status"] = {"phase": "Succeeded"}

    unfinalized = copy.deepcopy(pod)
    unfinalized["metadata"]["finalizers"] = []
    labelled = copy.deepcopy(pod)
    labelled["metadata"]["labels"]["team"] = "vision"
    for user, new in (
        ("system:serviceaccount:kube-system:job-controller", unfinalized),
        ("admin", labelled),
    ):
        update = copy.deepcopy(sent)
        update["request"].update(
            uid=f"update-{user}",
            name=metadata["name"],
            operation="UPDATE",
            userInfo={"username": user, "groups": ["system:authenticated"]},
            object=new,
            oldObject=pod,
            options={"apiVersion": "meta.k8s.io/v1", "kind": "PatchOptions"},
        )
        status, answer = await webhook.post("/validate", update)
        assert status == 200 and answer["response"]["allowed"], answer["response"]
        assert _decision(webhook, f"update-{user}") == "update"


def test_schema_check_can_fail() -> None:
    """The schema used above really refuses a broken pod (else the checks prove nothing)."""
    (path,) = helpers.fixture_files("*-mutate-create-share-raw.json")
    pod = helpers.fixture_request(path)["request"]["object"]
    pod["spec"]["containers"][0]["env"] = [{"name": "X", "valueFrom": {"fieldRef": 1}}]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, helpers.schema_version(), strict=True)
    assert helpers.schema_version().startswith("1.36")
