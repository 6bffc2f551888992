"""Which nodes a pod's spec allows (`gpuplace.cluster.node_affinity`), as kube-scheduler's
NodeAffinity plugin reads nodeSelector and required node affinity."""

from __future__ import annotations

from typing import Any

from gpuplace.cluster.node_affinity import NAME_FIELD, NodeAffinity


def pod_with(affinity: Any = None, selector: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main"}]}
    if affinity is not None:
        spec["affinity"] = affinity
    if selector is not None:
        spec["nodeSelector"] = selector
    return {"metadata": {"name": "p"}, "spec": spec}


def test_every_operator_and_the_node_selector_read_as_kube_scheduler_reads_them() -> None:
    def term(*expressions: dict[str, Any], fields: list[dict[str, Any]] | None = None) -> Any:
        body: dict[str, Any] = {"matchExpressions": list(expressions)}
        if fields:
            body["matchFields"] = fields
        return {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [body]}
            }
        }

    labels = {"a": "1", "count": "8", "zone": "z1"}
    cases: list[tuple[dict[str, Any], bool]] = [
        ({"key": "a", "operator": "In", "values": ["1", "2"]}, True),
        ({"key": "a", "operator": "NotIn", "values": ["1"]}, False),
        ({"key": "b", "operator": "NotIn", "values": ["1"]}, True),
        ({"key": "a", "operator": "Exists"}, True),
        ({"key": "a", "operator": "DoesNotExist"}, False),
        ({"key": "count", "operator": "Gt", "values": ["4"]}, True),
        ({"key": "count", "operator": "Lt", "values": ["4"]}, False),
        ({"key": "zone", "operator": "Gt", "values": ["4"]}, False),
        ({"key": "a", "operator": "Bogus", "values": ["1"]}, False),
    ]
    for expression, expected in cases:
        assert NodeAffinity.of(pod_with(term(expression))).matches("n", labels) is expected
    pinned = pod_with(term(fields=[{"key": NAME_FIELD, "operator": "In", "values": ["n"]}]))
    assert NodeAffinity.of(pinned).matches("n", labels)
    assert not NodeAffinity.of(pinned).matches("m", labels)
    assert NodeAffinity.of(pod_with(selector={"zone": "z1"})).matches("n", labels)
    assert not NodeAffinity.of(pod_with(selector={"zone": "z2"})).matches("n", labels)
    assert NodeAffinity.of(pod_with()).trivial
    assert NodeAffinity.of(pod_with()).allowed([("n", labels)]) is None
