"""The scheduler extender's builder: the verbs kube-scheduler calls, and what keeps them
fast and right.

`build(settings, registry, api, sync, holder, ...)` makes, over the sidecar's ledger
(`sync`) and placement policy (`holder`): the filter and prioritize decider
(`gpuplace.extender.deciding`: the fences of a starving gang or queued workload, the
measured loads' tie-break, the process's one reading of a pod), the binder (which writes
the grant and the Binding), the preempt verb (it holds a preemptor's GPUs once
kube-scheduler acts), the repeats of filter answers no node passed, the shapes scored
ahead (`gpuplace.extender.warming`, which gives way to the verbs in flight), and the
aiohttp app (/filter, /prioritize, /bind, /preempt) for its own site. `Extender.work()`
is its background work (the warmer); `warn_without_c_helpers()` says at start which of the
optional C speed-ups is missing and what that costs.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from gpuplace.cluster import kube, pods, recording
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender import app as extender_app
from gpuplace.extender import (
    binding,
    c_helpers,
    deciding,
    load_polling,
    preempt_verb,
    repeating,
    warming,
    workloads,
)
from gpuplace.extender.activity import Activity
from gpuplace.placement.fences import Fences
from gpuplace.runtime import gc_tuning
from gpuplace.wiring.settings import SidecarSettings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Extender:
    """The extender's parts, built and not started."""

    activity: Activity
    """Extender verbs in flight: the warmer gives way to them."""
    warmer: warming.Warmer
    decider: deciding.Decider
    binder: binding.Binder
    preempter: preempt_verb.Preempter
    service: extender_app.Service
    app: web.Application

    def work(self, settings: SidecarSettings) -> list[Coroutine[Any, Any, None]]:
        """The coroutines to run as background tasks (each runs until cancelled)."""
        return [self.warmer.run()] if settings.warm_shapes > 0 else []


def build(
    settings: SidecarSettings,
    registry: CollectorRegistry,
    api: kube.Kube,
    sync: LedgerSync,
    holder: workloads.PolicyHolder,
    *,
    fences: Fences,
    recorder: recording.Recorder | None,
    loads: load_polling.LoadBoard | None,
    reader: pods.Reader,
) -> Extender:
    """The extender of the module docstring."""
    activity = Activity()
    warmer = warming.Warmer(
        sync,
        holder,
        shapes=settings.warm_shapes,
        pending_shapes=settings.warm_pending_shapes,
        interval=settings.warm_interval_seconds,
        registry=registry,
        activity=activity,
        freeze_young_above=gc_tuning.young_freeze_limit(
            settings.gc_freeze_seconds, settings.gc_full_seconds
        ),
    )
    decider = deciding.Decider(
        sync,
        holder,
        mode=settings.filter_reasons,
        registry=registry,
        fences=fences,
        loads=loads,
        reader=reader,
    )
    binder = binding.Binder(
        api, sync, decider, recorder=recorder, hold_seconds=settings.reservation_timeout_seconds
    )
    preempter = preempt_verb.Preempter(
        sync,
        decider.request,
        recorder=recorder,
        beyond_offered=settings.preempt_beyond_offered,
        max_nodes=settings.preempt_max_nodes,
        max_victims=settings.preempt_max_victims,
        hold_seconds=settings.reservation_timeout_seconds,
        registry=registry,
    )
    sync.pod_listeners.append(preempter.observe)
    service = extender_app.Service(
        sync=sync,
        decider=decider,
        binder=binder,
        recorder=recorder,
        metrics=extender_app.Metrics(registry),
        ready_timeout=settings.sync_wait_seconds,
        max_body_bytes=settings.extender_max_body_bytes,
        preempt_max_body_bytes=settings.preempt_max_body_bytes,
        read_timeout=settings.extender_read_timeout_seconds,
        max_nodes=settings.extender_max_nodes,
        activity=activity,
        repeats=(
            repeating.Repeats(sync, size=settings.filter_answers_kept, registry=registry)
            if settings.filter_answers_kept
            else None
        ),
        preempter=preempter,
    )
    app = extender_app.create_app(service)
    return Extender(activity, warmer, decider, binder, preempter, service, app)


def warn_without_c_helpers() -> None:
    """Log which optional C speed-up is not in use and what its absence costs."""
    for used, helper, without in (
        (
            c_helpers.NAME_SET is not None,
            "gpuplace.extender._node_names",
            "filter parses every node name, ~3 ms",
        ),
        (
            c_helpers.RANKED_JSON is not None,
            "gpuplace.extender._priorities",
            "prioritize's answers are made in Python, ~1.5 ms",
        ),
    ):
        if not used:
            log.warning(
                "%s (C) is not in use: %s more per pod at 10,000 nodes; install with a "
                "C compiler to build it, and leave %s unset",
                helper,
                without,
                c_helpers.SWITCH,
            )
