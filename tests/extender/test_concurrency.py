"""Concurrent filter + bind calls never oversubscribe a GPU (checked in the API: the pods'
assignment annotations), and the ledger afterwards is what a restart would rebuild."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplace.cluster import assignments
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from tests.extender.conftest import Harness, harness
from tests.extender.test_binding import settled

GPU_MIB = 40960


def check_api(api: localapi.FakeApi, gpus_per_node: dict[str, int]) -> int:
    """Every GPU's granted share ≤ 100% and memory ≤ its memory, whole GPUs unshared;
    every bound pod carries an assignment on its node. Returns the number bound."""
    milli: dict[tuple[str, int], int] = defaultdict(int)
    memory: dict[tuple[str, int], int] = defaultdict(int)
    holders: dict[tuple[str, int], int] = defaultdict(int)
    bound = 0
    for pod in api.objects("pods"):
        grant = assignments.grant_of(pod)
        node = pod["spec"].get("nodeName")
        if node:
            bound += 1
            assert grant is not None and grant.node == node, pod["metadata"]["name"]
        if grant is None:
            continue
        for index in grant.gpus:
            assert index < gpus_per_node[grant.node]
            milli[(grant.node, index)] += grant.milli
            memory[(grant.node, index)] += grant.memory_mib
            holders[(grant.node, index)] += 1
    for key, total in milli.items():
        assert total <= 1000, (key, total)
        assert memory[key] <= GPU_MIB, (key, memory[key])
    return bound


async def race(h: Harness, pods: list[dict[str, Any]], seed: int) -> list[str]:
    """filter then bind each pod, all at once, each on a random node filter passed."""
    names = sorted(h.sidecar.sync.nodes)

    async def one(pod: dict[str, Any], rng: random.Random) -> str:
        verdict = await h.filter(pod, names)
        if not verdict["NodeNames"]:
            return "unschedulable"
        error = await h.bind(pod, rng.choice(verdict["NodeNames"]))
        return "bound" if not error else "refused"

    return await asyncio.gather(
        *(one(pod, random.Random(seed + index)) for index, pod in enumerate(pods))
    )


async def scenario(
    nodes: int, gpus: int, requests: list[tuple[int, int, int]], seed: int
) -> tuple[int, list[str]]:
    async with localapi.serve(
        localapi.FakeApi(bookmark_interval=0.2, access=localapi.Access.shipped())
    ) as server:
        api = server.api
        for index in range(nodes):
            api.create(objects.node(f"n{index}", gpus=gpus, gpu_memory_mib=GPU_MIB))
        pods = []
        for index, (percent, memory_gib, count) in enumerate(requests):
            body = objects.pod(
                f"p{index}",
                percent=percent if count == 1 else None,
                count=count if count > 1 else None,
                memory=f"{memory_gib}Gi" if memory_gib else None,
            )
            pods.append(api.create(body))
        async with harness(server) as h:
            await asyncio.wait_for(h.sidecar.sync.ready.wait(), 5)
            outcomes = await race(h, pods, seed)
            bound = check_api(api, {f"n{index}": gpus for index in range(nodes)})
            await h.synced(lambda: settled(api, h), timeout=10)
            before = h.sidecar.sync.ledger.snapshot()
        async with harness(server) as restarted:
            await asyncio.wait_for(restarted.sidecar.sync.ready.wait(), 5)
            assert restarted.sidecar.sync.ledger.snapshot() == before
        return bound, outcomes


async def test_a_thousand_concurrent_calls_never_oversubscribe() -> None:
    rng = random.Random(11)
    requests = [
        (rng.choice([10, 20, 25, 30, 50, 70, 100]), rng.choice([0, 0, 4, 10, 20]), 1)
        if rng.random() < 0.9
        else (100, 0, 2)
        for _ in range(500)
    ]
    bound, outcomes = await scenario(3, 2, requests, seed=5)
    assert len(outcomes) == 500  # 500 filters + 500 binds in flight together
    assert bound == outcomes.count("bound")
    assert bound >= 6  # the cluster did fill up
    assert outcomes.count("refused") > 0  # and binds did collide


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    nodes=st.integers(1, 3),
    gpus=st.integers(1, 4),
    requests=st.lists(
        st.tuples(
            st.integers(1, 100),
            st.sampled_from([0, 1, 8, 20, 40]),
            st.sampled_from([1, 1, 1, 2, 4]),
        ),
        min_size=1,
        max_size=40,
    ),
    seed=st.integers(0, 1000),
)
def test_property_no_oversubscription(
    nodes: int, gpus: int, requests: list[tuple[int, int, int]], seed: int
) -> None:
    bound, outcomes = asyncio.run(scenario(nodes, gpus, requests, seed))
    assert bound == outcomes.count("bound")
