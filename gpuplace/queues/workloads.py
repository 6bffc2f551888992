"""Queued pods as the engine's workloads: what runs, what waits, and what waits outside a
round.

`collect(pods, ...)` groups the queued pods by workload (a pod alone, or a gang:
`PodRecord.key`) and reads each from the pods themselves, so a restart finds the same:

- **running** (`admitting.Running`): the live members its queue admitted (no queue gate,
  or an admission being written: a plan mark or an assignment on a gated member, whose
  grant the ledger holds), in the order they were admitted (`assigned-at`; an elastic
  gang's extras last), with
  the lowest member priority (a victim's); members being deleted, or evicted by a
  reclaim of this process (`leaving`: UID -> the reclaiming workload), run on as a
  workload of their own that is *leaving* (`leaving_for`), so a reclaim in flight is
  never repeated and a gang's given-back extra does not make the whole gang leave;
- **waiting** (`admitting.Workload`): the members still gated by the queue, the oldest
  first, with the highest member priority and the oldest creation time: a pod; a gang
  once all `gang-size` members exist (an elastic gang then starts with at least
  `gang-min`); for a gang already running, the replacements of members that went (all
  of them, or for an elastic gang below its minimum enough to reach it). An elastic gang
  that runs with at least `gang-min` members does not wait: its gated members are the
  running workload's `missing`, which the engine adds as GPUs free;
- **aside** (`Aside`): gated workloads a round is not asked about: a gang still missing
  members, a plan being written or settled (the informers lag our own writes: decided
  next round), members beyond `gang-size`, a pod whose annotations cannot be read, the
  new members of a gang restarting after a member failed while members of its last run
  still hold GPUs (`gpuplace.controllers.restarts`: they are admitted as a new run once
  none is left, never beside the old one).

Members are `gangs.Member`s: each pod's request, the nodes its affinity and node selector
allow, less the nodes a starving or preempting gang or a starving queued workload holds
(`fenced`: the extender's filter keeps new pods off them, so an admission there could
never bind; the members it holds them for, `fence_members`, keep them, and their
workload's `held` names the nodes, where its reclaims look for victims first), and its
tolerations. Pure: no I/O, no clock. O(pods log pods + pods x nodes for affinities, one
pass per distinct affinity).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.pods import domain as pods_domain
from gpuplace.controllers import restarts
from gpuplace.placement import gangs
from gpuplace.placement.gangs import GangKey
from gpuplace.placement.inventory import Inventory
from gpuplace.placement.queueing import admitting

TERMINATING = "(terminating)"
"""`leaving_for` of a member being deleted that no reclaim of this process evicted (after a
restart, or deleted by anyone)."""
LEAVING = " (leaving)"
"""Appended to the key of a workload's members that are leaving."""

MEMBERS = "members"
WRITING = "writing"
FULL = "full"
UNREADABLE = "unreadable"
RESTARTING = "restarting"


@dataclass(frozen=True, slots=True)
class Aside:
    """A gated workload the round is not asked about, and why (`MEMBERS`, `WRITING`,
    `FULL`, `UNREADABLE`, `RESTARTING`)."""

    key: str
    queue: str
    pods: tuple[PodRecord, ...]
    why: str
    reason: str


@dataclass(slots=True)
class Found:
    running: list[admitting.Running] = field(default_factory=list)
    waiting: list[admitting.Workload] = field(default_factory=list)
    aside: list[Aside] = field(default_factory=list)
    pods: dict[str, PodRecord] = field(default_factory=dict)
    """Every live queued pod the round's workloads name, by UID."""


