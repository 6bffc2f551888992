"""Runs of a gang, and which of them a member's failure ended: what the gang controller
takes down and what new members wait for (docs/gangs.md, "When a member fails").

A *run* is the gang as it started together: the members whose plan marks carry one run
id (`gpuplace.cluster.gang_marks.PlanMark.run_id`: the plan that started it; a
replacement or an elastic gang's growth joins the run going). Under `gang-on-failure:
restart` (`PodRecord.controlled.restart`, the default of a gang that needs every
member) a run is *broken* when one of its members failed
(`gpuplace.cluster.pods.failure_of`: a container exited non-zero, phase Failed, a
disruption, a deletion before it completed), when the controller saw one go away unseen
(`gone`: its tombstones), or when a non-elastic run lacks members while a new member of
the gang waits gated (its owner replaced one that vanished: the trace a controller
restart leaves). A member that Succeeded never breaks its run.

`broken(pods)` reads it from the pods alone, so the gang controller (which evicts) and
the queue controller (which must not admit a new member beside an old one) see the
same: a broken run's `running` members are to be evicted; its `stopping` ones (every
member not yet finished, being deleted or not) still hold their GPUs, and until none is
left no member of a new run is planned or admitted. `current_run` is the run a plan
written now joins. Pure: no I/O, no clock. O(members) per gang.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuplace.cluster.pods import PodRecord
from gpuplace.placement.gangs import GangKey

VANISHED = "it went away before it completed"
"""The failure of a member seen only by its absence."""


@dataclass(frozen=True, slots=True)
class Gone:
    """A started member the informer saw deleted before it completed (a tombstone)."""

    uid: str
    name: str
    """`namespace/name`."""
    run: str
    why: str
    disrupted: bool = False
    """It carried `DisruptionTarget` when last seen (evicted, perhaps by the restart)."""


@dataclass(frozen=True, slots=True)
class Broken:
    """A run a member's failure ended."""

    key: GangKey
    run: str
    failed: str
    """The member named as failed (`namespace/name`; "" when only its absence shows)."""
    why: str
    """The failure alone: "its container main exited with code 1"."""
    cause: str
    """What broke the run, for Events: "member ml/train-0 failed: its container main
    exited with code 1"."""
    failed_uid: str
    running: tuple[PodRecord, ...]
    """Members of the run still live (neither finished nor being deleted) that do not end
    by themselves (`Controlled.ending`: a member whose containers all exited, the failed
    one of a Job's pod, is left to end, so its Job counts its failure): to evict."""
    stopping: tuple[PodRecord, ...]
    """Members of the run not finished yet, `running` included: they hold GPUs."""


def started(pod: PodRecord) -> bool:
    """The member joined a run: it carries a plan mark and neither of our gates."""
    return (
        pod.controlled.plan is not None
        and not pod.controlled.gang_gated
        and not pod.controlled.queue_gated
    )


def runs(pods: Iterable[PodRecord]) -> dict[str, list[PodRecord]]:
    """Members carrying a plan mark, by run id, for the runs some member started (any
    phase). O(members)."""
    found: dict[str, list[PodRecord]] = {}
    going: set[str] = set()
    for pod in pods:
        mark = pod.controlled.plan
        if mark is None:
            continue
        found.setdefault(mark.run_id, []).append(pod)
        if started(pod):
            going.add(mark.run_id)
    return {run: members for run, members in found.items() if run in going}


def current_run(pods: Iterable[PodRecord]) -> str:
    """The run of the gang's live started members, which a plan written now joins ("":
    none runs, the plan starts a new run). With several (a broken run's members still
    stopping beside a new one), the one with most live members. O(members)."""
    count: dict[str, int] = {}
    for pod in pods:
        if started(pod) and pod.live and pod.controlled.plan is not None:
            run = pod.controlled.plan.run_id
            count[run] = count.get(run, 0) + 1
    return max(count, key=lambda run: (count[run], run)) if count else ""


def broken(
    key: GangKey,
    pods: Sequence[PodRecord],
    *,
    gone: Mapping[str, Gone] | None = None,
    first: Mapping[str, str] | None = None,
    every_policy: bool = False,
) -> list[Broken]:
    """The gang's broken runs that still have members to take down or wait for (module
    docstring); [] unless its policy is `restart` (`every_policy`: whatever its policy,
    for telling a `continue` gang's members). `gone`: tombstones by UID; `first`:
    run -> the UID named when the run was first seen broken (kept by the caller, so its
    Events keep naming the same member; otherwise one that failed by itself comes before
    one disrupted, perhaps by this very restart, then by name). O(members)."""
    if not pods or not (every_policy or any(pod.controlled.restart for pod in pods)):
        return []
    lost: dict[str, list[Gone]] = {}
    for tomb in (gone or {}).values():
        lost.setdefault(tomb.run, []).append(tomb)
    waiting = any(
        pod.live
        and pod.controlled.plan is None
        and (pod.controlled.gang_gated or pod.controlled.queue_gated)
        for pod in pods
    )
    size = max(pod.controlled.gang_size for pod in pods)
    elastic = any(pod.elastic for pod in pods)
    found = []
    for run, members in sorted(runs(pods).items()):
        stopping = tuple(pod for pod in members if not pod.terminal)
        if not stopping:
            continue
        failures = [
            (pod.controlled.disrupted, str(pod), pod.controlled.failure, pod.uid)
            for pod in members
            if pod.controlled.failure
        ] + [(tomb.disrupted, tomb.name, tomb.why, tomb.uid) for tomb in lost.get(run, [])]
        if failures:
            named = [item for item in failures if item[3] == (first or {}).get(run)]
            _, who, why, uid = named[0] if named else min(failures)
            cause = f"member {who} failed: {why}"
        elif not elastic and waiting and len(members) < size:
            who, uid = "", ""
            lost_count = size - len(members)
            why = "went away before completing"
            cause = (
                f"{lost_count} of its {size} members went away before completing and "
                f"{'were' if lost_count > 1 else 'was'} replaced"
            )
        else:
            continue
        found.append(
            Broken(
                key,
                run,
                who,
                why,
                cause,
                uid,
                tuple(pod for pod in stopping if pod.live and not pod.controlled.ending),
                stopping,
            )
        )
    return found


def barrier(broken_runs: Iterable[Broken]) -> tuple[PodRecord, ...]:
    """The members of broken runs that still hold GPUs: no member of a new run is planned
    or admitted while any is left."""
    return tuple(pod for run in broken_runs for pod in run.stopping)


def by_gang(pods: Iterable[PodRecord]) -> dict[GangKey, list[PodRecord]]:
    """Gang members by gang (the queue controller's pods are not grouped so). O(pods)."""
    found: dict[GangKey, list[PodRecord]] = {}
    for pod in pods:
        if pod.controlled.gang_name:
            found.setdefault(pod.gang_key, []).append(pod)
    return found
