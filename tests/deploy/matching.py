"""Whether kube-apiserver would call one of gpuplace's webhooks for a request: the webhook's
`rules` (operation, resource and subresource) and its `matchConditions`, read from the
rendered manifests and evaluated by cel-python (`celpy`).

celpy is kinder than kube-apiserver's cel-go in one place that matters here: its `has(e.f)`
answers false when `e` is null or not a map, where cel-go (and the CEL spec) raise an
error. An error in a matchCondition falls back to failurePolicy (Fail for validation), so
`StrictEvaluator` makes `has` raise the same way; a condition that reads `oldObject` of a
CREATE unguarded then fails here as it would in the API server. Any error is an
`AssertionError`: the conditions must decide every request. Namespace scoping
(`namespaceSelector`) is tested in test_manifests.py, not here.
"""

from __future__ import annotations

import functools
from typing import Any

import lark
import pytest

from tests.deploy import rendering

pytest.importorskip("celpy", reason="cel-python (test extra) evaluates the CEL")

import celpy
from celpy import adapter, celtypes, evaluation

MUTATING = "MutatingWebhookConfiguration"
VALIDATING = "ValidatingWebhookConfiguration"


class StrictEvaluator(evaluation.Evaluator):
    """celpy's evaluator with `has(e.f)` as cel-go has it: an error unless `e` is a map."""

    def sub_evaluator(self, ast: lark.Tree[Any]) -> evaluation.Evaluator:
        return StrictEvaluator(ast, activation=self.activation)

    def macro_has_eval(self, exprlist: lark.Tree[Any]) -> Any:
        node: Any = exprlist
        while isinstance(node, lark.Tree) and node.data != "member_dot":
            (node,) = node.children
        operand = self.visit(node.children[0])
        if isinstance(operand, evaluation.CELEvalError):
            return operand
        if not isinstance(operand, celtypes.MapType):
            return evaluation.CELEvalError(
                f"has() selects {node.children[1]} from a {type(operand).__name__}", TypeError, None
            )
        return celtypes.BoolType(celtypes.StringType(node.children[1].value) in operand)


class StrictRunner(celpy.InterpretedRunner):
    def evaluate(self, context: Any) -> Any:
        return StrictEvaluator(ast=self.ast, activation=self.new_activation()).evaluate(context)


def webhook(kind: str) -> dict[str, Any]:
    """The one webhook of the rendered configuration `kind`."""
    config = rendering.one(rendering.render("base"), kind)
    (hook,) = config["webhooks"]
    result: dict[str, Any] = hook
    return result


@functools.cache
def _programs(kind: str) -> list[tuple[str, Any]]:
    environment = celpy.Environment(runner_class=StrictRunner)
    return [
        (c["name"], environment.program(environment.compile(c["expression"])))
        for c in webhook(kind)["matchConditions"]
    ]


def conditions(kind: str, request: dict[str, Any]) -> dict[str, bool]:
    """Each matchCondition's value for `request` (an AdmissionRequest dict)."""
    activation = {
        "object": adapter.json_to_cel(request.get("object")),
        "oldObject": adapter.json_to_cel(request.get("oldObject")),
        "request": adapter.json_to_cel(request),
    }
    values: dict[str, bool] = {}
    for name, program in _programs(kind):
        try:
            value = program.evaluate(activation)
        except evaluation.CELEvalError as error:
            raise AssertionError(f"matchCondition {name} failed: {error}") from None
        assert isinstance(value, celtypes.BoolType), f"{name} gave {value!r}"
        values[name] = bool(value)
    return values


def matches_rules(kind: str, request: dict[str, Any]) -> bool:
    """The webhook's `rules`: group, version, operation, resource[/subresource]."""
    resource = request.get("resource") or {"group": "", "version": "v1", "resource": "pods"}
    name = resource["resource"]
    if request.get("subResource"):
        name += "/" + request["subResource"]
    for rule in webhook(kind)["rules"]:
        assert "*" not in rule["resources"] and "*" not in rule["operations"], rule
        if (
            resource["group"] in rule["apiGroups"]
            and resource["version"] in rule["apiVersions"]
            and request["operation"] in rule["operations"]
            and name in rule["resources"]
        ):
            return True
    return False


def sent(kind: str, request: dict[str, Any]) -> bool:
    """Whether the API server calls the webhook: a rule matches and every condition holds
    (the conditions are evaluated, and must not fail, for every request of the rules)."""
    if not matches_rules(kind, request):
        return False
    return all(conditions(kind, request).values())
