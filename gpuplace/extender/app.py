"""The extender's HTTP face: POST /filter, /prioritize, /bind, /preempt (kube-scheduler's
extender v1).

`create_app(service)` builds the aiohttp app; `Service` holds the verbs' collaborators.
Errors are mapped here, in one place:

- a body that is not the extender JSON → HTTP 400 with `{"Error": "..."}` saying what
  is wrong (kube-scheduler logs it); a body over `max_body_bytes` (preempt's:
  `preempt_max_body_bytes`), or naming more than `max_nodes` nodes → 413; not in within
  `read_timeout` → 408; compressed → 415, unread (kube-scheduler never compresses;
  nothing is inflated here); a caller gone mid-request → counted `dropped`, one DEBUG
  line, never an ERROR;
- a pod we cannot place, or a bind that did not happen → HTTP 200 with the protocol's
  own error channel (`FailedNodes`/`FailedAndUnresolvableNodes`, or `Error`), which
  kube-scheduler turns into its FailedScheduling event and retries;
- not synced with the API within `ready_timeout` → HTTP 200 with `Error`: no decision
  is ever taken from a partial ledger.

Every call is timed into `gpuplace_extender_request_duration_seconds{verb, result}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import hdrs, web
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import ValidationError

from gpuplace.cluster import grammar, recording
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender import binding, deciding, preempt_verb, reasons, repeating, wire_objects
from gpuplace.extender.activity import Activity
from gpuplace.extender.preempt_wire import PreemptionArgs, PreemptionResult
from gpuplace.extender.wire import (
    BindingArgs,
    BindingResult,
    ExtenderArgs,
    FilterResult,
    ranked_priorities_json,
)
from gpuplace.placement import requests
from gpuplace.placement.requests import GpuRequest

log = logging.getLogger(__name__)

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
NOT_SYNCED = "gpuplace is still syncing with the Kubernetes API; retry"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.duration = Histogram(
            "gpuplace_extender_request_duration_seconds",
            "Time to answer kube-scheduler, by verb and result.",
            ["verb", "result"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.ahead = Counter(
            "gpuplace_prioritize_ahead_total",
            "prioritize answers prepared right after filter: used, or stale (nodes or "
            "state changed in between, scored again).",
            ["result"],
            registry=registry,
        )


AHEAD_KEPT = 16
"""prioritize answers prepared ahead and not yet asked for, kept at most."""


@dataclass(frozen=True, slots=True)
class Ahead:
    """A prioritize answer prepared after filter: for `passed` at ledger `generation`."""

    generation: int
    passed: list[str]
    answer: bytes
    names_json: bytes
    """`passed` as filter's answer encoded them (see `ExtenderArgs.with_names`)."""
    loads: object = None
    """The measured loads its scores were tie-broken with (`Decider.current_loads`):
    used only while those are still the loads in force, the same object."""