class _Nodes:
    """The nodes each affinity allows, less the fenced ones, computed once per affinity."""

    def __init__(
        self, inventory: Inventory, fenced: frozenset[str], members: frozenset[str]
    ) -> None:
        self.inventory = inventory
        self.fenced = fenced
        self.members = members
        """The pods the fence holds the nodes for (they keep them)."""
        self._memo: dict[tuple[NodeAffinity, bool], frozenset[str] | None] = {}

    def held(self, pods: Sequence[PodRecord]) -> frozenset[str]:
        """The fenced nodes when the fence is held for these pods, else none."""
        if self.fenced and all(pod.uid in self.members for pod in pods):
            return self.fenced
        return frozenset()

    def __call__(self, affinity: NodeAffinity, uid: str = "") -> frozenset[str] | None:
        fenced = bool(self.fenced) and uid not in self.members
        if (affinity, fenced) not in self._memo:
            nodes = [(node.name, node.labels) for node in self.inventory]
            allowed = affinity.allowed(nodes)
            if fenced:
                names = allowed if allowed is not None else frozenset(n for n, _ in nodes)
                allowed = names - self.fenced
            self._memo[(affinity, fenced)] = allowed
        return self._memo[(affinity, fenced)]


def member(pod: PodRecord, nodes: _Nodes, running: Sequence[PodRecord] = ()) -> gangs.Member:
    """The engine's member for a queued pod; `running`: its gang's admitted members (a
    replacement or growth keeps to the topology domain they run in)."""
    assert pod.request is not None
    return gangs.Member(
        pod.uid,
        pod.request,
        nodes(pod.controlled.affinity, pod.uid),
        pod.controlled.tolerations,
        pods_domain(pod, running, nodes.inventory),
    )


def collect(
    pods: Iterable[PodRecord],
    inventory: Inventory,
    *,
    fenced: frozenset[str] = frozenset(),
    fence_members: frozenset[str] = frozenset(),
    leaving: Mapping[str, str] | None = None,
) -> Found:
    """See the module docstring."""
    groups: dict[str, list[PodRecord]] = {}
    every = list(pods)
    restarting = {
        key: restarts.barrier(restarts.broken(key, members))
        for key, members in restarts.by_gang(every).items()
    }
    for pod in every:
        if pod.controlled.queue and not pod.terminal:
            groups.setdefault(pod.workload, []).append(pod)
    collector = _Collector(
        _Nodes(inventory, fenced, fence_members),
        leaving or {},
        {key: stopping for key, stopping in restarting.items() if stopping},
    )
    for group in groups.values():
        group.sort(key=PodRecord.order)
        collector.workload(group)
    return collector.found


@dataclass(slots=True)
class _Group:
    """One workload's pods: its key and queue, the admitted ones (in admission order) and
    the gated ones (oldest first)."""

    key: str
    queue: str
    admitted: list[PodRecord]
    gated: list[PodRecord]


class _Collector:
    def __init__(
        self,
        nodes: _Nodes,
        leaving: Mapping[str, str],
        restarting: Mapping[GangKey, tuple[PodRecord, ...]],
    ) -> None:
        self.nodes = nodes
        self.leaving = leaving
        self.restarting = restarting
        """Gangs whose broken run's members still hold GPUs (`restarts.barrier`)."""
        self.found = Found()

    def workload(self, pods: list[PodRecord]) -> None:
        admitted = sorted(
            (pod for pod in pods if not pod.controlled.queue_gated),
            key=lambda p: (p.assigned_at or p.created, p.name),
        )
        gated = [pod for pod in pods if pod.controlled.queue_gated and not pod.deleting]
        for pod in pods:
            self.found.pods[pod.uid] = pod
        group = _Group(pods[0].workload, pods[0].controlled.queue, admitted, gated)
        _running(self.found, group, self.leaving, self.nodes)
        stopping = self.restarting.get(pods[0].gang_key) if pods[0].controlled.gang_name else None
        if gated and stopping:
            self.found.aside.append(
                Aside(
                    group.key,
                    group.queue,
                    tuple(gated),
                    RESTARTING,
                    f"gang {pods[0].controlled.gang_name} restarts after a member failed: its "
                    f"new members are admitted as one workload once the {len(stopping)} "
                    f"member{'s' if len(stopping) != 1 else ''} of its last run still "
                    "holding GPUs have stopped",
                )
            )
        elif gated:
            _waiting(self.found, group, self.nodes)


