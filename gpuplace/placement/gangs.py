"""All-or-nothing placement of a gang: every member gets GPUs, or none does.

`plan(ledger, policy, members)` places N member requests at once on a *scratch copy*
of the nodes it touches (cloned `NodeState`s; the ledger itself is never written), so
a plan that fails leaves nothing behind: the ledger's grants, free state and
`generation` are exactly what they were. It returns a `Plan` (member uid → `Choice`)
or a `Shortfall` saying, in words a person reads, how many members fit and why the
rest do not, and whether an idle cluster could ever hold the gang (`ever`).

How members are placed (greedy first-fit-decreasing on capacity):

1. members are grouped by (request, eligible nodes, tolerations); groups are placed
   largest request first, so multi-GPU members claim nodes before small ones fill them;
   a member's candidates are the nodes of its models that its node constraints allow
   and that admit it as kube-scheduler would (taints it tolerates, the cordon:
   `Node.admits`, `gpuplace.placement.taints`), so no plan puts it where kube-scheduler
   will never bind it;
2. a node's *capacity* for a request is how many copies of it the node could take now
   (`capacity`; exact for the engine's packing rules: whole GPUs by count, or NVLink
   domains when required; shares by per-GPU share and memory; bounded by CPU, memory
   and pod slots);
3. a group fills the nodes the plan already uses first (never widens the span when it
   need not), then takes the node with the smallest capacity that holds all remaining
   members (best fit: one node, least waste), else the largest (fewest nodes); ties go
   to the node whose NVLink domains hold more members whole, then to the policy's
   score for one member there, then to inventory order;
4. within a node each member's GPUs are the policy's choice (`choosing.best_on`), whose
   candidate sets put the smallest NVLink domain that fits first: large domains stay
   whole for the members (or pods) that need them.

For a single group this minimises the number of nodes spanned (largest capacities
first is optimal for covering N); across groups it is a heuristic.

`reserve(ledger, plan, members)` then takes the plan into a ledger all-or-nothing.
`fence(ledger, members)` picks the nodes a starving gang should be given first as
other pods drain (see docs/gangs.md, anti-starvation).

Complexity, with C candidate nodes, G GPUs per node, S GPU sets per node and N
members: `plan` is O(C × G) per group for capacities, O(N × (C + S × score)) for the
picks and placements, and one extra O(C × G) pass on failure for the reason and the
idle-cluster check. Memory O(C) for capacities plus one cloned state per node used.

Pure: no I/O, no clock, no randomness (ties are broken by fixed orders).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuplace.placement import choosing, fit, requests
from gpuplace.placement.choosing import Choice, Policy
from gpuplace.placement.inventory import NO_NVLINK, Node
from gpuplace.placement.ledger import Grant, Ledger, LedgerError, NodeState
from gpuplace.placement.requests import WHOLE, GpuRequest, Topology
from gpuplace.placement.taints import UNSCHEDULABLE, Toleration, untolerated

GangKey = tuple[str, str]
"""A gang: (namespace, gang name)."""


@dataclass(frozen=True, slots=True)
class Domain:
    """What a gang asks of the nodes it spans (`gpuplace.io/gang-domain`): all on nodes
    with one value of the node label `key` (a rack, a block), as a requirement (never
    split) or a preference (as few values as hold it)."""

    key: str
    required: bool = True
    value: str = ""
    """The one value to keep to ("": any): a running gang's, so that its replacements
    and growth join it there (required), or go there first (preferred)."""


@dataclass(frozen=True, slots=True)
class DomainTry:
    """One domain a gang was planned in and did not fit: for reasons and `explain`."""

    value: str
    nodes: int
    placed: int
    needed: int
    ever: bool
    """An idle domain would hold the gang."""
    reason: str

    def text(self) -> str:
        """A short line: "3 of 4 fit now (2 nodes)"."""
        plural = "s" if self.nodes != 1 else ""
        never = "" if self.ever else ", never all even idle"
        return f"{self.placed} of {self.needed} fit now ({self.nodes} node{plural}{never})"


@dataclass(frozen=True, slots=True)
class Member:
    """One gang member: its pod UID, its request and the nodes it may go to."""

    uid: str
    request: GpuRequest
    nodes: frozenset[str] | None = None
    """Names of the nodes its own constraints allow (node affinity, node selector);
    None = any node."""
    tolerations: tuple[Toleration, ...] = ()
    """Its pod's tolerations: nodes with a NoSchedule/NoExecute taint it does not
    tolerate, or cordoned unless it tolerates that, are never planned (kube-scheduler
    would not bind it there; `gpuplace.placement.taints`)."""
    domain: Domain | None = None
    """The topology domain its gang keeps to (the same on every member), if any."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Where every member goes: `choices[uid]`, and the nodes spanned, first used first."""

    choices: Mapping[str, Choice]
    nodes: tuple[str, ...]

    def grants(self, members: Iterable[Member]) -> list[Grant]:
        """The RESERVED grants that realise the plan, in member order. O(N)."""
        return [
            choosing.grant_for(member.uid, self.choices[member.uid], member.request)
            for member in members
        ]

    def per_node(self) -> dict[str, int]:
        """Members per node, in `nodes` order. O(N)."""
        counts = Counter(choice.node for choice in self.choices.values())
        return {node: counts[node] for node in self.nodes}


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Why the gang does not fit now."""

    reason: str
    """One line for Events and conditions."""
    placed: int
    """Members that found room before the plan failed."""
    needed: int
    ever: bool
    """False when even an idle cluster could not hold the whole gang: no amount of
    waiting will help (the gang is too big, or its members' constraints too tight)."""
    reasons: Mapping[str, int] = field(default_factory=dict)
    """Why the unplaced members fit nowhere: misfit kind → nodes, for the first
    unplaced group (empty when it fit on some nodes but not enough of them)."""
    domains: tuple[DomainTry, ...] = ()
    """For a gang that keeps to one domain: each domain tried, and how far it got."""


# --- scratch state ----------------------------------------------------------------------


class _Scratch:
    """Node states as the plan so far leaves them: untouched nodes are the ledger's own
    (read only), touched ones are clones. O(G) per first touch."""

    __slots__ = ("_ledger", "_touched", "idle", "touches")

    def __init__(self, ledger: Ledger, *, idle: bool = False) -> None:
        self._ledger = ledger
        self._touched: dict[str, NodeState] = {}
        self.touches: dict[str, int] = {}
        """Members placed per node so far (cached ranks key on it)."""
        self.idle = idle
        """True: every node starts empty (what an idle cluster could hold)."""

    def state(self, name: str) -> NodeState | None:
        found = self._touched.get(name)
        if found is not None:
            return found
        live = self._ledger.state(name)
        if live is None:
            return None
        if self.idle:
            fresh = NodeState(live.node)
            self._touched[name] = fresh
            return fresh
        return live

    def take(self, name: str, request: GpuRequest, gpus: tuple[int, ...]) -> None:
        state = self._touched.get(name)
        if state is None:
            live = self._ledger.state(name)
            assert live is not None
            state = self._touched[name] = live.copy()
        take(state, request, gpus)
        self.touches[name] = self.touches.get(name, 0) + 1


def take(state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> None:
    """Take `request` on `gpus` of a scratch `state` (never a ledger's own). O(GPUs)."""
    state.hold(gpus, request.milli, request.memory_mib, -1)
    state.cpu -= request.cpu_milli
    state.memory -= request.host_memory_mib
    state.pods -= 1


# --- capacity ---------------------------------------------------------------------------


def capacity(state: NodeState, request: GpuRequest) -> tuple[int, int]:
    """(copies of `request` the node could take now, of which inside NVLink domains).

    Exact for the engine's rules (`fit.gpu_sets`): whole GPUs by count (by NVLink
    domain when the topology is required), shares per GPU by free share and memory;
    bounded by CPU, host memory and pod slots. The second number is what multi-GPU
    members could take without breaking a domain (equal to the first otherwise).
    O(GPUs).
    """
    if fit.static_misfit(state, request) is not None:
        return 0, 0
    slots = state.pods
    if request.cpu_milli:
        slots = min(slots, state.cpu // request.cpu_milli)
    if request.host_memory_mib:
        slots = min(slots, state.memory // request.host_memory_mib)
    if slots <= 0:
        return 0, 0
    if request.count == 0:
        return slots, slots
    node = state.node
    if request.milli == 0:
        copies = 0
        for gpu in node.gpus:
            i = gpu.index
            if request.allows(gpu.model) and state.open_to_memory_only(i):
                free_memory = state.free_memory[i]
                each = state.memory_taken(i, 0, request.memory_mib)
                copies += free_memory // each if free_memory > 0 else 0
        copies = min(slots, copies)
        return copies, copies
    if request.milli < WHOLE:
        copies = 0
        for gpu in node.gpus:
            if not request.allows(gpu.model):
                continue
            i = gpu.index
            here = state.free_milli[i] // request.milli if state.free_milli[i] > 0 else 0
            if request.memory_mib:
                free_memory = state.free_memory[i]
                each = state.memory_taken(i, request.milli, request.memory_mib)
                here = min(here, free_memory // each if free_memory > 0 else 0)
            copies += here
        copies = min(slots, copies)
        return copies, copies
    free = 0
    domains: dict[int, int] = {}
    for gpu in node.gpus:
        i = gpu.index
        if (
            state.free_milli[i] == WHOLE
            and request.allows(gpu.model)
            and gpu.memory_mib >= request.memory_mib
        ):
            free += 1
            if gpu.nvlink != NO_NVLINK:
                domains[gpu.nvlink] = domains.get(gpu.nvlink, 0) + 1
    if request.count == 1:
        return min(slots, free), min(slots, free)
    whole_domains = sum(size // request.count for size in domains.values())
    if request.topology is Topology.REQUIRED:
        copies = min(slots, whole_domains)
        return copies, copies
    return min(slots, free // request.count), min(slots, whole_domains)


# --- planning ---------------------------------------------------------------------------


def _weight(request: GpuRequest) -> tuple[int, int, int, int, int]:
    return (
        request.count,
        request.total_milli,
        request.memory_mib,
        request.cpu_milli,
        request.host_memory_mib,
    )


def _groups(members: Sequence[Member]) -> list[list[Member]]:
    """Members with equal request, eligible nodes and tolerations, heaviest request first
    (stable)."""
    by_key: dict[
        tuple[GpuRequest, frozenset[str] | None, tuple[Toleration, ...]], list[Member]
    ] = {}
    for member in members:
        by_key.setdefault((member.request, member.nodes, member.tolerations), []).append(member)
    return sorted(by_key.values(), key=lambda group: _weight(group[0].request), reverse=True)


def _candidates(
    ledger: Ledger,
    member: Member,
    exclude: Collection[str],
    only: Collection[str] | None = None,
) -> list[tuple[int, str]]:
    """(inventory position, name) of the nodes a member may use: its model's, allowed by
    its node constraints, not excluded, in `only` when given (a domain's nodes), and
    admitting it (taints, cordon). O(C × taints × tolerations)."""
    allowed = member.nodes
    names = choosing.candidates(ledger, member.request)
    order = _order(ledger)
    inventory = ledger.inventory
    return sorted(
        (order[name], name)
        for name in names
        if name not in exclude
        and (only is None or name in only)
        and (allowed is None or name in allowed)
        and name in order
        and inventory[name].admits(member.tolerations)
    )


def _kept_off(
    ledger: Ledger,
    member: Member,
    exclude: Collection[str],
    only: Collection[str] | None = None,
) -> dict[str, int]:
    """Nodes its constraints allow that its tolerations do not, by why. O(C × taints)."""
    allowed = member.nodes
    found: Counter[str] = Counter()
    for name in choosing.candidates(ledger, member.request):
        node = ledger.inventory.get(name)
        if node is None or name in exclude or (allowed is not None and name not in allowed):
            continue
        if only is not None and name not in only:
            continue
        taint = untolerated(node.taints, member.tolerations, unschedulable=node.unschedulable)
        if taint is UNSCHEDULABLE:
            found[CORDONED] += 1
        elif taint is not None:
            found[UNTOLERATED] += 1
    return dict(found.most_common())


CORDONED = "node cordoned"
UNTOLERATED = "taint not tolerated"


def _order(ledger: Ledger) -> dict[str, int]:
    return {name: position for position, name in enumerate(ledger.inventory.names())}


class _Planner:
    """One planning pass over a scratch view; see `plan`."""

    def __init__(
        self,
        ledger: Ledger,
        policy: Policy,
        exclude: Collection[str],
        *,
        idle: bool,
        only: Collection[str] | None = None,
    ) -> None:
        self.ledger = ledger
        self.policy = policy
        self.exclude = exclude
        self.only = only
        """The nodes of the domain planned in (None: every node)."""
        self.scratch = _Scratch(ledger, idle=idle)
        self.choices: dict[str, Choice] = {}
        self.used: dict[str, int] = {}
        """Nodes the plan uses → position (first used first)."""
        self.scores: dict[tuple[object, GpuRequest], float] = {}
        self.ranks: dict[str, tuple[int, tuple[float, float, int]]] = {}
        """Per node, for the group being placed: (touches when ranked, rank)."""

    def place_group(self, group: list[Member]) -> list[Member]:
        """Place as many members of the group as possible; returns the unplaced."""
        request = group[0].request
        self.ranks = {}
        nodes = _candidates(self.ledger, group[0], self.exclude, self.only)
        position = {name: rank for rank, name in nodes}
        caps: dict[str, tuple[int, int]] = {}
        for _, name in nodes:
            state = self.scratch.state(name)
            if state is not None:
                found = capacity(state, request)
                if found[0] > 0:
                    caps[name] = found
        remaining = list(group)
        while remaining and caps:
            name = self._pick(caps, position, request, len(remaining))
            placed_here = 0
            want = min(caps[name][0], len(remaining))
            while placed_here < want:
                state = self.scratch.state(name)
                assert state is not None
                outcome = choosing.best_on(state, request, self.policy)
                if not isinstance(outcome, Choice):
                    break
                member = remaining.pop(0)
                self.scratch.take(name, request, outcome.gpus)
                self.choices[member.uid] = outcome
                self.used.setdefault(name, len(self.used))
                placed_here += 1
            state = self.scratch.state(name)
            assert state is not None
            left = capacity(state, request) if placed_here else (0, 0)
            if left[0] > 0:
                caps[name] = left
            else:
                del caps[name]
        return remaining

    def _pick(
        self,
        caps: Mapping[str, tuple[int, int]],
        position: Mapping[str, int],
        request: GpuRequest,
        remaining: int,
    ) -> str:
        used = [name for name in caps if name in self.used]
        if used:
            return min(used, key=lambda name: (-caps[name][0], self.used[name]))
        enough = [name for name in caps if caps[name][0] >= remaining]
        if enough:
            tight = min(caps[name][0] for name in enough)
            tier = [name for name in enough if caps[name][0] == tight]
        else:
            top = max(cap for cap, _ in caps.values())
            tier = [name for name in caps if caps[name][0] == top]
        if len(tier) == 1:
            return tier[0]
        best_domain = max(caps[name][1] for name in tier)
        tier = [name for name in tier if caps[name][1] == best_domain]
        if len(tier) == 1:
            return tier[0]
        return min(tier, key=lambda name: self._rank(name, request, position[name]))

    def _rank(self, name: str, request: GpuRequest, position: int) -> tuple[float, float, int]:
        """Tie-break among nodes of equal capacity: policy score, place in line, inventory
        order. Cached per node until the plan touches it. O(1) on a hit."""
        touches = self.scratch.touches.get(name, 0)
        cached = self.ranks.get(name)
        if cached is not None and cached[0] == touches:
            return cached[1]
        rank = (-self._score(name, request), self._place(name), position)
        self.ranks[name] = (touches, rank)
        return rank

    def _place(self, name: str) -> float:
        """The policy's place in line for the node (lower first), when it has one."""
        place = getattr(self.policy, "place", None)
        found = place(name) if callable(place) else None
        return float(found) if isinstance(found, int | float) else 2.0

    def _score(self, name: str, request: GpuRequest) -> float:
        """The policy's score for one member on the node, memoised by the node's state
        signature: nodes in the same state score alike (their place in line aside,
        which `_place` breaks). O(1) on a hit, O(GPU sets × score) on a miss."""
        state = self.scratch.state(name)
        if state is None:
            return float("-inf")
        key = (state.signature(), request)
        found = self.scores.get(key)
        if found is None:
            outcome = choosing.best_on(state, request, self.policy)
            found = self.scores[key] = (
                outcome.score if isinstance(outcome, Choice) else float("-inf")
            )
        return found

    def why(self, member: Member) -> dict[str, int]:
        """Misfit kinds over the member's candidate nodes, and the nodes its tolerations
        keep it off (for the reason line). O(C × G)."""
        kinds: Counter[str] = Counter(_kept_off(self.ledger, member, self.exclude, self.only))
        for _, name in _candidates(self.ledger, member, self.exclude, self.only):
            state = self.scratch.state(name)
            if state is None:
                continue
            reason = fit.misfit(state, member.request)
            if reason is not None:
                kinds[reason.kind.value] += 1
        return dict(kinds.most_common())


def plan(
    ledger: Ledger,
    policy: Policy,
    members: Sequence[Member],
    *,
    exclude: Collection[str] = frozenset(),
    explain: bool = True,
) -> Plan | Shortfall:
    """Place every member at once, or say why not; the ledger is never changed.

    `exclude`: nodes no member may use (e.g. held for another gang). Without `explain`, a
    shortfall skips the passes that find its reason and whether an idle cluster could
    hold the gang (its `reason` is short, `ever` True, `reasons` empty): for callers that
    only ask whether it fits. A gang whose members carry a `Domain` is planned in one
    domain at a time (`_in_domains`). Deterministic for equal inputs. See the module
    docstring for the rules and the complexity.
    """
    if not members:
        return Plan({}, ())
    uids = [member.uid for member in members]
    if len(set(uids)) != len(uids):
        raise ValueError("gang members must have distinct uids")
    domain = domain_of(members)
    if domain is not None:
        return _in_domains(ledger, policy, members, domain, exclude=exclude, explain=explain)
    return _plan(ledger, policy, members, exclude=exclude, explain=explain)


def _plan(
    ledger: Ledger,
    policy: Policy,
    members: Sequence[Member],
    *,
    exclude: Collection[str],
    explain: bool,
    only: Collection[str] | None = None,
) -> Plan | Shortfall:
    """`plan` over the nodes of `only` (None: all), without domains."""
    planner = _Planner(ledger, policy, exclude, idle=False, only=only)
    groups = _groups(members)
    for group in groups:
        unplaced = planner.place_group(group)
        if unplaced and not explain:
            placed = len(planner.choices)
            return Shortfall(
                f"{placed} of {len(members)} gang members fit now", placed, len(members), True
            )
        if unplaced:
            return _shortfall(
                ledger,
                policy,
                members,
                groups=groups,
                planner=planner,
                unplaced=unplaced,
                exclude=exclude,
                only=only,
            )
    return Plan(dict(planner.choices), tuple(planner.used))


# --- topology domains -------------------------------------------------------------------


def domain_of(members: Iterable[Member]) -> Domain | None:
    """The domain the gang asks for (its first member's that asks for one), or None."""
    return next((member.domain for member in members if member.domain is not None), None)


def domains(ledger: Ledger, key: str) -> dict[str, frozenset[str]]:
    """The domains of node label `key`: value -> the names of the nodes carrying it, in
    value order. Nodes without the label are in none. O(nodes)."""
    found: dict[str, set[str]] = {}
    for node in ledger.inventory:
        value = node.labels.get(key)
        if value is not None:
            found.setdefault(value, set()).add(node.name)
    return {value: frozenset(found[value]) for value in sorted(found)}


def domain_room(nodes: Iterable[Node], key: str, request: GpuRequest) -> dict[str, int]:
    """Per value of node label `key`: how many copies of `request` its nodes would hold
    when idle (what admission checks a gang keeping to one domain against: a required
    domain that no value could ever hold refuses the gang). Values in order; nodes
    without the label are in none. O(nodes × G)."""
    found: dict[str, int] = {}
    for node in nodes:
        value = node.labels.get(key)
        if value is not None:
            found[value] = found.get(value, 0) + capacity(NodeState(node), request)[0]
    return {value: found[value] for value in sorted(found)}


def _room(ledger: Ledger, members: Sequence[Member], nodes: Collection[str]) -> int:
    """Copies of the gang's heaviest request the nodes could take now (how much room a
    domain has, for choosing the tightest that fits). O(|nodes| × G)."""
    request = _groups(members)[0][0].request
    total = 0
    for name in nodes:
        state = ledger.state(name)
        if state is not None:
            total += capacity(state, request)[0]
    return total


def _in_domains(
    ledger: Ledger,
    policy: Policy,
    members: Sequence[Member],
    domain: Domain,
    *,
    exclude: Collection[str],
    explain: bool,
) -> Plan | Shortfall:
    """Plan the gang inside one domain of `domain.key`: each domain is planned alone (its
    nodes only, every other rule as `_plan`), and of those that hold the whole gang the
    plan spanning the fewest nodes wins, then the tightest domain (least room left for the
    gang's heaviest request: large domains stay whole), then the value. A domain the gang
    already runs in (`domain.value`) is the only one tried when required, the first when
    preferred. When none holds it: a required domain gives a `Shortfall` naming the
    domains tried and why each fell short (`Shortfall.domains`); a preferred one is then
    planned in as few domains as hold it: the k roomiest together for k = 2, 3, ..., then
    on every node (unlabelled ones too).

    O(D × (C + plan on one domain)) for D domains (one `_plan` each, its candidates
    filtered from the C nodes of the model), plus for a preference that no one domain
    meets up to D more plans over unions.
    """
    every = domains(ledger, domain.key)
    if domain.value:
        pinned = {domain.value: every.get(domain.value, frozenset())}
        every = pinned if domain.required else {**pinned, **every}
    tried: list[DomainTry] = []
    best: tuple[tuple[int, int, str], Plan] | None = None
    for value, nodes in every.items():
        found = _plan(ledger, policy, members, exclude=exclude, explain=explain, only=nodes)
        if isinstance(found, Plan):
            rank = (len(found.nodes), _room(ledger, members, nodes), value)
            if domain.value and value == domain.value:
                return found
            if best is None or rank < best[0]:
                best = (rank, found)
            continue
        tried.append(
            DomainTry(value, len(nodes), found.placed, found.needed, found.ever, found.reason)
        )
    if best is not None:
        return best[1]
    if not domain.required:
        roomiest = sorted(every, key=lambda value: (-_room(ledger, members, every[value]), value))
        for k in range(2, len(roomiest) + 1):
            union = frozenset().union(*(every[value] for value in roomiest[:k]))
            found = _plan(ledger, policy, members, exclude=exclude, explain=False, only=union)
            if isinstance(found, Plan):
                return found
        found = _plan(ledger, policy, members, exclude=exclude, explain=explain)
        if isinstance(found, Plan):
            return found
        return dataclasses.replace(found, domains=tuple(tried))
    return _no_domain(domain, members, tried, explain)


def _no_domain(
    domain: Domain, members: Sequence[Member], tried: list[DomainTry], explain: bool
) -> Shortfall:
    """Why no one domain of a required `domain` holds the gang, naming each tried."""
    needed = len(members)
    placed = max((item.placed for item in tried), default=0)
    ever = any(item.ever for item in tried)
    where = f"one {domain.key} (gang-domain, required)"
    if domain.value:
        where = f"{domain.key}={domain.value}, where the gang runs (gang-domain, required)"
    if not tried:
        return Shortfall(
            f"no node carries the label {domain.key} (gang-domain, required): the gang "
            f"keeps to one of its values and no node has one; {needed} members wait",
            0,
            needed,
            False,
        )
    if not explain:
        return Shortfall(f"no {where} holds all {needed} gang members now", placed, needed, True)
    shown = "; ".join(f"{item.value}: {item.text()}" for item in tried[:MAX_DOMAINS_SHOWN])
    more = len(tried) - MAX_DOMAINS_SHOWN
    if more > 0:
        shown += f"; and {more} more"
    count = f"{len(tried)} domain{'s' if len(tried) != 1 else ''}"
    if ever:
        head = f"no {where} holds all {needed} gang members now ({count} tried)"
    else:
        head = (
            f"the gang can never fit in {where}: even with every node idle no domain would "
            f"hold all {needed} members ({count} tried)"
        )
    return Shortfall(f"{head}: {shown}", placed, needed, ever, domains=tuple(tried))


MAX_DOMAINS_SHOWN = 6
"""Domains a shortfall's one line names (all are in `Shortfall.domains`)."""


def _shortfall(
    ledger: Ledger,
    policy: Policy,
    members: Sequence[Member],
    *,
    groups: list[list[Member]],
    planner: _Planner,
    unplaced: list[Member],
    exclude: Collection[str],
    only: Collection[str] | None = None,
) -> Shortfall:
    placed = len(planner.choices)
    needed = len(members)
    idle = _Planner(ledger, policy, exclude, idle=True, only=only)
    ever = True
    idle_placed = 0
    for group in groups:
        left = idle.place_group(group)
        idle_placed += len(group) - len(left)
        if left:
            ever = False
    first = unplaced[0]
    kinds = planner.why(first)
    head = f"{placed} of {needed} gang members fit now"
    need = f"{len(unplaced)} more need {requests.describe(first.request)}"
    if kinds:
        total = sum(kinds.values())
        detail = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        need += f"; {total} node{'s' if total != 1 else ''}: {detail}"
    elif first.nodes is not None and not first.nodes:
        need += "; no node matches the pod's node affinity or node selector"
    if not ever and (CORDONED in kinds or UNTOLERATED in kinds):
        head = (
            "the gang cannot fit on the nodes that admit its members (cordoned or tainted "
            f"ones left out): even idle they would hold only {idle_placed} of {needed}; "
            f"{placed} fit now"
        )
    elif not ever:
        head = (
            f"the gang can never fit: even with every node idle only {idle_placed} of "
            f"{needed} members would; {placed} fit now"
        )
    return Shortfall(f"{head}; {need}", placed, needed, ever, kinds)


def reserve(ledger: Ledger, plan: Plan, members: Sequence[Member]) -> list[Grant]:
    """Take the plan's grants into `ledger`, all or none. O(N × G).

    Raises `LedgerError` (nothing reserved) when any grant is refused, e.g. because
    the ledger changed since the plan was made.
    """
    taken: list[Grant] = []
    try:
        for grant in plan.grants(members):
            if ledger.reserve(grant):
                taken.append(grant)
    except LedgerError:
        for grant in taken:
            ledger.release(grant.pod_uid)
        raise
    return taken


def fence(
    ledger: Ledger,
    members: Sequence[Member],
    *,
    exclude: Collection[str] = frozenset(),
) -> tuple[str, ...]:
    """Nodes that would hold the whole gang once drained, those closest to it first.

    For each group, nodes are taken by (members fitting now, members fitting when idle,
    inventory order), both descending, until their idle capacity covers the group. The
    result is where a starving gang should be given room first: keeping other pods off
    these nodes lets them drain towards the gang. Empty when even an idle cluster could
    not hold the gang. A gang that keeps to one domain gets the nodes of one domain: the
    roomiest now of those that could hold it idle (a preferred domain that none could
    hold: any nodes). O(groups × C × G), and O(D × that) for D domains.
    """
    domain = domain_of(members)
    if domain is None:
        return _fence(ledger, members, exclude, None)
    every = domains(ledger, domain.key)
    if domain.value:
        every = {domain.value: every.get(domain.value, frozenset())}
    for value in sorted(every, key=lambda value: (-_room(ledger, members, every[value]), value)):
        found = _fence(ledger, members, exclude, every[value])
        if found:
            return found
    return () if domain.required else _fence(ledger, members, exclude, None)


def _fence(
    ledger: Ledger,
    members: Sequence[Member],
    exclude: Collection[str],
    only: Collection[str] | None,
) -> tuple[str, ...]:
    """`fence` over the nodes of `only` (None: all)."""
    chosen: dict[str, None] = {}
    idle_left: dict[str, NodeState] = {}
    for group in _groups(members):
        request = group[0].request
        rows = []
        for position, name in _candidates(ledger, group[0], exclude, only):
            live = ledger.state(name)
            if live is None:
                continue
            empty = idle_left.get(name)
            if empty is None:
                empty = NodeState(live.node)
            later = capacity(empty, request)[0]
            if later <= 0:
                continue
            rows.append((-capacity(live, request)[0], -later, position, name, later))
        rows.sort()
        need = len(group)
        for _, _, _, name, later in rows:
            if need <= 0:
                break
            chosen[name] = None
            take = min(later, need)
            need -= take
            state = idle_left.get(name)
            if state is None:
                live = ledger.state(name)
                assert live is not None
                state = idle_left[name] = NodeState(live.node)
            for _ in range(take):
                outcome = choosing.best_on(state, request, _Plain())
                if not isinstance(outcome, Choice):
                    break
                state.hold(outcome.gpus, request.milli, request.memory_mib, -1)
                state.cpu -= request.cpu_milli
                state.memory -= request.host_memory_mib
                state.pods -= 1
        if need > 0:
            return ()
    return tuple(chosen)


class _Plain:
    """A policy that ranks nothing: the first fitting GPU set (fence sizing only)."""

    name = "plain"

    def score(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        return 0.0

    def prefer(self, state: NodeState, request: GpuRequest, gpus: tuple[int, ...]) -> float:
        return 0.0

    def place(self, name: str) -> float | None:
        return None
