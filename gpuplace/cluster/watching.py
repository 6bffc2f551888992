"""Informers: a local, current copy of one kind of object, kept by list + watch.

The contract (client-go's reflector, which kube-scheduler itself relies on):

1. list (in pages of `page_size`; all pages come from one snapshot), hand the whole
   state to the handler (`replace`), remember the list's resourceVersion, set `synced`;
2. watch from that resourceVersion with `allowWatchBookmarks`; every ADDED/MODIFIED/
   DELETED goes to the handler (`upsert`/`delete`) and advances the resourceVersion,
   a BOOKMARK only advances it;
3. when the server ends the watch (its timeout) resume from the last resourceVersion:
   no relist, nothing missed;
4. on 410 Gone (HTTP, or an ERROR event with code 410), or an expired list `continue`,
   the resourceVersion is too old to resume from: relist and `replace`;
5. any other failure: wait (exponential backoff with jitter, reset by a healthy watch)
   and retry the same step.

Objects are keyed by UID and stored after `transform` (a slim record, not the dict:
100,000 pods as raw dicts would take gigabytes). resourceVersions are opaque strings,
never compared. `synced` stays set once the first list is in: decisions wait for it,
and a relist replaces the state atomically (the handler gets one `replace`).
The handler runs synchronously in the event loop and must not block.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuplace.cluster import kube
from gpuplace.runtime import gc_tuning

log = logging.getLogger(__name__)

T = TypeVar("T")


class Handler(Protocol[T]):
    """Receives an informer's changes, synchronously, in the order the API made them."""

    def replace(self, objects: list[T]) -> None: ...

    def upsert(self, obj: T) -> None: ...

    def delete(self, obj: T) -> None: ...


class TooOldError(Exception):
    """The resourceVersion to resume from is too old: relist."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: waits in [0, min(cap, first × 2^n)]."""

    first: float = 0.2
    cap: float = 30.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap, self.first * (2 ** min(attempt, 30))))


