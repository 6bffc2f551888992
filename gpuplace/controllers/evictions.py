"""Evicting for a waiting workload: the PodDisruptionBudget pre-check and the evictions.

The controllers that preempt — the gang controller for a waiting gang
(`gpuplace.gangs.evicting`), the claim controller for a lone DRA pod
(`gpuplace.claims.preempting`), the queue controller reclaiming for a waiting workload
(`gpuplace.queues.reclaiming`) — first check all their victims together as the API server
would (`budget_refusals`: each victim read again, each namespace's budgets listed once,
`gpuplace.cluster.disruptions.refused`), so that a plan a budget forbids evicts nothing,
then evict them in order through the Eviction API (`evict`: the UID as precondition,
never a plain DELETE), stopping at the first refusal. An eviction without an answer (a
timeout, a gateway's 502-504) may have gone through (`unknown_outcome`): the caller
counts its victim as leaving once the pod shows its deletion, never evicting it twice.
`preempt` is `evict` for a preemptor, each victim told (`GpuPreempted`); `freed` and
`refusal_text` word what the Events say. Owns no state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpuplace.cluster import disruptions, kube, recording, refusals
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import telling


class EvictionApi(Protocol):
    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def evict_pod(self, namespace: str, name: str, *, uid: str) -> None: ...

    async def disruption_budgets(self, namespace: str) -> list[dict[str, Any]]: ...


async def fresh_victim(api: EvictionApi, record: PodRecord) -> disruptions.Victim | None:
    """A victim as the API has it now (labels for its budgets); None when it is gone or
    was replaced. Raises `kube.ApiError`."""
    try:
        body = await api.get_pod(record.namespace, record.name)
    except kube.ApiError as error:
        if error.not_found:
            return None
        raise
    metadata = body.get("metadata") or {}
    if metadata.get("uid") != record.uid:
        return None
    return disruptions.Victim(
        uid=record.uid,
        namespace=record.namespace,
        name=record.name,
        labels={str(k): str(v) for k, v in (metadata.get("labels") or {}).items()},
        phase=str((body.get("status") or {}).get("phase") or ""),
        deleting=bool(metadata.get("deletionTimestamp")),
    )


async def budget_refusals(
    api: EvictionApi,
    records: Sequence[PodRecord],
    *,
    fresh: dict[str, disruptions.Victim | None] | None = None,
    budgets: dict[str, list[disruptions.Budget]] | None = None,
) -> dict[str, str] | None:
    """The PodDisruptionBudget pre-check of evicting all of `records` now: victim UID ->
    why the API server would refuse it (empty: none), or None when a victim is gone or
    was replaced. Reads each victim and each namespace's budgets once (`fresh` and
    `budgets` keep them across calls). Raises `kube.ApiError`. O(victims + budgets)
    reads, then `gpuplace.cluster.disruptions.refused`."""
    fresh = {} if fresh is None else fresh
    budgets = {} if budgets is None else budgets
    for record in records:
        if record.uid not in fresh:
            fresh[record.uid] = await fresh_victim(api, record)
        if record.namespace not in budgets:
            listed = await api.disruption_budgets(record.namespace)
            budgets[record.namespace] = [disruptions.budget(pdb) for pdb in listed]
    victims = [fresh[record.uid] for record in records]
    if any(victim is None for victim in victims):
        return None
    every = [budget for found in budgets.values() for budget in found]
    return disruptions.refused(every, [victim for victim in victims if victim is not None])


@dataclass(frozen=True, slots=True)
class Evicted:
    """What `evict` came to: the victims the API accepted, in order, and the first
    refusal, if any (the victim, and the API's error)."""

    gone: tuple[PodRecord, ...]
    refusal: tuple[PodRecord, kube.ApiError] | None = None

    @property
    def unsure(self) -> PodRecord | None:
        """The refused victim whose eviction may have gone through (`unknown_outcome`)."""
        if self.refusal is not None and unknown_outcome(self.refusal[1]):
            return self.refusal[0]
        return None


async def evict(
    api: EvictionApi,
    victims: Sequence[PodRecord],
    each: Callable[[PodRecord], None] = lambda _: None,
) -> Evicted:
    """Evict `victims` in order (pods/NAME/eviction, the UID as precondition), calling
    `each` on every one the API accepted; stop at the first refusal. O(victims) calls."""
    gone: list[PodRecord] = []
    for victim in victims:
        try:
            await api.evict_pod(victim.namespace, victim.name, uid=victim.uid)
        except kube.ApiError as refused:
            return Evicted(tuple(gone), (victim, refused))
        gone.append(victim)
        each(victim)
    return Evicted(tuple(gone))


async def preempt(
    api: EvictionApi,
    sync: LedgerSync,
    victims: Sequence[PodRecord],
    recorder: recording.Recorder | None,
    *,
    preemptor: str,
    evicted: set[str],
    unsure: set[str],
) -> Evicted:
    """`evict` for a preemptor (`preemptor` words it in the Events: "gang team-a/train
    (priority 100, ...)"): each victim the API accepted hears `GpuPreempted` with the GPUs
    it frees and joins `evicted`; a victim whose eviction's outcome is unknown joins
    `unsure`. O(victims) calls."""
    gpus = freed(sync, victims)

    def told(victim: PodRecord) -> None:
        evicted.add(victim.uid)
        telling.emit(
            recorder,
            victim,
            recording.NORMAL,
            recording.PREEMPTED,
            f"preempted to free {gpus.get(victim.uid, 'its GPUs')} for {preemptor}",
        )

    done = await evict(api, victims, told)
    if done.unsure is not None:
        unsure.add(done.unsure.uid)
    return done


def freed(sync: LedgerSync, victims: Sequence[PodRecord]) -> Mapping[str, str]:
    """Per victim, the GPUs it frees ("GPUs 0,1 of node gpu-3")."""
    shown: dict[str, str] = {}
    for victim in victims:
        grant = sync.ledger.get(victim.uid)
        if grant is not None:
            plural = "s" if len(grant.gpus) > 1 else ""
            gpus = ",".join(map(str, grant.gpus))
            shown[victim.uid] = f"GPU{plural} {gpus} of node {grant.node}"
    return shown


def already_going(error: kube.ApiError) -> bool:
    """The pod needs no eviction: it is gone (404), or its namespace is being deleted
    and takes it (kube-apiserver's NamespaceLifecycle 403)."""
    return error.not_found or (
        error.status == 403 and error.message.endswith(refusals.NAMESPACE_TERMINATING)
    )


def unknown_outcome(error: kube.ApiError) -> bool:
    """The request may have been carried out (no answer, or a gateway's)."""
    return error.status in (0, 502, 503, 504)


def refusal_text(error: kube.ApiError) -> str:
    """Why an eviction was refused, as Events say it."""
    if unknown_outcome(error):
        return (
            f"its outcome is unknown, {error.status} {error.reason}: {error.message}; "
            "if it went through, the pod terminates and is not evicted again"
        )
    if error.status == 429:
        return f"a PodDisruptionBudget forbids it now: {error.message}"
    if error.not_found:
        return "the pod is gone"
    if error.conflict:
        return "the pod was replaced"
    return f"{error.status} {error.reason}: {error.message}"
