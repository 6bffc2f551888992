"""preempt: narrow kube-scheduler's victims to those that free one GPU set, then hold it.

kube-scheduler's DefaultPreemption chooses victims per node on node totals of
`gpuplace.io/gpu-percent` and asks the extender (`preemptVerb`) before it evicts
anything. `Preempter.answer` replies, per candidate node, with the victims after which
the preemptor fits on one GPU set (`gpuplace.placement.victim_choice.evict`), and leaves out the
nodes where no such victims exist: nothing is evicted for nothing.

Who may be a victim on a node (a `gpuplace.placement.victim_choice.Unit` each):

- the pods kube-scheduler offered there (it checked their priority and PDBs);
- when no selection of those makes room and `beyond_offered` is on, also the node's
  other bound pods of strictly lower priority than the preemptor: kube-scheduler had
  them as potential victims too, and spared them only because node totals said so
  (kube-scheduler evicts any pod of the answer that is on that node). Such a selection
  ranks after any of offered pods only. A node offered with no victims at all (newer
  kube-scheduler releases send such a *placeholder* when node totals fit without
  preemption but an extender is interested: victims are the extender's to choose) is
  always answered this way;
- a gang member only with its whole gang: every running member on this node and
  allowed as above, evicted together; a gang with a member elsewhere is never a
  victim whole (kube-scheduler evicts only on the one node it nominates);
- but an extra member of a running elastic gang (one of those beyond `gang-min` that
  `gpuplace.placement.elastic.extras` gives back first, the most recently started
  first) may go alone, when on this node and allowed as above, wherever its mates run:
  the gang keeps `gang-min` members at least. Its `gang-min` core goes only with the
  whole gang. Extras go before whole gangs and, at the same priority, before a pod
  alone (`gpuplace.placement.victim_choice`'s cost says why);
- never a pod gpuplace holds GPUs for but that is not bound there (a reservation), nor
  the preemptor itself.

Where the preemptor already fits the node's GPUs, kube-scheduler's victims stand
unchanged, unless they would split a running gang (an elastic gang's extras alone do
not split it): then the node is left out. A node
offered with no victims where it already fits is left out too (`not-needed`): the answer
never names a node with no victims, which kube-scheduler takes as an error that fails the
whole preemption (`callExtenders`); the pod is tried again in its next scheduling cycle,
where filter passes that node.

Offered victims holding no GPU stay in the answer (kube-scheduler needed them for
something gpuplace does not count, CPU or ports).

The answer's plan is kept per preemptor (`pending`). When kube-scheduler acts on it —
the preemptor's `status.nominatedNodeName` names one of its nodes, or a victim of one
starts terminating or is gone — the preemptor's GPUs there are *held* (`LedgerSync.hold`, over
the victims still running: nobody else can take them as they leave), Events say on the
victims and the preemptor which GPU was freed for whom, and filter offers the
preemptor only that node, passing it once the victims are gone (`gpuplace.extender.deciding`).
The hold expires like any reservation if the pod is not bound in time.

Bounded per call: at most `max_nodes` candidate nodes are considered (in kube-scheduler's
order) and a node offered with more than `max_victims` victims is left out (both counted
`over-limit`); everything else is linear in what was offered, plus each node's bounded
search. `answering` is a generator that pauses after each node, where the extender gives
the event loop a turn; the answer is worked out on a `Snapshot` taken before the first
node, so those pauses change nothing of it. No await between reading the ledger and
holding.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster import grammar, pods, recording
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender.preempt_wire import PreemptionArgs, PreemptionResult
from gpuplace.placement import choosing, elastic, fit, requests, victim_choice
from gpuplace.placement.choosing import Choice
from gpuplace.placement.ledger import Grant, LedgerError, NodeState
from gpuplace.placement.requests import GpuRequest
from gpuplace.placement.victim_choice import Unit

log = logging.getLogger(__name__)

PENDING_KEPT = 256
"""Preemptors whose answers are kept until kube-scheduler acts on one (oldest dropped)."""
OWNER = "preemption"
LOGGED_NODES = 16
"""Nodes the "preemption answered" log line gives a count of victims for (it counts the
nodes answered, and names no victim: an answer may name 1,000 per node)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """One node of an answer: evict `victims`, then the preemptor takes `gpus`."""

    node: str
    gpus: tuple[int, ...]
    victims: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One node's part of an answer."""

    result: str
    """Its `gpuplace_preempt_nodes_total` result: narrowed, kept, dropped, not-needed."""
    answered: tuple[list[str], int] | None = None
    """Its victims and their count of PDB violations, when the node is answered."""
    plan: Plan | None = None
    """What to hold once kube-scheduler acts (None: its victims stand as offered)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one call's answer reads, copied when the call starts: the answer is worked
    out on it, node by node, whatever changes while the extender pauses between nodes."""

    states: Mapping[str, NodeState]
    """The candidate nodes' free state (copies)."""
    grants: Mapping[str, list[Grant]]
    """The grants on the candidate nodes, by node."""
    records: Mapping[str, PodRecord]
    """The pods of those grants and of the offered victims, by UID."""
    gangs: Mapping[tuple[str, str], list[PodRecord]]
    """The live members of every gang with a member among those grants."""


