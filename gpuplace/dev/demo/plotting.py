"""The demo's picture: per-GPU occupancy at the end, as a PNG.

One bar per GPU, grouped by node (nodes grouped by GPU model, shaded), stacked by the
pods holding a share of it (height = compute share, one colour per pod, gang members
hatched; a memory-only share, which holds no compute, is dotted and as high as its share
of the GPU's memory), with a black tick at the GPU memory held on it (a whole GPU's: all of it).
Drawn with matplotlib's Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

from gpuplace.placement.ledger import Ledger
from gpuplace.placement.requests import WHOLE


def plot(
    path: Path,
    ledger: Ledger,
    pod_names: Mapping[str, str],
    *,
    gang_pods: frozenset[str] = frozenset(),
    title: str = "",
) -> None:
    """Write the PNG. `pod_names` maps pod UID → "namespace/name"; `gang_pods` are UIDs."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    states = sorted(
        (state for state in ledger.states() if state.node.gpus),
        key=lambda state: (state.node.model, state.node.name),
    )
    whole = {(g.node, index) for g in ledger if g.milli >= WHOLE for index in g.gpus}
    by_node: dict[str, list[tuple[str, tuple[int, ...], int, int]]] = {}
    order: list[str] = []
    memory_only = {g.pod_uid for g in ledger if g.memory_only}
    for grant in sorted(ledger, key=lambda g: pod_names.get(g.pod_uid, g.pod_uid)):
        by_node.setdefault(grant.node, []).append(
            (grant.pod_uid, grant.gpus, grant.milli, grant.memory_mib)
        )
        if grant.pod_uid not in order:
            order.append(grant.pod_uid)
    # tab20 and tab20b, dark shades first, so that neighbours differ
    shades = [*range(0, 20, 2), *range(1, 20, 2)]
    palette = [colormaps[name](index) for index in shades for name in ("tab20", "tab20b")]
    colour = {uid: palette[i % len(palette)] for i, uid in enumerate(order)}

    figure = Figure(figsize=(22, 9), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    x = 0.0
    ticks: list[float] = []
    labels: list[str] = []
    model_spans: dict[str, list[float]] = {}
    for state in states:
        node = state.node
        start = x
        for gpu in node.gpus:
            bottom = 0.0
            for uid, gpus, milli, memory in by_node.get(node.name, []):
                if gpu.index not in gpus:
                    continue
                height = 100.0 * milli / WHOLE
                if uid in memory_only and gpu.memory_mib:
                    # No compute granted: the bar shows its memory, dotted.
                    height = 100.0 * memory / gpu.memory_mib
                axes.bar(
                    x,
                    height,
                    bottom=bottom,
                    width=0.85,
                    color=colour[uid],
                    edgecolor="white",
                    linewidth=0.4,
                    hatch=_hatch(uid, gang_pods, memory_only),
                )
                bottom += height
            if gpu.memory_mib:
                taken = gpu.memory_mib - state.free_memory[gpu.index]
                if (node.name, gpu.index) in whole:
                    taken = gpu.memory_mib  # a whole GPU's memory is all its holder's
                reserved = 100.0 * taken / gpu.memory_mib
                axes.plot([x - 0.42, x + 0.42], [reserved, reserved], color="black", linewidth=1.2)
            x += 1.0
        ticks.append((start + x - 1.0) / 2)
        labels.append(node.name)
        span = model_spans.setdefault(node.model, [start - 0.5, x - 0.5])
        span[1] = x - 0.5
        x += 1.0
    for index, (model, (left, right)) in enumerate(model_spans.items()):
        if index % 2 == 0:
            axes.axvspan(left - 0.5, right + 0.5, color="0.94", zorder=0)
        axes.text(
            (left + right) / 2,
            103,
            model.removeprefix("NVIDIA-"),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    axes.set_xticks(ticks)
    axes.set_xticklabels(labels, rotation=90, fontsize=7)
    axes.set_xlim(-1.0, max(x - 1.0, 1.0))
    axes.set_ylim(0, 112)
    axes.set_yticks([0, 25, 50, 75, 100])
    axes.set_ylabel("% of the GPU's compute granted (bars) / memory reserved (black ticks)")
    axes.set_title(title or "gpuplace demo: per-GPU occupancy")
    axes.grid(True, axis="y", linewidth=0.3)
    handles = [
        Patch(
            facecolor=colour[uid],
            hatch=_hatch(uid, gang_pods, memory_only),
            label=pod_names.get(uid, uid) + (" (memory only)" if uid in memory_only else ""),
        )
        for uid in order
    ]
    if handles:
        axes.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.16),
            ncol=8,
            fontsize=7,
            frameon=False,
        )
    figure.tight_layout()
    figure.savefig(path, format="png")


def _hatch(uid: str, gang_pods: Collection[str], memory_only: Collection[str]) -> str | None:
    """Gang members hatched, memory-only shares (memory, no compute) dotted."""
    if uid in gang_pods:
        return "//"
    return ".." if uid in memory_only else None
