"""The demo's text output: what happened to each pod, how full and how fragmented the
cluster ended up, what users would have seen (kubectl errors, Events, `gpuplace explain`)
and the webhook's audit log, condensed. Pure: builds strings from a `running.Outcome`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import keys
from gpuplace.cluster.gang_marks import plan_mark
from gpuplace.dev.demo import scenario
from gpuplace.dev.demo.running import Outcome, PodResult
from gpuplace.extender import explaining
from gpuplace.placement import requests
from gpuplace.placement.fragmentation import Workload
from gpuplace.placement.ledger import Ledger
from gpuplace.placement.requests import WHOLE

PLACED = "placed"
REFUSED = "refused"
PENDING = "pending"
WAITING = "waiting"


def status(result: PodResult) -> str:
    if result.admitted.refused:
        return REFUSED
    if result.node is not None:
        return PLACED
    return WAITING if result.gated else PENDING


def _short_model(model: str) -> str:
    return model.removeprefix("NVIDIA-")


def header(outcome: Outcome, node_objects: Sequence[dict[str, Any]]) -> str:
    models: Counter[str] = Counter()
    gpu_nodes = 0
    for node in node_objects:
        labels = node["metadata"].get("labels") or {}
        count = int(labels.get(keys.GFD_COUNT, "0"))
        if count:
            gpu_nodes += 1
            models[_short_model(labels.get(keys.GFD_PRODUCT, "?"))] += count
    gpus = sum(models.values())
    mix = ", ".join(f"{count} {model}" for model, count in models.most_common())
    other = len(node_objects) - gpu_nodes
    ports = outcome.ports
    return "\n".join(
        [
            "gpuplace demo: the whole flow on this machine, no cluster needed",
            "",
            "  This process PLAYS kube-apiserver (an in-memory API with the real wire format,",
            "  gpuplace.dev.localapi) and kube-scheduler (profile `gpuplace`, extender weight",
            "  100000, holding its leader Lease).",
            "  The admission webhook, the scheduler extender and the gang controller are the real",
            "  `gpuplace serve`, on 127.0.0.1: webhook https :"
            f"{ports.get('webhook')} (fresh CA), extender http :{ports.get('extender')}, "
            f"ops :{ports.get('ops')}.",
            f"  Cluster: {len(node_objects)} nodes, {gpu_nodes} with {gpus} GPUs ({mix}), "
            f"{other} CPU-only.",
            f"  Policy {outcome.policy}, seed {outcome.seed}.",
        ]
    )


def _assignment(pod: dict[str, Any] | None) -> tuple[str, str]:
    """(GPU indices, share) from the pod's assignment annotations."""
    if pod is None:
        return "", ""
    annotations = pod["metadata"].get("annotations") or {}
    gpus = annotations.get(keys.ASSIGNED_GPUS, "")
    if not gpus:
        return "", ""
    try:
        milli = int(annotations.get(keys.ASSIGNED_MILLI, "0"))
        memory = int(annotations.get(keys.ASSIGNED_MEMORY, "0"))
    except ValueError:
        return gpus, "?"
    if milli >= WHOLE:
        return _ranges(gpus), "whole" if "," not in gpus else f"{gpus.count(',') + 1}× whole"
    share = requests.share_text(milli)
    if memory:
        share += f" {memory // 1024}Gi" if memory % 1024 == 0 else f" {memory}Mi"
    return gpus, share


def _refusal(result: PodResult) -> str:
    return result.admitted.message


