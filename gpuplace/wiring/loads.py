"""The load-aware tie-break's builder (`--load-aware`): measured GPU loads, read in the
background.

`build(settings, registry, reader, clock)` makes, with `--load-aware`, the board of
measured GPU loads that breaks the policy's exact ties (`gpuplace.extender.load_polling
.LoadBoard`, whose age `clock` measures; `gpuplace.placement.load_ties`) and the poller
that fills it every `--load-refresh-seconds` from a `gpuplace.usage.gpu_loads.LoadReader`
that `reader()` makes; without `--load-aware`, None. `gpuplace serve` passes the
Prometheus reader `--usage-prometheus`, `--usage-metrics` and `--usage-token-file` name
(`prometheus_reader`, through `gpuplace.wiring.composing.compose`); with no reader at
all, `--load-aware` refuses to start (`NoLoadReader`). `Loads.close()` closes a reader
that has an `aclose()` or `close()` when the sidecar stops (the protocol asks for none).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from gpuplace.extender import load_polling
from gpuplace.usage import prometheus
from gpuplace.usage.gpu_loads import LoadReader
from gpuplace.wiring.settings import SidecarSettings

log = logging.getLogger(__name__)


class NoLoadReader(ValueError):
    """`--load-aware` without a source of measured GPU loads."""


NO_LOAD_READER = (
    "--load-aware needs a source of measured GPU loads: set --usage-prometheus to a "
    "Prometheus that scrapes the node agents (or dcgm-exporter, with --usage-metrics=dcgm)"
)


@dataclass(slots=True)
class Loads:
    """The measured GPU loads and their poller, built and not started (`poller.run()`)."""

    board: load_polling.LoadBoard
    poller: load_polling.LoadPoller

    async def close(self) -> None:
        """Close the reader when it can be closed (an `aclose()` or `close()`, awaited when
        it returns an awaitable: an HTTP session to Prometheus). Never raises."""
        reader = self.poller.reader
        close = getattr(reader, "aclose", None) or getattr(reader, "close", None)
        if not callable(close):
            return
        try:
            result = close()
            if inspect.isawaitable(result):
                await result
        except Exception as error:  # stopping anyway: only logged, by type (its text may
            # carry what the reader was given)
            log.warning(
                "closing the reader of GPU loads failed", extra={"error": type(error).__name__}
            )


def check(settings: SidecarSettings, reader: Callable[[], LoadReader] | None) -> None:
    """Raise `NoLoadReader` when `--load-aware` has no reader (before anything connects)."""
    if settings.load_aware and reader is None:
        raise NoLoadReader(NO_LOAD_READER)


def build(
    settings: SidecarSettings,
    registry: CollectorRegistry,
    reader: Callable[[], LoadReader] | None,
    clock: Callable[[], float],
) -> Loads | None:
    """The loads of the module docstring (None without `--load-aware`). Raises
    `NoLoadReader`."""
    if not settings.load_aware:
        return None
    check(settings, reader)
    assert reader is not None
    board = load_polling.LoadBoard(settings.load_max_age_seconds, clock=clock)
    poller = load_polling.LoadPoller(
        reader(),
        board,
        window_seconds=settings.load_window_seconds,
        refresh_seconds=settings.load_refresh_seconds,
        registry=registry,
    )
    return Loads(board, poller)


def prometheus_reader(settings: SidecarSettings) -> Callable[[], LoadReader]:
    """The factory of the reader of measured GPU loads that `--usage-prometheus`,
    `--usage-metrics` and `--usage-token-file` name."""
    assert settings.usage_prometheus is not None
    source = prometheus.Source(
        url=settings.usage_prometheus,
        metrics=settings.usage_metrics,
        token_file=settings.usage_token_file,
        step_seconds=settings.usage_step_seconds,
    )
    return lambda: prometheus.Reader(source)
