"""Property: across random interleavings of queued pods and gangs being created, finished
and deleted, kube-scheduler runs, evictions completing and controller restarts, the
controller's rounds never exceed a quota and never admit a pod without a place.

Checked after every step (the controllers keep running between steps, so steps land in the
middle of their writes): no GPU is granted twice in the API; every admitted pod (queue
gate gone) holds a grant; no queue uses more than its nominal plus borrowing limit and no
cohort more than its queues' nominals (`Rig.check`); a gang's members lose their queue
gates only under one plan that every member carries. At the end, once everything settled:
kube-scheduler places every admitted pod through the extender (none waits for a GPU its
queue promised), and a gang is admitted whole or not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplace.cluster import keys
from gpuplace.cluster.gang_marks import gated, plan_mark
from gpuplace.dev import localapi
from tests.gangs.test_rounds_property import bounded
from tests.queues.rig import FAST, Rig, gpuqueue, namespace, nodes, queued, rig
from tests.queues.test_reclaiming import kubelet_finishes

STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("pod"), st.sampled_from(["team-a", "team-b"]), st.integers(1, 3)),
        st.tuples(st.just("gang"), st.sampled_from(["team-a", "team-b"])),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("delete"), st.integers(0, 20)),
        st.tuples(st.just("schedule")),
        st.tuples(st.just("kubelet")),
        st.tuples(st.just("restart")),
    ),
    min_size=4,
    max_size=18,
)


def check_gangs(pods: list[dict[str, Any]], *, settled: bool = False) -> None:
    """A gang member leaves its queue only under a plan; settled, a plan's members are
    all admitted or all waiting."""
    by_plan: dict[str, list[bool]] = {}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if keys.GANG_LABEL not in labels or keys.QUEUE_LABEL not in labels:
            continue
        waiting = gated(pod, keys.QUEUE_GATE)
        mark = plan_mark(pod)
        if mark is None:
            assert waiting, f"{pod['metadata']['name']} left its queue without a plan"
            continue
        by_plan.setdefault(mark.id, []).append(waiting)
    if settled:
        for plan, states in by_plan.items():
            assert all(states) or not any(states), f"plan {plan} is half admitted: {states}"


def live(r: Rig) -> list[dict[str, Any]]:
    return sorted(
        (
            pod
            for pod in r.pods()
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            and not pod["metadata"].get("deletionTimestamp")
        ),
        key=lambda pod: (pod["metadata"]["namespace"], pod["metadata"]["name"]),
    )


async def scenario(steps: list[tuple[Any, ...]], pauses: list[float]) -> None:
    async with localapi.serve(
        localapi.FakeApi(bookmark_interval=0.2, access=localapi.Access.shipped())
    ) as server:
        nodes(server.api, 2, gpus=4)
        namespace(server.api, "team-a", team="a")
        namespace(server.api, "team-b", team="b")
        server.api.create(gpuqueue("team-a", "3", cohort="research", borrowing="2"))
        server.api.create(gpuqueue("team-b", "4", cohort="research"))
        counter = 0
        async with contextlib.AsyncExitStack() as stack:
            r = await stack.enter_async_context(rig(server, settings=FAST))
            for step, pause in zip(steps, pauses, strict=False):
                kind = step[0]
                counter += 1
                if kind == "pod":
                    r.api.create(queued(f"p{counter}", step[1], count=step[2]))
                elif kind == "gang":
                    for i in range(2):
                        r.api.create(
                            queued(f"g{counter}-{i}", step[1], count=1, gang=f"g{counter}", size=2)
                        )
                elif kind in ("finish", "delete"):
                    # only a pod that runs on a node finishes; any pod may be deleted
                    found = [
                        pod
                        for pod in live(r)
                        if kind == "delete" or (pod.get("spec") or {}).get("nodeName")
                    ]
                    if found:
                        pod = found[step[1] % len(found)]["metadata"]
                        if kind == "finish":
                            r.api.set_phase(pod["namespace"], pod["name"], "Succeeded")
                        else:
                            r.api.delete("pods", pod["name"], pod["namespace"])
                elif kind == "schedule":
                    await r.schedule()
                elif kind == "kubelet":
                    kubelet_finishes(r.api)
                elif kind == "restart":
                    await stack.aclose()
                    r = await stack.enter_async_context(rig(server, settings=FAST))
                await asyncio.sleep(pause)
                r.check()
                check_gangs(r.pods())
            # let everything settle; the evicted go; kube-scheduler places what is admitted
            for _ in range(3):
                await r.quiet(timeout=20.0)
                kubelet_finishes(r.api)
            await r.quiet(timeout=20.0)
            left = await r.schedule()
            assert left == [], f"admitted pods without a place: {left}"
            r.check()
            check_gangs(r.pods(), settled=True)


@pytest.mark.timeout(600)  # 8 scenarios, each a local API and two controllers: minutes on
# a loaded machine, where pytest's 120 s would cut it short
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=STEPS, seed=st.integers(0, 2**16))
def test_rounds_never_exceed_a_quota_nor_admit_a_pod_without_a_place(
    steps: list[tuple[Any, ...]], seed: int
) -> None:
    rng = random.Random(seed)
    pauses = [rng.choice([0.0, 0.003, 0.01, 0.05]) for _ in steps]
    asyncio.run(bounded(scenario(steps, pauses), 90.0))
