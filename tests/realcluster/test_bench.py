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
    # what bounds it: the sidecar's verbs, and kube-apiserver's queues per FlowSchema
    assert result["sidecar_verbs"]["bind ok"]["calls"] == 3, result
    # filter passes the policy's best node alone: kube-scheduler binds it without scoring
    # and calls no prioritize (the shipped profile names none)
    verbs = set(result["sidecar_verbs"])
    assert "filter ok" in verbs and not any(verb.startswith("prioritize") for verb in verbs)
    assert result["kube_scheduler"]["gpuplace"].get("Score", {}).get("calls", 0) == 0, result
    flows = result["api_priority_and_fairness"]
    assert flows["gpuplace"]["requests"] > 0, flows  # the sidecar's Bindings, at least
    assert flows["gpuplace"]["mean_wait_s"] >= 0, flows  # exempt requests are not queued
    # the sidecar's event-loop lag over the burst (gpuplace.runtime.loop_lag): its probes ran
    assert result["sidecar_loop_lag"]["probes"] > 0, result
    cores = result["cpu"]["cores_used"]
    assert {"sidecar", "gpuplace kube-scheduler", "kube-apiserver"} <= set(cores), result
    for kind in ("gpuplace", "plain"):
        scheduler = result["kube_scheduler"][kind]
        assert scheduler["attempt"]["calls"] >= 3 and scheduler["Filter"]["calls"] >= 3, result
        assert scheduler["algorithm"]["calls"] >= 3, result
