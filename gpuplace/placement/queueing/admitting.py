"""A round of queue admission: which waiting workloads to admit now, in which order, and
where; which borrowed workloads to preempt so that a queue gets back what it lent.

A *workload* is a pod, or a gang as one unit (all its members; an elastic gang at least
`gang-min` of them). `admit(placer, queues, running, waiting, now=...)` decides one round:

1. every running workload's use is counted from its grants in the placer's ledger
   (`quotas.usage`), in its queue's buckets;
2. each queue orders its waiting workloads: those with victims leaving for them first,
   then those waiting longer than the queue's `max_wait`, then by priority (highest
   first), then by age (oldest first), then by key;
3. across queues, the queue furthest below its weighted fair share goes next
   (`quotas.Accounts.order`: the weighted dominant share of what it borrows, plus its
   past share from `past` while it borrows, then how full its nominal quota is), each
   time one of its workloads was tried: capacity goes first to the queue furthest below
   its share, and every admission moves it back in line;
4. a workload is admitted when BOTH its queue's quota (its own, or what its cohort lends)
   covers it AND the ledger has a real place for it: first the quota decides which GPU
   models it may use (an upper bound of its use on each model), then it is planned on
   those (`gangs.plan`, all members or none; one pod through the `choosing.Chooser`), then
   its exact use on the planned GPUs is checked again. What is admitted is reserved in the
   placer's ledger at once, so the next admission of the round never counts a GPU twice;
5. an elastic gang that does not fit whole starts with the most members that fit, from
   `minimum` up (`elastic.start`); a running elastic gang with members missing grows by
   the most that fit, but only in a round where no waiting workload lacked a place or its
   cohort's quota (growth never takes what a waiting workload needs);
6. a StrictFIFO queue stops at its first workload that is not admitted; a BestEffortFIFO
   queue tries the ones behind it;
7. then, for at most `reclaims` waiting workloads refused for their cohort's quota or a
   place, the borrowed workloads to preempt (`reclaiming.victims`, where `admits` is step
   4 on the ledger and accounts without them; never several where one alone does and is
   no worse a victim, `reclaiming` step 5): as the queue's `reclaim` policy allows when
   the workload fits inside its queue's nominal quota, and as its `fair_sharing` policy
   allows from queues that would still borrow at least the share its queue reaches
   (`quotas.FairStrategy.FINAL_SHARE`; shares here are `Accounts.fair_share`, the past
   share counted), or, where the queue lists
   `INITIAL_SHARE` next and the first finds no victims, from queues that borrowed more
   than that share before. A workload with nodes kept for it (`Workload.held`) looks
   among the workloads wholly on those nodes first, then among all.
   Workloads already leaving count as gone there, so a reclaim in flight is not repeated;
   each reclaim chosen is applied while the next is looked for (never two on one freed
   GPU), and all is undone before the round returns.

The placer must be given a ledger that the round may write: `Placer.scratch` copies one
(what a controller passes: its live ledger stays untouched until it reserves the grants
itself); a replay may pass its own.

Complexity, with W waiting workloads, Q queues, R running ones and B buckets per queue:
O(R x (GPUs of a grant + B)) to count, O(W log W + W log Q) to order, and per workload
tried O(models x members + B) for quota plus one plan (O(changed nodes + distinct node
states) for one pod through the chooser, `gangs.plan` for a gang), x O(log gang size) for
an elastic gang that does not fit whole; each reclaim looked for adds C cheap checks of
its candidates and O(log C + V) admission tests (V victims; `reclaiming`), and when V
is two or more C more cheap checks (`_Preempting.could`: quota, the candidate's nodes;
one plan) and at most `reclaiming.ALONE_TESTS` more tests (candidates tried alone:
`reclaiming.fewest`), each test O(GPUs of the victims) to lift and put back their grants
(twice for a held workload); at most `RECLAIM_TRIES` x `reclaims` workloads are looked at.

Pure: no I/O; `now` and every time are the caller's numbers (seconds).
"""

from __future__ import annotations

import enum
import heapq
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuplace.placement import choosing, elastic, gangs
from gpuplace.placement.choosing import Choice, Policy
from gpuplace.placement.gangs import Member, Plan, Shortfall
from gpuplace.placement.ledger import Grant, Ledger
from gpuplace.placement.queueing import quotas, reclaiming
from gpuplace.placement.queueing.quotas import Accounts, Refusal, Use, Verdict
from gpuplace.placement.requests import WHOLE, GpuRequest


@dataclass(frozen=True, slots=True)
class Workload:
    """A waiting workload: one pod, or a gang (every member, started or not)."""

    key: str
    """Unique among the round's workloads, e.g. `namespace/pod` or `namespace/gang`."""
    queue: str
    members: tuple[Member, ...]
    priority: int = 0
    created: float = 0.0
    """When it started waiting, on the caller's clock (seconds): age order and max wait."""
    minimum: int = 0
    """An elastic gang's `gang-min`: it may start with this many members; 0: all."""
    held: frozenset[str] = frozenset()
    """Nodes kept for it (a capacity hold, `gpuplace.placement.queueing.holds`, or a starving
    gang's fence): its reclaims look for victims there first (step 7)."""

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError(f"workload {self.key} has no member")
        if len({member.uid for member in self.members}) != len(self.members):
            raise ValueError(f"workload {self.key}: members must have distinct uids")
        if not 0 <= self.minimum <= len(self.members):
            raise ValueError(f"workload {self.key}: minimum must be 0..{len(self.members)}")

    @property
    def elastic(self) -> bool:
        return 0 < self.minimum < len(self.members)


