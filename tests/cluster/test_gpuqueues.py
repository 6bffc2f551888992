"""The GpuQueue at the edge: the objects the API server accepts become the engine's
QueueSpec in its units (rounded down); what it refuses is refused here too, with the
queue's name; label selectors match as Kubernetes' do."""

from __future__ import annotations

import pytest

from gpuplace.cluster import gpuqueues
from gpuplace.placement.queueing import quotas
from gpuplace.placement.queueing.quotas import ANY_MODEL, GPU_COMPUTE, GPU_MEMORY, GPUS, Quota
from tests.deploy import gpuqueue_cases as cases


@pytest.mark.parametrize("name", sorted(cases.GOOD))
def test_every_good_queue_parses(name: str) -> None:
    spec = gpuqueues.parse(cases.GOOD[name])
    assert spec.name == "team-a" and spec.quotas


def test_quantities_become_the_engine_units_rounded_down() -> None:
    spec = gpuqueues.parse(cases.GOOD["cohort with limits"])
    assert spec.quotas == {
        (GPUS, ANY_MODEL): Quota(8000, 4000, 2000),
        (GPU_MEMORY, "NVIDIA-H100-80GB-HBM3"): Quota(640 * 1024),
        (GPU_COMPUTE, ANY_MODEL): Quota(2500, None, 2500),
    }
    assert (spec.cohort, spec.weight) == ("research", 2.0)
    odd = cases.queue(
        resources=[
            {"name": "gpus", "nominal": "1.0005"},
            {"name": "gpu-memory", "nominal": "1.5Mi"},
        ]
    )
    assert gpuqueues.parse(odd).quotas == {
        (GPUS, ANY_MODEL): Quota(1000),
        (GPU_MEMORY, ANY_MODEL): Quota(1),
    }


def test_defaults_and_policies() -> None:
    plain = gpuqueues.parse(cases.GOOD["smallest"])
    assert plain.weight == 1.0 and plain.cohort == "" and plain.max_wait is None
    assert plain.reclaim is quotas.Preemption.ANY
    assert plain.fair_sharing is quotas.Preemption.NEVER
    assert plain.queueing is quotas.Queueing.BEST_EFFORT_FIFO
    full = gpuqueues.parse(cases.GOOD["everything"])
    assert full.weight == 0.5 and full.max_wait == 5400
    assert full.reclaim is quotas.Preemption.LOWER_PRIORITY
    assert full.fair_sharing is quotas.Preemption.ANY
    assert full.queueing is quotas.Queueing.STRICT_FIFO


@pytest.mark.parametrize("name", sorted(cases.BAD))
def test_what_the_api_server_refuses_is_refused_with_the_queue_named(name: str) -> None:
    case = cases.BAD[name]
    with pytest.raises(gpuqueues.QueueError) as raised:
        gpuqueues.parse(case.obj)
    assert "GpuQueue team-a" in str(raised.value)
    assert case.parser in str(raised.value)


def test_the_namespace_selector_matches_as_kubernetes_does() -> None:
    queue = gpuqueues.read(cases.GOOD["everything"])
    selector = queue.spec.namespace_selector
    assert selector is not None
    assert selector.matches({"team": "a", "tier": "gold"})
    assert not selector.matches({"team": "a", "tier": "gold", "frozen": "yes"})
    assert not selector.matches({"team": "b", "tier": "gold"})
    assert gpuqueues.read(cases.queue(namespaceSelector={})).spec.namespace_selector.matches({})  # type: ignore[union-attr]
    assert gpuqueues.read(cases.GOOD["smallest"]).spec.namespace_selector is None


def test_a_file_of_queues_names_each_once_and_holds_only_queues() -> None:
    assert [s.name for s in gpuqueues.parse_all([cases.queue("a"), cases.queue("b")])] == ["a", "b"]
    with pytest.raises(gpuqueues.QueueError, match="given twice"):
        gpuqueues.parse_all([cases.queue("a"), cases.queue("a")])
    with pytest.raises(gpuqueues.QueueError, match="expected kind GpuQueue"):
        gpuqueues.parse_all([{"kind": "ConfigMap"}])
