"""A gang ends together (docs/gangs.md, "When a member fails"): a member that fails takes
the others of its run down through the Eviction API, and the members its owner creates
again start as one new run once the old one holds no GPU; under `continue` the others
run on. Against the fake API server with the real sidecar and gang controller."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpuplace.cluster import keys
from gpuplace.cluster.gang_marks import gated, plan_mark
from gpuplace.dev import localapi
from gpuplace.gangs.controller import GangController, GangSettings
from gpuplace.gangs.restarting import Restarts
from tests.gangs.rig import Rig, check_grants, condition, events, member, nodes, rig
from tests.gangs.test_evicting import RUNNING, SETTINGS, budget, evicted

EXITED = {
    "phase": "Failed",
    "containerStatuses": [
        {"name": "main", "state": {"terminated": {"exitCode": 3, "reason": "Error"}}}
    ],
}

RESTARTED_IN_PLACE = {
    "containerStatuses": [
        {
            "name": "main",
            "restartCount": 1,
            "state": {"running": {}},
            "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
        }
    ]
}
"""A member whose container was OOM-killed and restarted in place (restartPolicy: Always)."""


async def started(
    r: Rig, prefix: str, size: int, *, annotations: dict[str, str] | None = None, count: int = 1
) -> list[dict[str, Any]]:
    """A gang `t` of `size` members, planned, bound and running."""
    for i in range(size):
        r.api.create(member(f"{prefix}{i}", "t", size, count=count, annotations=annotations))
    await r.quiet()
    assert await r.schedule_ungated() == []
    for i in range(size):
        r.api.patch("pods", f"{prefix}{i}", {"status": RUNNING}, "default", subresource="status")
    await r.quiet()
    return [r.api.get("pods", f"{prefix}{i}", "default") for i in range(size)]


def run_of(pod: dict[str, Any]) -> str:
    mark = plan_mark(pod)
    assert mark is not None
    return mark.run_id


def finish(r: Rig, name: str) -> None:
    """The kubelet's part after an eviction: the containers stop, the pod goes."""
    r.api.set_phase("default", name, "Failed")
    r.api.delete("pods", name, "default")


def check_one_run_holds(r: Rig) -> None:
    """No member of one run holds GPUs beside a member of another (point 4)."""
    holding = {
        run_of(pod)
        for pod in r.gang_pods("t")
        if plan_mark(pod) is not None
        and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        and pod["metadata"]["uid"] in r.h.sidecar.sync.ledger
    }
    assert len(holding) <= 1, holding


async def test_a_failed_member_takes_its_gang_down_and_the_new_members_start_as_one(
    server: localapi.Server,
) -> None:
    nodes(server.api, 1, gpus=4)
    async with rig(server, settings=SETTINGS) as r:
        old = await started(r, "t", 3)
        first = run_of(old[0])
        assert {run_of(pod) for pod in old} == {first}
        r.api.patch("pods", "t1", {"status": EXITED}, "default", subresource="status")
        await r.h.synced(lambda: evicted(r.api) == ["t0", "t2"])
        await r.quiet()
        for name in ("t0", "t2"):
            pod = r.api.get("pods", name, "default")
            assert pod["metadata"].get("deletionTimestamp"), name
            kinds = {c["type"]: c for c in pod["status"]["conditions"]}
            assert kinds["DisruptionTarget"]["reason"] == "EvictionByEvictionAPI"
            ready = condition(pod)
            assert ready is not None and (ready["status"], ready["reason"]) == (
                "False",
                "GangRestarting",
            )
            assert (
                "member default/t1 failed: its container main exited with code 3"
                in (ready["message"])
            )
        said = await events(r, "GangRestarting")
        assert said and all(
            message.startswith(
                "gang t restarts: member default/t1 failed: its container main exited with "
                "code 3; this member is evicted through the Eviction API"
            )
            for message in said
        )
        (failed,) = await events(r, "GangMemberFailed")
        assert failed.startswith(
            "this member failed (its container main exited with code 3); gang t restarts "
            "(gang-on-failure: restart): its 2 other running members are evicted"
        )
        assert r.metric("gpuplace_gang_restarts_total", {"policy": "restart"}) == 1
        assert r.metric("gpuplace_gang_restart_evictions_total", {"result": "evicted"}) == 2
        # the owner creates the members again while t0 and t2 still terminate: they wait
        for i in range(3):
            r.api.create(member(f"n{i}", "t", 3, count=1))
        await r.quiet()
        await r.rounds(3)
        new = [r.api.get("pods", f"n{i}", "default") for i in range(3)]
        assert all(gated(pod) and plan_mark(pod) is None for pod in new)
        waiting = await events(r, "GangRestarting")
        assert any("this member waits until the 2 members of its last run" in m for m in waiting)
        check_one_run_holds(r)
        finish(r, "t0")
        await r.quiet()
        await r.rounds(2)
        assert all(gated(r.api.get("pods", f"n{i}", "default")) for i in range(3))
        check_one_run_holds(r)
        finish(r, "t2")
        await r.quiet()
        assert await r.schedule_ungated() == []
        await r.quiet()
        new = [r.api.get("pods", f"n{i}", "default") for i in range(3)]
        assert not any(map(gated, new)) and all(pod["spec"].get("nodeName") for pod in new)
        runs = {run_of(pod) for pod in new}
        assert len(runs) == 1 and first not in runs
        check_one_run_holds(r)
        check_grants(r.api.objects("nodes"), r.pods())
        assert evicted(r.api) == ["t0", "t2"]  # the new run is left alone


