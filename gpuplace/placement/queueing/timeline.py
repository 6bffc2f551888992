"""Event-driven replay of a trace with arrival and run times, with queues or without.

Each job arrives at its time, waits until it is admitted and placed, runs for its run
time, then leaves. At every moment something happens (arrivals, departures), first the
departures free their GPUs, then the arrivals join the waiting line, then:

- without queues (`queues=None`), every waiting job is tried in arrival order and takes
  a place if one fits now (kube-scheduler retries unschedulable pods on cluster events;
  a job that does not fit never holds back the ones behind it);
- with queues, a round of `gpuplace.placement.queueing.admitting.admit`: quota, fair share,
  borrowing; its reclaims preempt at once (the victims lose their work and wait again,
  keeping their arrival time), then another round runs at the same moment.

The replay records, after every moment, each team's use and demand in GPU equivalents
(`quotas.GPUS` over all models) and the cluster's compute allocated, so that
`figures` can integrate them over time; and per job how long it waited in total.

Complexity: O(events log events) to order them, plus per moment one pass over the
waiting jobs (a place each: O(changed nodes + distinct node states) through the
chooser; without queues, a request shape that found no place is not tried again in the
same moment) or one admission round (`admitting`), plus O(teams) to record.

Pure: no I/O, no clock (times are the trace's numbers).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuplace.placement import gangs
from gpuplace.placement.choosing import Choice, Policy, grant_for
from gpuplace.placement.gangs import Member
from gpuplace.placement.inventory import Inventory, Node
from gpuplace.placement.ledger import Ledger
from gpuplace.placement.queueing import admitting, fairness, holds, quotas, share_history
from gpuplace.placement.requests import WHOLE, GpuRequest

RECLAIM_ROUNDS = 4
"""Admission rounds at most per moment (each may preempt, then admits the reclaimer)."""


@dataclass(frozen=True, slots=True)
class Job:
    uid: str
    team: str
    request: GpuRequest
    arrives: float
    runtime: float
    priority: int = 0


@dataclass(slots=True)
class JobRecord:
    waited: float = 0.0
    """Total seconds spent waiting (every wait, after a preemption too)."""
    starts: int = 0
    preempted: int = 0
    done: bool = False


@dataclass(frozen=True, slots=True)
class Sample:
    """The cluster from `time` until the next sample."""

    time: float
    allocated: int
    """milli-GPU of compute held."""
    use: Mapping[str, int]
    """Per team, GPU equivalents held (milli)."""
    demand: Mapping[str, int]
    """Per team, GPU equivalents held or waited for (milli)."""


@dataclass(slots=True)
class Timeline:
    capacity: int
    """milli-GPU of the cluster."""
    samples: list[Sample] = field(default_factory=list)
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    teams: dict[str, str] = field(default_factory=dict)
    """Team of each job uid."""
    preemptions: int = 0
    holds: int = 0
    """Capacity holds taken or moved (`holds`: a new starving workload held for, or its
    hold moved to other nodes)."""
    lost_gpu_seconds: float = 0.0
    """GPU-seconds of work the preempted jobs had done (lost: they start over)."""
    never: list[str] = field(default_factory=list)
    """Jobs no node of the cluster could ever hold (left out of everything)."""


def equivalents(request: GpuRequest) -> int:
    """GPU equivalents a request holds when its GPUs' memory is unknown: its compute,
    or for a memory-only share 0. O(1)."""
    return request.milli * request.count if request.count else 0


def run(
    nodes: Sequence[Node],
    jobs: Sequence[Job],
    policy: Policy,
    *,
    queues: Sequence[quotas.QueueSpec] | None = None,
    queue_of: Mapping[str, str] | None = None,
    half_life: float | None = None,
    hold_after: float | None = None,
) -> Timeline:
    """Replay `jobs` on `nodes` (see the module docstring); with `queues`, each job
    goes to queue `queue_of[job.team]`. O(events log events + moments x round)."""
    ledger = Ledger(Inventory(nodes))
    placer = admitting.Placer(ledger, policy, explain=False)
    timeline = Timeline(sum(len(node.gpus) for node in nodes) * WHOLE)
    by_uid: dict[str, Job] = {}
    events: list[tuple[float, int, str, int]] = []
    """(time, 0 departure / 1 arrival, uid, which start of it departs); departures go
    first at a moment, and one of a start since preempted is stale."""
    never_fits = _Static(Ledger(Inventory(nodes)), policy)
    for job in jobs:
        if job.request.count and not never_fits.ever(job.request):
            timeline.never.append(job.uid)
            continue
        by_uid[job.uid] = job
        timeline.teams[job.uid] = job.team
        timeline.jobs[job.uid] = JobRecord()
        events.append((job.arrives, 1, job.uid, 0))
    heapq.heapify(events)
    line = _Line(by_uid)
    running: dict[str, float] = {}
    """uid -> when it started."""
    generation: dict[str, int] = {}
    """Starts per job: a departure event of an earlier start is stale."""
    queued = None
    if queues is not None:
        assert queue_of is not None
        queued = _Queued(
            placer, queues, queue_of, by_uid, timeline, half_life=half_life, hold_after=hold_after
        )
    teams = sorted(set(timeline.teams.values()))
    while events:
        now = events[0][0]
        freed = False
        arrived: list[str] = []
        while events and events[0][0] == now:
            _, kind, uid, start = heapq.heappop(events)
            if kind == 0:
                if uid not in running or generation[uid] != start:
                    continue
                del running[uid]
                ledger.release(uid)
                timeline.jobs[uid].done = True
                freed = True
            else:
                line.add(uid, now)
                arrived.append(uid)
        if queued is None:
            started = _greedy(placer, [by_uid[uid] for uid in line.order()])
        else:
            started = queued.round(now, running, line, arrived, freed)
        for uid in started:
            record = timeline.jobs[uid]
            record.waited += now - line.remove(uid)
            record.starts += 1
            generation[uid] = generation.get(uid, 0) + 1
            running[uid] = now
            heapq.heappush(events, (now + by_uid[uid].runtime, 0, uid, generation[uid]))
        timeline.samples.append(_sample(now, by_uid, running, line, teams))
    return timeline


class _Line:
    """The waiting jobs in arrival order, and since when each waits."""

    def __init__(self, by_uid: Mapping[str, Job]) -> None:
        self._by_uid = by_uid
        self._order: list[tuple[float, str]] = []
        self.since: dict[str, float] = {}

    def add(self, uid: str, now: float) -> None:
        self.since[uid] = now
        bisect.insort(self._order, (self._by_uid[uid].arrives, uid))

    def remove(self, uid: str) -> float:
        """Forget `uid`; returns since when it waited. O(waiting)."""
        key = (self._by_uid[uid].arrives, uid)
        del self._order[bisect.bisect_left(self._order, key)]
        return self.since.pop(uid)

    def order(self) -> list[str]:
        return [uid for _, uid in self._order]

    def __len__(self) -> int:
        return len(self._order)


class _Static:
    """Whether a request could ever fit the idle cluster (memoised per request)."""

    def __init__(self, idle: Ledger, policy: Policy) -> None:
        self._placer = admitting.Placer(idle, policy, explain=False)
        self._known: dict[GpuRequest, bool] = {}

    def ever(self, request: GpuRequest) -> bool:
        found = self._known.get(request)
        if found is None:
            found = self._known[request] = not isinstance(
                self._placer.plan([Member("probe", request)]), gangs.Shortfall
            )
        return found


def _greedy(placer: admitting.Placer, waiting: Sequence[Job]) -> list[str]:
    """Without queues: every waiting job in arrival order takes a place if one fits."""
    started: list[str] = []
    failed: set[GpuRequest] = set()
    for job in waiting:
        if job.request in failed:
            continue
        planned = placer.plan([Member(job.uid, job.request)])
        if isinstance(planned, gangs.Shortfall):
            failed.add(job.request)
            continue
        choice: Choice = planned.choices[job.uid]
        placer.ledger.reserve(grant_for(job.uid, choice, job.request))
        started.append(job.uid)
    return started


class _Queued:
    """Admission rounds for the replay, with the workload values kept per job."""

    def __init__(
        self,
        placer: admitting.Placer,
        queues: Sequence[quotas.QueueSpec],
        queue_of: Mapping[str, str],
        by_uid: Mapping[str, Job],
        timeline: Timeline,
        *,
        half_life: float | None = None,
        hold_after: float | None = None,
    ) -> None:
        self.placer = placer
        self.history = share_history.ShareHistory(half_life) if half_life else None
        self.queues = tuple(queues)
        self.strict = {q.name for q in queues if q.queueing is quotas.Queueing.STRICT_FIFO}
        self.by_uid = by_uid
        self.timeline = timeline
        self.dirty = False
        """The last moment ended with preemptions whose room was not all taken yet."""
        self.workloads = {
            uid: admitting.Workload(
                uid, queue_of[job.team], (Member(uid, job.request),), job.priority, job.arrives
            )
            for uid, job in by_uid.items()
        }
        self.hold_after = hold_after
        self.hold: tuple[str, frozenset[str]] | None = None
        """The workload capacity is held for, and its nodes (`holds`)."""
        self._held: dict[str, admitting.Workload] = {}
        """The other workloads, kept off the held nodes (per hold)."""
        self._nodes = frozenset(node.name for node in placer.ledger.inventory)

    def _workload(self, uid: str) -> admitting.Workload:
        """The job's workload, kept off the held nodes unless it is the one held for."""
        workload = self.workloads[uid]
        if self.hold is None:
            return workload
        if self.hold[0] == uid:
            return replace(workload, held=self.hold[1])
        found = self._held.get(uid)
        if found is None:
            allowed = self._nodes - self.hold[1]
            found = self._held[uid] = replace(
                workload, members=tuple(replace(m, nodes=allowed) for m in workload.members)
            )
        return found

    def _rehold(self, decided: admitting.Round, now: float, past: Mapping[str, float]) -> None:
        """After a round: hold capacity for the starving workload (`holds.starving`),
        keeping the hold while the same one starves (on other nodes when `holds.repick`
        finds better ones); none once none does."""
        assert self.hold_after is not None
        head = holds.starving(
            decided,
            self.workloads,
            now=now,
            after=self.hold_after,
            past=past,
            current=self.hold[0] if self.hold is not None else "",
        )
        if head is None:
            self.hold, self._held = None, {}
            return
        ledger = self.placer.ledger
        queue_of = {grant.pod_uid: self.workloads[grant.pod_uid].queue for grant in ledger}
        stay = holds.staying(decided, head, queue_of, past)
        same = self.hold is not None and self.hold[0] == head.key
        nodes = holds.choose(ledger, head, stay, self.hold[1] if self.hold and same else None)
        if nodes is None:
            return
        self.hold = (head.key, frozenset(nodes)) if nodes else None
        self._held = {}
        self.timeline.holds += 1 if nodes else 0

    def round(
        self,
        now: float,
        running: dict[str, float],
        line: _Line,
        arrived: Sequence[str],
        freed: bool,
    ) -> list[str]:
        """Admission rounds at `now`; reclaims preempt at once (their victims wait again).
        Where nothing left since the last round, only the jobs that just arrived (and
        StrictFIFO queues' lines) are tried: the others failed then and would fail again,
        as nothing was freed since and their queues' use only grew. Returns the jobs
        started."""
        started: list[str] = []
        freed, self.dirty = freed or self.dirty, False
        for attempt in range(RECLAIM_ROUNDS):
            chosen = set(started)
            if freed or attempt:
                uids = [uid for uid in line.order() if uid not in chosen]
            else:
                fresh = set(arrived)
                uids = [
                    uid
                    for uid in line.order()
                    if uid not in chosen
                    and (uid in fresh or self.workloads[uid].queue in self.strict)
                ]
            if not uids:
                break
            waiting = [self._workload(uid) for uid in uids]
            runs = [self._running(uid, since) for uid, since in running.items()]
            runs += [self._running(uid, now) for uid in started]
            past = self.history.past(now) if self.history is not None else {}
            decided = admitting.admit(
                self.placer, self.queues, runs, waiting, now=now, reclaims=8, past=past
            )
            if self.history is not None:
                self.history.observe(now, {q.name: q.share for q in decided.queues})
            if self.hold_after is not None and (freed or attempt):
                self._rehold(decided, now, past)  # a round that saw every waiting job
            started += [admission.key for admission in decided.admissions]
            self.dirty = False
            if not decided.reclaims:
                break
            for reclaim in decided.reclaims:
                for victim in reclaim.victims:
                    for uid in victim.uids:
                        self._preempt(uid, now, running, line, started)
            self.dirty = True
        return started

    def _running(self, uid: str, since: float) -> admitting.Running:
        job = self.by_uid[uid]
        return admitting.Running(uid, self.workloads[uid].queue, (uid,), job.priority, since)

    def _preempt(
        self, uid: str, now: float, running: dict[str, float], line: _Line, started: list[str]
    ) -> None:
        self.placer.ledger.release(uid)
        self.timeline.preemptions += 1
        self.timeline.jobs[uid].preempted += 1
        if uid in started:  # admitted at this very moment: still in the line
            started.remove(uid)
            return
        since = running.pop(uid)
        job = self.by_uid[uid]
        self.timeline.lost_gpu_seconds += (now - since) * equivalents(job.request) / WHOLE
        line.add(uid, now)