@dataclass(frozen=True, slots=True)
class Running:
    """An admitted workload: its members hold (or have reserved) grants in the ledger."""

    key: str
    queue: str
    uids: tuple[str, ...]
    """Its admitted members, in the order they started (an elastic gang's extras last)."""
    priority: int = 0
    admitted: float = 0.0
    minimum: int = 0
    """An elastic gang's `gang-min`; 0: not elastic (every member is needed)."""
    missing: tuple[Member, ...] = ()
    """An elastic gang's members not started yet: it grows by these as GPUs free."""
    started: tuple[float, ...] = ()
    """When each of `uids` started (default: `admitted` for all): elastic extras are
    given back the most recently started first."""
    leaving_for: str = ""
    """The key of the workload its eviction was asked for ("" = not leaving). Its GPUs
    still count until it is gone, except when reclaim looks for victims."""


class Why(enum.Enum):
    """Why a workload waits."""

    QUOTA = "quota"
    """Its queue's own quota (nominal, or nominal plus borrowing limit) does not cover it,
    or names no quota for what it uses."""
    COHORT = "cohort"
    """Its queue may borrow, but its cohort has not enough left to lend."""
    PLACE = "place"
    """Quota covers it, but no GPU (set) in the ledger can hold it now."""
    NEVER = "never"
    """No GPU of the cluster could ever hold it, even idle."""
    BEHIND = "behind"
    """Its StrictFIFO queue stopped at an earlier workload."""
    RECLAIMING = "reclaiming"
    """Borrowed workloads are being preempted (or leaving) to make room for it."""
    NO_QUEUE = "no queue"
    """It names a queue that does not exist."""


@dataclass(frozen=True, slots=True)
class Waiting:
    key: str
    queue: str
    position: int
    """1-based place in its queue's order this round."""
    why: Why
    reason: str
    """One line a person reads (Events, `gpuplace explain`)."""
    overdue: bool = False
    """Waited longer than its queue's `max_wait`."""


@dataclass(frozen=True, slots=True)
class Admission:
    """Admit these members of workload `key` (all of them, or an elastic gang's count),
    on these GPUs: the caller reserves `grants` and ungates the members."""

    key: str
    queue: str
    choices: Mapping[str, Choice]
    grants: tuple[Grant, ...]
    use: Mapping[quotas.Bucket, int]
    borrowing: bool
    """It takes quota its queue borrows from the cohort (reclaimable)."""
    growth: bool = False
    """It adds members to a running elastic gang."""

    @property
    def uids(self) -> tuple[str, ...]:
        return tuple(self.choices)


@dataclass(frozen=True, slots=True)
class Victim:
    key: str
    queue: str
    uids: tuple[str, ...]
    shrink: bool
    """An elastic gang's extra member given back (the gang runs on)."""


@dataclass(frozen=True, slots=True)
class Reclaim:
    """Preempt `victims` (through the Eviction API, whole workloads) for workload `key`."""

    key: str
    queue: str
    victims: tuple[Victim, ...]


@dataclass(frozen=True, slots=True)
class QueueStatus:
    """What `gpuplace queues` and the GpuQueue's status show for one queue."""

    name: str
    cohort: str
    used: Mapping[quotas.Bucket, int]
    borrowed: Mapping[quotas.Bucket, int]
    lent: Mapping[quotas.Bucket, int]
    admitted: int
    """Running workloads (after this round's admissions)."""
    waiting: int
    """Workloads still waiting after this round."""
    waiting_pods: int
    share: float
    """Weighted dominant share of what it borrows (`quotas.Accounts.share`)."""


@dataclass(frozen=True, slots=True)
class Round:
    admissions: tuple[Admission, ...]
    waiting: tuple[Waiting, ...]
    reclaims: tuple[Reclaim, ...]
    queues: tuple[QueueStatus, ...]


# --- placing ---------------------------------------------------------------------------


class Placer:
    """Plans workloads on one ledger and reserves what is admitted there, so that the
    admissions of a round never count a GPU twice. One pod goes through a
    `choosing.Chooser` (incremental: O(changed nodes + distinct node states)); a gang
    through `gangs.plan`."""

    __slots__ = ("_chooser", "explain", "ledger", "policy", "rng")

    def __init__(
        self,
        ledger: Ledger,
        policy: Policy,
        *,
        rng: random.Random | None = None,
        explain: bool = True,
    ) -> None:
        self.ledger = ledger
        self.policy = policy
        self.rng = rng or random.Random(0)
        self.explain = explain
        """False: a pod that finds no place gets a short reason (a replay saves the pass
        over every node that the full reason costs)."""
        self._chooser = choosing.Chooser(ledger, policy)

    @classmethod
    def scratch(cls, ledger: Ledger, policy: Policy, *, rng: random.Random | None = None) -> Placer:
        """A placer on a copy of `ledger` (same inventory object, never changed here).
        O(nodes + grants)."""
        copy = Ledger(ledger.inventory)
        copy.restore(ledger)
        return cls(copy, policy, rng=rng)

    def plan(self, members: Sequence[Member], *, explain: bool | None = None) -> Plan | Shortfall:
        """Where every member would go now, or why not (a short reason without
        `explain`, default `self.explain`); changes nothing."""
        explain = self.explain if explain is None else explain
        if len(members) == 1:
            member = members[0]
            choice = self._chooser.choose(member.request, self.rng, member.nodes)
            if choice is not None:
                return Plan({member.uid: choice}, (choice.node,))
            if not explain:
                return Shortfall("no node has room for it now", 0, 1, True)
        return gangs.plan(self.ledger, self.policy, members, explain=explain)

    def take(self, plan: Plan, members: Sequence[Member]) -> list[Grant]:
        """Reserve the plan's grants. O(members x GPUs)."""
        grants = plan.grants(members)
        for grant in grants:
            self.ledger.reserve(grant)
        return grants

    def lift(self, uids: Iterable[str]) -> list[Grant]:
        """Release the grants of `uids` (for a what-if); `put_back` restores them."""
        lifted = []
        for uid in uids:
            grant = self.ledger.release(uid)
            if grant is not None:
                lifted.append(grant)
        return lifted

    def put_back(self, grants: Iterable[Grant]) -> None:
        for grant in grants:
            self.ledger.reserve(grant, overcommit=True)


