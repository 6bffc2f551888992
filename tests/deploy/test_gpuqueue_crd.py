"""The GpuQueue CRD as `kustomize build` renders it: its shape (cluster-scoped, status
subresource, printer columns that point at fields it has), and its schema and CEL rules
applied here the way kube-apiserver applies them (defaults, then the structural schema by
jsonschema, then list-map keys, then every `x-kubernetes-validations` rule by cel-python
with Kubernetes' quantity functions) to the good and bad queues of gpuqueue_cases. The same
table goes to a real kube-apiserver in test_gpuqueue_apiserver.py."""

from __future__ import annotations

import copy
import functools
from decimal import Decimal
from typing import Any

import jsonschema
import pytest

from gpuplace.cluster import gpuqueues, quantities
from tests.deploy import gpuqueue_cases as cases
from tests.deploy import rendering

pytest.importorskip("celpy", reason="cel-python (test extra) evaluates the CEL")

import celpy
from celpy import adapter, celtypes

Obj = dict[str, Any]
CRD_NAME = f"{gpuqueues.PLURAL}.{gpuqueues.GROUP}"


def crd(tree: str = "base") -> Obj:
    return rendering.one(rendering.render(tree), "CustomResourceDefinition", CRD_NAME)


def schema() -> Obj:
    (version,) = crd()["spec"]["versions"]
    found: Obj = version["schema"]["openAPIV3Schema"]
    return found


# --- Kubernetes' CEL quantity library, for cel-python ------------------------------------


class Quantity(celtypes.StringType):
    """A parsed quantity (the text is kept; comparisons read its value)."""

    @property
    def value(self) -> Decimal:
        return quantities.parse(str(self))


def _is_quantity(text: Any) -> celtypes.BoolType:
    try:
        quantities.parse(str(text))
    except quantities.QuantityError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _quantity(text: Any) -> Quantity:
    if not _is_quantity(text):
        raise ValueError(f"quantity({text!r}): not a quantity")
    return Quantity(str(text))


def _compare(a: Quantity, b: Quantity) -> celtypes.IntType:
    return celtypes.IntType((a.value > b.value) - (a.value < b.value))


FUNCTIONS: dict[str, Any] = {
    "isQuantity": _is_quantity,
    "quantity": _quantity,
    "compareTo": _compare,
    "isLessThan": lambda a, b: celtypes.BoolType(a.value < b.value),
    "isGreaterThan": lambda a, b: celtypes.BoolType(a.value > b.value),
}


@functools.cache
def _program(rule: str) -> Any:
    environment = celpy.Environment()
    return environment.program(environment.compile(rule), functions=FUNCTIONS)


# --- kube-apiserver's steps, in order --------------------------------------------------


def defaulted(node: Obj, value: Any) -> Any:
    """`value` with the schema's defaults filled in, as the API server does first."""
    if isinstance(value, dict) and "properties" in node:
        value = dict(value)
        for name, child in node["properties"].items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = defaulted(child, value[name])
    elif isinstance(value, list) and "items" in node:
        value = [defaulted(node["items"], item) for item in value]
    return value


def map_duplicates(node: Obj, value: Any, path: str = "") -> list[str]:
    """Items of `x-kubernetes-list-type: map` lists with equal keys, and equal items of
    `set` lists."""
    found: list[str] = []
    if isinstance(value, dict) and "properties" in node:
        for name, child in node["properties"].items():
            if name in value:
                found += map_duplicates(child, value[name], f"{path}.{name}")
    elif isinstance(value, list) and "items" in node:
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            seen = set()
            for index, item in enumerate(value):
                key = tuple(item.get(k) for k in keys)
                if key in seen:
                    found.append(
                        f"{path}[{index}]: Duplicate value: {dict(zip(keys, key, strict=True))}"
                    )
                seen.add(key)
        if node.get("x-kubernetes-list-type") == "set":
            for index, item in enumerate(value):
                if item in value[:index]:
                    found.append(f"{path}[{index}]: Duplicate value: {item!r}")
        for item in value:
            found += map_duplicates(node["items"], item, path)
    return found