@dataclass(frozen=True, slots=True)
class Call:
    """One preempt call: the preemptor and the snapshot its answer is worked out on."""

    uid: str
    priority: int
    request: GpuRequest
    snapshot: Snapshot


@dataclass(frozen=True, slots=True)
class Pending:
    """A preemptor's answer, per node, until kube-scheduler nominates one of them."""

    uid: str
    namespace: str
    name: str
    priority: int
    request: GpuRequest
    plans: Mapping[str, Plan]
    at: float


class Preempter:
    """The `preempt` verb and the holds that follow it; see the module docstring."""

    def __init__(
        self,
        sync: LedgerSync,
        request_of: Callable[[Mapping[str, Any]], GpuRequest | None],
        *,
        recorder: recording.Recorder | None = None,
        beyond_offered: bool = True,
        max_nodes: int = 1000,
        max_victims: int = 1000,
        hold_seconds: float = 300.0,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sync = sync
        self.request_of = request_of
        """The pod's GPU request (None: asks for none); raises `AnnotationError`."""
        self.recorder = recorder
        self.beyond_offered = beyond_offered
        self.max_nodes = max_nodes
        """Candidate nodes one call considers, in kube-scheduler's order; the rest are
        left out (`over-limit`)."""
        self.max_victims = max_victims
        """A node offered with more victims than this is left out (`over-limit`)."""
        self.hold_seconds = hold_seconds
        self._clock = clock
        self.pending: OrderedDict[str, Pending] = OrderedDict()
        self._victims: dict[str, str] = {}
        """Victim UID → preemptor UID, for the victims of every pending plan."""
        self.nodes = Counter(
            "gpuplace_preempt_nodes_total",
            "Candidate nodes of kube-scheduler's preemptions: victims narrowed to one GPU "
            "set, kept as offered (GPUs were not short), dropped (no victims free one), "
            "not-needed (the pod fits there with no victims: left out), or over-limit (past "
            "the nodes one call considers, or offered with more victims than a node's "
            "limit: left out).",
            ["result"],
            registry=registry,
        )
        self.holds = Counter(
            "gpuplace_preempt_holds_total",
            "GPUs held for a preemptor once kube-scheduler acted on its preemption.",
            registry=registry,
        )

    # --- the verb ------------------------------------------------------------------------

    def answer(self, args: PreemptionArgs) -> PreemptionResult:
        """`answering(args)` run to its end at once (no other work in between)."""
        steps = self.answering(args)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                result: PreemptionResult = done.value
                return result

    def answering(self, args: PreemptionArgs) -> Generator[None, None, PreemptionResult]:
        """Per candidate node, the victims to evict, as a generator that pauses after each
        node (the extender gives the event loop a turn there, `gpuplace.extender.app`)
        and returns the answer. Nodes where no victims free a GPU set are left out, and
        so are the nodes past `max_nodes` and those offered with more than `max_victims`
        victims.

        The answer is worked out on a `Snapshot` taken before the first node, as if no
        pause came in between: what changes meanwhile changes nothing of it (as with
        any answer, kube-scheduler acts on it a little later). O(offered victims +
        grants + pods of gangs + nodes × (GPUs + search)), each node's search bounded
        by `gpuplace.placement.victim_choice` over at most `max_victims` offered pods
        and the node's own grants."""
        pod = args.pod
        offered = self._within_limits(args.offered())
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid") or "")
        try:
            request = self.request_of(pod)
        except grammar.AnnotationError:
            self.nodes.labels("dropped").inc(len(offered))
            return PreemptionResult()  # filter refused it everywhere: preempt for nothing
        if request is None or request.count == 0:
            return PreemptionResult(nodes=self._as_offered(offered))
        priority = pods.priority_of((pod.get("spec") or {}).get("priority"))
        answer: dict[str, tuple[list[str], int]] = {}
        plans: dict[str, Plan] = {}
        call = Call(uid, priority, request, self._snapshot(offered))
        for node, (victims, violations) in offered.items():
            outcome = self._node(call, node, victims, violations)
            self.nodes.labels(outcome.result).inc()
            if outcome.answered is not None:
                answer[node] = outcome.answered
            if outcome.plan is not None:
                plans[node] = outcome.plan
            yield
        name = str(metadata.get("name") or "")
        namespace = str(metadata.get("namespace") or "default")
        log.info(
            "preemption answered",
            extra={
                "pod": f"{namespace}/{name}",
                "offered_nodes": len(offered),
                "offered_victims": sum(len(v) for v, _ in offered.values()),
                "answered_nodes": len(answer),
                "answered": {
                    node: len(victims)
                    for node, (victims, _) in itertools.islice(answer.items(), LOGGED_NODES)
                },
            },
        )
        if uid and plans:
            self._remember(Pending(uid, namespace, name, priority, request, plans, self._clock()))
        return PreemptionResult(nodes=answer)

    def _snapshot(self, offered: Mapping[str, tuple[list[str], int]]) -> Snapshot:
        """The `Snapshot` of the candidate nodes `offered`. O(grants + offered victims +
        pods of gangs + nodes × GPUs)."""
        ledger, pods_now = self.sync.ledger, self.sync.pods
        states = {}
        for node in offered:
            state = ledger.state(node)
            if state is not None:
                states[node] = state.copy()
        grants = self._grants_on(states.keys())
        records = {}
        for uid in itertools.chain(
            (grant.pod_uid for held in grants.values() for grant in held),
            (victim for victims, _ in offered.values() for victim in victims),
        ):
            record = pods_now.get(uid)
            if record is not None:
                records[uid] = record
        return Snapshot(states, grants, records, self._gangs(records.values()))

    def _node(self, call: Call, node: str, victims: list[str], violations: int) -> Outcome:
        """One node's part of the answer, on the call's snapshot."""
        snapshot, uid = call.snapshot, call.uid
        state = snapshot.states.get(node)
        if state is None:
            return Outcome("dropped")
        own = [grant for grant in snapshot.grants.get(node, ()) if grant.pod_uid == uid]
        if own:  # its own hold there counts as free for it
            state = victim_choice.after(state, [Unit((uid,), tuple(own), (call.priority,))])
        if fit.misfit(state, call.request) is None:
            if not victims:  # it fits as it is: nothing to evict, nothing to answer
                return Outcome("not-needed")
            if self._splits_a_gang(node, victims, snapshot):
                return Outcome("dropped")
            return Outcome("kept", (victims, violations))
        found = self._evict(call, node, state, victims, violations)
        if found is None:
            return Outcome("dropped")
        eviction, extra, kept_offered = found
        chosen = [*eviction.uids, *extra]
        plan = Plan(node, eviction.gpus, tuple(chosen))
        return Outcome("narrowed", (chosen, min(violations, kept_offered)), plan)

    def _within_limits(
        self, offered: dict[str, tuple[list[str], int]]
    ) -> dict[str, tuple[list[str], int]]:
        """The first `max_nodes` nodes of `offered` (in kube-scheduler's order), less
        those offered with more than `max_victims` victims. O(nodes)."""
        kept: dict[str, tuple[list[str], int]] = {}
        for node, found in itertools.islice(offered.items(), self.max_nodes):
            if len(found[0]) <= self.max_victims:
                kept[node] = found
        if len(kept) < len(offered):
            self.nodes.labels("over-limit").inc(len(offered) - len(kept))
            log.info(
                "preemption beyond the limits: nodes left out",
                extra={
                    "offered_nodes": len(offered),
                    "left_out": len(offered) - len(kept),
                    "max_nodes": self.max_nodes,
                    "max_victims": self.max_victims,
                },
            )
        return kept

    def _as_offered(
        self, offered: dict[str, tuple[list[str], int]]
    ) -> dict[str, tuple[list[str], int]]:
        """kube-scheduler's victims as they are (a pod gpuplace places nothing for), less
        the nodes offered with none: an answer with no victims on a node fails
        kube-scheduler's whole preemption. O(nodes)."""
        kept = {node: found for node, found in offered.items() if found[0]}
        self.nodes.labels("kept").inc(len(kept))
        self.nodes.labels("not-needed").inc(len(offered) - len(kept))
        return kept

    def _evict(
        self, call: Call, node: str, state: NodeState, victims: list[str], violations: int
    ) -> tuple[victim_choice.Eviction, list[str], int] | None:
        """The eviction on one node, the offered victims that hold no GPU there, and how
        many of the answer's pods kube-scheduler offered. O(victims + grants on the node
        + the search)."""
        snapshot, uid, request = call.snapshot, call.uid, call.request
        on_node = [grant for grant in snapshot.grants.get(node, ()) if grant.pod_uid != uid]
        holders = {grant.pod_uid for grant in on_node}
        extra = [victim for victim in victims if victim not in holders and victim != uid]
        offered = set(victims)
        units = self._units(node, on_node, offered, None, snapshot)
        eviction = victim_choice.evict(state, request, units, pdb_violations=violations)
        if eviction is None and (self.beyond_offered or not victims):
            wider = self._units(node, on_node, offered, call.priority, snapshot)
            if len(wider) > len(units):
                eviction = victim_choice.evict(state, request, wider, pdb_violations=violations)
        if eviction is None:
            return None
        kept_offered = len(extra) + sum(1 for victim in eviction.uids if victim in offered)
        return eviction, extra, kept_offered

    def _units(
        self,
        node: str,
        grants: list[Grant],
        offered: set[str],
        below: int | None,
        snapshot: Snapshot,
    ) -> list[Unit]:
        """The units that may go on `node`: offered pods, and with `below` also the bound
        pods of lower priority than it. A gang is one unit, or none; a running elastic
        gang also offers each of its extras here alone (`victim_choice.extras`: units
        that share pods are alternatives). O(grants on node + members of their gangs)."""
        by_uid = {grant.pod_uid: grant for grant in grants}
        records, gangs = snapshot.records, snapshot.gangs

        def allowed(record: PodRecord | None) -> bool:
            if record is None or record.node_name != node or record.terminal:
                return False
            return record.uid in offered or (below is not None and record.priority < below)

        def unit(members: list[PodRecord]) -> Unit:
            return Unit(
                tuple(m.uid for m in members),
                tuple(by_uid[m.uid] for m in members if m.uid in by_uid),
                tuple(m.priority for m in members),
                sum(1 for m in members if m.uid not in offered),
            )

        units: list[Unit] = []
        seen: set[str] = set()
        for grant in grants:
            record = records.get(grant.pod_uid)
            if record is None or grant.pod_uid in seen or not allowed(record):
                continue
            members = (
                gangs.get((record.namespace, record.gang), [record]) if record.gang else [record]
            )
            seen.update(member.uid for member in members)
            started = [unit([m]) for m in pods.started(members)]
            spares = [
                spare
                for spare in victim_choice.extras(started, record.minimum)
                if spare.grants and allowed(records.get(spare.uids[0]))
            ]
            units.extend(spares)
            if all(allowed(member) for member in members):
                units.append(victim_choice.whole(unit(members), spares))
        return units

    @staticmethod
    def _splits_a_gang(node: str, victims: list[str], snapshot: Snapshot) -> bool:
        """Whether evicting `victims` on `node` would leave part of a running gang: one
        of them is a gang member whose live mates are not all among them, on that node,
        unless all of that gang's among them are extras of an elastic gang
        (`gpuplace.placement.elastic.extras`: it keeps `gang-min` members at least).
        O(victims + members of their gangs)."""
        chosen = set(victims)
        seen: set[tuple[str, str]] = set()
        for uid in victims:
            record = snapshot.records.get(uid)
            if record is None or not record.gang or (record.namespace, record.gang) in seen:
                continue
            seen.add((record.namespace, record.gang))
            mates = snapshot.gangs.get((record.namespace, record.gang), [record])
            if all(m.uid in chosen and m.node_name == node for m in mates):
                continue
            spares = {m.uid for m in elastic.extras(pods.started(mates), record.minimum)}
            if not spares.issuperset(m.uid for m in mates if m.uid in chosen):
                return True
        return False

    def _grants_on(self, nodes: Any) -> dict[str, list[Grant]]:
        """The ledger's grants on `nodes`, by node. O(grants): preemption is rare."""
        wanted = set(nodes)
        found: dict[str, list[Grant]] = {}
        for grant in self.sync.ledger:
            if grant.node in wanted:
                found.setdefault(grant.node, []).append(grant)
        return found

    def _gangs(self, among: Iterable[PodRecord]) -> dict[tuple[str, str], list[PodRecord]]:
        """The live members of every gang with a member `among` these pods. O(pods) when
        there is one, else O(among)."""
        wanted = {(record.namespace, record.gang) for record in among if record.gang}
        members: dict[tuple[str, str], list[PodRecord]] = {key: [] for key in wanted}
        if wanted:
            for record in self.sync.pods.values():
                key = (record.namespace, record.gang)
                if record.gang and key in members and not record.terminal:
                    members[key].append(record)
        return members

    def _remember(self, pending: Pending) -> None:
        self._forget(pending.uid)
        self.pending[pending.uid] = pending
        for plan in pending.plans.values():
            for victim in plan.victims:
                self._victims[victim] = pending.uid
        while len(self.pending) > PENDING_KEPT:
            self._forget(next(iter(self.pending)))

    def _forget(self, uid: str) -> Pending | None:
        gone = self.pending.pop(uid, None)
        if gone is not None:
            for plan in gone.plans.values():
                for victim in plan.victims:
                    if self._victims.get(victim) == uid:
                        del self._victims[victim]
        return gone

    # --- acting on kube-scheduler's choice -----------------------------------------------

    def observe(self, old: PodRecord | None, new: PodRecord | None) -> None:
        """A pod listener of `LedgerSync`: holds the preemptor's GPUs once its preemption is
        under way (nominated there, or a victim there terminating); lets go of a plan once
        its pod is bound or gone, or nominated elsewhere. O(1) per event, O(victims) when
        a hold is taken."""
        if new is None:
            if old is not None:
                self._victim_going(old.uid)  # deleted at once (no grace period)
                self._forget(old.uid)
            return
        pending = self.pending.get(new.uid)
        if pending is not None:
            if new.bound or new.terminal:
                self._forget(new.uid)
            elif new.nominated and new.nominated in pending.plans:
                self._hold(pending, pending.plans[new.nominated])
            elif old is not None and old.nominated and not new.nominated:
                self._release(pending)
            return
        if new.deleting and (old is None or not old.deleting):
            self._victim_going(new.uid)

    def _victim_going(self, uid: str) -> None:
        """A victim of a pending plan started terminating (or is gone): kube-scheduler
        acts on that plan, so its GPUs are held for the preemptor now. O(plans)."""
        preemptor = self._victims.get(uid)
        found = self.pending.get(preemptor) if preemptor is not None else None
        if found is not None:
            plan = next((p for p in found.plans.values() if uid in p.victims), None)
            if plan is not None:
                self._hold(found, plan)

    def _hold(self, pending: Pending, plan: Plan) -> None:
        held = self.sync.hold_of(pending.uid)
        if held is not None and held.grant.node == plan.node and held.grant.gpus == plan.gpus:
            return
        if held is not None and held.owner == OWNER:
            self.sync.unhold(pending.uid)
        elif held is not None or self.sync.ledger.get(pending.uid) is not None:
            return  # a bind or gang plan of its own: that one stands
        grant = choosing.grant_for(pending.uid, Choice(plan.node, plan.gpus, 0.0), pending.request)
        try:
            self.sync.hold(grant, seconds=self.hold_seconds, owner=OWNER, overcommit=True)
        except LedgerError as error:
            log.warning("preemption hold refused", extra={"uid": pending.uid, "why": str(error)})
            return
        self.holds.inc()
        self._announce(pending, plan)

    def _release(self, pending: Pending) -> None:
        held = self.sync.hold_of(pending.uid)
        if held is not None and held.owner == OWNER:
            self.sync.unhold(pending.uid)

    def _announce(self, pending: Pending, plan: Plan) -> None:
        gpus = ",".join(map(str, plan.gpus))
        where = f"GPU{'s' if len(plan.gpus) > 1 else ''} {gpus} of node {plan.node}"
        names = []
        for victim in plan.victims:
            record = self.sync.pods.get(victim)
            names.append(str(record) if record is not None else victim)
        log.info(
            "preemption under way",
            extra={
                "pod": f"{pending.namespace}/{pending.name}",
                "node": plan.node,
                "gpus": list(plan.gpus),
                "victims": names,
            },
        )
        if self.recorder is None:
            return
        wants = requests.describe(pending.request)
        self.recorder.emit(
            recording.Subject(pending.namespace, pending.name, pending.uid),
            recording.NORMAL,
            recording.PREEMPTION,
            f"{where} is being freed for this pod ({wants}) by preempting "
            f"{', '.join(names)}; held for it until they have terminated",
        )
        for victim in plan.victims:
            record = self.sync.pods.get(victim)
            if record is None:
                continue
            self.recorder.emit(
                recording.Subject(record.namespace, record.name, record.uid),
                recording.NORMAL,
                recording.PREEMPTED,
                f"preempted to free {where} for {pending.namespace}/{pending.name} "
                f"(priority {pending.priority}, {wants})",
            )
