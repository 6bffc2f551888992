"""The typical workload the sidecar measures fragmentation against (its metrics): the
deciding policy's own, or for a policy that scores against none, one built alike from the
same pods on the same refresh rule."""

from __future__ import annotations

from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender.workloads import FALLBACK, PolicyHolder
from gpuplace.placement.fragmentation import TaskType
from tests.cluster.test_syncing import node_record, pod_record


def test_a_workload_policy_is_measured_against_the_workload_it_decides_with() -> None:
    sync = LedgerSync()
    sync.replace_nodes([node_record("n0")])
    sync.upsert_pod(pod_record("a", percent=25))
    holder = PolicyHolder(sync, "default")
    assert holder.workload is not None
    assert holder.measured() is holder.workload


def test_a_policy_without_a_workload_is_measured_against_one_built_alike() -> None:
    now = [0.0]
    sync = LedgerSync()
    sync.replace_nodes([node_record("n0")])
    holder = PolicyHolder(sync, "best-fit", refresh_seconds=60, clock=lambda: now[0])
    assert holder.workload is None
    assert holder.measured() is FALLBACK  # no pod seen yet
    sync.upsert_pod(pod_record("a", percent=25))
    built = holder.measured()  # a fallback gives way at once
    assert TaskType(1000, 250, 1, frozenset()) in dict(built.observed)
    sync.upsert_pod(pod_record("b", percent=50))
    now[0] = 59.0
    assert holder.measured() is built  # not rebuilt before the refresh is due
    now[0] = 61.0
    rebuilt = holder.measured()
    assert rebuilt is not built
    assert TaskType(1000, 500, 1, frozenset()) in dict(rebuilt.observed)
