"""The ledger, kept equal to what the API says.

`LedgerSync` is the handler of both informers. Nodes: an enabled, readable node is in
the ledger's inventory (closed to new GPU pods while its node agent is silent:
`check_agents`, which the sidecar calls every few seconds); anything else is not.
Pods: a managed pod's grant is exactly what its assignment annotations say
(`gpuplace.cluster.assignments`), CONFIRMED once it is bound to that node, RESERVED before;
a Succeeded, Failed or deleted pod holds nothing. ResourceClaims (the sidecar's third
informer, on the DRA path: `gpuplace.cluster.claims`): an allocated claim holds exactly
what its `status.allocation` says of gpuplace's GPUs, until it is deallocated or deleted
(kube-scheduler counts it until then too), under its pod's UID for a claim gpuplace made
(its annotations, if a plan wrote any, then count no more: the claim is what the GPU
really gives) and under `claim:<UID>` for any other. So grants made through claims and
through the extender are one ledger: a GPU one holds is never offered by the other.
A relist rebuilds the ledger from scratch (`Ledger.restore`), so the live ledger and
one rebuilt after a restart are the same function of the API's state: equal
`Ledger.snapshot()`s (nodes, pods and claims alike).

The one thing the API does not hold yet is a *hold*: a grant reserved in memory for
a pod before its annotations are written (a bind in flight) or by a planner (the gang
controller). A hold serves only its pod, survives pod events that carry no
assignment, yields to the pod's annotations as soon as they appear, and expires at its
deadline (`expired_holds`, for the reaper). Everything here is synchronous: the event
loop makes each method atomic, so decide-and-reserve needs no lock if it does not
await in between.

Also collected here, because only the pod stream sees them: the GPU requests of the
managed pods that arrived most recently (`requests`), from which the extender builds
the typical workload, and the request shapes of the pods waiting for a node
(`pending`), which the extender scores ahead of kube-scheduler's calls for them, and
how many managed GPU pods are not bound yet and why (`unbound`, for
`gpuplace_pending_pods`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import assignments, claims, nodes
from gpuplace.cluster.claims import ClaimRecord
from gpuplace.cluster.nodes import NodeRecord
from gpuplace.cluster.pods import PodRecord
from gpuplace.placement.choosing import scoring_shape
from gpuplace.placement.inventory import Inventory, Node
from gpuplace.placement.ledger import Grant, GrantState, Ledger, LedgerError
from gpuplace.placement.requests import GpuRequest

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 10_000

GATED = "gated"
UNREADABLE = "unreadable"
RESERVED = "reserved"
UNSCHEDULABLE = "unschedulable"
WAITING = "waiting"
PENDING_REASONS = (GATED, UNREADABLE, RESERVED, UNSCHEDULABLE, WAITING)
"""Why a managed GPU pod is not bound yet, one reason per pod, the first that holds:
a scheduling gate is set (a gang waiting to be complete or to fit: kube-scheduler does
not see it); its annotations cannot be read (gpuplace cannot place it); GPUs are
reserved for it (a bind in flight, a gang's plan, a preemptor's hold); kube-scheduler's
last try found no node (condition PodScheduled=False/Unschedulable); else it waits for
kube-scheduler."""


PLANNED = "plan"
"""The owner of a hold the planner took (`gpuplace.planning`): the grant it chose for a pod
it handed its node. Unlike a bind's or a gang plan's, it is the engine's preference, not
a promise: kube-scheduler may find that node unusable, and the extender's filter then
drops the hold and chooses again (`gpuplace.extender.deciding`)."""


@dataclass(frozen=True, slots=True)
class Hold:
    """A grant reserved in memory only, until `deadline` (monotonic seconds)."""

    grant: Grant
    deadline: float
    owner: str


class LedgerSync:
    """Ledger + the informers' view of nodes and managed pods; see the module docstring."""

    def __init__(
        self,
        *,
        window: int = DEFAULT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
        agent_silence: float = nodes.DEFAULT_AGENT_SILENCE,
        require_agent: bool = False,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`agent_silence`: seconds after a node agent's last heartbeat that its node
        takes no new GPU pods (0: never); `require_agent`: nodes no agent ever reported
        on take none either; `wall`: the clock heartbeats are read against."""
        self.agent_silence = agent_silence
        self.require_agent = require_agent
        self._wall = wall
        self.ledger = Ledger(Inventory())
        self.nodes: dict[str, NodeRecord] = {}
        """Every node the node informer has, by name (gpuplace's or not)."""
        self.pods: dict[str, PodRecord] = {}
        """Every managed pod, by UID."""
        self.pods_version = 0
        """Grows whenever a pod arrives, goes, or changes what victim selection reads of
        it (node, phase, deletion, priority, gang, whether it holds a grant): the ledger's
        generation misses some of these (a Binding only confirms a grant)."""
        self._names: dict[tuple[str, str], str] = {}
        self._holds: dict[str, Hold] = {}
        self.busy: set[str] = set()
        """UIDs of pods with a bind in flight: the reaper leaves them alone."""
        self.requests: deque[GpuRequest] = deque(maxlen=window)
        """GPU requests of the most recently arrived managed pods (the typical workload)."""
        self.requests_version = 0
        """Grows whenever `requests` changes."""
        self.pending: Counter[GpuRequest] = Counter()
        """Per scoring shape (`gpuplace.placement.choosing.scoring_shape`), how many managed pods
        ask for it and wait for kube-scheduler to place them: not bound, not finished,
        not being deleted, not gated (a gang's pods get their grants before their gates
        go), and holding no grant."""
        self._waiting: dict[str, GpuRequest] = {}
        """The scoring shape of each waiting pod, by UID (what `pending` counts)."""
        self.unbound: Counter[str] = Counter()
        """Managed GPU pods not bound, not finished and not being deleted, by reason
        (`PENDING_REASONS`); `waiting` + `unschedulable` are the pods `pending` counts."""
        self._reasons: dict[str, str] = {}
        """The reason of each pod `unbound` counts, by UID."""
        self._unbound: set[str] = set()
        """UIDs of the pods annotated with a grant and neither bound nor finished (what
        `stale` looks among: a handful, where `pods` can hold 100,000)."""
        self.stamps = assignments.Stamps()
        """The times every writer of grants in this process stamps `assigned-at` with
        (queue admissions, gang plans, binds): after every one the pods show, so the
        order of admissions survives a restart (`gpuplace.cluster.assignments.Stamps`)."""
        self.ready = asyncio.Event()
        """Set by the composition once both informers have synced."""
        self.node_listeners: list[Callable[[NodeRecord], None]] = []
        self.pod_listeners: list[Callable[[PodRecord | None, PodRecord | None], None]] = []
        """Called with (old, new) after each pod change; new is None on delete."""
        self.claims: dict[str, ClaimRecord] = {}
        """Every ResourceClaim the claim informer has, by UID (empty without it)."""
        self._claim_names: dict[tuple[str, str], str] = {}
        self._claim_keys: dict[str, tuple[str, ...]] = {}
        """Claim UID → the ledger keys its grants are under."""
        self._claimed: dict[str, str] = {}
        """Pod UID → the UID of the claim gpuplace made for it whose grant it holds: the
        claim, not the pod's annotations, says what that pod holds."""
        self._claims_on: dict[str, set[str]] = {}
        """Node → UIDs of the claims holding GPUs there."""
        self.claim_listeners: list[Callable[[ClaimRecord | None, ClaimRecord | None], None]] = []
        """Called with (old, new) after each claim change; new is None on delete."""
        self._clock = clock
        self.nodes_handler = _Nodes(self)
        self.pods_handler = _Pods(self)
        self.claims_handler = _Claims(self)

    # --- reading -------------------------------------------------------------------

    def pod(self, namespace: str, name: str) -> PodRecord | None:
        uid = self._names.get((namespace, name))
        return self.pods.get(uid) if uid is not None else None

    def claim(self, namespace: str, name: str) -> ClaimRecord | None:
        """The ResourceClaim `namespace/name`, if the claim informer has it."""
        uid = self._claim_names.get((namespace, name))
        return self.claims.get(uid) if uid is not None else None

    def claim_of(self, record: PodRecord) -> ClaimRecord | None:
        """The claim gpuplace made for a pod on the DRA path (None: none, or not seen)."""
        return self.claim(record.namespace, record.claim) if record.claim else None

    def hold_of(self, uid: str) -> Hold | None:
        return self._holds.get(uid)

    def holds(self) -> list[Hold]:
        return list(self._holds.values())

    # --- holds ---------------------------------------------------------------------

    def hold(
        self, grant: Grant, *, seconds: float, owner: str = "bind", overcommit: bool = False
    ) -> bool:
        """Reserve `grant` in memory for `seconds`. Returns False when the pod already held
        exactly it. Raises `gpuplace.placement.ledger.LedgerError` (Oversubscribed, Conflict).
        `overcommit`: take it even where the node lacks room (a preemptor's GPUs, still
        held by the pods being preempted: nobody else may take them as they go)."""
        taken = self.ledger.reserve(grant, overcommit=overcommit)
        if taken or grant.pod_uid in self._holds:
            self._holds[grant.pod_uid] = Hold(grant, self._clock() + seconds, owner)
        self._track_waiting(grant.pod_uid, self.pods.get(grant.pod_uid))
        return taken

    def unhold(self, uid: str) -> Grant | None:
        """Drop a hold that the API does not back yet; returns the released grant."""
        if self._holds.pop(uid, None) is None:
            return None
        released = self.ledger.release(uid)
        self._track_waiting(uid, self.pods.get(uid))
        return released

    def confirm(self, uid: str) -> None:
        """The pod is bound: its grant is CONFIRMED (before the informer says so)."""
        self._holds.pop(uid, None)
        if uid in self.ledger:
            self.ledger.confirm(uid)

    def expired_holds(self) -> list[Hold]:
        now = self._clock()
        return [
            hold
            for uid, hold in self._holds.items()
            if hold.deadline <= now and uid not in self.busy
        ]

    def stale(self, before: float) -> list[PodRecord]:
        """Annotated pods still unbound whose assignment is older than `before` (POSIX
        seconds) and that no bind is working on: the reaper's candidates. Gated pods
        belong to the gang controller and are left out. O(annotated unbound pods)."""
        found = (self.pods[uid] for uid in self._unbound)
        return [
            record
            for record in found
            if not record.gated
            and record.uid not in self.busy
            and (record.assigned_at is None or record.assigned_at < before)
        ]

    # --- nodes ---------------------------------------------------------------------

    def _effective(self, record: NodeRecord) -> Node | None:
        return nodes.effective(
            record, self._wall(), silence=self.agent_silence, require_agent=self.require_agent
        )

    def put_node(self, record: NodeRecord) -> None:
        self.nodes[record.name] = record
        current = self.ledger.inventory.get(record.name)
        node = self._effective(record)
        if node is None:
            if current is not None:
                log.info("node left gpuplace", extra={"node": record.name})
                self.ledger.remove_node(record.name)
        elif current is not None and current == node and current.labels != node.labels:
            # labels are not part of a Node's equality (nothing the ledger counts), but the
            # gang and queue planners read them (node affinity, topology domains) and the
            # webhook (the DRA label): swapped in without a new generation, so the scoring
            # caches keep what they hold
            self.ledger.relabel(node)
        elif current is None or current != node:
            self._closing(current, node)
            self.ledger.put_node(node)
            for uid in list(self._claims_on.get(record.name, ())):
                self._hold_claim(self.claims[uid])  # its GPUs' CUDA contexts may differ
        for listener in self.node_listeners:
            listener(record)

    @staticmethod
    def _closing(current: Node | None, node: Node) -> None:
        was = current.closed if current is not None else ""
        if node.closed and node.closed != was:
            log.warning(
                "node closed to new GPU pods", extra={"node": node.name, "why": node.closed}
            )
        elif was and not node.closed:
            log.info("node open to new GPU pods again", extra={"node": node.name})

    def check_agents(self) -> list[str]:
        """Close the nodes whose agent fell silent since their last event, reopen those it
        came back on (a heartbeat arrives as a node event: `put_node`); returns their
        names. Pods on them keep their grants. O(nodes)."""
        changed = []
        inventory = self.ledger.inventory
        for record in self.nodes.values():
            if record.node is None or (record.heartbeat is None and not self.require_agent):
                continue
            node = self._effective(record)
            current = inventory.get(record.name)
            if node is not None and current is not None and current.closed != node.closed:
                self._closing(current, node)
                self.ledger.put_node(node)
                changed.append(record.name)
        return changed

    def drop_node(self, name: str) -> None:
        self.nodes.pop(name, None)
        if name in self.ledger.inventory:
            self.ledger.remove_node(name)

    def replace_nodes(self, records: Iterable[NodeRecord]) -> None:
        fresh = {record.name: record for record in records}
        for name in [name for name in self.nodes if name not in fresh]:
            self.drop_node(name)
        for record in fresh.values():
            self.put_node(record)

    # --- pods ----------------------------------------------------------------------

    def _arrived(self, record: PodRecord) -> None:
        if record.request is not None and record.request.count and not record.terminal:
            self.requests.append(record.request)
            self.requests_version += 1

    def _track_waiting(self, uid: str, record: PodRecord | None) -> None:
        """Keep `pending` equal to the waiting pods' shapes, and `unbound` to the
        unbound pods' reasons, after `uid` changed to `record` (None: gone). O(1)."""
        shape = self._waiting.pop(uid, None)
        if shape is not None:
            _decrement(self.pending, shape)
        reason = self._reasons.pop(uid, None)
        if reason is not None:
            _decrement(self.unbound, reason)
        reason = self._unbound_reason(uid, record)
        if reason is None:
            return
        self._reasons[uid] = reason
        self.unbound[reason] += 1
        if (
            reason in (WAITING, UNSCHEDULABLE)
            and record
            and record.request is not None
            and not record.claim  # kube-scheduler's DRA allocator places it, not the extender
        ):
            shape = scoring_shape(record.request)
            self._waiting[uid] = shape
            self.pending[shape] += 1

    def _unbound_reason(self, uid: str, record: PodRecord | None) -> str | None:
        """Why `record` (a managed pod) is not bound (`PENDING_REASONS`), or None: bound,
        finished, being deleted, gone, or asking for no GPU. O(1)."""
        if record is None or record.node_name or record.terminal or record.deleting:
            return None
        request = record.request
        if (request is None and not record.problem) or (request is not None and not request.count):
            return None
        if record.gated:
            return GATED
        if request is None:
            return UNREADABLE
        if self.ledger.get(uid) is not None:
            return RESERVED
        return UNSCHEDULABLE if record.unschedulable else WAITING

    def _track_unbound(self, record: PodRecord) -> None:
        """Keep `_unbound` right after `record` changed. O(1)."""
        if record.grant is not None and not record.bound and not record.terminal:
            self._unbound.add(record.uid)
        else:
            self._unbound.discard(record.uid)

    def upsert_pod(self, record: PodRecord) -> None:
        old = self.pods.get(record.uid)
        if old is None or _standing(old) != _standing(record):
            self.pods_version += 1
        if old is None:
            self._arrived(record)
        self.pods[record.uid] = record
        self._names[record.key] = record.uid
        self.stamps.seen(record.assigned_at)
        self._reconcile(record)
        self._track_waiting(record.uid, record)
        self._track_unbound(record)
        for listener in self.pod_listeners:
            listener(old, record)

    def delete_pod(self, record: PodRecord) -> None:
        old = self.pods.pop(record.uid, None)
        self.pods_version += 1
        if self._names.get(record.key) == record.uid:
            del self._names[record.key]
        self._holds.pop(record.uid, None)
        if record.uid not in self._claimed:  # its claim holds until it is deleted
            self.ledger.release(record.uid)
        self._track_waiting(record.uid, None)
        self._unbound.discard(record.uid)
        for listener in self.pod_listeners:
            listener(old or record, None)

    def _reconcile(self, record: PodRecord) -> None:
        uid = record.uid
        if uid in self._claimed:
            self._holds.pop(uid, None)  # its claim says what it holds
            return
        held = self.ledger.get(uid)
        if record.terminal:
            self._holds.pop(uid, None)
            if held is not None:
                self.ledger.release(uid)
            return
        desired = record.grant
        if desired is None:
            if uid not in self._holds and held is not None:
                self.ledger.release(uid)
            return
        self._holds.pop(uid, None)
        if held is None:
            self.ledger.reserve(desired, overcommit=True)
        elif held.same_hold(desired):
            if desired.state is GrantState.CONFIRMED and held.state is GrantState.RESERVED:
                self.ledger.confirm(uid)
        else:
            self.ledger.release(uid)
            self.ledger.reserve(desired, overcommit=True)

    def replace_pods(self, records: Iterable[PodRecord]) -> None:
        fresh = {record.uid: record for record in records}
        old = self.pods
        self.pods = fresh
        self.pods_version += 1
        self._names = {record.key: uid for uid, record in fresh.items()}
        self._holds = {
            uid: hold
            for uid, hold in self._holds.items()
            if (
                uid in fresh
                and not fresh[uid].terminal
                and fresh[uid].grant is None
                and uid not in self._claimed
            )
            or (uid not in fresh and uid in self.busy)  # a bind in flight for a newer pod
        }
        self._restore()
        self.requests.clear()
        self.pending.clear()
        self._waiting.clear()
        self.unbound.clear()
        self._reasons.clear()
        self._unbound.clear()
        for record in fresh.values():
            self.stamps.seen(record.assigned_at)
            self._arrived(record)
            self._track_waiting(record.uid, record)
            self._track_unbound(record)
        for listener in self.pod_listeners:
            for uid, record in fresh.items():
                listener(old.get(uid), record)
            for uid, gone in old.items():
                if uid not in fresh:
                    listener(gone, None)

    def _restore(self) -> None:
        """Rebuild the ledger from the pods' grants, the holds and the claims' grants.
        O(pods + claims)."""
        grants = [
            record.grant
            for record in self.pods.values()
            if record.grant is not None and not record.terminal and record.uid not in self._claimed
        ]
        grants.extend(hold.grant for hold in self._holds.values())
        for uid, keys in self._claim_keys.items():
            for grant in self._claim_grants(self.claims[uid]):
                if grant.pod_uid in keys:
                    grants.append(grant)
        self.ledger.restore(grants)

    # --- claims ------------------------------------------------------------------

    def _claim_grants(self, record: ClaimRecord) -> list[Grant]:
        node = self.ledger.inventory.get(record.node) if record.node else None
        return claims.grants(record, node, bound=bool(record.reserved))

    def _keys_for(self, record: ClaimRecord) -> tuple[str, ...]:
        """The keys `record`'s grants go under: all of them, but a pod's UID another
        claim made for that pod already holds (two such claims: the second is not
        counted, and said so). O(its grants)."""
        keys = []
        for grant in self._claim_grants(record):
            holder = self._claimed.get(grant.pod_uid)
            if holder is not None and holder != record.uid:
                log.warning(
                    "a second claim made for one pod is not counted",
                    extra={"claim": str(record), "pod": grant.pod_uid},
                )
                continue
            keys.append(grant.pod_uid)
        return tuple(keys)

    def _note_keys(self, record: ClaimRecord, keys: tuple[str, ...]) -> None:
        if not keys:
            return
        self._claim_keys[record.uid] = keys
        self._claims_on.setdefault(record.node, set()).add(record.uid)
        if record.managed and record.owner in keys:
            self._claimed[record.owner] = record.uid

    def _release_claim(self, uid: str) -> None:
        """Give back what a claim held. O(its grants)."""
        for key in self._claim_keys.pop(uid, ()):
            self.ledger.release(key)
            if self._claimed.get(key) == uid:
                del self._claimed[key]
        for members in self._claims_on.values():
            members.discard(uid)

    def _hold_claim(self, record: ClaimRecord) -> None:
        """Take what `record` holds under its keys, releasing what those keys held before
        (a pod's planned grant, or a hold, yields to its claim). O(its grants)."""
        self._release_claim(record.uid)
        keys = self._keys_for(record)
        taken = []
        for grant in self._claim_grants(record):
            if grant.pod_uid not in keys:
                continue
            self._holds.pop(grant.pod_uid, None)
            self.ledger.release(grant.pod_uid)
            try:
                self.ledger.reserve(grant, overcommit=True)
            except LedgerError as error:
                log.warning("claim not counted", extra={"claim": str(record), "why": str(error)})
                continue
            taken.append(grant.pod_uid)
        self._note_keys(record, tuple(taken))

    def _owner_changed(self, *records: ClaimRecord | None) -> None:
        """The pods gpuplace made these claims for: their own grant back where no claim
        holds for them any more, their waiting reason anew. O(1)."""
        for record in records:
            pod = self.pods.get(record.owner) if record is not None and record.managed else None
            if pod is None:
                continue
            self._reconcile(pod)
            self._track_waiting(pod.uid, pod)
            self._track_unbound(pod)
            self.pods_version += 1

    def put_claim(self, record: ClaimRecord) -> None:
        old = self.claims.get(record.uid)
        self.claims[record.uid] = record
        self._claim_names[(record.namespace, record.name)] = record.uid
        self._hold_claim(record)
        self._owner_changed(old, record)
        for listener in self.claim_listeners:
            listener(old, record)

    def drop_claim(self, record: ClaimRecord) -> None:
        old = self.claims.pop(record.uid, None) or record
        if self._claim_names.get((record.namespace, record.name)) == record.uid:
            del self._claim_names[(record.namespace, record.name)]
        self._release_claim(record.uid)
        self._owner_changed(old)
        for listener in self.claim_listeners:
            listener(old, None)

    def replace_claims(self, records: Iterable[ClaimRecord]) -> None:
        old = self.claims
        self.claims = {record.uid: record for record in records}
        self._claim_names = {(r.namespace, r.name): uid for uid, r in self.claims.items()}
        self._claim_keys.clear()
        self._claimed.clear()
        self._claims_on.clear()
        for record in sorted(self.claims.values(), key=lambda r: (r.namespace, r.name)):
            self._note_keys(record, self._keys_for(record))
        self._holds = {uid: hold for uid, hold in self._holds.items() if uid not in self._claimed}
        self.pods_version += 1
        self._restore()
        for pod in self.pods.values():
            self._track_waiting(pod.uid, pod)
            self._track_unbound(pod)
        for listener in self.claim_listeners:
            for uid, record in self.claims.items():
                listener(old.get(uid), record)
            for uid, gone in old.items():
                if uid not in self.claims:
                    listener(gone, None)


def _standing(record: PodRecord) -> tuple[object, ...]:
    """What `pods_version` follows of a pod."""
    return (
        record.node_name,
        record.phase,
        record.deleting,
        record.priority,
        record.gang,
        record.grant is not None,
    )


def _decrement(counter: Counter[Any], key: object) -> None:
    """One less of `key`, dropping it at zero. O(1)."""
    left = counter[key] - 1
    if left > 0:
        counter[key] = left
    else:
        del counter[key]


class _Nodes:
    """The node informer's handler."""

    def __init__(self, sync: LedgerSync) -> None:
        self._sync = sync

    def replace(self, objects: list[NodeRecord]) -> None:
        self._sync.replace_nodes(objects)

    def upsert(self, obj: NodeRecord) -> None:
        self._sync.put_node(obj)

    def delete(self, obj: NodeRecord) -> None:
        self._sync.drop_node(obj.name)


class _Claims:
    """The ResourceClaim informer's handler."""

    def __init__(self, sync: LedgerSync) -> None:
        self._sync = sync

    def replace(self, objects: list[ClaimRecord]) -> None:
        self._sync.replace_claims(objects)

    def upsert(self, obj: ClaimRecord) -> None:
        self._sync.put_claim(obj)

    def delete(self, obj: ClaimRecord) -> None:
        self._sync.drop_claim(obj)


class _Pods:
    """The pod informer's handler."""

    def __init__(self, sync: LedgerSync) -> None:
        self._sync = sync

    def replace(self, objects: list[PodRecord]) -> None:
        self._sync.replace_pods(objects)

    def upsert(self, obj: PodRecord) -> None:
        self._sync.upsert_pod(obj)

    def delete(self, obj: PodRecord) -> None:
        self._sync.delete_pod(obj)