def why(result: PodResult) -> str:
    kind = status(result)
    if kind == REFUSED:
        return f"{result.admitted.refused_by.split('.')[0]}: {_refusal(result)}"
    if kind == WAITING:
        annotations = result.submission.annotations
        return (
            f"gated until all {annotations.get(keys.GANG_SIZE)} of gang "
            f"{annotations.get(keys.GANG_NAME)} exist; holds no GPU"
        )
    attempt = result.attempts[-1] if result.attempts else None
    if kind == PENDING:
        return attempt.message if attempt is not None else "not scheduled"
    assert result.final is not None
    mark = plan_mark(result.final)
    if mark is not None:
        return f"gang: all {mark.members} planned as one, ungated together"
    if attempt is None:
        return "bound"
    if attempt.fitting <= 1:
        return f"only fit: {attempt.feasible} passed kube-scheduler, 1 the extender"
    ties = f", random pick among {attempt.tied} tied" if attempt.tied > 1 else ""
    return f"policy's best of {attempt.fitting} fitting nodes{ties}"


def _ranges(indices: str) -> str:
    """'0,1,2,3,6' → '0-3,6'."""
    try:
        values = sorted(int(part) for part in indices.split(",") if part)
    except ValueError:
        return indices
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][-1] + 1:
            runs[-1].append(value)
        else:
            runs.append([value])
    return ",".join(
        f"{run[0]}-{run[-1]}" if len(run) >= 3 else ",".join(str(v) for v in run) for run in runs
    )


@dataclass(frozen=True, slots=True)
class Row:
    pod: str
    asks: str
    result: str
    node: str
    gpus: str
    share: str
    why: str


def rows(outcome: Outcome) -> list[Row]:
    out = []
    for result in outcome.results:
        gpus, share = _assignment(result.final if result.node else None)
        out.append(
            Row(
                result.key,
                scenario.asks(result.submission.annotations),
                status(result),
                result.node or "",
                gpus,
                share,
                why(result),
            )
        )
    return out


