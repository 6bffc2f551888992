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
  victim (kube-scheduler evicts only on the one node it nominates);
- never a pod gpuplace holds GPUs for but that is not bound there (a reservation), nor
  the preemptor itself.

Where the preemptor already fits the node's GPUs, kube-scheduler's victims stand
unchanged, unless they would split a running gang: then the node is left out. A node
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

Synchronous: no await between reading the ledger and answering or holding.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gpuplace.cluster import annotations as grammar
from gpuplace.cluster import pods, recording
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender.preempt_wire import PreemptionArgs, PreemptionResult
from gpuplace.placement import choosing, fit, requests, victim_choice
from gpuplace.placement.choosing import Choice
from gpuplace.placement.ledger import Grant, LedgerError, NodeState
from gpuplace.placement.requests import GpuRequest
from gpuplace.placement.victim_choice import Unit

log = logging.getLogger(__name__)

PENDING_KEPT = 256
"""Preemptors whose answers are kept until kube-scheduler acts on one (oldest dropped)."""
OWNER = "preemption"


@dataclass(frozen=True, slots=True)
class Plan:
    """One node of an answer: evict `victims`, then the preemptor takes `gpus`."""

    node: str
    gpus: tuple[int, ...]
    victims: tuple[str, ...]


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
        hold_seconds: float = 300.0,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sync = sync
        self.request_of = request_of
        """The pod's GPU request (None: asks for none); raises `AnnotationError`."""
        self.recorder = recorder
        self.beyond_offered = beyond_offered
        self.hold_seconds = hold_seconds
        self._clock = clock
        self.pending: OrderedDict[str, Pending] = OrderedDict()
        self._victims: dict[str, str] = {}
        """Victim UID → preemptor UID, for the victims of every pending plan."""
        self.nodes = Counter(
            "gpuplace_preempt_nodes_total",
            "Candidate nodes of kube-scheduler's preemptions: victims narrowed to one GPU "
            "set, kept as offered (GPUs were not short), dropped (no victims free one), or "
            "not-needed (the pod fits there with no victims: left out).",
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
        """Per candidate node, the victims to evict; nodes where none free a GPU set are
        left out. O(grants + candidates × search), see `gpuplace.placement.victim_choice`."""
        pod = args.pod
        offered = args.offered()
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
        grants = self._grants_on(offered.keys())
        gangs = self._gangs(grants)
        answer: dict[str, tuple[list[str], int]] = {}
        plans: dict[str, Plan] = {}
        for node, (victims, violations) in offered.items():
            state = self.sync.ledger.state(node)
            if state is None:
                self.nodes.labels("dropped").inc()
                continue
            own = [grant for grant in grants.get(node, ()) if grant.pod_uid == uid]
            if own:  # its own hold there counts as free for it
                state = victim_choice.after(state, [Unit((uid,), tuple(own), (priority,))])
            if fit.misfit(state, request) is None:
                if not victims:  # it fits as it is: nothing to evict, nothing to answer
                    self.nodes.labels("not-needed").inc()
                    continue
                if self._splits_a_gang(node, victims, gangs):
                    self.nodes.labels("dropped").inc()
                    continue
                self.nodes.labels("kept").inc()
                answer[node] = (victims, violations)
                continue
            found = self._evict(
                node,
                state,
                request,
                uid=uid,
                priority=priority,
                victims=victims,
                violations=violations,
                grants=grants,
                gangs=gangs,
            )
            if found is None:
                self.nodes.labels("dropped").inc()
                continue
            eviction, extra = found
            chosen = [*eviction.uids, *extra]
            answer[node] = (chosen, min(violations, sum(1 for v in chosen if v in victims)))
            plans[node] = Plan(node, eviction.gpus, tuple(chosen))
            self.nodes.labels("narrowed").inc()
        name = str(metadata.get("name") or "")
        namespace = str(metadata.get("namespace") or "default")
        log.info(
            "preemption answered",
            extra={
                "pod": f"{namespace}/{name}",
                "offered": {node: len(v) for node, (v, _) in offered.items()},
                "answered": {node: plan.victims for node, plan in plans.items()},
            },
        )
        if uid and plans:
            self._remember(Pending(uid, namespace, name, priority, request, plans, self._clock()))
        return PreemptionResult(nodes=answer)

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
        self,
        node: str,
        state: NodeState,
        request: GpuRequest,
        *,
        uid: str,
        priority: int,
        victims: list[str],
        violations: int,
        grants: Mapping[str, list[Grant]],
        gangs: Mapping[tuple[str, str], list[PodRecord]],
    ) -> tuple[victim_choice.Eviction, list[str]] | None:
        """The eviction on one node and the offered victims that hold no GPU there."""
        on_node = [grant for grant in grants.get(node, ()) if grant.pod_uid != uid]
        holders = {grant.pod_uid for grant in on_node}
        extra = [victim for victim in victims if victim not in holders and victim != uid]
        offered = set(victims)
        units = self._units(node, on_node, offered, None, gangs)
        eviction = victim_choice.evict(state, request, units, pdb_violations=violations)
        if eviction is None and (self.beyond_offered or not victims):
            wider = self._units(node, on_node, offered, priority, gangs)
            if len(wider) > len(units):
                eviction = victim_choice.evict(state, request, wider, pdb_violations=violations)
        return None if eviction is None else (eviction, extra)

    def _units(
        self,
        node: str,
        grants: list[Grant],
        offered: set[str],
        below: int | None,
        gangs: Mapping[tuple[str, str], list[PodRecord]],
    ) -> list[Unit]:
        """The units that may go on `node`: offered pods, and with `below` also the bound
        pods of lower priority than it. A gang is one unit, or none. O(grants on node)."""
        by_uid = {grant.pod_uid: grant for grant in grants}
        records = self.sync.pods

        def allowed(record: PodRecord | None) -> bool:
            if record is None or record.node_name != node or record.terminal:
                return False
            return record.uid in offered or (below is not None and record.priority < below)

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
            if not all(allowed(member) for member in members):
                continue
            held = tuple(by_uid[m.uid] for m in members if m.uid in by_uid)
            units.append(
                Unit(
                    tuple(m.uid for m in members),
                    held,
                    tuple(m.priority for m in members),
                    sum(1 for m in members if m.uid not in offered),
                )
            )
        return units

    def _splits_a_gang(
        self, node: str, victims: list[str], gangs: Mapping[tuple[str, str], list[PodRecord]]
    ) -> bool:
        """Whether evicting `victims` on `node` would leave part of a running gang: one
        of them is a gang member whose live mates are not all among them, on that node.
        O(victims × gang size)."""
        chosen = set(victims)
        for uid in victims:
            record = self.sync.pods.get(uid)
            if record is None or not record.gang:
                continue
            mates = gangs.get((record.namespace, record.gang), [record])
            if any(m.uid not in chosen or m.node_name != node for m in mates):
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

    def _gangs(self, grants: Mapping[str, list[Grant]]) -> dict[tuple[str, str], list[PodRecord]]:
        """The live members of every gang with a member among `grants`. O(pods) when
        there is one, else O(grants on the nodes)."""
        records = self.sync.pods
        wanted = set()
        for held in grants.values():
            for grant in held:
                record = records.get(grant.pod_uid)
                if record is not None and record.gang:
                    wanted.add((record.namespace, record.gang))
        members: dict[tuple[str, str], list[PodRecord]] = {key: [] for key in wanted}
        if wanted:
            for record in records.values():
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