# --- the round -------------------------------------------------------------------------


@dataclass(slots=True)
class _Tried:
    """The outcome of one admission test."""

    plan: Plan | None = None
    members: tuple[Member, ...] = ()
    use: Use = field(default_factory=dict)
    why: Why = Why.PLACE
    reason: str = ""


class _Round:
    def __init__(
        self,
        placer: Placer,
        queues: Iterable[quotas.QueueSpec],
        running: Sequence[Running],
        now: float,
        past: Mapping[str, float] | None = None,
    ) -> None:
        self.placer = placer
        self.accounts = Accounts(queues, past)
        self.now = now
        inventory = placer.ledger.inventory
        self.models = inventory.models()
        self.memory = {
            model: cap.max_memory_mib for model, cap in inventory.capabilities().per_model.items()
        }
        self.failures: dict[tuple[object, ...], _Tried] | None = {}
        """Failed tests of the admission pass by (queue, members' shapes): a round only
        adds use and takes GPUs until reclaim looks, so a test that failed fails again
        (None once reclaim lifts grants)."""
        self.floors: dict[tuple[object, ...], tuple[int, _Tried]] = {}
        """Without reasons to explain: per (queue, members, request but its share), the
        smallest share quota refused this round; a larger one is refused alike (quota only
        grows within the admission pass)."""
        self.running = [r for r in running if r.queue in self.accounts.specs]
        self.uid_use: dict[str, tuple[str, Use]] = {}
        """Per running pod: its queue and what it counts there."""
        for workload in self.running:
            for uid in workload.uids:
                grant = placer.ledger.get(uid)
                if grant is None:
                    continue
                per_model = quotas.usage([grant], inventory)
                use = self.accounts.use_of(workload.queue, per_model, strict=False)
                assert not isinstance(use, Verdict)
                self.uid_use[uid] = (workload.queue, use)
                self.accounts.charge(workload.queue, use)

    # --- one test ---------------------------------------------------------------------

    def attempt(self, queue: str, members: Sequence[Member], *, explain: bool = True) -> _Tried:
        """Step 4 of the module docstring for exactly `members`; changes nothing.
        Without `explain`, only whether it passes matters (a short reason)."""
        if self.failures is None:
            return self._attempt(queue, members, explain)
        key = (queue, *((member.request, member.nodes) for member in members))
        failed = self.failures.get(key)
        if failed is not None:
            return failed
        tried = self._attempt(queue, members, explain)
        if tried.plan is None and explain:
            self.failures[key] = tried
        return tried

    def _attempt(self, queue: str, members: Sequence[Member], explain: bool) -> _Tried:
        floor_key = None
        if self.failures is not None and not self.placer.explain:
            first = members[0].request
            if all(member.request == first for member in members):
                floor_key = (queue, len(members), first.count, first.memory_mib, first.models)
                floor = self.floors.get(floor_key)
                if floor is not None and floor[0] <= first.milli:
                    return floor[1]
        restricted = self.restrict(queue, members)
        if isinstance(restricted, Verdict):
            why = Why.COHORT if restricted.refusal is Refusal.COHORT else Why.QUOTA
            tried = _Tried(why=why, reason=restricted.message)
            if floor_key is not None:
                self.floors[floor_key] = (members[0].request.milli, tried)
            return tried
        planned = self.placer.plan(restricted, explain=explain and self.placer.explain)
        if isinstance(planned, Shortfall):
            return _Tried(why=Why.PLACE if planned.ever else Why.NEVER, reason=planned.reason)
        grants = planned.grants(restricted)
        use = self.accounts.use_of(queue, quotas.usage(grants, self.placer.ledger.inventory))
        verdict = use if isinstance(use, Verdict) else self.accounts.check(queue, use)
        if verdict is not None:
            why = Why.COHORT if verdict.refusal is Refusal.COHORT else Why.QUOTA
            return _Tried(why=why, reason=verdict.message)
        assert not isinstance(use, Verdict)
        return _Tried(planned, tuple(restricted), use)

    def restrict(self, queue: str, members: Sequence[Member]) -> list[Member] | Verdict:
        """`members` limited to the GPU models on which the queue's quota covers all of
        them (an upper bound of their use there), or why no model is. O(models x
        members + buckets)."""
        requests = [member.request for member in members if member.request.count]
        if not requests:
            return list(members)
        wanted: set[str] = set()
        for request in requests:
            wanted.update(request.models or self.models)
        allowed: set[str] = set()
        refusal: Verdict | None = None
        for model in sorted(wanted & set(self.models)):
            vector = quotas.estimate(requests, model, self.memory.get(model, 0))
            use = self.accounts.use_of(queue, {model: vector})
            verdict = use if isinstance(use, Verdict) else self.accounts.check(queue, use)
            if verdict is None:
                allowed.add(model)
            elif refusal is None or _rank(verdict) > _rank(refusal):
                refusal = verdict
        if not allowed:
            return refusal or Verdict(Refusal.NO_QUOTA, "no GPU model of the cluster fits")
        if allowed >= set(self.models):
            return list(members)
        limited = []
        for member in members:
            request = member.request
            if request.count:
                models = (request.models & allowed) if request.models else frozenset(allowed)
                if not models:
                    assert refusal is not None
                    return refusal
                request = replace(request, models=models)
            limited.append(replace(member, request=request))
        return limited

    def commit(self, queue: str, tried: _Tried) -> list[Grant]:
        assert tried.plan is not None
        grants = self.placer.take(tried.plan, tried.members)
        self.accounts.charge(queue, tried.use)
        return grants

    # --- one workload -----------------------------------------------------------------

    def admit(self, workload: Workload) -> tuple[Admission | None, _Tried]:
        """Admit all members, or an elastic gang's most that fit; else why not."""
        members = workload.members
        whole = self.attempt(workload.queue, members)
        if whole.plan is None and workload.elastic:
            most = self.most(workload.queue, members, workload.minimum, len(members) - 1)
            if most is not None:
                whole = most
        if whole.plan is None:
            return None, whole
        return self.admission(workload.key, workload.queue, whole), whole

    def most(self, queue: str, members: Sequence[Member], low: int, high: int) -> _Tried | None:
        """The admission test of the most of `members` (their first k, k from `low` to
        `high`) that pass it, by bisection (`elastic.largest`); None when `low` do not."""
        found: dict[int, _Tried] = {}

        def fits(count: int) -> bool:
            found[count] = self.attempt(queue, members[:count])
            return found[count].plan is not None

        count = elastic.largest(fits, low, high)
        return None if count is None else found[count]

    def admission(self, key: str, queue: str, tried: _Tried, *, growth: bool = False) -> Admission:
        borrowing = not self.accounts.within_nominal(queue, tried.use)
        grants = self.commit(queue, tried)
        assert tried.plan is not None
        choices = {member.uid: tried.plan.choices[member.uid] for member in tried.members}
        return Admission(key, queue, choices, tuple(grants), tried.use, borrowing, growth)