def _sample(
    now: float,
    by_uid: Mapping[str, Job],
    running: Mapping[str, float],
    line: _Line,
    teams: Sequence[str],
) -> Sample:
    use = dict.fromkeys(teams, 0)
    allocated = 0
    for uid in running:
        job = by_uid[uid]
        held = equivalents(job.request)
        use[job.team] += held
        allocated += held
    demand = dict(use)
    for uid in line.since:
        job = by_uid[uid]
        demand[job.team] += equivalents(job.request)
    return Sample(now, allocated, use, demand)


# --- figures ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TeamFigures:
    team: str
    weight: float
    nominal_gpus: float
    jobs: int
    mean_share: float
    """Time-averaged fraction of the cluster it held while contended."""
    mean_entitlement: float
    """Time-averaged fraction it was entitled to then (`fairness.entitlements`)."""
    share_vs_entitlement: float
    """∫ held / ∫ entitled over contended time: 1.0 is exactly its weighted share."""
    within_10_percent: float
    """Fraction of contended time it held within ±10% of its entitlement."""
    wait_p50_s: float
    wait_p99_s: float
    preempted: int


@dataclass(frozen=True, slots=True)
class Figures:
    allocation: float
    """Time-averaged compute allocated, % of the cluster, from the first to the last arrival."""
    allocation_contended: float
    """The same over contended time only."""
    contended_fraction: float
    """Fraction of that time the teams together asked for more than the cluster."""
    jain: float
    """Time-averaged Jain index of held/entitled over the teams, while contended."""
    teams: tuple[TeamFigures, ...]
    preemptions: int
    lost_gpu_hours: float
    never_fit: int
    holds: int = 0
    """Capacity holds taken or moved (a new starving workload held for, or its hold
    moved to other nodes)."""