async def test_a_member_whose_container_exited_is_left_to_end_so_its_job_counts_it(
    server: localapi.Server,
) -> None:
    """On v1.36 the kubelet shows a container's exit before the pod's phase Failed. The
    failed member of a Job (restartPolicy Never) is not evicted in that window: an
    eviction would mark it disrupted and the Job's podFailurePolicy would not count the
    failure against backoffLimit (and it would delete the pod the logs are in). The
    others are evicted; the new run waits until it has ended too."""
    nodes(server.api, 1, gpus=4)
    async with rig(server, settings=SETTINGS) as r:
        for i in range(3):
            r.api.create(member(f"t{i}", "t", 3, count=1, extra={"restartPolicy": "Never"}))
        await r.quiet()
        assert await r.schedule_ungated() == []
        for i in range(3):
            r.api.patch("pods", f"t{i}", {"status": RUNNING}, "default", subresource="status")
        exited = {**EXITED, "phase": "Running"}
        r.api.patch("pods", "t1", {"status": exited}, "default", subresource="status")
        await r.h.synced(lambda: evicted(r.api) == ["t0", "t2"])
        await r.quiet()
        await r.rounds(2)
        assert evicted(r.api) == ["t0", "t2"]
        t1 = r.api.get("pods", "t1", "default")
        assert not t1["metadata"].get("deletionTimestamp")
        assert "DisruptionTarget" not in {c["type"] for c in t1["status"].get("conditions", [])}
        (failed,) = await events(r, "GangMemberFailed")
        assert "its 2 other running members are evicted" in failed
        for i in range(3):
            r.api.create(member(f"n{i}", "t", 3, count=1))
        finish(r, "t0")
        finish(r, "t2")
        await r.quiet()
        await r.rounds(2)
        assert all(gated(r.api.get("pods", f"n{i}", "default")) for i in range(3))
        r.api.set_phase("default", "t1", "Failed")  # the kubelet has stopped it
        await r.quiet()
        assert await r.schedule_ungated() == []
        await r.quiet()
        assert not any(gated(r.api.get("pods", f"n{i}", "default")) for i in range(3))
        check_one_run_holds(r)


async def test_a_member_that_succeeds_is_no_failure(server: localapi.Server) -> None:
    nodes(server.api, 1, gpus=4)
    async with rig(server, settings=SETTINGS) as r:
        await started(r, "t", 3)
        r.api.set_phase("default", "t1", "Succeeded")
        r.api.delete("pods", "t1", "default")  # and its owner cleans it up
        await r.quiet()
        await r.rounds(3)
        assert evicted(r.api) == []
        assert await events(r, "GangMemberFailed") == []


async def test_under_continue_the_others_run_on_and_hear_who_failed(
    server: localapi.Server,
) -> None:
    nodes(server.api, 1, gpus=4)
    async with rig(server, settings=SETTINGS) as r:
        await started(r, "t", 3, annotations={keys.GANG_ON_FAILURE: "continue"})
        r.api.patch("pods", "t1", {"status": EXITED}, "default", subresource="status")
        await r.quiet()
        await r.rounds(3)
        assert evicted(r.api) == []
        told = await events(r, "GangMemberFailed")
        assert len(told) == 2 and all(
            m == "gang t: member default/t1 failed: its container main exited with code 3; "
            "this member runs on (gang-on-failure: continue)"
            for m in told
        )
        assert r.metric("gpuplace_gang_restarts_total", {"policy": "continue"}) == 1