def _rank(verdict: Verdict) -> int:
    """Which refusal explains best: the cohort's, then the queue's own, then no quota."""
    return {Refusal.NO_QUOTA: 0, Refusal.QUOTA: 1, Refusal.COHORT: 2}[verdict.refusal]


def _order(workload: Workload, leaving: set[str], overdue: bool) -> tuple[object, ...]:
    urgency = 0 if workload.key in leaving else 1 if overdue else 2
    return (urgency, -workload.priority, workload.created, workload.key)


def admit(
    placer: Placer,
    queues: Iterable[quotas.QueueSpec],
    running: Sequence[Running],
    waiting: Sequence[Workload],
    *,
    now: float,
    reclaims: int = 1,
    past: Mapping[str, float] | None = None,
) -> Round:
    """One round; see the module docstring for the rules and the complexity. The
    placer's ledger receives the admitted grants (RESERVED). `past`: each queue's past
    share (`share_history.ShareHistory.past`), counted in its fair share."""
    state = _Round(placer, queues, running, now, past)
    accounts = state.accounts
    leaving = {r.leaving_for for r in state.running if r.leaving_for}
    lines: dict[str, list[tuple[Workload, bool]]] = {}
    results: list[Waiting] = []
    for workload in waiting:
        spec = accounts.specs.get(workload.queue)
        if spec is None:
            results.append(
                Waiting(
                    workload.key,
                    workload.queue,
                    0,
                    Why.NO_QUEUE,
                    f"queue {workload.queue} does not exist",
                )
            )
            continue
        overdue = spec.max_wait is not None and now - workload.created > spec.max_wait
        lines.setdefault(workload.queue, []).append((workload, overdue))
    for line in lines.values():
        line.sort(key=lambda item: _order(item[0], leaving, item[1]))

    admissions: list[Admission] = []
    failed: list[tuple[Workload, int, bool, _Tried]] = []
    heap: list[tuple[object, ...]] = []
    cursor = dict.fromkeys(lines, 0)

    def push(queue: str) -> None:
        line = lines[queue]
        at = cursor[queue]
        if at < len(line):
            head, overdue = line[at]
            urgency = _order(head, leaving, overdue)[0]
            heapq.heappush(heap, (urgency, *accounts.order(queue)))

    for queue in lines:
        push(queue)
    while heap:
        queue = str(heapq.heappop(heap)[-1])
        line = lines[queue]
        at = cursor[queue]
        workload, overdue = line[at]
        cursor[queue] = at + 1
        admission, tried = state.admit(workload)
        if admission is not None:
            admissions.append(admission)
        else:
            failed.append((workload, at + 1, overdue, tried))
            if accounts.specs[queue].queueing is quotas.Queueing.STRICT_FIFO:
                for position in range(at + 1, len(line)):
                    behind, late = line[position]
                    results.append(
                        Waiting(
                            behind.key,
                            queue,
                            position + 1,
                            Why.BEHIND,
                            f"behind {workload.key} in StrictFIFO queue {queue}",
                            late,
                        )
                    )
                cursor[queue] = len(line)
        push(queue)

    crowded = any(tried.why in (Why.PLACE, Why.COHORT) for _, _, _, tried in failed)
    if not crowded:
        admissions += _grow(state)

    state.failures = None
    reclaimed, in_flight = _reclaims(state, failed, reclaims)
    for workload, position, overdue, tried in failed:
        if workload.key in in_flight:
            why, reason = Why.RECLAIMING, in_flight[workload.key]
        else:
            why, reason = tried.why, tried.reason
        results.append(Waiting(workload.key, workload.queue, position, why, reason, overdue))
    results.sort(key=lambda w: (w.queue, w.position, w.key))
    return Round(
        tuple(admissions),
        tuple(results),
        tuple(reclaimed),
        _statuses(state, admissions, results, waiting),
    )