@dataclass(slots=True)
class Service:
    """What the verbs need; built by the composition root (gpuplace.wiring.sidecar)."""

    sync: LedgerSync
    decider: deciding.Decider
    binder: binding.Binder
    recorder: recording.Recorder | None
    metrics: Metrics
    ready_timeout: float = 5.0
    max_body_bytes: int = 32 * 1024 * 1024
    preempt_max_body_bytes: int = 4 * 1024 * 1024
    """preempt's own limit (within `max_body_bytes`): its body is decoded in one
    stretch of the event loop, ~25 ms per MiB."""
    read_timeout: float = 10.0
    """Seconds a request body may take to arrive (then HTTP 408)."""
    max_nodes: int = 20_000
    """Nodes one filter or prioritize call may name (more: HTTP 413)."""
    activity: Activity = field(default_factory=Activity)
    """Verbs in flight (background work gives way to them)."""
    ahead: OrderedDict[str, Ahead] = field(default_factory=OrderedDict)
    """prioritize answers prepared right after filter, by pod UID (`AHEAD_KEPT` at most)."""
    repeats: repeating.Repeats | None = None
    """filter answers kept for kube-scheduler's repeats (`gpuplace.extender.repeating`;
    None: off)."""
    preempter: preempt_verb.Preempter | None = None
    """The preempt verb (None: kube-scheduler's victims are answered unchanged)."""

    async def ready(self) -> bool:
        if self.sync.ready.is_set():
            return True
        try:
            await asyncio.wait_for(self.sync.ready.wait(), self.ready_timeout)
        except TimeoutError:
            return False
        return True

    async def filter(self, args: ExtenderArgs) -> tuple[bytes, str, Then]:
        """filter's answer as JSON, its outcome, and, when prioritize for the same pod
        can be answered ahead, the preparation of that answer: the handler runs it once
        this answer is in the socket (`_send`), while kube-scheduler reads it before it
        calls prioritize for these nodes.

        An answer that no node passed is kept: a repeat of that filter while none of its
        nodes changed gets it again (`gpuplace.extender.repeating`). One that some node passed is
        not: its pod goes on to bind, or, with several nodes passed (a policy's tie) and a
        profile that names prioritize, to prioritize, whose answer this filter prepares
        ahead."""
        if not await self.ready():
            return FilterResult(error=NOT_SYNCED).dump_with_names()[0], "not-synced", None
        names = args.names()
        every = self.decider.every_node()
        repeat = self._repeatable(args)
        if repeat is not None and self.repeats is not None:
            kept = self.repeats.find(repeat, names)
            if kept is not None:
                if kept.failure:
                    self._report_failure(args, kept.failure)
                return kept.body, kept.outcome, None
        result, outcome, ahead_for, failure = self._filter(args, names)
        body, names_json = result.dump_with_names()
        if repeat is not None and self.repeats is not None and outcome == "none-fit":
            answer = repeating.Answer(body, outcome, failure)
            self.repeats.keep(
                repeat, names, answer, every=every is not None and names is every.names
            )
        if ahead_for and result.node_names is not None and names_json is not None:
            passed = result.node_names
            self.activity.expect_next()  # bind, or prioritize for a tie if the profile asks
            if len(passed) > 1:
                return body, outcome, lambda: self._answer_ahead(ahead_for, passed, names_json)
        return body, outcome, None

    def _repeatable(self, args: ExtenderArgs) -> GpuRequest | None:
        """The pod's GPU request when its filter answer depends on nothing of the pod's
        but that request (see `gpuplace.extender.repeating`), else None. O(1)."""
        if args.node_objects() is not None:
            return None
        try:
            request = self.decider.request(args.pod)
        except grammar.AnnotationError:
            return None
        if request is None:
            return None
        fences = self.decider.fences
        if fences is not None and fences.current is not None:
            return None
        uid = str((args.pod.get("metadata") or {}).get("uid") or "")
        if uid and self.sync.ledger.get(uid) is not None:
            return None
        return request

    def _filter(self, args: ExtenderArgs, names: list[str]) -> tuple[FilterResult, str, str, str]:
        """The answer, its outcome, the UID of the pod to answer prioritize ahead for
        ("" for none), and the FailedGpuPlacement message ("" for none)."""
        verdict = self.decider.filter(args.pod, names)
        # Failed nodes only when none passed (`Verdict.failed`): kube-scheduler reads
        # them only then. model_construct: built from our own values, validating 10,000
        # entries is waste
        result = FilterResult.model_construct(
            failed_nodes=verdict.failed, failed_and_unresolvable=verdict.unresolvable
        )
        objects = args.node_objects()
        if objects is None:
            result.node_names = verdict.passed
        else:
            result.nodes = {"items": [objects[name] for name in verdict.passed if name in objects]}
        if not verdict.passed and (verdict.gpu_pod or verdict.problem):
            failure = self._failure(names, verdict)
            self._report_failure(args, failure)
            return result, "none-fit", "", failure
        uid = str((args.pod.get("metadata") or {}).get("uid") or "")
        ahead = uid and verdict.gpu_pod and verdict.holding is None and objects is None
        return result, "ok", uid if ahead else "", ""

    def _answer_ahead(self, uid: str, passed: list[str], names_json: bytes) -> None:
        """Prepare prioritize's answer for the nodes filter passed (see `prioritize`)."""
        generation = self.sync.ledger.generation
        view = self.decider.current_loads()
        chosen = self.decider.chosen_ahead(uid, passed, view)
        if chosen is None:
            return
        answer = ranked_priorities_json(passed, chosen)
        self.ahead[uid] = Ahead(generation, passed, answer, names_json, view)
        self.ahead.move_to_end(uid)
        while len(self.ahead) > AHEAD_KEPT:
            self.ahead.popitem(last=False)

    @staticmethod
    def _failure(names: list[str], verdict: deciding.Verdict) -> str:
        """Why no node of `names` fits the pod (nothing that names the pod: a kept
        answer may be sent again for another pod of the same request)."""
        if verdict.problem:
            message = verdict.problem
        else:
            message = f"{reasons.summary(len(names), verdict.misfits)}"
            if verdict.request is not None:
                message = f"{message} (for {requests.describe(verdict.request)})"
            examples = reasons.examples(verdict.misfits)
            if examples:
                message = f"{message}; e.g. {examples}"
        return message

    def _report_failure(self, args: ExtenderArgs, failure: str) -> None:
        """Log and record (FailedGpuPlacement Event) that no node fits, and why."""
        metadata = args.pod.get("metadata") or {}
        namespace, name = str(metadata.get("namespace") or "default"), str(metadata["name"])
        message = f"{failure}. Node by node: gpuplace explain {namespace}/{name}"
        log.info("no node fits", extra={"pod": f"{namespace}/{name}", "why": message[:300]})
        if self.recorder is not None:
            self.recorder.emit(
                recording.Subject(namespace, name, str(metadata.get("uid") or "")),
                recording.WARNING,
                "FailedGpuPlacement",
                message,
            )

    def filter_args(self, raw: bytes) -> ExtenderArgs:
        """filter's arguments. When `NodeNames` are every node, as kube-scheduler usually
        sends them, they are compared as bytes with the set of every node's name rather
        than parsed (`ExtenderArgs.with_every_name`): ~3 ms less at 10,000 nodes, and
        the engine then knows them for every node by identity, with no lookup per name.
        Not before the first sync: the nodes are still arriving (each would rebuild the
        set, O(nodes)), and filter answers "syncing" from its arguments alone."""
        every = self.decider.every_node() if self.sync.ready.is_set() else None
        if every is not None:
            args = ExtenderArgs.with_every_name(raw, every)
            if args is not None:
                return args
        return ExtenderArgs.model_validate_json(raw)

    def prioritize_args(self, raw: bytes) -> ExtenderArgs:
        """prioritize's arguments. When its nodes are those of the answer prepared last
        (kube-scheduler's prioritize follows the pod's filter), byte for byte as filter
        wrote them, they are that answer's list as it is, not parsed again
        (`ExtenderArgs.with_names`; `prioritize`'s comparison of the lists then finds
        the very same strings)."""
        if self.ahead:
            latest = self.ahead[next(reversed(self.ahead))]
            args = ExtenderArgs.with_names(raw, latest.passed, latest.names_json)
            if args is not None:
                return args
        return ExtenderArgs.model_validate_json(raw)

    async def prioritize(self, args: ExtenderArgs) -> tuple[bytes, str]:
        """The nodes named and their scores, as JSON. The answer prepared ahead after
        this pod's filter is used when the nodes are those it passed and nothing the
        scores depend on changed since (ledger, policy, request, the loads in force;
        O(names) to compare); else scored now."""
        names = args.names()
        if not await self.ready():
            return b"[]", "not-synced"  # no scores: every node counts as 0
        uid = str((args.pod.get("metadata") or {}).get("uid") or "")
        ahead = self.ahead.pop(uid, None) if uid else None
        answer = None
        if ahead is not None:
            used = (
                ahead.passed == names
                and ahead.loads is self.decider.current_loads()
                and self.decider.still_current(args.pod, uid, ahead.generation)
            )
            self.metrics.ahead.labels("used" if used else "stale").inc()
            answer = ahead.answer if used else None
        if answer is None:
            answer = ranked_priorities_json(names, self.decider.chosen(args.pod, names))
        self.activity.expect_next()  # bind
        return answer, "ok"

    async def preempt(self, args: PreemptionArgs) -> tuple[PreemptionResult, str]:
        """Per candidate node, the victims that free one GPU set for the pod; nodes where
        none do are left out (`gpuplace.extender.preempt_verb`). Before the first sync: no node (an
        answer from a partial ledger could evict for nothing; kube-scheduler retries)."""
        if not await self.ready():
            return PreemptionResult(), "not-synced"
        if self.preempter is None:  # as offered, less the nodes with no victims
            offered = args.offered()
            return PreemptionResult(nodes={n: v for n, v in offered.items() if v[0]}), "ok"
        return await in_slices(self.preempter.answering(args)), "ok"

    async def bind(self, args: BindingArgs) -> tuple[BindingResult, str]:
        if not await self.ready():
            return BindingResult(error=NOT_SYNCED), "not-synced"
        try:
            await self.binder.bind(args)
        except binding.BindError as error:
            log.info(
                "bind refused",
                extra={
                    "pod": f"{args.pod_namespace}/{args.pod_name}",
                    "node": args.node,
                    "why": str(error)[:300],
                },
            )
            return BindingResult(error=str(error)), error.result
        return BindingResult(), "ok"


