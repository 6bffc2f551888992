"""The queues scene's text output: step by step, what people did, what `kubectl apply`
said, the Events gpuplace wrote, what the played parts did, who holds which GPU of the
node and the GpuQueues as `kubectl get gq` would show them with their status. Pure:
builds strings from a `queue_running.QueueOutcome`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from gpuplace.cluster import keys
from gpuplace.dev.demo import queue_scene
from gpuplace.dev.demo.admitting import Admitted
from gpuplace.dev.demo.queue_running import QueueOutcome, Seen

SHOWN_EVENTS = frozenset({"GpusAssigned", "Scheduled"})
"""Events left out of a step: the played lines already say where each pod went."""
SHOWN_EVENTS_NOTE = "(GpusAssigned and Scheduled Events left out: the lines above say it)"


def cut(text: str, width: int) -> str:
    """`text` cut to `width` (an ellipsis where cut), its indentation and columns kept."""
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def header(outcome: QueueOutcome) -> str:
    labels = outcome.node["metadata"].get("labels") or {}
    count = labels.get(keys.GFD_COUNT, "?")
    model = str(labels.get(keys.GFD_PRODUCT, "?")).removeprefix("NVIDIA-")
    ports = outcome.ports
    return "\n".join(
        [
            "gpuplace demo, the queues scene: two teams share one node through GpuQueues",
            "",
            "  This process PLAYS kube-apiserver (gpuplace.dev.localapi), kube-scheduler, the",
            "  kubelet (pods run, finish, and stop when evicted) and the Job controller (it",
            "  replaces team A's evicted pods).",
            "  The admission webhook, the scheduler extender, the gang controller and the queue",
            "  controller are the real `gpuplace serve --queues`, on 127.0.0.1:",
            f"  webhook https :{ports.get('webhook')} (fresh CA), extender http "
            f":{ports.get('extender')}, ops :{ports.get('ops')}.",
            f"  Cluster: 1 node, {queue_scene.NODE} with {count} {model}.",
            f"  GpuQueues team-a and team-b: {queue_scene.NOMINAL} GPUs nominal each, cohort "
            f"{queue_scene.COHORT}, reclaimWithinCohort Any",
            "  (the default); namespaces team-a and team-b name them with the label",
            "  gpuplace.io/queue (docs/queues.md).",
            f"  Policy {outcome.policy}, seed {outcome.seed}.",
        ]
    )


def _applied(admitted: Admitted) -> str:
    if admitted.pod is None:
        return f"{admitted.submission.key}: {admitted.error}"
    gates = [g.get("name") for g in (admitted.pod.get("spec") or {}).get("schedulingGates") or []]
    behind = f", behind gates {', '.join(map(str, gates))}" if gates else ""
    return f"{admitted.submission.key} created{behind}"


def _live(pod: dict[str, Any]) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return phase not in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp")


def gpu_map(pods: Sequence[dict[str, Any]], gpus: int, width: int = 140) -> list[str]:
    """Who holds each GPU of the node (from the pods' assignment annotations), as pairs
    of aligned lines (GPU indices, holders) no wider than `width`; `-` for a free GPU."""
    holders = ["-"] * gpus
    for pod in pods:
        annotations = pod["metadata"].get("annotations") or {}
        if annotations.get(keys.ASSIGNED_NODE) != queue_scene.NODE or not _live(pod):
            continue
        team = str(pod["metadata"]["namespace"]).removeprefix("team-").upper()
        for index in str(annotations.get(keys.ASSIGNED_GPUS, "")).split(","):
            if index.isdigit() and int(index) < gpus:
                holders[int(index)] = f"{team} {pod['metadata']['name']}"
    size = max(len(holder) for holder in holders) + 2
    per_line = max((width - 6) // size, 1)
    lines = []
    for first in range(0, gpus, per_line):
        shown = range(first, min(first + per_line, gpus))
        lines.append(f"  GPU {''.join(str(i).ljust(size) for i in shown)}".rstrip())
        lines.append(f"      {''.join(holders[i].ljust(size) for i in shown)}".rstrip())
    return lines


def queue_table(queues: Sequence[dict[str, Any]]) -> list[str]:
    """`kubectl get gq` with the `gpus` quota line of each status."""
    header_row = (
        "GPUQUEUE",
        "COHORT",
        "NOMINAL",
        "USED",
        "BORROWED",
        "LENT",
        "ADMITTED",
        "WAITING",
        "SHARE",
    )
    rows = [header_row]
    for queue in queues:
        spec = queue.get("spec") or {}
        status = queue.get("status") or {}
        line: dict[str, Any] = next(iter(spec.get("resources") or []), {})
        used: dict[str, Any] = next(iter(status.get("resources") or []), {})
        rows.append(
            (
                str(queue["metadata"]["name"]),
                str(spec.get("cohort", "")),
                str(line.get("nominal", "")),
                str(used.get("used", "-")),
                str(used.get("borrowed", "-")),
                str(used.get("lent", "-")),
                str(status.get("admittedWorkloads", "-")),
                f"{status.get('waitingWorkloads', '-')} ({status.get('waitingPods', '-')} pods)",
                str(status.get("weightedShare", "-")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header_row))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _gangs(pods: Sequence[dict[str, Any]]) -> list[str]:
    """Each gang: its members running, and the `gang-count` the controller wrote on each
    when it started (what the member reads through the downward API)."""
    gangs: dict[str, tuple[str, list[str]]] = {}
    for pod in pods:
        annotations = pod["metadata"].get("annotations") or {}
        name = annotations.get(keys.GANG_NAME)
        if not name:
            continue
        key = f"{pod['metadata']['namespace']}/{name}"
        _, running = gangs.setdefault(key, (str(annotations.get(keys.GANG_SIZE, "?")), []))
        if _live(pod) and annotations.get(keys.ASSIGNED_NODE):
            running.append(f"{pod['metadata']['name']} {annotations.get(keys.GANG_COUNT, '-')}")
    return [
        f"  gang {key}: {len(running)} of {size} members run; {keys.GANG_COUNT} of each: "
        + (", ".join(running) or "-")
        for key, (size, running) in gangs.items()
    ]


def step(number: int, seen: Seen, gpus: int, width: int = 140) -> str:
    """One step: what people did and what came of it; `gpus`: the node's GPU count."""
    lines = [f"Step {number}: {seen.step.title}"]
    for admitted in seen.admitted:
        if admitted.submission in seen.step.submit:
            lines.append(cut(f"  $ kubectl apply: {_applied(admitted)}", width))
    lines += [cut(f"  (played) {line}", width) for line in seen.played]
    events = [e for e in seen.events if e.get("reason") not in SHOWN_EVENTS]
    if events:
        lines.append("  Events:")
        keyed = [
            (
                f"{e['involvedObject'].get('namespace')}/{e['involvedObject'].get('name')}",
                str(e.get("reason", "")),
                str(e.get("message", "")),
            )
            for e in events
        ]
        left = max(len(pod) for pod, _, _ in keyed)
        for pod, reason, message in keyed:
            lines.append(f"    {pod.ljust(left)}  {reason}")
            lines += textwrap.wrap(
                message, width, initial_indent=" " * 6, subsequent_indent=" " * 6
            )
    lines += gpu_map(seen.pods, gpus, width)
    lines += _gangs(seen.pods)
    lines += queue_table(seen.queues)
    return "\n".join(lines)


def report(outcome: QueueOutcome, width: int = 140) -> str:
    labels = outcome.node["metadata"].get("labels") or {}
    gpus = int(labels.get(keys.GFD_COUNT, "0"))
    sections = [header(outcome)]
    sections += [step(number, seen, gpus, width) for number, seen in enumerate(outcome.steps, 1)]
    sections.append(SHOWN_EVENTS_NOTE)
    return "\n\n".join(sections)