def _running(found: Found, group: _Group, leaving: Mapping[str, str], nodes: _Nodes) -> None:
    key, queue, admitted, gated = group.key, group.queue, group.admitted, group.gated
    going = [pod for pod in admitted if pod.deleting or pod.uid in leaving]
    # members whose admission is being written (or was, and the informer has not shown the
    # gate gone yet) hold their grants already: they count against the quota as running,
    # else a round between our write and its echo would admit on quota they use
    writing = [pod for pod in gated if pod.controlled.plan is not None or pod.controlled.assigned]
    staying = [pod for pod in admitted if pod not in going] + writing
    if going:
        found.running.append(
            admitting.Running(
                key + LEAVING,
                queue,
                tuple(pod.uid for pod in going),
                priority=min(pod.priority for pod in going),
                admitted=min(pod.assigned_at or pod.created for pod in going),
                leaving_for=next(
                    (leaving[pod.uid] for pod in going if pod.uid in leaving), TERMINATING
                ),
            )
        )
    if not staying:
        return
    head = staying[0]
    growing = head.elastic and len(staying) >= head.minimum
    missing: tuple[gangs.Member, ...] = ()
    if growing and not _writing(gated):
        readable = [pod for pod in gated if pod.request is not None]
        missing = tuple(
            member(pod, nodes, staying)
            for pod in readable[: head.controlled.gang_size - len(staying)]
        )
    found.running.append(
        admitting.Running(
            key,
            queue,
            tuple(pod.uid for pod in staying),
            priority=min(pod.priority for pod in staying),
            admitted=min(pod.assigned_at or pod.created for pod in staying),
            minimum=head.minimum if head.elastic else 0,
            missing=missing,
            started=tuple(pod.assigned_at or pod.created for pod in staying),
        )
    )


def _writing(gated: list[PodRecord]) -> bool:
    """A plan is being written or settled on these gated members (decided next round)."""
    return any(pod.controlled.plan is not None or pod.controlled.assigned for pod in gated)


def _waiting(found: Found, group: _Group, nodes: _Nodes) -> None:
    key, queue, admitted, gated = group.key, group.queue, group.admitted, group.gated
    pods = tuple(gated)
    if _writing(gated):
        found.aside.append(Aside(key, queue, pods, WRITING, "its admission is being written"))
        return
    unreadable = [pod for pod in gated if pod.request is None]
    for pod in unreadable:
        found.aside.append(
            Aside(key, queue, (pod,), UNREADABLE, pod.problem or "it asks for no GPU")
        )
    ready = [pod for pod in gated if pod.request is not None]
    if not ready:
        return
    head = ready[0]
    gang, size = head.controlled.gang_name, head.controlled.gang_size
    if not gang:
        for pod in ready:  # a pod alone: one workload each (only one has this key)
            found.waiting.append(
                admitting.Workload(
                    pod.workload,
                    queue,
                    (member(pod, nodes),),
                    pod.priority,
                    pod.created,
                    held=nodes.held((pod,)),
                )
            )
        return
    started = len([pod for pod in admitted if not pod.deleting])
    need = size - started
    members, extras = ready[: max(need, 0)], ready[max(need, 0) :]
    if extras:
        found.aside.append(
            Aside(
                key,
                queue,
                tuple(extras),
                FULL,
                f"gang {gang} already has its {size} members; this pod waits until one of "
                "them goes away",
            )
        )
    if not members:
        return
    if head.elastic and started >= head.minimum:
        return  # a running elastic gang grows through `Running.missing`
    low = len(members)
    if head.elastic:
        low = max(head.minimum - started, 1)
    if len(members) < (need if not started or not head.elastic else low):
        have = started + len(members)
        found.aside.append(
            Aside(
                key,
                queue,
                tuple(members),
                MEMBERS,
                f"gang {gang}: {have} of its {size} members exist; it is admitted as one "
                "workload once all do",
            )
        )
        return
    running = [pod for pod in admitted if not pod.deleting]
    found.waiting.append(
        admitting.Workload(
            key,
            queue,
            tuple(member(pod, nodes, running) for pod in members),
            max(pod.priority for pod in members),
            min(pod.created for pod in members),
            minimum=low if head.elastic and low < len(members) else 0,
            held=nodes.held(members),
        )
    )
