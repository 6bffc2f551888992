"""The sidecar's link to the node agents: a node whose agent falls silent takes no new GPU pod.

Each node agent renews a heartbeat on its node (`gpuplace.cluster.nodes`), which the
ledger sync reads with every node event; with `--agent-silence-seconds` above 0,
`work(settings, sync)` is the watch that compares those heartbeats with the clock
(`LedgerSync.check_agents`) within a quarter of the bound, at most every
`CHECK_SECONDS`, closing the silent ones (their pods keep their GPUs) and opening those
that speak again. O(nodes) per pass, no API call. `--require-node-agent` (the sync's
`require_agent`) keeps GPU pods off nodes no agent ever reported on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from gpuplace.cluster.syncing import LedgerSync
from gpuplace.wiring.settings import SidecarSettings

CHECK_SECONDS = 5.0
"""How often node agents' heartbeats are compared with the clock, at most."""


async def watch(sync: LedgerSync, silence: float) -> None:
    """Close nodes whose agent fell silent for `silence` seconds, until cancelled."""
    period = min(CHECK_SECONDS, silence / 4)
    while True:
        await asyncio.sleep(period)
        sync.check_agents()


def work(settings: SidecarSettings, sync: LedgerSync) -> list[Coroutine[Any, Any, None]]:
    """The watch of the module docstring (none with `--agent-silence-seconds 0`)."""
    if settings.agent_silence_seconds <= 0:
        return []
    return [watch(sync, settings.agent_silence_seconds)]
