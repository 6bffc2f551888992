"""The sidecar's link to the node agents: a node whose agent falls silent takes no new GPU pod.

Each node agent renews a heartbeat on its node (`gpuplace.cluster.nodes`), which the
ledger sync reads with every node event; with `--agent-silence-seconds` above 0,
`work(settings, sync)` is the watch that compares those heartbeats with the clock
(`LedgerSync.check_agents`) within a quarter of the bound, at most every
`CHECK_SECONDS`, closing the silent ones (their pods keep their GPUs) and opening those
that speak again. O(nodes) per pass, no API call. `--require-node-agent` (the sync's
`require_agent`) keeps GPU pods off nodes no agent ever reported on. With
`--dra-silence-taints` (`silence_taints`), the same pass taints a silent DRA node's
ResourceSlice devices (`gpuplace.cluster.slice_taints`: API calls only for nodes that fell
silent since the last pass).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from prometheus_client import CollectorRegistry

from gpuplace.cluster import kube, slice_taints
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.wiring.settings import SidecarSettings

CHECK_SECONDS = 5.0
"""How often node agents' heartbeats are compared with the clock, at most."""


def silence_taints(
    settings: SidecarSettings, api: kube.Kube, registry: CollectorRegistry
) -> slice_taints.SilenceTaints | None:
    """The writer of silent DRA nodes' device taints (None without `--dra-silence-taints`)."""
    if not settings.dra_silence_taints:
        return None
    return slice_taints.SilenceTaints(
        api, silence=settings.agent_silence_seconds, registry=registry
    )


async def watch(
    sync: LedgerSync, silence: float, taints: slice_taints.SilenceTaints | None = None
) -> None:
    """Close nodes whose agent fell silent for `silence` seconds (and taint their DRA
    devices with `taints`), until cancelled."""
    period = min(CHECK_SECONDS, silence / 4)
    while True:
        await asyncio.sleep(period)
        sync.check_agents()
        if taints is not None:
            await taints.check(list(sync.nodes.values()))


def work(
    settings: SidecarSettings,
    sync: LedgerSync,
    taints: slice_taints.SilenceTaints | None = None,
) -> list[Coroutine[Any, Any, None]]:
    """The watch of the module docstring (none with `--agent-silence-seconds 0`)."""
    if settings.agent_silence_seconds <= 0:
        return []
    return [watch(sync, settings.agent_silence_seconds, taints)]