def _grow(state: _Round) -> list[Admission]:
    """Step 5: running elastic gangs add the most missing members that fit, queues in
    fair-share order, each gang once. O(gangs x log missing) admission tests."""
    growing = [r for r in state.running if r.missing and r.minimum and not r.leaving_for]
    growing.sort(key=lambda r: (state.accounts.order(r.queue), -r.priority, r.admitted, r.key))
    grown = []
    for workload in growing:
        most = state.most(workload.queue, workload.missing, 1, len(workload.missing))
        if most is not None:
            grown.append(state.admission(workload.key, workload.queue, most, growth=True))
    return grown


RECLAIM_TRIES = 4
"""Workloads looked at for a reclaim per reclaim allowed in a round (each look may cost
an admission test per candidate)."""


def _candidates(state: _Round, queue: str) -> list[reclaiming.Candidate]:
    """Running workloads of the other queues of `queue`'s cohort, not leaving: whole
    workloads, and each extra member of an elastic gang; each with the GPU its grants
    hold and its GPU time (that x seconds since each pod started, up to the round's
    `now`). O(their pods)."""
    spec = state.accounts.specs[queue]
    ledger = state.placer.ledger
    found = []

    def held(uid: str) -> int:
        grant = ledger.get(uid)
        return 0 if grant is None else grant.milli * len(grant.gpus)

    def gpu_time(uid: str, since: float) -> float:
        return held(uid) / WHOLE * max(state.now - since, 0.0)

    for workload in state.running:
        other = state.accounts.specs[workload.queue]
        if workload.leaving_for or other.cohort != spec.cohort or other.name == queue:
            continue
        started = workload.started or (workload.admitted,) * len(workload.uids)
        pairs = list(zip(workload.uids, started, strict=True))
        found.append(
            reclaiming.Candidate(
                workload.key,
                workload.queue,
                workload.uids,
                workload.priority,
                workload.admitted,
                gpu_time=sum(gpu_time(uid, when) for uid, when in pairs),
                milli=sum(held(uid) for uid in workload.uids),
            )
        )
        for uid, when in elastic.extras(pairs, workload.minimum):
            found.append(
                reclaiming.Candidate(
                    workload.key,
                    workload.queue,
                    (uid,),
                    workload.priority,
                    when,
                    shrink=True,
                    gpu_time=gpu_time(uid, when),
                    milli=held(uid),
                )
            )
    return found