def figures(
    timeline: Timeline,
    nominal: Mapping[str, float],
    weight: Mapping[str, float],
    until: float,
) -> Figures:
    """Integrate the samples from the first one to `until`. `nominal` and `weight` per
    team (GPU equivalents, milli; and weights) define entitlements. O(samples x teams)."""
    capacity = timeline.capacity
    teams = sorted(set(timeline.teams.values()))
    span = contended = allocated = allocated_contended = jain_time = 0.0
    held = dict.fromkeys(teams, 0.0)
    owed = dict.fromkeys(teams, 0.0)
    close = dict.fromkeys(teams, 0.0)
    samples = timeline.samples
    for i, sample in enumerate(samples):
        if sample.time >= until:
            break
        end = min(samples[i + 1].time if i + 1 < len(samples) else until, until)
        length = end - sample.time
        if length <= 0:
            continue
        span += length
        allocated += sample.allocated * length
        if sum(sample.demand.values()) <= capacity:
            continue
        contended += length
        allocated_contended += sample.allocated * length
        entitled = fairness.entitlements(capacity, sample.demand, nominal, weight)
        ratios = []
        for team in teams:
            owed[team] += entitled.get(team, 0.0) * length
            held[team] += sample.use.get(team, 0) * length
            if entitled.get(team, 0.0) > 0:
                ratio = sample.use.get(team, 0) / entitled[team]
                ratios.append(ratio)
                if abs(ratio - 1) <= 0.1:
                    close[team] += length
        jain_time += fairness.jain(ratios) * length
    waits: dict[str, list[float]] = {team: [] for team in teams}
    preempted = dict.fromkeys(teams, 0)
    for uid, record in timeline.jobs.items():
        team = timeline.teams[uid]
        if record.starts:
            waits[team].append(record.waited)
        preempted[team] += record.preempted
    rows = []
    for team in teams:
        found = sorted(waits[team])
        rows.append(
            TeamFigures(
                team,
                weight.get(team, 1.0),
                nominal.get(team, 0.0) / WHOLE,
                sum(1 for uid in timeline.jobs if timeline.teams[uid] == team),
                _ratio(held[team], contended * capacity),
                _ratio(owed[team], contended * capacity),
                _ratio(held[team], owed[team]),
                _ratio(close[team], contended),
                _quantile(found, 0.5),
                _quantile(found, 0.99),
                preempted[team],
            )
        )
    return Figures(
        100 * _ratio(allocated, span * capacity),
        100 * _ratio(allocated_contended, contended * capacity),
        _ratio(contended, span),
        _ratio(jain_time, contended),
        tuple(rows),
        timeline.preemptions,
        timeline.lost_gpu_seconds / 3600,
        len(timeline.never),
        timeline.holds,
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]
