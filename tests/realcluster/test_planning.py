"""Plan, then pin (docs/placement.md; issue 47, point 5) through the real chain: every GPU
pod no gang or queue plans is gated at admission (`gpuplace.io/place`), planned by the
sidecar's engine and handed to the stock kube-scheduler with its node: as
`status.nominatedNodeName` (`--plan-pin nominate`) or pinned in its required node
affinity in the write that removes the gate (`--plan-pin affinity`). Opt-in (off as
shipped, docs/performance.md): each test restarts serve with its pin.
Nodes are fake GPU nodes of the test's own GPU model (objects.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from tests.realcluster import install
from tests.realcluster.conftest import Scope
from tests.realcluster.install import Installation
from tests.realcluster.kit import Kubectl
from tests.realcluster.objects import gpu_node, grant, metric, pod, wait_bound
from tests.realcluster.test_preemption import evicts_the_shares_of_exactly_one_gpu

RELEASES = "gpuplace_plan_releases_total"


def metrics_of(gpuplace: Installation) -> str:
    return f"http://127.0.0.1:{gpuplace.ports.metrics}/metrics"


def share(scope: Scope) -> dict[str, str]:
    return {"gpuplace.io/gpu-percent": "25", "gpuplace.io/gpu-model": scope.model}


def pinned_nodes(placed: dict[str, Any]) -> list[list[str]]:
    """Per required node-affinity term, the `metadata.name In` values it carries."""
    affinity = (placed["spec"].get("affinity") or {}).get("nodeAffinity") or {}
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    return [
        [
            value
            for field in term.get("matchFields") or []
            if field["key"] == "metadata.name" and field["operator"] == "In"
            for value in field["values"]
        ]
        for term in required.get("nodeSelectorTerms") or []
    ]


@contextlib.contextmanager
def serving(gpuplace: Installation, pin: str) -> Iterator[None]:
    """`gpuplace serve --plan-pin PIN` (opt-in: off as shipped) for one test; as shipped
    after it."""
    shipped = gpuplace.serve
    shipped.stop()
    gpuplace.serve = install.serve_process(gpuplace, flags={"--plan-pin": pin})
    gpuplace.serve.log = gpuplace.workdir / f"serve-plan-{pin}.log"
    try:
        gpuplace.serve.start()
        install.wait_leading(gpuplace)
        yield
    finally:
        gpuplace.serve.stop()
        gpuplace.serve = shipped
        shipped.start()


@pytest.fixture
def nominate_pin(gpuplace: Installation) -> Iterator[None]:
    with serving(gpuplace, "nominate"):
        yield


@pytest.fixture
def affinity_pin(gpuplace: Installation) -> Iterator[None]:
    with serving(gpuplace, "affinity"):
        yield


@pytest.mark.usefixtures("nominate_pin")
def test_a_planned_node_kube_scheduler_refuses_sends_the_pod_elsewhere(
    scope: Scope, kubectl: Kubectl, gpuplace: Installation
) -> None:
    """`--plan-pin nominate`: the engine plans the second share onto the
    first one's GPU, but a pod gpuplace does not manage took that node's CPU meanwhile
    (bound there by name: the ledger does not see it). kube-scheduler tries the nominated
    node first, its own filter refuses it, it offers every other node, and the extender's
    filter drops the stale plan and chooses again: the pod is bound elsewhere, never left
    pending on a node it cannot use."""
    scope.add_nodes(
        gpu_node(scope.node("a"), model=scope.model, gpus=2),
        gpu_node(scope.node("b"), model=scope.model, gpus=2),
    )
    one_cpu = {"requests": {"cpu": "1"}}
    metrics = metrics_of(gpuplace)
    nominated = f'{RELEASES}{{result="nominated"}}'
    before = metric(metrics, nominated)
    kubectl.apply(pod("first", scope.namespace, share(scope), resources=one_cpu))
    placed = wait_bound(kubectl, scope.namespace, "first")
    first = grant(placed)["node"]
    assert placed["spec"]["nodeName"] == first
    assert metric(metrics, nominated) == before + 1  # planned and nominated, then bound
    other = scope.node("b") if first == scope.node("a") else scope.node("a")
    filler = pod("filler", scope.namespace, resources={"requests": {"cpu": "63"}})
    filler["spec"]["nodeName"] = first
    kubectl.apply(filler)
    stale = metric(metrics, "gpuplace_extender_stale_plans_total")
    kubectl.apply(pod("second", scope.namespace, share(scope), resources=one_cpu))
    placed = wait_bound(kubectl, scope.namespace, "second")
    assert grant(placed)["node"] == other
    assert metric(metrics, nominated) == before + 2
    assert metric(metrics, "gpuplace_extender_stale_plans_total") == stale + 1


@pytest.mark.usefixtures("affinity_pin")
def test_a_pinned_pod_binds_to_the_engines_node_and_gpu(
    scope: Scope, kubectl: Kubectl, gpuplace: Installation
) -> None:
    """`--plan-pin affinity`: the engine's choice is the pod's only node (`metadata.name
    In [node]` in each required term, written with the ungate), and the pod is bound
    there on the planned GPU: identical 25% shares fill the used GPU of node b before
    opening an empty one on node a, whose name sorts first (kube-scheduler's own scoring
    would spread them: it is never offered a)."""
    scope.add_nodes(gpu_node(scope.node("b"), model=scope.model, gpus=2))
    metrics = metrics_of(gpuplace)
    pinned = f'{RELEASES}{{result="pinned"}}'
    before = metric(metrics, pinned)
    kubectl.apply(pod("first", scope.namespace, share(scope)))
    first = wait_bound(kubectl, scope.namespace, "first")
    node, gpus = grant(first)["node"], grant(first)["gpus"]
    assert node == scope.node("b")
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=2))
    for name in ("second", "third"):
        kubectl.apply(pod(name, scope.namespace, share(scope)))
        placed = wait_bound(kubectl, scope.namespace, name)
        assert placed["spec"]["nodeName"] == node
        assert (grant(placed)["node"], grant(placed)["gpus"]) == (node, gpus)
        terms = pinned_nodes(placed)
        assert terms and all(values == [node] for values in terms), terms
        assert "gpuplace.io/place" not in [
            gate["name"] for gate in placed["spec"].get("schedulingGates") or []
        ]
    assert pinned_nodes(first) and pinned_nodes(first)[0] == [node]
    assert metric(metrics, pinned) == before + 3


@pytest.mark.usefixtures("nominate_pin")
def test_with_the_planner_preemption_still_frees_exactly_one_gpu(
    scope: Scope, kubectl: Kubectl, gpuplace: Installation
) -> None:
    """`--plan-pin nominate`: the four low-priority shares are planned and nominated; the
    high-priority whole GPU finds no room, so the planner releases it with no node
    (`unplanned`), kube-scheduler preempts through the extender's preempt verb, and the
    victims are the two shares of one GPU, as without the planner."""
    metrics = metrics_of(gpuplace)
    before = {
        result: metric(metrics, f'{RELEASES}{{result="{result}"}}')
        for result in ("nominated", "unplanned")
    }
    evicts_the_shares_of_exactly_one_gpu(scope, kubectl)
    assert metric(metrics, f'{RELEASES}{{result="nominated"}}') == before["nominated"] + 4
    assert metric(metrics, f'{RELEASES}{{result="unplanned"}}') == before["unplanned"] + 1
