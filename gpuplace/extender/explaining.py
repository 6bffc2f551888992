"""Why a pod is where it is, or why it is pending: node by node, for `gpuplace explain`.

Works on a LedgerSync built from the API (the same state the sidecar decides from, minus
its in-memory holds) and the same policy. A pod the webhook sent to DRA nodes is told by
its ResourceClaim (gated until the sidecar creates it, waiting for kube-scheduler's DRA
allocator, or holding the GPU it was allocated) and weighed against the DRA nodes only;
a pod on the device-plugin path against the other nodes only; a pod without annotations
that holds gpuplace's GPUs through claims of its own is told what they hold. For a pod
that already holds GPUs, the nodes are scored as if it did not (its own grant is set
aside on this private copy), so the table shows where it would go now next to where it
is. Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuplace.cluster import keys, nodes, recording
from gpuplace.cluster.claims import ClaimRecord
from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender import reasons
from gpuplace.extender.workloads import PolicyHolder
from gpuplace.placement import choosing
from gpuplace.placement.ledger import Grant, GrantState
from gpuplace.placement.requests import WHOLE, share_text

FITS = "fits"
HERE = "here"


@dataclass(frozen=True, slots=True)
class Row:
    node: str
    model: str
    gpus: int
    free: str
    """Per-GPU free share in percent, "100/40/0" (or "-" for a node gpuplace does not manage)."""
    verdict: str
    """"here" (the pod's node), "fits", or the misfit kind."""
    why: str
    """The misfit's detail, or the policy's view of the node (score and GPUs it would take)."""
    score: int | None = None
    """kube-scheduler extender score 0-10 for nodes that fit."""
    memory: str = "-"
    """Per-GPU free memory of what the engine packs, MiB, "80960/78659" ("-" unmanaged)."""


@dataclass(slots=True)
class Explanation:
    pod: str
    headline: list[str]
    rows: list[Row] = field(default_factory=list)
    summary: str = ""

    def as_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _free(sync: LedgerSync, name: str) -> tuple[str, str, int, str]:
    state = sync.ledger.state(name)
    if state is None:
        record = sync.nodes.get(name)
        why = record.problem if record is not None and record.problem else ""
        return ("-", why, 0, "-")
    # A GPU holding memory-only shares has no compute open to others: "mem" says why.
    free = "/".join(
        "mem" if held else f"{max(milli, 0) / 10:g}"
        for milli, held in zip(state.free_milli, state.memory_only, strict=True)
    )
    memory = "/".join(str(max(mib, 0)) for mib in state.free_memory)
    return (free or "-", state.node.model or "-", len(state.node.gpus), memory or "-")


def memory_lines(sync: LedgerSync, grant: Grant) -> list[str]:
    """What a share's grant takes of its GPU's memory and what that GPU packs, for a
    person: the ask, its CUDA context under MPS (inside the limit MPS enforces) and the
    GPU's packable memory. [] for whole GPUs and shares without memory. O(1)."""
    state = sync.ledger.state(grant.node)
    if state is None or not grant.memory_mib or not grant.gpus or grant.milli >= WHOLE:
        return []
    index = grant.gpus[0]
    if index >= len(state.node.gpus):
        return []
    gpu = state.node.gpus[index]
    takes = gpu.takes(grant.milli, grant.memory_mib)
    return [
        f"On GPU {index} it takes {takes} MiB: its {grant.memory_mib} MiB and "
        f"{takes - grant.memory_mib} MiB for its CUDA context, which MPS counts inside the "
        f"limit of each of its processes (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={takes}M); the "
        f"GPU packs {gpu.memory_mib} MiB ({_packable_basis(sync, grant.node)})."
    ]


def _packable_basis(sync: LedgerSync, name: str) -> str:
    record = sync.nodes.get(name)
    if record is not None and record.heartbeat is not None:
        return "what a client can get with MPS running, as its node agent read it from NVML"
    return (
        f"GPU Feature Discovery's memory less {nodes.UNPUBLISHED_MARGIN_MIB} MiB: no node "
        "agent publishes it"
    )


def _grant_text(grant: Grant) -> str:
    gpus = ",".join(str(index) for index in grant.gpus)
    share = share_text(grant.milli)
    memory = f", {grant.memory_mib} MiB" if grant.memory_mib else ""
    return f"GPU{'s' if len(grant.gpus) > 1 else ''} {gpus} ({share}{memory} each)"


def _claim_text(claim: ClaimRecord) -> str:
    """What an allocated claim holds, for a person: `GPU 0 of node n (30%, 8486 MiB
    each: its MPS memory limit)`."""
    gpus = ",".join(str(held.gpu) for held in claim.held)
    first = claim.held[0]
    memory = f", {first.memory_mib} MiB" if first.memory_mib else ""
    limit = (
        ": its MPS memory limit, the CUDA context inside" if memory and first.milli < WHOLE else ""
    )
    plural = "s" if len(claim.held) > 1 else ""
    return (
        f"GPU{plural} {gpus} of node {claim.node} ({share_text(first.milli)}{memory} each{limit})"
    )


def claims_lines(
    sync: LedgerSync, namespace: str, names: Sequence[str], unread: str = ""
) -> list[str]:
    """What the pod's own ResourceClaims (`names`) hold of gpuplace's GPUs, for a pod
    without gpuplace annotations. O(claims)."""
    lines = []
    for name in names:
        claim = sync.claim(namespace, name)
        if claim is not None and claim.held:
            lines.append(
                f"Holds {_claim_text(claim)} through ResourceClaim {namespace}/{name} "
                f"({_users_text(claim)}), counted in gpuplace's ledger."
            )
        elif claim is not None and not claim.managed and not claim.allocated:
            lines.append(
                f"Its own ResourceClaim {namespace}/{name} waits for kube-scheduler's DRA "
                "allocator, which takes the first device that fits (gpuplace's engine does "
                "not plan a claim a user writes; the gpuplace.io annotations do)."
            )
    if names and unread and not lines:
        lines.append(f"Its ResourceClaims could not be read: {unread}.")
    return lines


def _dra_lines(sync: LedgerSync, record: PodRecord, grant: Grant | None, unread: str) -> list[str]:
    """Where a pod on the DRA path stands, by its claim (None: it is not on it)."""
    name = f"{record.namespace}/{record.claim}"
    claim = sync.claim_of(record)
    if claim is not None and claim.held:
        where = "Running on" if record.bound else "Allocated, not bound yet:"
        return [
            f"{where} {_claim_text(claim)} through its ResourceClaim {name}, allocated by "
            f"kube-scheduler's DRA allocator {_chooser_text(claim)}."
        ]
    if claim is None and unread:
        return [f"On the DRA path with ResourceClaim {name}, which could not be read: {unread}."]
    if claim is None and record.claim_gated:
        return [
            f"Pending behind the scheduling gate {keys.DRA_GATE}: gpuplace's sidecar creates "
            f"its ResourceClaim {name} (--dra-claims), then lets it go."
        ]
    if claim is None:
        return [
            f"Pending: its ResourceClaim {name} does not exist (kube-scheduler does not "
            "queue it until it does; gpuplace creates it while the pod is gated)."
        ]
    planned = (
        f" gpuplace planned {_grant_text(grant)} on node {grant.node} for it."
        if grant is not None
        else ""
    )
    gated = " It is also gated: its gang or queue lets it go first." if record.gated else ""
    if claim.pinned:
        return [
            f"Pending: its ResourceClaim {name} waits for kube-scheduler's DRA allocator, "
            f"pinned to the GPU{'s' if len(claim.pinned) > 1 else ''} gpuplace planned "
            f"({', '.join(claim.pinned)}); if they are taken meanwhile, gpuplace plans it "
            f"anew and makes the claim again.{planned}{gated}"
        ]
    return [
        f"Pending: its ResourceClaim {name} waits for kube-scheduler's DRA allocator, which "
        f"allocates the first device that fits on a DRA node.{planned}{gated}"
    ]


def _users_text(claim: ClaimRecord) -> str:
    if claim.managed:
        return "DRA: allocated by kube-scheduler"
    return (
        "DRA: kube-scheduler's first fit over the DRA nodes' devices; the pod's own claim, "
        "which gpuplace's engine does not plan"
    )


def _chooser_text(claim: ClaimRecord) -> str:
    """Who chose the device of an allocated claim."""
    if claim.pinned:
        return "on the GPUs gpuplace's engine planned (the claim pinned to them)"
    return "(first fit over the DRA nodes' devices: gpuplace had no plan for it)"


def _on_path(sync: LedgerSync, record: PodRecord) -> list[str]:
    """The nodes a pod's path can take it to: the DRA nodes for a pod the webhook sent
    there, the others for any other pod (where DRA nodes exist, their GPUs are claims'
    only). O(nodes)."""
    names = sorted(sync.nodes)
    dra = {name for name in names if _is_dra(sync.nodes[name])}
    if record.claim:
        return [name for name in names if name in dra]
    return [name for name in names if name not in dra]


def _is_dra(record: nodes.NodeRecord) -> bool:
    return record.node is not None and nodes.is_dra(record.node)


def explain(
    sync: LedgerSync,
    holder: PolicyHolder,
    record: PodRecord,
    *,
    events: Sequence[Mapping[str, Any]] = (),
    conditions: Sequence[Mapping[str, Any]] = (),
    gates: Sequence[str] = (),
    claims: Sequence[str] = (),
    claims_unread: str = "",
) -> Explanation:
    """The explanation for one pod (`gates`: the names of its scheduling gates; `claims`:
    the ResourceClaims it uses, `claims_unread` why none could be read). Mutates `sync`
    (sets the pod's own grant aside)."""
    result = Explanation(pod=str(record), headline=[])
    head = result.headline
    if record.terminal:
        head.append(f"{record.phase}: its containers have stopped; it holds no GPU.")
        return result
    if record.request is None:
        if record.problem:
            head.append(f"Cannot be placed: {record.problem}")
        else:
            head.append("Asks for no GPU (no gpuplace annotations): gpuplace has no say.")
            head.extend(claims_lines(sync, record.namespace, claims, claims_unread))
        if record.node_name:
            head.append(f"Bound to node {record.node_name}.")
        return result
    grant = sync.ledger.get(record.uid)
    if record.claim:
        head.extend(_dra_lines(sync, record, grant, claims_unread))
    elif record.bound and grant is not None and grant.state is GrantState.CONFIRMED:
        head.append(f"Running on node {grant.node} with {_grant_text(grant)}.")
        head.extend(memory_lines(sync, grant))
    elif record.bound:
        head.append(
            f"Bound to node {record.node_name} without a gpuplace assignment"
            + (f" ({record.problem})." if record.problem else ".")
        )
    elif grant is not None:
        head.append(
            f"Pending, with {_grant_text(grant)} reserved on node {grant.node}: the next "
            "scheduling attempt binds it there (it is offered no other node); the "
            "reservation is released if that does not happen in time."
        )
    elif record.gated and keys.QUEUE_GATE in gates:
        head.append(
            f"Pending behind the scheduling gate {keys.QUEUE_GATE}: its GpuQueue admits it "
            "when its quota and a free GPU cover it (docs/queues.md)."
        )
    elif record.gated and keys.PLACE_GATE in gates and keys.GANG_GATE not in gates:
        others = [gate for gate in gates if gate != keys.PLACE_GATE]
        first = f" once {', '.join(others)} is removed" if others else ""
        head.append(
            f"Pending behind the scheduling gate {keys.PLACE_GATE}: gpuplace's planner "
            f"chooses its node and GPUs{first} and releases it at once with that node for "
            "kube-scheduler to try first (docs/placement.md, plan then pin); a pod that stays "
            "here means no replica's planner leads (gpuplace_plan_controller_leading)."
        )
    elif record.gated:
        head.append(
            "Pending behind scheduling gates: the gang controller lets it go when its gang "
            "can be placed as a whole."
        )
    else:
        head.append("Pending: no GPUs assigned yet.")
    head.extend(preemption_lines(sync, record, conditions, events))
    for condition in conditions:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            head.append(f"kube-scheduler: {condition.get('message') or condition.get('reason')}")
    for event in list(events)[-3:]:
        count = event.get("count") or 1
        times = f" (x{count})" if count and count > 1 else ""
        head.append(f"Event {event.get('reason')}{times}: {event.get('message')}")

    if grant is not None:
        sync.ledger.release(record.uid)
    chooser = holder.current()
    names = _on_path(sync, record)
    evaluation = chooser.evaluate(record.request, names)
    scores = choosing.extender_scores(evaluation)
    here = grant.node if grant is not None else record.node_name
    rows: list[Row] = []
    for name in names:
        free, model, gpus, memory = _free(sync, name)
        choice = evaluation.choices.get(name)
        if choice is not None:
            taken = ",".join(str(index) for index in choice.gpus)
            rows.append(
                Row(
                    name,
                    model,
                    gpus,
                    free,
                    HERE if name == here else FITS,
                    _scored(choice) + f"would take GPU {taken}",
                    scores.get(name, 0),
                    memory,
                )
            )
        else:
            misfit = evaluation.misfits.get(name) or choosing.UNKNOWN
            verdict = HERE if name == here else misfit.kind.value
            why = misfit.message if name != here else f"{misfit.kind.value}: {misfit.message}"
            rows.append(Row(name, model if model else "-", gpus, free, verdict, why, None, memory))
    kinds = Counter(row.verdict for row in rows if row.score is None and row.verdict != HERE)

    def order(row: Row) -> tuple[int, int, int, str]:
        if row.verdict == HERE:
            return (0, 0, 0, row.node)
        if row.score is not None:
            return (1, -row.score, 0, row.node)
        return (2, -kinds[row.verdict], 0, row.node)

    result.rows = sorted(rows, key=order)
    result.summary = reasons.summary(len(names), evaluation.misfits)
    best = [choice.node for choice in evaluation.best()]
    if best:
        result.summary += f"; the policy ({holder.name}) prefers {', '.join(best[:3])}"
    if record.claim:
        result.summary += (
            " (DRA nodes only: kube-scheduler's DRA allocator picks the device, first fit; "
            "the policy's choice is where gpuplace would put it)"
        )
    if not evaluation.choices and grant is None and not record.gated:
        head.append(
            "No gpuplace node can take it now; it waits until GPUs free up"
            + (
                "."
                if any(m.resolvable for m in evaluation.misfits.values())
                else ", but no node could ever hold it: check its annotations."
            )
        )
    return result


GANG_PREEMPTION = (recording.PREEMPTION, recording.GANG_PREEMPTION_REFUSED)
"""Event reasons the gang controller writes on a member of a gang that preempts."""


def preemption_lines(
    sync: LedgerSync,
    record: PodRecord,
    conditions: Sequence[Mapping[str, Any]] = (),
    events: Sequence[Mapping[str, Any]] = (),
) -> list[str]:
    """What a preemption under way means for the pod: as a preemptor (kube-scheduler
    nominated a node and evicts pods there for it), as a member of a gated gang that
    preempts (its latest gang-preemption Event, and which of the pods it names are
    still terminating), or as a victim. O(pods) for a preemptor, O(events +
    conditions) else."""
    lines = []
    latest = next((e for e in reversed(events) if e.get("reason") in GANG_PREEMPTION), None)
    if record.gated and not record.bound and latest is not None:
        message = str(latest.get("message") or "")
        going = sorted(
            str(other)
            for other in sync.pods.values()
            if other.deleting and not other.terminal and str(other) in message
        )
        state = (
            f"{len(going)} of its victims still terminating ({', '.join(going[:5])})"
            if going
            else "none of the pods it names is terminating any more"
        )
        lines.append(f"Gang preemption pending: {message} Now: {state}.")
    if record.nominated and not record.bound:
        node = record.nominated
        going = sorted(
            str(other)
            for other in sync.pods.values()
            if other.node_name == node and other.deleting and not other.terminal
        )
        if going and record.claim:
            shown = ", ".join(going[:5]) + (f" and {len(going) - 5} more" if len(going) > 5 else "")
            lines.append(
                f"Preemption under way: gpuplace's claim controller nominated node {node} and "
                f"evicted {shown} there for it (kube-scheduler does not preempt for a "
                "ResourceClaim); its claim is pinned to the GPUs they free, which "
                "kube-scheduler allocates once they have terminated."
            )
        elif going:
            shown = ", ".join(going[:5]) + (f" and {len(going) - 5} more" if len(going) > 5 else "")
            lines.append(
                f"Preemption under way: kube-scheduler nominated node {node} and is evicting "
                f"{shown} there; gpuplace holds the GPUs they free for this pod until it binds."
            )
        elif record.claim:
            lines.append(
                f"Nominated to node {node} by gpuplace's claim controller (its plan, or a "
                "preemption whose victims are gone); no pod there is terminating: "
                "kube-scheduler tries that node first."
            )
        else:
            lines.append(
                f"Nominated to node {node} by kube-scheduler's preemption, or by gpuplace's "
                "planner (its plan); no pod there is terminating: kube-scheduler tries that "
                "node first, and every other one if it no longer fits there."
            )
    for condition in conditions:
        if (
            condition.get("type") == "DisruptionTarget"
            and condition.get("status") == "True"
            and condition.get("reason") == "PreemptionByScheduler"
        ):
            lines.append(
                f"Being preempted: {condition.get('message') or 'for a higher priority pod'} "
                "(its Events name the pod and the GPU it frees)."
            )
        elif (
            condition.get("type") == "DisruptionTarget"
            and condition.get("status") == "True"
            and condition.get("reason") == "EvictionByEvictionAPI"
            and record.deleting
        ):
            lines.append(
                "Being evicted through the Eviction API (a GpuPreempted Event names the gang "
                "or the DRA pod it makes room for, if gpuplace evicted it)."
            )
    return lines


def render(explanation: Explanation, *, limit: int | None = 40) -> str:
    """A readable table (`limit` rows; None = all)."""
    lines = [f"Pod {explanation.pod}"]
    lines += [f"  {line}" for line in explanation.headline]
    if explanation.rows:
        lines.append("")
        header = ("NODE", "MODEL", "GPUS", "FREE %", "FREE MiB", "VERDICT", "SCORE", "WHY")
        shown = explanation.rows if limit is None else explanation.rows[:limit]
        table = [header] + [
            (
                row.node,
                row.model,
                str(row.gpus),
                row.free,
                row.memory,
                row.verdict,
                "" if row.score is None else str(row.score),
                row.why,
            )
            for row in shown
        ]
        widths = [min(max(len(cells[i]) for cells in table), 40) for i in range(len(header) - 1)]
        for cells in table:
            fixed = "  ".join(
                cell[:40].ljust(width) for cell, width in zip(cells, widths, strict=False)
            )
            lines.append(f"{fixed}  {cells[-1]}".rstrip())
        hidden = len(explanation.rows) - len(shown)
        if hidden > 0:
            lines.append(f"... and {hidden} more nodes (--all shows them)")
    if explanation.summary:
        lines += ["", explanation.summary]
    return "\n".join(lines)


def _scored(choice: choosing.Choice) -> str:
    """The policy's score, and the NVLink preference of `preferred` when it counted."""
    score = choice.score
    if score >= choosing.LINKED / 2:
        return f"one NVLink domain, policy score {score - choosing.LINKED:.6g}; "
    return f"policy score {score:.6g}; "
