"""The webhooks' matchConditions, evaluated by a CEL interpreter against the
AdmissionReviews a real kube-apiserver sent (shared/fixtures/admission) and a few edge
cases: only pods that carry (or, for validation, carried) a gpuplace.io/ annotation are
sent, and no request makes an expression fail (a failing condition would fall back to the
failurePolicy, which for validation is Fail)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from cluster import keys
from tests.deploy import rendering

celpy = pytest.importorskip("celpy", reason="cel-python (test extra) evaluates the CEL")

FIXTURES = rendering.ROOT.parent / "shared" / "fixtures" / "admission"


def conditions(kind: str) -> list[str]:
    config = rendering.one(rendering.render("base"), kind)
    (webhook,) = config["webhooks"]
    return [c["expression"] for c in webhook["matchConditions"]]


def sent(expressions: list[str], request: dict[str, Any]) -> bool:
    """Whether the API server would call the webhook: every condition true; an error is
    a test failure (it would make the call depend on failurePolicy)."""
    env = celpy.Environment()
    activation = {
        "object": celpy.json_to_cel(request.get("object")),
        "oldObject": celpy.json_to_cel(request.get("oldObject")),
        "request": celpy.json_to_cel(request),
    }
    results = []
    for expression in expressions:
        value = env.program(env.compile(expression)).evaluate(activation)
        assert isinstance(value, celpy.celtypes.BoolType), f"{expression!r} gave {value!r}"
        results.append(bool(value))
    return all(results)


def carries(obj: dict[str, Any] | None) -> bool:
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    return any(key.startswith(keys.PREFIX) for key in annotations)


def captured() -> list[tuple[str, dict[str, Any]]]:
    """The captured AdmissionReview requests; empty (their test skips) without ../shared."""
    files = sorted(FIXTURES.glob("*.json"))
    return [(f.name, json.loads(f.read_text())["request"]["request"]) for f in files]


@pytest.mark.skipif(not captured(), reason=f"captured fixtures not found in {FIXTURES}")
@pytest.mark.parametrize(
    ("name", "request_"), captured() or [("none", {})], ids=[n for n, _ in captured()] or ["none"]
)
def test_captured_requests(name: str, request_: dict[str, Any]) -> None:
    wanted = carries(request_.get("object"))
    assert sent(conditions("MutatingWebhookConfiguration"), request_) is wanted
    wanted_validation = wanted or carries(request_.get("oldObject"))
    assert sent(conditions("ValidatingWebhookConfiguration"), request_) is wanted_validation
    if "plain" in name:
        assert not wanted  # the case the conditions exist for: never sent


@pytest.mark.skipif(not captured(), reason=f"captured fixtures not found in {FIXTURES}")
def test_removing_every_gpuplace_annotation_is_still_validated() -> None:
    update = next(r for n, r in captured() if r["operation"] == "UPDATE" and carries(r["object"]))
    stripped = copy.deepcopy(update)
    annotations = stripped["object"]["metadata"]["annotations"]
    for key in [k for k in annotations if k.startswith(keys.PREFIX)]:
        del annotations[key]
    assert not sent(conditions("MutatingWebhookConfiguration"), stripped)
    assert sent(conditions("ValidatingWebhookConfiguration"), stripped)


def test_pod_without_annotations_and_lookalike_keys() -> None:
    bare: dict[str, Any] = {
        "operation": "CREATE",
        "object": {"metadata": {"name": "p"}},
        "oldObject": None,
    }
    lookalike = copy.deepcopy(bare)
    lookalike["object"]["metadata"]["annotations"] = {"example.com/gpuplace.io-x": "1"}
    for request in (bare, lookalike):
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            assert not sent(conditions(kind), request)


@pytest.mark.skipif(not FIXTURES.parent.is_dir(), reason=f"{FIXTURES.parent} not present")
def test_fixtures_directory_is_where_the_readme_says() -> None:
    assert Path(FIXTURES, "..", "README.md").resolve().exists()