class _Preempting:
    """For one waiting workload: may a candidate go (`allowed`), would the workload be
    admitted once chosen ones are gone (`admits`)."""

    def __init__(
        self, state: _Round, workload: Workload, members: Sequence[Member], gone: Iterable[str]
    ) -> None:
        self.state = state
        self.workload = workload
        self.members = members
        self.gone = set(gone)
        spec = state.accounts.specs[workload.queue]
        self.reclaim = spec.reclaim if _within_nominal(state, workload.queue, members) else None
        self.fair = spec.fair_sharing
        self.strategy = quotas.FairStrategy.FINAL_SHARE
        """The fair-sharing strategy `allowed` applies (`_reclaims` tries the queue's
        in turn)."""
        self.share = _share_after(state, workload.queue, members)
        """The waiting workload's queue's share once admitted (an upper bound)."""
        self._initial: dict[str, tuple[float, float]] = {}
        """Per victim queue, its fair share and its share now before this look
        (`INITIAL_SHARE`)."""
        self._seen: list[reclaiming.Candidate] = []
        self._uids: set[str] = set()
        self._use: dict[str, Use] = {}
        self._asked: dict[GpuRequest, int] = {}
        """Members per distinct request (`could`)."""
        for member in members:
            self._asked[member.request] = self._asked.get(member.request, 0) + 1
        self._quota: bool | None = None
        """Whether its quota covers it with only what is leaving gone (`could`)."""
        self._capacity: dict[str, tuple[int, ...]] | None = None
        """With only what is leaving gone: {} when the workload has a place regardless of
        quota, else per node (and under "" in all) the copies of each of its requests
        the node could take (`could`; None: not looked at yet)."""

    @property
    def possible(self) -> bool:
        """Whether any candidate could be allowed: some other queue of the cohort
        borrows, and reclaim applies or that queue's share is at least the one this
        queue would reach. O(queues)."""
        accounts = self.state.accounts
        cohort = accounts.specs[self.workload.queue].cohort
        reclaim = self.reclaim is not None and self.reclaim is not quotas.Preemption.NEVER
        fair = self.fair is not quotas.Preemption.NEVER
        for name, spec in accounts.specs.items():
            if spec.cohort != cohort or name == self.workload.queue:
                continue
            share = accounts.order(name)[0]
            if (reclaim and accounts.borrowing(name)) or (
                fair and share > 0 and share >= self.share
            ):
                return True
        return False

    def removed(self, uids: Iterable[str]) -> dict[str, Use]:
        """Per queue, the use of `uids`."""
        found: dict[str, Use] = {}
        for uid in uids:
            owner, use = self.state.uid_use.get(uid, ("", {}))
            if owner:
                into = found.setdefault(owner, {})
                for bucket, amount in use.items():
                    into[bucket] = into.get(bucket, 0) + amount
        return found

    def _taken(self, chosen: Sequence[reclaiming.Candidate]) -> tuple[set[str], dict[str, Use]]:
        """The uids of `chosen` and their use per queue, kept from call to call while
        `chosen` only grows (as `reclaiming.victims` asks; a list that does not end with
        the last one seen starts over): O(new victims) a call."""
        seen = self._seen
        if len(chosen) < len(seen) or (seen and chosen[len(seen) - 1] is not seen[-1]):
            self._seen, self._uids, self._use = [], set(), {}
            seen = self._seen
        for candidate in chosen[len(seen) :]:
            fresh = [uid for uid in candidate.uids if uid not in self._uids]
            self._uids.update(fresh)
            for owner, use in self.removed(fresh).items():
                into = self._use.setdefault(owner, {})
                for bucket, amount in use.items():
                    into[bucket] = into.get(bucket, 0) + amount
            seen.append(candidate)
        return self._uids, self._use

    def allowed(
        self, candidate: reclaiming.Candidate, chosen: Sequence[reclaiming.Candidate]
    ) -> bool:
        """The candidate's queue borrows once `chosen` are gone, and a policy lets it go:
        reclaim (the workload fits its nominal quota), or fair sharing by `strategy` (its
        queue keeps at least the share the waiting workload's queue reaches; or, with
        `INITIAL_SHARE`, had more than that share before this look). O(buckets + new
        victims)."""
        accounts = self.state.accounts
        if candidate.queue not in self._initial:
            self._initial[candidate.queue] = (
                accounts.fair_share(candidate.queue),
                accounts.share(candidate.queue),
            )
        uids, use = self._taken(chosen)
        before = use.get(candidate.queue, {})
        accounts.charge(candidate.queue, before, -1)
        try:
            if not accounts.borrowing(candidate.queue):
                return False
            priority = self.workload.priority
            if self.reclaim is not None and self.reclaim.allows(candidate.priority, priority):
                return True
            if not self.fair.allows(candidate.priority, priority):
                return False
            mine = self.removed(set(candidate.uids) - uids).get(candidate.queue, {})
            if self.strategy is quotas.FairStrategy.INITIAL_SHARE:
                fair, now = self._initial[candidate.queue]
                # the past share counts only while the victim's queue would still borrow:
                # it never takes a queue into its own nominal
                still = accounts.share_with(candidate.queue, mine, -1) > 0
                return self.share < (fair if still else now)
            return accounts.fair_share_with(candidate.queue, mine, -1) >= self.share
        finally:
            accounts.charge(candidate.queue, before)

    def admits(self, chosen: Sequence[reclaiming.Candidate]) -> bool:
        uids = set(self.gone)
        for candidate in chosen:
            uids.update(candidate.uids)
        return _admits_without(self.state, uids, self.workload.queue, self.members)

    def could(self, candidate: reclaiming.Candidate) -> bool:
        """False where `admits([candidate])` is certainly false, without a plan (what
        `reclaiming.fewest` asks before it tests a candidate alone): the workload's quota
        (`_Round.restrict`, the first test of an admission) does not cover it once the
        candidate and what is leaving are gone; or, where the workload has no place even
        regardless of quota with only what is leaving gone (one plan per look, kept),
        the nodes cannot hold its members once the candidate is gone: for some request,
        the copies the nodes could take (`gangs.capacity`, exact per node; counted once
        per look, then only the candidate's nodes again) are fewer than the members
        asking for it. O(buckets + GPUs lifted + the candidate's nodes x GPUs x distinct
        requests); the first call adds a plan and O(nodes x GPUs x requests)."""
        state = self.state
        uids = self.gone | set(candidate.uids)
        if self._quota is None:
            self._quota = self._covered(self.gone)
        if not self._quota and not self._covered(uids):
            return False  # (covered with only what is leaving gone: covered without more)
        placer = state.placer
        if self._capacity is None:
            lifted = placer.lift(self.gone)
            try:
                planned = placer.plan(self.members, explain=False)
                self._capacity = {} if not isinstance(planned, Shortfall) else self._copies()
            finally:
                placer.put_back(lifted)
        if not self._capacity:
            return True  # a place there is: only the quota decides
        lifted = placer.lift(uids)
        try:
            nodes = {grant.node for grant in lifted if grant.pod_uid in candidate.uids}
            after = {name: self._copies_on(name) for name in nodes}
        finally:
            placer.put_back(lifted)
        none = (0,) * len(self._asked)
        for index, asked in enumerate(self._asked.values()):
            total = self._capacity[""][index]
            for name in nodes:
                total += after[name][index] - self._capacity.get(name, none)[index]
            if total < asked:
                return False
        return True

    def _covered(self, uids: Iterable[str]) -> bool:
        """Whether the workload's quota (`_Round.restrict`) covers it once `uids` are gone.
        O(buckets + models x members)."""
        accounts = self.state.accounts
        removed = self.removed(uids)
        for owner, use in removed.items():
            accounts.charge(owner, use, -1)
        try:
            return not isinstance(self.state.restrict(self.workload.queue, self.members), Verdict)
        finally:
            for owner, use in removed.items():
                accounts.charge(owner, use)

    def _copies_on(self, name: str) -> tuple[int, ...]:
        """Per distinct request (`_asked`'s order), the copies node `name` could take now
        (0 for a node the ledger does not hold). O(GPUs x requests)."""
        there = self.state.placer.ledger.state(name)
        return tuple(
            0 if there is None else gangs.capacity(there, request)[0] for request in self._asked
        )

    def _copies(self) -> dict[str, tuple[int, ...]]:
        """`_copies_on` for every node, and under "" their sums. O(nodes x GPUs x
        requests)."""
        ledger = self.state.placer.ledger
        found = {node.name: self._copies_on(node.name) for node in ledger.inventory}
        width = len(self._asked)
        found[""] = tuple(sum(copies[i] for copies in found.values()) for i in range(width))
        return found