def cel_refusals(node: Obj, value: Any, path: str = "") -> list[str]:
    """The messages of every CEL rule that refuses `value`, children first as the API
    server reports them all. A rule that fails to evaluate refuses too."""
    found: list[str] = []
    if isinstance(value, dict) and "properties" in node:
        for name, child in node["properties"].items():
            if name in value:
                found += cel_refusals(child, value[name], f"{path}.{name}")
    elif isinstance(value, list) and "items" in node:
        for index, item in enumerate(value):
            found += cel_refusals(node["items"], item, f"{path}[{index}]")
    for rule in node.get("x-kubernetes-validations", ()):
        try:
            result = _program(rule["rule"]).evaluate({"self": adapter.json_to_cel(value)})
        except Exception as error:  # celpy raises its own evaluation errors
            result = error
        if result is not True and not (isinstance(result, celtypes.BoolType) and bool(result)):
            found.append(f"{path}: {rule['message']}")
    return found


def refusals(obj: Obj) -> list[str]:
    """Why the API server would refuse `obj` ([] when it would store it). Like it, the
    rules run even where the schema already refuses a value of the right type (a
    malformed quantity gets the pattern's refusal and the rule's)."""
    root = schema()
    value = defaulted(root, obj)
    validator = jsonschema.Draft7Validator(root)
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(value)
    ]
    return errors + map_duplicates(root, value) + cel_refusals(root, value)


# --- the shape --------------------------------------------------------------------------


def test_the_crd_is_a_cluster_scoped_queue_with_a_status_subresource() -> None:
    found = crd()
    spec = found["spec"]
    assert (spec["group"], spec["scope"]) == (gpuqueues.GROUP, "Cluster")
    assert spec["names"]["kind"] == gpuqueues.KIND and spec["names"]["plural"] == gpuqueues.PLURAL
    (version,) = spec["versions"]
    assert version["name"] == gpuqueues.VERSION and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    assert "status" in version["schema"]["openAPIV3Schema"]["properties"]


def test_printer_columns_point_at_fields_the_schema_has() -> None:
    (version,) = crd()["spec"]["versions"]
    root = version["schema"]["openAPIV3Schema"]
    for column in version["additionalPrinterColumns"]:
        node = root
        for part in column["jsonPath"].lstrip(".").split("."):
            if node is root and part == "metadata":
                break
            node = node["properties"][part]
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[:5] == ["Cohort", "Weight", "Admitted", "Waiting", "Share"]


@pytest.mark.parametrize("tree", rendering.TREES)
def test_every_shipped_tree_installs_the_crd_and_its_rbac(tree: str) -> None:
    objects = rendering.render(tree)
    assert rendering.one(objects, "CustomResourceDefinition", CRD_NAME)
    roles = rendering.named(objects, "ClusterRole")
    assert {"gpuplace-queues", "gpuplace-queues-viewer", "gpuplace-queues-editor"} <= set(roles)
    assert (
        roles["gpuplace-queues-viewer"]["metadata"]["labels"][
            "rbac.authorization.k8s.io/aggregate-to-view"
        ]
        == "true"
    )
    assert (
        roles["gpuplace-queues-editor"]["metadata"]["labels"][
            "rbac.authorization.k8s.io/aggregate-to-edit"
        ]
        == "true"
    )


def test_every_rule_compiles() -> None:
    rules: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            rules.extend(rule["rule"] for rule in node.get("x-kubernetes-validations", ()))
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(schema())
    assert len(rules) >= 8
    for rule in rules:
        _program(rule)


# --- good and bad queues ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(cases.GOOD))
def test_good_queues_pass_the_schema_and_every_rule(name: str) -> None:
    assert refusals(cases.GOOD[name]) == []


@pytest.mark.parametrize("name", sorted(cases.BAD))
def test_bad_queues_are_refused_and_cel_says_why(name: str) -> None:
    case = cases.BAD[name]
    found = refusals(case.obj)
    assert found, f"{name} was not refused"
    if case.cel:
        assert any(case.api in message for message in found), found


def test_the_schema_defaults_the_model_weight_and_strategy() -> None:
    value = defaulted(schema(), cases.GOOD["smallest"])
    assert value["spec"]["resources"][0]["model"] == "*"
    assert value["spec"]["weight"] == "1"
    assert value["spec"]["queueingStrategy"] == "BestEffortFIFO"