def cut(text: str, width: int) -> str:
    """`text` on one line, at most `width` characters (an ellipsis where cut)."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def table(outcome: Outcome, width: int = 140) -> str:
    header_row = Row("POD", "ASKS", "RESULT", "NODE", "GPUS", "SHARE", "WHY")
    body = rows(outcome)
    everything = [header_row, *body]
    fixed = ["pod", "asks", "result", "node", "gpus", "share"]
    widths = {name: min(max(len(getattr(row, name)) for row in everything), 30) for name in fixed}
    used = sum(widths.values()) + 2 * len(fixed)
    rest = max(width - used, 30)
    lines = []
    for row in everything:
        cells = [cut(getattr(row, name), widths[name]).ljust(widths[name]) for name in fixed]
        lines.append(("  ".join(cells) + "  " + cut(row.why, rest)).rstrip())
    counts = Counter(row.result for row in body)
    lines.append("")
    lines.append(
        f"{len(body)} pods: {counts[PLACED]} placed, {counts[REFUSED]} refused at admission, "
        f"{counts[PENDING]} pending, {counts[WAITING]} waiting for their gang"
    )
    return "\n".join(lines)


def refusals(outcome: Outcome) -> str:
    lines = ["Refused at admission — what `kubectl apply` prints:"]
    for result in outcome.results:
        if result.admitted.refused:
            lines.append(f"  {result.key}")
            lines.append(f"    Error from server: {result.admitted.error}")
    return "\n".join(lines)


def _explained(explanation: explaining.Explanation, *, rows: int) -> str:
    """`gpuplace explain`'s text, its nodes reordered so that the rarest verdicts (the
    nodes that nearly fit) come first, cut to `rows` nodes; headline only for rows=0."""
    if rows == 0:
        return "\n".join([f"Pod {explanation.pod}"] + [f"  {h}" for h in explanation.headline])
    kinds = Counter(row.verdict for row in explanation.rows)

    def order(row: explaining.Row) -> tuple[int, bool, int, str]:
        managed = row.model not in ("", "-")
        return (0 if row.score is not None else 1, not managed, kinds[row.verdict], row.node)

    reordered = explaining.Explanation(
        explanation.pod,
        explanation.headline,
        sorted(explanation.rows, key=order),
        explanation.summary,
    )
    return explaining.render(reordered, limit=rows)


def not_running(outcome: Outcome) -> str:
    lines = ["Not running — what `kubectl describe pod` and `gpuplace explain` show:"]
    told: set[str] = set()
    for result in outcome.results:
        kind = status(result)
        if kind not in (PENDING, WAITING):
            continue
        gang = result.submission.annotations.get(keys.GANG_NAME)
        if kind == WAITING and gang in told:
            lines.append(f"  {result.key} ({kind}): the same as its gang mate above")
            continue
        if gang:
            told.add(gang)
        lines.append(f"  {result.key} ({kind})")
        for event in result.events:
            source = (event.get("source") or {}).get("component", "")
            lines.append(
                f"    Event {event.get('type')} {event.get('reason')} (from {source}): "
                f"{event.get('message')}"
            )
        if result.explanation is not None:
            text = _explained(result.explanation, rows=0 if kind == WAITING else 6)
            lines.append(f"    $ gpuplace explain {result.key}")
            lines += [f"    | {line}".rstrip() for line in text.splitlines()]
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Usage:
    gpus: int
    full: int
    shared: int
    idle: int
    allocated_milli: int
    memory_mib: int
    reserved_mib: int
    """GPU memory held: whole GPUs' entire memory, shares' reserved memory."""
    idle_milli: int
    pieces_milli: int
    """Idle compute on GPUs that are partly allocated."""
    fragment_milli: float
    by_model: dict[str, tuple[int, int, int]]
    """model → (GPUs, allocated milli, whole GPUs free)."""
    memory_only: int = 0
    """GPUs held by memory-only shares (counted fully allocated: their compute is closed
    to compute shares and whole GPUs)."""


def whole_held(ledger: Ledger) -> set[tuple[str, int]]:
    """(node, GPU index) of every GPU a whole-GPU grant holds."""
    return {(g.node, index) for g in ledger if g.milli >= WHOLE for index in g.gpus}


def usage(ledger: Ledger, workload: Workload) -> Usage:
    gpus = full = shared = idle = allocated = memory = reserved = idle_milli = pieces = 0
    fragment = 0.0
    memory_only = 0
    whole = whole_held(ledger)
    by_model: dict[str, list[int]] = {}
    for state in ledger.states():
        node = state.node
        if not node.gpus:
            continue
        fragment += workload.amount(node.model, state.cpu, tuple(sorted(state.free_milli)))
        memory_only += sum(1 for held in state.memory_only if held)
        for gpu, free, free_memory in zip(
            node.gpus, state.free_milli, state.free_memory, strict=True
        ):
            gpus += 1
            used = WHOLE - max(free, 0)
            allocated += used
            idle_milli += max(free, 0)
            memory += gpu.memory_mib
            if (node.name, gpu.index) in whole:
                reserved += gpu.memory_mib
            else:
                reserved += gpu.memory_mib - free_memory
            if free >= WHOLE:
                idle += 1
            elif free <= 0:
                full += 1
            else:
                shared += 1
                pieces += free
            model = by_model.setdefault(_short_model(gpu.model), [0, 0, 0])
            model[0] += 1
            model[1] += used
            model[2] += 1 if free >= WHOLE else 0
    return Usage(
        gpus,
        full,
        shared,
        idle,
        allocated,
        memory,
        reserved,
        idle_milli,
        pieces,
        fragment,
        {model: (v[0], v[1], v[2]) for model, v in sorted(by_model.items())},
        memory_only,
    )


def summary(outcome: Outcome) -> str:
    workload = Workload.from_requests(outcome.requests)
    figures = usage(outcome.ledger, workload)
    pct = 100.0 * figures.allocated_milli / max(figures.gpus * WHOLE, 1)
    mem_pct = 100.0 * figures.reserved_mib / max(figures.memory_mib, 1)
    idle = figures.idle_milli
    frag_pct = 100.0 * figures.fragment_milli / idle if idle else 0.0
    pieces_pct = 100.0 * figures.pieces_milli / idle if idle else 0.0
    lines = [
        "Utilisation and fragmentation (the sidecar's ledger at the end):",
        f"  GPUs        {figures.gpus}: {figures.full} fully allocated"
        + (f" ({figures.memory_only} by memory-only shares)" if figures.memory_only else "")
        + f", {figures.shared} shared (partly allocated), {figures.idle} idle",
        f"  compute     {pct:.1f}% allocated ({figures.allocated_milli / WHOLE:.2f} of "
        f"{figures.gpus} GPUs)",
        f"  GPU memory  {mem_pct:.1f}% held ({figures.reserved_mib / 1024:,.0f} of "
        f"{figures.memory_mib / 1024:,.0f} GiB: whole GPUs entirely, shares what they reserved)",
        f"  pieces      {figures.pieces_milli / WHOLE:.2f} GPUs of idle compute sit on partly "
        f"allocated GPUs ({pieces_pct:.1f}% of the {idle / WHOLE:.2f} idle GPUs); the rest is "
        "whole free GPUs",
        f"  fragments   {figures.fragment_milli / WHOLE:.2f} idle GPUs ({frag_pct:.1f}%) are "
        "fragment by the FGD measure the default policy minimises (Weng et al., ATC'23):",
        f"              idle compute the typical workload ({len(workload.types)} request types "
        f"of the {len(outcome.requests)} GPU pods, by popularity) could not use where it is;",
        "              model-specific and multi-GPU types count GPUs they cannot take as fragment",
        "",
        "  MODEL                GPUS  ALLOCATED  WHOLE GPUS FREE",
    ]
    for model, (count, milli, free) in figures.by_model.items():
        lines.append(
            f"  {model:<20} {count:>4}  {100.0 * milli / (count * WHOLE):>8.1f}%  {free:>15}"
        )
    gangs = _gangs(outcome.results)
    if gangs:
        lines.append("")
        lines += gangs
    return "\n".join(lines)


def _gangs(results: Iterable[PodResult]) -> list[str]:
    by_gang: dict[tuple[str, str, str], list[PodResult]] = {}
    for result in results:
        annotations = result.submission.annotations
        if keys.GANG_NAME in annotations and not result.admitted.refused:
            key = (
                result.submission.namespace,
                annotations[keys.GANG_NAME],
                annotations.get(keys.GANG_SIZE, "?"),
            )
            by_gang.setdefault(key, []).append(result)
    lines = []
    for (namespace, name, size), members in by_gang.items():
        placed = [m for m in members if m.node]
        if len(placed) == len(members) and members:
            where = Counter(m.node for m in placed)
            spread = ", ".join(f"{node} ×{count}" for node, count in sorted(where.items()))
            lines.append(
                f"  gang {namespace}/{name}: all {len(members)} members planned at once by the "
                f"gang controller, ungated together, bound on {spread}"
            )
        else:
            lines.append(
                f"  gang {namespace}/{name}: {len(members)} of {size} members exist; all gated, "
                f"{len(placed)} placed, no GPU held while it waits"
            )
    return lines


def audit(lines: Sequence[dict[str, Any]], width: int = 140) -> str:
    out = [
        f"Audit log — the webhook's JSON audit log, one line per review ({len(lines)} lines), "
        "condensed:"
    ]
    for line in lines:
        pod = f"{line.get('namespace', '')}/{line.get('name', '')}"
        text = (
            f"  {str(line.get('time', ''))[11:23]}  {line.get('endpoint', ''):<8} "
            f"{line.get('decision', ''):<7} {line.get('reason', ''):<20} {pod:<26} "
            f"{float(line.get('latencyMs', 0.0)):6.2f} ms"
        )
        detail = line.get("message") or "; ".join(line.get("warnings") or [])
        if detail:
            text += "  " + str(detail)
        out.append(text if len(text) <= width else text[: width - 1] + "…")
    return "\n".join(out)