def _where(
    state: _Round, workload: Workload, candidates: list[reclaiming.Candidate]
) -> list[list[reclaiming.Candidate]]:
    """The candidate lists to look for victims in, in turn: for a workload with nodes
    held for it, first those wholly on them, then all. The victims' order
    (`reclaiming.ordered`: most recently admitted first) knows no node, and the queues
    that may lose workloads may lose only so many: pods elsewhere, which make quota room
    but no place, would use that up before the held nodes' own were reached, so the
    nodes kept for the workload would drain only as their pods end. O(candidates' pods)."""
    if not workload.held:
        return [candidates]
    ledger = state.placer.ledger
    there = []
    for candidate in candidates:
        grants = [ledger.get(uid) for uid in candidate.uids]
        if all(grant is not None and grant.node in workload.held for grant in grants):
            there.append(candidate)
    return [there, candidates] if there and len(there) < len(candidates) else [candidates]


def _reclaims(
    state: _Round, failed: Sequence[tuple[Workload, int, bool, _Tried]], limit: int
) -> tuple[list[Reclaim], dict[str, str]]:
    """Step 7: victims for at most `limit` workloads (queues in fair-share order), and
    the reason line of every workload a reclaim is (or already was) under way for. Each
    reclaim chosen is applied (its victims lifted, its workload admitted) while the next
    ones are looked for, so two never count on the same freed GPU; all is undone after."""
    accounts = state.accounts
    reclaims: list[Reclaim] = []
    in_flight: dict[str, str] = {}
    gone = [uid for r in state.running if r.leaving_for for uid in r.uids]
    asked = [
        workload
        for workload, _, _, tried in failed
        if tried.why in (Why.PLACE, Why.COHORT) and accounts.specs[workload.queue].cohort
    ]
    asked.sort(key=lambda w: (accounts.order(w.queue), -w.priority, w.created, w.key))
    hopeless: set[tuple[object, ...]] = set()
    """Shapes (queue, reclaims applied so far, members) no victims would admit."""
    hopeful: dict[str, bool] = {}
    taken: set[str] = set()
    undo: list[_Applied] = []
    tries = 0
    try:
        for workload in asked:
            if len(reclaims) >= limit or tries >= RECLAIM_TRIES * limit:
                break
            queue = workload.queue
            if queue not in hopeful:
                hopeful[queue] = _may_preempt(state, queue)
            if not hopeful[queue]:
                continue
            members = workload.members[: workload.minimum] if workload.elastic else workload.members
            shape = (queue, len(undo), *((m.request, m.nodes) for m in members))
            if shape in hopeless:
                continue
            preempting = _Preempting(state, workload, members, gone)
            if not preempting.possible:
                hopeless.add(shape)
                continue
            tries += 1
            candidates = [c for c in _candidates(state, queue) if taken.isdisjoint(c.uids)]
            chosen = None
            for group in _where(state, workload, candidates):
                for strategy in _strategies(state, queue):
                    preempting.strategy = strategy
                    chosen = reclaiming.victims(
                        group, preempting.admits, preempting.allowed, preempting.could
                    )
                    if chosen is not None:
                        break
                if chosen is not None:
                    break
            if chosen is None:
                hopeless.add(shape)
                continue
            if not chosen:
                in_flight[workload.key] = "waiting for preempted workloads to leave"
                continue
            victims = tuple(
                Victim(c.key, c.queue, c.uids, c.shrink) for c in reclaiming.ordered(chosen)
            )
            reclaims.append(Reclaim(workload.key, queue, victims))
            names = ", ".join(v.key for v in victims)
            in_flight[workload.key] = f"preempting borrowed workloads of its cohort: {names}"
            uids = {uid for c in chosen for uid in c.uids}
            taken |= uids
            undo.append(_apply(state, uids, queue, members))
            hopeful.clear()
    finally:
        for applied in reversed(undo):
            applied.undo(state)
    return reclaims, in_flight