class InformerMetrics:
    """Informer counters and gauges, labelled by resource (`nodes`, `pods`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "gpuplace_informer_events_total",
            "Watch events received, by resource and type.",
            ["resource", "type"],
            registry=registry,
        )
        self.lists = Counter(
            "gpuplace_informer_lists_total",
            "Full lists, by resource and why (start, gone).",
            ["resource", "reason"],
            registry=registry,
        )
        self.failures = Counter(
            "gpuplace_informer_failures_total",
            "Failed list or watch requests, by resource.",
            ["resource"],
            registry=registry,
        )
        self.objects = Gauge(
            "gpuplace_informer_objects",
            "Objects in the informer's cache, by resource.",
            ["resource"],
            registry=registry,
        )
        self.synced = Gauge(
            "gpuplace_informer_synced",
            "1 once the informer's first list is in, by resource.",
            ["resource"],
            registry=registry,
        )


class Informer(Generic[T]):
    """List + watch of one kind into a handler; see the module docstring."""

    def __init__(
        self,
        api: kube.Kube,
        kind: kube.Kind,
        handler: Handler[T],
        transform: Callable[[dict[str, Any]], T],
        *,
        label_selector: str = "",
        field_selector: str = "",
        page_size: int = 500,
        watch_seconds: int = 300,
        backoff: Backoff = Backoff(),
        metrics: InformerMetrics | None = None,
    ) -> None:
        self.api = api
        self.kind: kube.Kind = kind
        self.handler = handler
        self.transform = transform
        self.label_selector = label_selector
        self.field_selector = field_selector
        """e.g. `spec.nodeName=NODE`: the node agent watches only its own node's pods."""
        self.page_size = page_size
        self.watch_seconds = watch_seconds
        self.backoff = backoff
        self.metrics = metrics
        self.objects: dict[str, T] = {}
        """The cache: transformed objects by UID."""
        self.resource_version = ""
        self.synced = asyncio.Event()
        self.last_event = 0.0
        """time.monotonic() of the last list or watch event (bookmarks included)."""

    # --- the loop ----------------------------------------------------------------

    async def run(self) -> None:
        """List, then watch forever (until cancelled). Never raises otherwise."""
        failures = 0
        reason = "start"
        while True:
            try:
                if not self.resource_version:
                    await self.relist(reason)
                    failures = 0
                started = time.monotonic()
                received = await self._watch()
                if received or time.monotonic() - started > 1.0:
                    failures = 0
                else:
                    failures += 1
                    await asyncio.sleep(self.backoff.delay(failures))
            except TooOldError:
                log.info("resource version too old, relisting", extra={"resource": self.kind})
                self.resource_version = ""
                reason = "gone"
            except kube.ApiError as error:
                failures += 1
                if self.metrics is not None:
                    self.metrics.failures.labels(self.kind).inc()
                delay = self.backoff.delay(failures)
                log.warning(
                    "list or watch failed, retrying",
                    extra={
                        "resource": self.kind,
                        "status": error.status,
                        "reason": error.reason,
                        "error": error.message,
                        "retry_seconds": round(delay, 2),
                    },
                )
                await asyncio.sleep(delay)

    async def relist(self, reason: str = "start") -> None:
        """List everything now and `replace` the handler's state. Raises ApiError, TooOldError.

        Each page is turned into records as it arrives (the raw dicts die with it), and
        the cyclic garbage collector is paused meanwhile (`gpuplace.runtime.gc_tuning.paused`):
        collecting while a list of 100,000 objects is being built traverses them again
        and again and makes the list several times slower; nothing built here is cyclic
        garbage."""
        objects: dict[str, T] = {}
        token = ""
        resource_version = ""
        with gc_tuning.paused():
            fetching = asyncio.ensure_future(self._page(""))
            try:
                while True:
                    page = await fetching
                    metadata = page.get("metadata") or {}
                    resource_version = resource_version or str(
                        metadata.get("resourceVersion") or ""
                    )
                    token = str(metadata.get("continue") or "")
                    if token:  # the server prepares the next page while we read this one
                        fetching = asyncio.ensure_future(self._page(token))
                    for item in page.get("items") or []:
                        if isinstance(item, dict):
                            uid = _uid(item)
                            converted = self._convert(item)
                            if uid and converted is not None:
                                objects[uid] = converted
                    del page
                    if not token:
                        break
                self.objects = objects
                self.handler.replace(list(objects.values()))
            finally:
                if not fetching.done():
                    fetching.cancel()
        self.resource_version = resource_version
        self.last_event = time.monotonic()
        if self.metrics is not None:
            self.metrics.lists.labels(self.kind, reason).inc()
            self.metrics.objects.labels(self.kind).set(len(objects))
            self.metrics.synced.labels(self.kind).set(1)
        if not self.synced.is_set():
            log.info("informer synced", extra={"resource": self.kind, "objects": len(objects)})
        self.synced.set()

    async def _page(self, token: str) -> dict[str, Any]:
        try:
            return await self.api.list_page(
                self.kind,
                label_selector=self.label_selector,
                field_selector=self.field_selector,
                limit=self.page_size,
                token=token,
            )
        except kube.ApiError as error:
            if error.gone and token:
                raise TooOldError() from error
            raise

    async def _watch(self) -> int:
        """One watch request; returns how many events came. Raises TooOldError, ApiError."""
        received = 0
        try:
            stream = self.api.watch(
                self.kind,
                resource_version=self.resource_version,
                label_selector=self.label_selector,
                field_selector=self.field_selector,
                timeout_seconds=self.watch_seconds,
            )
            async for event in stream:
                received += 1
                self._apply(event)
        except kube.ApiError as error:
            if error.gone:
                raise TooOldError() from error
            raise
        return received

    def _apply(self, event: dict[str, Any]) -> None:
        kind = str(event.get("type") or "")
        raw = event.get("object")
        if not isinstance(raw, dict):
            raise kube.ApiError(200, "Undecodable", f"watch event {kind} without an object")
        self.last_event = time.monotonic()
        if self.metrics is not None:
            self.metrics.events.labels(self.kind, kind or "UNKNOWN").inc()
        if kind == "ERROR":
            error = kube.ApiError.from_status(int(raw.get("code") or 500), raw)
            if error.gone:
                raise TooOldError()
            raise error
        version = str((raw.get("metadata") or {}).get("resourceVersion") or "")
        if kind == "BOOKMARK":
            if version:
                self.resource_version = version
            return
        uid = _uid(raw)
        if kind in ("ADDED", "MODIFIED"):
            converted = self._convert(raw)
            if uid and converted is not None:
                self.objects[uid] = converted
                self.handler.upsert(converted)
        elif kind == "DELETED":
            old = self.objects.pop(uid, None)
            gone = old if old is not None else self._convert(raw)
            if gone is not None:
                self.handler.delete(gone)
        else:
            log.warning("unknown watch event type", extra={"resource": self.kind, "type": kind})
        if version:
            self.resource_version = version
        if self.metrics is not None:
            self.metrics.objects.labels(self.kind).set(len(self.objects))

    def _convert(self, raw: dict[str, Any]) -> T | None:
        try:
            return self.transform(raw)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            metadata = raw.get("metadata") or {}
            log.warning(
                "object skipped: cannot read it",
                extra={
                    "resource": self.kind,
                    "namespace": metadata.get("namespace"),
                    "name": metadata.get("name"),
                    "error": str(error)[:200],
                },
            )
            return None


def _uid(raw: dict[str, Any]) -> str:
    return str((raw.get("metadata") or {}).get("uid") or "")
