"""The webhook's aiohttp application: `POST /mutate` and `POST /validate`.

The one place where failures become HTTP: a compressed body → 415 (never inflated), a
body over the limit → 413, not received in time → 408, not an AdmissionReview v1 → 400,
each with a JSON body `{"error": …}` (a caller gone mid-body is counted `dropped`); a
decision (allowed or denied) → 200 with the AdmissionReview answer. Each review is timed,
counted and written to the audit log. A bug is answered 500 (and logged) rather than
allowed: whether a failing webhook blocks pods is the webhook configuration's
`failurePolicy`, not this code's choice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import hdrs, web

from gpuplace.webhook import admission, pods, reviews
from gpuplace.webhook.auditing import AuditLog
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import CapabilitySource
from gpuplace.webhook.metrics import WebhookMetrics
from gpuplace.webhook.queueing import QueueSource
from gpuplace.webhook.tls import CertificateReloader

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", WebhookConfig)
REVIEWER = web.AppKey("reviewer", admission.Reviewer)
AUDIT = web.AppKey("audit", AuditLog)
METRICS = web.AppKey("metrics", WebhookMetrics)

Decide = Callable[[admission.Reviewer, reviews.AdmissionRequest], admission.Decision]


class _RefusedError(Exception):
    """The HTTP request itself is refused before any review (400, 408, 413)."""

    def __init__(self, status: int, result: str, error: str, details: tuple[str, ...] = ()):
        super().__init__(error)
        self.status = status
        self.result = result
        self.error = error
        self.details = details


def _json(status: int, body: dict[str, Any]) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
        content_type="application/json",
    )


async def _body(request: web.Request, config: WebhookConfig) -> bytes:
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if encoding not in ("", "identity"):  # the API server never compresses a review
        message = f"Content-Encoding {encoding[:40]!r} is not accepted: send the review as is"
        raise _RefusedError(415, "unsupported_encoding", message)
    limit = config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _RefusedError(413, "too_large", f"the body is larger than {limit} bytes")
    try:
        async with asyncio.timeout(config.read_timeout_seconds):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _RefusedError(413, "too_large", f"the body is larger than {limit} bytes") from None
    except TimeoutError:
        raise _RefusedError(
            408, "timeout", f"the body was not received within {config.read_timeout_seconds}s"
        ) from None
    except ConnectionError:  # the caller went away mid-body: nobody to answer
        log.debug("client gone before its review arrived")
        raise _RefusedError(400, "dropped", "the connection closed mid-body") from None


def _handler(endpoint: str, decide: Decide) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        started = time.perf_counter()
        app = request.app
        metrics, audit = app[METRICS], app[AUDIT]
        review: reviews.AdmissionReview | None = None
        decision: admission.Decision | None = None
        try:
            body = await _body(request, app[CONFIG])
            try:
                review = reviews.parse(body)
                decision = decide(app[REVIEWER], review.request)
            except reviews.ReviewError as error:
                raise _RefusedError(400, "malformed", error.message, error.details) from None
        except _RefusedError as refused:
            elapsed = time.perf_counter() - started
            metrics.observe(endpoint, "", refused.result, elapsed)
            uid = review.request.uid if review is not None else ""
            audit.write(
                endpoint=endpoint,
                decision=refused.result,
                reason=refused.result,
                latency_seconds=elapsed,
                uid=uid,
                message=refused.error,
            )
            body_out: dict[str, Any] = {"error": refused.error}
            if refused.details:
                body_out["details"] = list(refused.details)
            return _json(refused.status, body_out)
        except Exception:
            elapsed = time.perf_counter() - started
            log.exception("review failed", extra={"endpoint": endpoint})
            metrics.observe(endpoint, "", "error", elapsed)
            audit.write(
                endpoint=endpoint,
                decision="error",
                reason="error",
                latency_seconds=elapsed,
                uid=review.request.uid if review is not None else "",
            )
            return _json(500, {"error": "internal error; see the gpuplace logs"})
        assert review is not None and decision is not None
        return _answer(
            endpoint, review.request, decision, started=started, metrics=metrics, audit=audit
        )

    return handle


def _answer(
    endpoint: str,
    request: reviews.AdmissionRequest,
    decision: admission.Decision,
    *,
    started: float,
    metrics: WebhookMetrics,
    audit: AuditLog,
) -> web.Response:
    audit_annotations: dict[str, str] = {"decision": decision.reason}
    if decision.spec is not None:
        audit_annotations["request"] = admission.describe(decision.spec)
    if decision.queue:
        audit_annotations["queue"] = decision.queue
    if decision.allowed:
        answer = reviews.allowed(
            request.uid, patch=decision.ops, warnings=decision.warnings, audit=audit_annotations
        )
        result = "allowed"
    else:
        answer = reviews.denied(
            request.uid,
            code=decision.code,
            reason=decision.status_reason,
            message=decision.message,
            warnings=decision.warnings,
            audit=audit_annotations,
        )
        result = "denied"
    response = _json(200, answer)
    elapsed = time.perf_counter() - started
    metrics.observe(endpoint, request.operation, result, elapsed, decision.reason)
    if decision.ops:
        metrics.patch_operations.labels(endpoint).inc(len(decision.ops))
    pod = request.object if request.object is not None else request.old_object
    name, generate_name = pods.display_name(pod, request.name)
    audit.write(
        endpoint=endpoint,
        decision=result,
        reason=decision.reason,
        latency_seconds=elapsed,
        uid=request.uid,
        operation=request.operation,
        kind=request.kind.kind,
        namespace=request.namespace,
        name=name,
        generate_name=generate_name,
        user=request.user_info.username,
        dry_run=request.dry_run,
        annotations=_gpuplace_annotations(pod),
        message=decision.message,
        patch=decision.paths,
        warnings=decision.warnings,
        gpu_queue=decision.queue,
    )
    return response


def _gpuplace_annotations(pod: dict[str, Any] | None) -> dict[str, str]:
    if pod is None:
        return {}
    meta = pod.get("metadata")
    values = meta.get("annotations") if isinstance(meta, dict) else None
    if not isinstance(values, dict):
        return {}
    return {k: str(v) for k, v in values.items() if isinstance(k, str) and pods.is_ours(k)}


def create_app(
    config: WebhookConfig,
    source: CapabilitySource,
    audit: AuditLog,
    metrics: WebhookMetrics,
    *,
    certificates: CertificateReloader | None = None,
    queues: QueueSource | None = None,
) -> web.Application:
    """The webhook application. With `certificates`, its reload poll runs while the app
    runs (serve it with `certificates.context`); `queues`: which queue a GPU pod uses
    (None: queues are off)."""
    app = web.Application(client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[REVIEWER] = admission.Reviewer(config, source, queues)
    app[AUDIT] = audit
    app[METRICS] = metrics
    app.router.add_post("/mutate", _handler("mutate", admission.Reviewer.mutate))
    app.router.add_post("/validate", _handler("validate", admission.Reviewer.validate))
    if certificates is not None:

        async def reload_certificates(_: web.Application) -> AsyncIterator[None]:
            async with certificates.watching():
                yield

        app.cleanup_ctx.append(reload_certificates)
    return app