SERVICE = web.AppKey("gpuplace.extender", Service)

T = TypeVar("T")
SLICE_SECONDS = 0.005
"""How long a verb's work runs before it gives the event loop a turn (`in_slices`)."""


async def in_slices(steps: Generator[None, None, T]) -> T:
    """Run `steps` to its end, giving the event loop a turn whenever it has run for
    `SLICE_SECONDS` since the last: other verbs, `/readyz` and the informers then wait
    about that long at most for one step (a preempt call's node) to end, not for the
    whole of it."""
    until = time.perf_counter() + SLICE_SECONDS
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: T = done.value
            return result
        if time.perf_counter() >= until:
            await asyncio.sleep(0)
            until = time.perf_counter() + SLICE_SECONDS


class _RefusedError(Exception):
    """A request refused before any decision: HTTP `status`, `result` in the duration
    histogram, and what the answer's `Error` says."""

    def __init__(self, status: int, result: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.result = result
        self.message = message

    def response(self) -> web.Response:
        body = BindingResult(error=self.message[:2000]).dump()
        return web.Response(status=self.status, body=body, content_type="application/json")


IDENTITY = frozenset({"", "identity"})


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Then = Callable[[], None] | None
"""Work a verb leaves for after its answer is in the socket (see `_send`)."""


def _verb(
    verb: str, answer: Callable[[Service, bytes], Awaitable[tuple[bytes, str, Then]]]
) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        service = request.app[SERVICE]
        with service.activity:
            response, then = await _answered(verb, answer, service, request)
            try:
                await _send(request, response)
            except ConnectionError:  # the caller went away: nothing to answer to
                log.debug("client gone before its answer", extra={"verb": verb})
                return response
            if then is not None:
                try:
                    then()
                except Exception:  # the answer is sent; only the work ahead is lost
                    log.exception("preparing ahead after %s failed", verb)
        return response

    return handle


async def _answered(
    verb: str,
    answer: Callable[[Service, bytes], Awaitable[tuple[bytes, str, Then]]],
    service: Service,
    request: web.Request,
) -> tuple[web.Response, Then]:
    """The response to `request`, timed into the duration histogram (the answer's
    writing is not: the socket's pace is not ours)."""
    started = time.perf_counter()
    result = "bad-request"
    try:
        raw = await _body(verb, service, request)
        try:
            body, result, then = await answer(service, raw)
        except ValidationError as error:
            message = f"not a kube-scheduler {verb} request: {wire_objects.describe(error)}"
            raise _RefusedError(400, "bad-request", message) from None
        return web.Response(body=body, content_type="application/json"), then
    except _RefusedError as refused:
        result = refused.result
        return refused.response(), None
    finally:
        service.metrics.duration.labels(verb, result).observe(time.perf_counter() - started)


async def _body(verb: str, service: Service, request: web.Request) -> bytes:
    """The request's body as sent, or `_RefusedError`: compressed (415: kube-scheduler
    never compresses, and nothing is inflated here), over the verb's limit (413), not in
    within `read_timeout` seconds (408), or cut off by the caller (never answered)."""
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if encoding not in IDENTITY:
        message = f"Content-Encoding {encoding[:40]!r} is not accepted: send the body as is"
        raise _RefusedError(415, "unsupported-encoding", message)
    limit = service.preempt_max_body_bytes if verb == "preempt" else service.max_body_bytes
    too_large = _RefusedError(413, "too-large", f"the {verb} request body is over {limit} bytes")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        async with asyncio.timeout(service.read_timeout):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except TimeoutError:
        message = f"the {verb} request body did not arrive within {service.read_timeout} s"
        raise _RefusedError(408, "timeout", message) from None
    except ConnectionError:
        log.debug("client gone before its request body arrived", extra={"verb": verb})
        raise _RefusedError(400, "dropped", "the connection closed mid-body") from None
    if len(raw) > limit:  # sent chunked, with no Content-Length
        raise too_large
    return raw


async def _send(request: web.Request, response: web.Response) -> None:
    """Write `response` and return once the kernel holds every byte of it, with this
    verb still in flight (`Activity`). filter's and prioritize's answers at 10,000
    nodes (~200-300 KB) often do not fit the socket at once: the rest goes out when
    the socket is writable again, and whatever the event loop runs first (the next
    verb's preparation, a warmer slice, a watch event) would hold back kube-scheduler's
    read of it. A transport without a high-water mark pauses the writer until its
    buffer is empty, so `write_eof` returns only then. aiohttp sees the response
    already sent when the handler returns it."""
    transport = request.transport
    if transport is not None and transport.get_write_buffer_limits() != (0, 0):
        transport.set_write_buffer_limits(high=0)
    await response.prepare(request)
    await response.write_eof()


def _within_max_nodes(verb: str, service: Service, args: ExtenderArgs) -> ExtenderArgs:
    """`args`, unless they name more than `max_nodes` nodes: 413 (each node costs a few
    microseconds of the event loop and ~60 bytes of the answer). O(1) for `NodeNames`,
    O(nodes) for full `Nodes`."""
    named = len(args.names())
    if named > service.max_nodes:
        message = f"the {verb} request names {named} nodes, over {service.max_nodes}"
        raise _RefusedError(413, "too-large", message)
    return args


async def _filter(service: Service, raw: bytes) -> tuple[bytes, str, Then]:
    return await service.filter(_within_max_nodes("filter", service, service.filter_args(raw)))


async def _prioritize(service: Service, raw: bytes) -> tuple[bytes, str, Then]:
    args = _within_max_nodes("prioritize", service, service.prioritize_args(raw))
    body, outcome = await service.prioritize(args)
    return body, outcome, None


async def _preempt(service: Service, raw: bytes) -> tuple[bytes, str, Then]:
    result, outcome = await service.preempt(PreemptionArgs.model_validate_json(raw))
    return result.dump(), outcome, None


async def _bind(service: Service, raw: bytes) -> tuple[bytes, str, Then]:
    result, outcome = await service.bind(BindingArgs.model_validate_json(raw))
    return result.dump(), outcome, None


def create_app(service: Service) -> web.Application:
    app = web.Application(client_max_size=service.max_body_bytes)
    app[SERVICE] = service
    app.router.add_post("/filter", _verb("filter", _filter))
    app.router.add_post("/prioritize", _verb("prioritize", _prioritize))
    app.router.add_post("/bind", _verb("bind", _bind))
    app.router.add_post("/preempt", _verb("preempt", _preempt))
    return app
