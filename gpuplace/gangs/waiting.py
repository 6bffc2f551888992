"""Which gangs wait, and with which members: the gang controller's view of one round.

Per gang (`gpuplace.controllers.store.gang_members`), the live ungated members count as
started; the oldest gated members fill the gang up to its size N (a replacement pod joins
a started gang this way); members beyond N stay gated (Event `GangFull`), and a member whose
annotations cannot be read never joins (`GangMemberInvalid`). A gang with gated members
waits: for members while fewer than N exist (incomplete), else for room. An elastic gang
(`gang-min` M below N) starts once all N exist, with as many as fit from M up; once
it runs with at least M, its other members wait to *grow* it (`Wait.growing`): any
number of them may start. A gang whose gated members still show a plan mark or a
reservation (our own writes not yet seen by the informers) is left for the next round,
so a half-seen plan is never mistaken for started members. A queued gang (its members
carry `gpuplace.io/queue`) is its queue's to admit and plan (`gpuplace.queues`): it
never waits here. A gang restarting after a member failed waits for nothing until the
members of its last run have stopped (`held`): then its new members form a new run, and
none of them joins the old one.

Waiting gangs are tried in `Wait.order`: priority (the highest of their members), then
age (the oldest member's creation), then name. O(gang pods log gang pods) per round.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from gpuplace.cluster import recording
from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.pods import domain as member_domain
from gpuplace.controllers import restarts, telling
from gpuplace.controllers.store import PodIndex
from gpuplace.gangs import events
from gpuplace.placement import gangs
from gpuplace.placement.gangs import GangKey
from gpuplace.placement.inventory import Inventory
from gpuplace.placement.ledger import Ledger


@dataclass(slots=True)
class Wait:
    """A gang that waits: the members that would form it now."""

    key: GangKey
    members: list[PodRecord]
    size: int
    need: int
    priority: int
    since: float
    deadline: float
    timeout: float
    started: int = 0
    """Live members already ungated."""
    minimum: int = 0
    """`gang-min` of an elastic gang (0: not elastic)."""

    @property
    def growing(self) -> bool:
        """An elastic gang that runs with at least `gang-min` members: the waiting ones
        start as GPUs free, in any number; it neither preempts nor times out."""
        return 0 < self.minimum <= self.started

    @property
    def complete(self) -> bool:
        if self.growing:
            return True
        if self.minimum and self.started:  # an elastic gang below its minimum
            return self.started + len(self.members) >= self.minimum
        return len(self.members) == self.need

    @property
    def low(self) -> int:
        """The fewest of `members` a plan may start: all of them, or for an elastic gang
        as many as take it to `gang-min` (at least one)."""
        if not self.minimum:
            return len(self.members)
        return min(max(self.minimum - self.started, 1), len(self.members))

    def order(self) -> tuple[int, float, GangKey]:
        return (-self.priority, self.since, self.key)


def waits(
    store: PodIndex[GangKey],
    ledger: Ledger,
    now: float,
    *,
    told: telling.Told,
    recorder: recording.Recorder | None = None,
    held: Collection[GangKey] = (),
) -> list[Wait]:
    """The gangs that wait now (module docstring), in the store's order; members that
    cannot join are told why once (`told`). `held`: gangs restarting whose last run still
    holds GPUs (`gpuplace.gangs.restarting`): none of their members waits yet."""
    found = []
    for key, pods in store.groups().items():
        if key in held:
            continue
        live = [pod for pod in pods if pod.live]
        if not live or any(pod.controlled.queue for pod in live):
            continue
        if any(
            pod.controlled.gang_gated and (pod.controlled.plan is not None or pod.uid in ledger)
            for pod in live
        ):
            # a plan is being written, finished or undone and our view of it is
            # not settled yet (informers lag our own writes): decide next round
            continue
        candidates = sorted((pod for pod in live if pod.controlled.gang_gated), key=PodRecord.order)
        if not candidates:
            continue
        invalid = [pod for pod in candidates if pod.request is None]
        for pod in invalid:
            if told.first(pod.uid, events.INVALID):
                telling.emit(
                    recorder,
                    pod,
                    recording.WARNING,
                    events.INVALID,
                    f"this pod cannot join gang {key[1]}: {pod.problem or 'no GPU request'}",
                )
        candidates = [pod for pod in candidates if pod.request is not None]
        if not candidates:
            continue
        started = len(live) - len(candidates) - len(invalid)
        leader = min(live, key=PodRecord.order)
        size = leader.controlled.gang_size
        need = size - started
        members, extras = candidates[: max(need, 0)], candidates[max(need, 0) :]
        for pod in extras:
            if told.first(pod.uid, events.FULL):
                telling.emit(
                    recorder,
                    pod,
                    recording.WARNING,
                    events.FULL,
                    f"gang {key[1]} already has its {size} members; this pod stays "
                    "gated until one of them goes away",
                )
        if not members:
            continue
        since = min(pod.created for pod in members) or now
        timeout = members[0].controlled.gang_timeout
        minimum = leader.minimum if leader.elastic else 0
        found.append(
            Wait(
                key=key,
                members=members,
                size=size,
                need=need,
                priority=max(pod.priority for pod in members),
                since=since,
                deadline=float("inf") if 0 < minimum <= started else since + timeout,
                timeout=timeout,
                started=started,
                minimum=minimum,
            )
        )
    return found


def planned(wait: Wait, store: PodIndex[GangKey], inventory: Inventory) -> list[gangs.Member]:
    """The engine's members for a waiting gang: each pod's request, the nodes its node
    affinity and selector allow (computed once per distinct affinity), its tolerations,
    and its gang's topology domain (pinned to where the gang runs, for a replacement or
    growth: `gpuplace.cluster.pods.domain`). O(members + distinct affinities × nodes)."""
    allowed: dict[NodeAffinity, frozenset[str] | None] = {}
    running = [pod for pod in store.members(wait.key) if restarts.started(pod) and pod.live]
    result = []
    for pod in wait.members:
        assert pod.request is not None
        if pod.controlled.affinity not in allowed:
            allowed[pod.controlled.affinity] = pod.controlled.affinity.allowed(
                (node.name, node.labels) for node in inventory
            )
        result.append(
            gangs.Member(
                pod.uid,
                pod.request,
                allowed[pod.controlled.affinity],
                pod.controlled.tolerations,
                member_domain(pod, running, inventory),
            )
        )
    return result
