"""Property: across random interleavings of gang members being created and deleted, other
pods being scheduled and deleted, kube-scheduler runs and sidecar restarts, no gang is
ever partly ungated and no GPU is ever granted twice.

Checked after every step (the controller keeps running between steps, so steps land
in the middle of its writes): nothing of ours is ungated without a plan, no member of a
plan is ungated before every remaining member of that plan is narrowed to its node, the
API's grants fit every GPU, and the live ledger is never below zero. At the end, once
everything settled: every plan is entirely ungated or entirely gated, and every
ungated member binds to its planned node through the extender.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplace.cluster import keys
from gpuplace.cluster.gang_marks import gated, plan_mark
from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.gangs.controller import GangSettings
from tests.gangs.rig import Rig, check_grants, check_plans, member, other, rig

GANGS = {  # name: (size, GPUs per member)
    "g0": (2, 2),
    "g1": (3, 1),
    "g2": (2, 4),
}

STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("member"), st.sampled_from(sorted(GANGS))),
        st.tuples(st.just("delete-member"), st.sampled_from(sorted(GANGS)), st.integers(0, 3)),
        st.tuples(st.just("other"), st.integers(1, 2)),
        st.tuples(st.just("delete-other"), st.integers(0, 5)),
        st.tuples(st.just("schedule")),
        st.tuples(st.just("restart")),
    ),
    min_size=4,
    max_size=22,
)


def check_commit_before_ungate(pods: list[dict[str, Any]]) -> None:
    by_plan: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        if keys.GANG_LABEL not in (pod["metadata"].get("labels") or {}):
            continue
        mark = plan_mark(pod)
        if mark is None:
            assert gated(pod), "a gang member was ungated without a plan"
            continue
        by_plan.setdefault(mark.id, []).append(pod)
    for members in by_plan.values():
        if all(gated(pod) for pod in members):
            continue
        for pod in members:
            mark = plan_mark(pod)
            assert mark is not None
            pinned = NodeAffinity.of(pod).pinned_to()
            assert pinned == mark.node, "a plan was ungated before all members were narrowed"


def check_ledger(r: Rig) -> None:
    for state in r.h.sidecar.sync.ledger.states():
        assert all(milli >= 0 for milli in state.free_milli), "a GPU was granted twice"
        assert all(memory >= 0 for memory in state.free_memory)


@contextlib.asynccontextmanager
async def served(nodes: int) -> AsyncIterator[localapi.Server]:
    """A local API server with the shipped RBAC and `nodes` 4-GPU nodes gpu-0, gpu-1, ..."""
    async with localapi.serve(
        localapi.FakeApi(bookmark_interval=0.2, access=localapi.Access.shipped())
    ) as server:
        for i in range(nodes):
            server.api.create(objects.node(f"gpu-{i}", gpus=4))
        yield server


async def scenario(steps: list[tuple[Any, ...]], pauses: list[float]) -> None:
    async with served(3) as server:
        counter = 0
        gang_settings = GangSettings(poll_seconds=0.1, settle_seconds=0.002)
        async with contextlib.AsyncExitStack() as stack:
            r = await stack.enter_async_context(rig(server, settings=gang_settings))
            for step, pause in zip(steps, pauses, strict=False):
                kind = step[0]
                if kind == "member":
                    size, gpus = GANGS[step[1]]
                    counter += 1
                    r.api.create(member(f"{step[1]}-m{counter}", step[1], size, count=gpus))
                elif kind == "delete-member":
                    found = sorted(p["metadata"]["name"] for p in r.gang_pods(step[1]))
                    if found:
                        r.api.delete("pods", found[step[2] % len(found)], "default")
                elif kind == "other":
                    counter += 1
                    r.api.create(other(f"o{counter}", count=step[1]))
                elif kind == "delete-other":
                    found = sorted(
                        p["metadata"]["name"]
                        for p in r.pods_everywhere()
                        if p["metadata"]["name"].startswith("o")
                    )
                    if found:
                        r.api.delete("pods", found[step[1] % len(found)], "default")
                elif kind == "schedule":
                    await r.h.synced(lambda: True)
                    await r.schedule_ungated()
                elif kind == "restart":
                    await stack.aclose()
                    r = await stack.enter_async_context(rig(server, settings=gang_settings))
                await asyncio.sleep(pause)
                pods = server.api.objects("pods")
                check_commit_before_ungate(pods)
                check_grants(server.api.objects("nodes"), pods)
                check_ledger(r)
            # let everything settle, then kube-scheduler places what is ungated
            await r.quiet(timeout=15.0)
            check_plans(r.pods_everywhere())
            await r.schedule_ungated()
            await r.quiet(timeout=15.0)
            pods = r.pods_everywhere()
            check_plans(pods)
            check_grants(r.api.objects("nodes"), pods)
            check_ledger(r)
            for pod in pods:
                mark = plan_mark(pod)
                if mark is not None and not gated(pod):
                    assert pod["spec"].get("nodeName") == mark.node


@pytest.mark.timeout(600)  # 14 scenarios, each a local API and a controller: past 120 s
# when the machine is starved (seen at nice 15 beside a CI run), as the queue property's
@settings(
    max_examples=14,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(steps=STEPS, seed=st.integers(0, 2**16))
def test_no_gang_is_ever_partly_ungated_and_no_gpu_is_granted_twice(
    steps: list[tuple[Any, ...]], seed: int
) -> None:
    rng = random.Random(seed)
    pauses = [rng.choice([0.0, 0.003, 0.01, 0.05]) for _ in steps]
    asyncio.run(bounded(scenario(steps, pauses), EXAMPLE_SECONDS))


EXAMPLE_SECONDS = 60.0


async def bounded(work: Coroutine[Any, Any, None], seconds: float) -> None:
    """Run `work`; if it is not done in `seconds`, fail with every task's stack."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if task in done:
        task.result()
        return
    stacks = io.StringIO()
    for other_task in asyncio.all_tasks():
        print(f"--- {other_task.get_name()}", file=stacks)
        other_task.print_stack(file=stacks)
    task.cancel()
    raise AssertionError(f"the scenario hung for {seconds:g}s:\n{stacks.getvalue()}")