async def test_a_container_restarted_in_place_takes_down_every_member_itself_too(
    server: localapi.Server,
) -> None:
    """restartPolicy OnFailure: the kubelet restarts the crashed container, the pod stays
    Running; its peers' collective is broken all the same, so every member goes, the
    restarted one too (else it would hold GPUs beside the new run)."""
    nodes(server.api, 1, gpus=4)
    async with rig(server, settings=SETTINGS) as r:
        await started(r, "t", 2)
        r.api.patch("pods", "t0", {"status": RESTARTED_IN_PLACE}, "default", subresource="status")
        await r.h.synced(lambda: evicted(r.api) == ["t0", "t1"])
        said = await events(r, "GangRestarting")
        assert any(
            "its container main exited with code 137 (OOMKilled) and was restarted" in m
            for m in said
        )


async def test_a_refused_eviction_is_told_and_tried_again(server: localapi.Server) -> None:
    nodes(server.api, 1, gpus=4)
    async with rig(server, settings=SETTINGS) as r:
        await started(r, "t", 3)
        r.api.patch("pods", "t2", {"metadata": {"labels": {"app": "kept"}}}, "default")
        budget(r.api, "kept", {"app": "kept"}, allowed=0)
        r.api.patch("pods", "t1", {"status": EXITED}, "default", subresource="status")
        # the refusal is told after the API answered the eviction, not when it was asked
        await r.h.synced(
            lambda: r.metric("gpuplace_gang_restart_evictions_total", {"result": "refused"}) >= 1
        )
        refused = await events(r, "GangRestartRefused")
        assert refused and refused[0].startswith(
            "gang t restarts (member default/t1 failed: its container main exited with code "
            "3), but the eviction of this member was refused (a PodDisruptionBudget forbids"
        )
        assert not r.api.get("pods", "t2", "default")["metadata"].get("deletionTimestamp")
        budget(r.api, "kept", {"app": "kept"}, allowed=1)
        await r.h.synced(
            lambda: bool(r.api.get("pods", "t2", "default")["metadata"].get("deletionTimestamp"))
        )
        assert r.metric("gpuplace_gang_restart_evictions_total", {"result": "refused"}) >= 1


async def test_a_member_gone_unseen_is_read_back_from_its_replacement(
    server: localapi.Server,
) -> None:
    """A member deleted at once while no controller watched (a restart of the sidecar):
    nothing of it is left in the API. Its owner's replacement waiting beside a run short
    of a member is the trace: the run is broken and taken down, and the replacement starts
    with the members created again, not beside the old ones."""
    nodes(server.api, 1, gpus=4)
    async with rig(server, settings=SETTINGS) as r:
        await started(r, "t", 3)
        # what a restarted controller knows: no tombstone of t1
        controller: GangController = r.controller
        r.h.sidecar.sync.pod_listeners.remove(controller.restarts.listen)
        r.api.delete("pods", "t1", "default")
        await r.h.synced(lambda: "t1" not in {p.name for p in r.store.pods.values()})
        await r.rounds(2)
        assert evicted(r.api) == [] and controller.restarts.gone == {}
        r.api.create(member("n1", "t", 3, count=1))
        await r.h.synced(lambda: evicted(r.api) == ["t0", "t2"])
        said = await events(r, "GangRestarting")
        assert any(
            "1 of its 3 members went away before completing and was replaced" in m for m in said
        )


async def test_a_deleted_member_breaks_its_run_through_its_tombstone(
    server: localapi.Server,
) -> None:
    nodes(server.api, 1, gpus=4)
    async with rig(server, settings=replace(SETTINGS, poll_seconds=0.2)) as r:
        await started(r, "t", 3)
        r.api.delete("pods", "t1", "default")  # gone at once, no replacement
        await r.h.synced(lambda: evicted(r.api) == ["t0", "t2"])
        said = await events(r, "GangRestarting")
        assert any("member default/t1 failed: it went away before it completed" in m for m in said)
        assert isinstance(r.controller.restarts, Restarts)


async def test_restart_is_the_default_of_a_fixed_gang_continue_of_an_elastic_one(
    server: localapi.Server,
) -> None:
    nodes(server.api, 1, gpus=4)
    async with rig(server, settings=GangSettings(poll_seconds=0.2, settle_seconds=0.005)) as r:
        await started(r, "t", 3, annotations={keys.GANG_MIN: "2"})
        r.api.patch("pods", "t1", {"status": EXITED}, "default", subresource="status")
        await r.quiet()
        await r.rounds(3)
        assert evicted(r.api) == []