@dataclass(slots=True)
class _Applied:
    """A reclaim applied for the rest of the round: its victims' grants lifted and their
    use removed, its workload's grants reserved and its use charged."""

    lifted: list[Grant]
    removed: list[tuple[str, Use]]
    granted: list[Grant]
    queue: str
    use: Use

    def undo(self, state: _Round) -> None:
        for grant in self.granted:
            state.placer.ledger.release(grant.pod_uid)
        state.accounts.charge(self.queue, self.use, -1)
        for owner, use in self.removed:
            state.accounts.charge(owner, use)
        state.placer.put_back(self.lifted)


def _apply(state: _Round, uids: set[str], queue: str, members: Sequence[Member]) -> _Applied:
    lifted = state.placer.lift(uids)
    removed = [state.uid_use[uid] for uid in uids if uid in state.uid_use]
    for owner, theirs in removed:
        state.accounts.charge(owner, theirs, -1)
    tried = state.attempt(queue, members)
    granted: list[Grant] = []
    use: Use = {}
    if tried.plan is not None:
        granted = state.placer.take(tried.plan, tried.members)
        use = tried.use
        state.accounts.charge(queue, use)
    return _Applied(lifted, removed, granted, queue, use)


def _strategies(state: _Round, queue: str) -> tuple[quotas.FairStrategy, ...]:
    """The fair-sharing strategies to try in turn for a workload of `queue`: its own,
    or only the first when fair sharing cannot apply (reclaim and the first decide
    alike then: `allowed` reads the strategy only for fair sharing). O(1)."""
    spec = state.accounts.specs[queue]
    if spec.fair_sharing is quotas.Preemption.NEVER:
        return spec.fair_strategies[:1]
    return spec.fair_strategies


def _may_preempt(state: _Round, queue: str) -> bool:
    """A necessary condition for any workload of `queue` to preempt: another queue of
    its cohort borrows, and either `queue` uses less than its nominal somewhere (reclaim)
    or that queue's share is above `queue`'s (fair sharing). O(queues x buckets)."""
    accounts = state.accounts
    spec = accounts.specs[queue]
    used = accounts.used[queue]
    room = any(used.get(bucket, 0) < quota.nominal for bucket, quota in spec.quotas.items())
    reclaim = room and spec.reclaim is not quotas.Preemption.NEVER
    fair = spec.fair_sharing is not quotas.Preemption.NEVER
    mine = accounts.order(queue)[0]
    for name, other in accounts.specs.items():
        if other.cohort != spec.cohort or name == queue or not accounts.borrowing(name):
            continue
        if reclaim or (fair and accounts.order(name)[0] > mine):
            return True
    return False


def _share_after(state: _Round, queue: str, members: Sequence[Member]) -> float:
    """The queue's `share` with the members admitted, on the model that would make it
    largest (an upper bound). O(models x members)."""
    requests = [member.request for member in members if member.request.count]
    top = state.accounts.fair_share(queue)
    for model in state.models:
        vector = quotas.estimate(requests, model, state.memory.get(model, 0))
        use = state.accounts.use_of(queue, {model: vector})
        if not isinstance(use, Verdict):
            top = max(top, state.accounts.fair_share_with(queue, use))
    return top


def _within_nominal(state: _Round, queue: str, members: Sequence[Member]) -> bool:
    """Whether the members' use fits inside the queue's nominal quota on some model
    (an upper bound of their use there): only then may it reclaim."""
    requests = [member.request for member in members if member.request.count]
    for model in state.models:
        if requests and not any(not r.models or model in r.models for r in requests):
            continue
        vector = quotas.estimate(requests, model, state.memory.get(model, 0))
        use = state.accounts.use_of(queue, {model: vector})
        if not isinstance(use, Verdict) and state.accounts.within_nominal(queue, use):
            return True
    return False


def _admits_without(state: _Round, uids: set[str], queue: str, members: Sequence[Member]) -> bool:
    """Whether `members` would be admitted once `uids` are gone: their grants lifted from
    the ledger and their use from their queues, then put back. O(their GPUs + a test)."""
    lifted = state.placer.lift(uids)
    removed = [
        (owner, use) for uid in uids for owner, use in [state.uid_use.get(uid, ("", {}))] if owner
    ]
    for owner, use in removed:
        state.accounts.charge(owner, use, -1)
    try:
        return state.attempt(queue, members, explain=False).plan is not None
    finally:
        for owner, use in removed:
            state.accounts.charge(owner, use)
        state.placer.put_back(lifted)


def _statuses(
    state: _Round,
    admissions: Sequence[Admission],
    waiting: Sequence[Waiting],
    asked: Sequence[Workload],
) -> tuple[QueueStatus, ...]:
    accounts = state.accounts
    running: dict[str, int] = {}
    for workload in state.running:
        running[workload.queue] = running.get(workload.queue, 0) + 1
    for admission in admissions:
        if not admission.growth:
            running[admission.queue] = running.get(admission.queue, 0) + 1
    pods = {workload.key: len(workload.members) for workload in asked}
    counts: dict[str, tuple[int, int]] = {}
    for entry in waiting:
        workloads, members = counts.get(entry.queue, (0, 0))
        counts[entry.queue] = (workloads + 1, members + pods.get(entry.key, 0))
    found = []
    for name in sorted(accounts.specs):
        spec = accounts.specs[name]
        workloads, members = counts.get(name, (0, 0))
        found.append(
            QueueStatus(
                name,
                spec.cohort,
                dict(accounts.used[name]),
                accounts.borrowing(name),
                accounts.lent(name),
                running.get(name, 0),
                workloads,
                members,
                accounts.share(name),
            )
        )
    return tuple(found)
