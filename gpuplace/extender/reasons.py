"""Why nodes do not fit, in words: per node for kube-scheduler, per kind for people.

kube-scheduler aggregates the per-node reasons of `FailedNodes` by exact string into
its own FailedScheduling event ("0/12 nodes are available: 9 <reason>, 3 <reason>").
A per-node message ("gpu 3: 40% free, needs 50%") differs on every node, which turns
that event into one entry per node (and past 1,024 characters it is cut). So by
default the per-node reason is the misfit's *kind* ("no GPU with enough share free"),
which aggregates into a readable line; `detail` mode sends the node's own message
instead. Our own Event and `gpuplace explain` carry the details.

Pure: no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Literal

from gpuplace.placement import fit

Mode = Literal["kind", "detail"]
PREFIX = "gpuplace: "


def for_node(misfit: fit.Misfit, mode: Mode = "kind") -> str:
    """The reason kube-scheduler gets for one node."""
    if mode == "detail":
        return f"{PREFIX}{misfit.summary} ({misfit.message})"
    return PREFIX + misfit.summary


_KIND_REASONS = {kind.value: PREFIX + kind.value for kind in fit.MisfitKind}


def for_nodes(
    misfits: Mapping[str, fit.Misfit], mode: Mode = "kind"
) -> tuple[dict[str, str], dict[str, str]]:
    """`for_node` of every node, split into (resolvable, unresolvable) for `FailedNodes`
    and `FailedAndUnresolvableNodes`. O(nodes); in `kind` mode one dict lookup per node
    (a filter can name 10,000 nodes that do not fit)."""
    if mode == "kind":
        words = _KIND_REASONS
        return (
            {name: words[m.summary] for name, m in misfits.items() if m.resolvable},
            {name: words[m.summary] for name, m in misfits.items() if not m.resolvable},
        )
    return (
        {name: for_node(m, mode) for name, m in misfits.items() if m.resolvable},
        {name: for_node(m, mode) for name, m in misfits.items() if not m.resolvable},
    )


def summary(total: int, misfits: Mapping[str, fit.Misfit]) -> str:
    """'0/12 nodes: 9 no GPU with enough share free, 3 wrong GPU model' (most common
    kind first). O(nodes)."""
    counts = Counter(misfit.kind for misfit in misfits.values())
    fitting = total - len(misfits)
    parts = [
        f"{count} {kind.value}"
        for kind, count in sorted(counts.items(), key=lambda item: (-item[1], item[0].value))
    ]
    head = f"{max(fitting, 0)}/{total} nodes"
    return f"{head}: {', '.join(parts)}" if parts else head


def examples(misfits: Mapping[str, fit.Misfit], limit: int = 3) -> str:
    """One node's detail per kind, most common kind first: 'gpu-7: gpu 3: 40% free, needs
    50%; t4-0: GPU model T4, needs one of A100'."""
    first: dict[fit.MisfitKind, tuple[str, str]] = {}
    counts: Counter[fit.MisfitKind] = Counter()
    for node, misfit in sorted(misfits.items()):
        counts[misfit.kind] += 1
        first.setdefault(misfit.kind, (node, misfit.message))
    ordered = sorted(counts, key=lambda kind: (-counts[kind], kind.value))[:limit]
    return "; ".join(f"{first[kind][0]}: {first[kind][1]}" for kind in ordered)
