"""Property (issue 45, point 4): across random interleavings of members failing (a
container exit, phase Failed, a deletion, a container restarted in place), the owner
creating members again (as a Job does, even while the old ones still terminate), the
kubelet finishing evicted members in any order, kube-scheduler runs and sidecar restarts,
a restart never leaves a member of the old run holding GPUs beside a member of a new one.

Checked after every step (the controller keeps running between steps): of the gang's
members that hold GPUs in the ledger (reserved by a plan or granted, not finished), all
carry one run; the API's grants fit every GPU. At the end, once the old members finished
and the owner filled the gang: it runs whole again, as one run, bound where it was planned.
Nodes have room for two runs side by side, so only the rule keeps them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplace.cluster.gang_marks import gated, plan_mark
from tests.gangs.rig import Rig, check_grants, member, rig
from tests.gangs.test_evicting import RUNNING, SETTINGS
from tests.gangs.test_restarting import (
    EXITED,
    RESTARTED_IN_PLACE,
    check_one_run_holds,
    finish,
    run_of,
)
from tests.gangs.test_rounds_property import EXAMPLE_SECONDS, bounded, served

SIZE = 3

STEPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("fail"), st.integers(0, SIZE - 1), st.sampled_from(["exit", "phase", "delete"])
        ),
        st.tuples(st.just("fail"), st.integers(0, SIZE - 1), st.just("in-place")),
        st.tuples(st.just("recreate")),
        st.tuples(st.just("finish"), st.integers(0, SIZE - 1)),
        st.tuples(st.just("schedule")),
        st.tuples(st.just("restart")),
    ),
    min_size=3,
    max_size=14,
)


def live(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed") and not pod[
        "metadata"
    ].get("deletionTimestamp")


async def schedule(r: Rig) -> None:
    """kube-scheduler binds what is ungated; the kubelet starts what is bound."""
    await r.h.synced(lambda: True)
    await r.schedule_ungated()
    for pod in r.gang_pods("t"):
        if pod["spec"].get("nodeName") and (pod.get("status") or {}).get("phase") == "Pending":
            r.api.patch(
                "pods",
                pod["metadata"]["name"],
                {"status": RUNNING},
                "default",
                subresource="status",
            )


async def scenario(steps: list[tuple[Any, ...]]) -> None:
    async with served(2) as server:
        counter = 0

        def create() -> None:
            nonlocal counter
            counter += 1
            r.api.create(member(f"m{counter}", "t", SIZE, count=1))

        async with contextlib.AsyncExitStack() as stack:
            r = await stack.enter_async_context(rig(server, settings=SETTINGS))
            for _ in range(SIZE):
                create()
            await r.quiet()
            await schedule(r)
            await r.quiet()
            for step in steps:
                pods = sorted(r.gang_pods("t"), key=lambda pod: pod["metadata"]["name"])
                kind = step[0]
                if kind == "fail":
                    running = [p for p in pods if live(p) and p["spec"].get("nodeName")]
                    if running:
                        name = running[step[1] % len(running)]["metadata"]["name"]
                        if step[2] == "delete":
                            r.api.delete("pods", name, "default")
                        else:
                            status = {"exit": EXITED, "in-place": RESTARTED_IN_PLACE}.get(
                                step[2], {"phase": "Failed"}
                            )
                            r.api.patch(
                                "pods", name, {"status": status}, "default", subresource="status"
                            )
                elif kind == "recreate":  # a Job creates every missing member at once
                    for _ in range(SIZE - sum(map(live, pods))):
                        create()
                elif kind == "finish":
                    going = [
                        p
                        for p in pods
                        if p["metadata"].get("deletionTimestamp")
                        or (p.get("status") or {}).get("phase") == "Failed"
                    ]
                    if going:
                        finish(r, going[step[1] % len(going)]["metadata"]["name"])
                elif kind == "schedule":
                    await schedule(r)
                elif kind == "restart":
                    await stack.aclose()
                    r = await stack.enter_async_context(rig(server, settings=SETTINGS))
                await r.rounds(1)
                check_one_run_holds(r)
                check_grants(server.api.objects("nodes"), server.api.objects("pods"))
            # the kubelet finishes whatever was taken down, the owner fills the gang again
            for _ in range(4):
                await r.quiet(timeout=15.0)
                for pod in r.gang_pods("t"):
                    if not live(pod):
                        finish(r, pod["metadata"]["name"])
                for _ in range(SIZE - sum(map(live, r.gang_pods("t")))):
                    create()
                await r.quiet(timeout=15.0)
                check_one_run_holds(r)
                await schedule(r)
            await r.quiet(timeout=15.0)
            pods = r.gang_pods("t")
            assert len(pods) == SIZE and all(map(live, pods)), [
                (p["metadata"]["name"], p.get("status")) for p in pods
            ]
            assert not any(map(gated, pods))
            assert len({run_of(pod) for pod in pods}) == 1
            for pod in pods:
                mark = plan_mark(pod)
                assert mark is not None and pod["spec"].get("nodeName") == mark.node
            check_one_run_holds(r)
            check_grants(server.api.objects("nodes"), server.api.objects("pods"))


@pytest.mark.timeout(600)  # 10 scenarios, each a local API and a controller (see
# test_rounds_property for why the default 120 s is too tight on a starved machine)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=STEPS)
def test_a_restart_never_leaves_an_old_member_holding_gpus_beside_a_new_one(
    steps: list[tuple[Any, ...]],
) -> None:
    asyncio.run(bounded(scenario(steps), EXAMPLE_SECONDS))
