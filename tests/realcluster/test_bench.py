"""The throughput bench against the stock scheduler (`bench/scheduler_throughput.py`,
docs/performance.md) at a tiny size on the session's cluster, so that it cannot rot:
every pod of both kinds is bound, GPU pods by the gpuplace profile to the GPU nodes and
plain ones by the default scheduler to the plain nodes, and the figures are there."""

from __future__ import annotations

from bench import scheduler_throughput
from tests.realcluster.install import Installation


async def test_the_bench_binds_every_pod_of_both_kinds(gpuplace: Installation) -> None:
    result = await scheduler_throughput.measure(gpuplace, nodes=2, pods=3, timeout=120)
    for kind in ("gpuplace", "plain"):
        figures = result[kind]
        assert (figures["pods"], figures["bound"]) == (3, 3), result
        assert figures["pods_per_second"] > 0
        latency = figures["ungate_to_bind_s"]
        assert 0 <= latency["p50"] <= latency["p99"] <= latency["max"]
    assert result["placed_on"] == {"gpuplace": "gpu", "plain": "plain"}
    assert result["throughput_ratio"] > 0
