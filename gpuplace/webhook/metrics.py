"""The webhook's Prometheus metrics, registered on the registry the process passes in.

- `gpuplace_admission_reviews_total{endpoint,result}`: reviews answered; result is
  allowed, denied, malformed (HTTP 400), too_large (413), timeout (408),
  unsupported_encoding (415), dropped (the caller went away mid-body) or error (500).
- `gpuplace_admission_duration_seconds{endpoint,operation,result}`: time from the request
  line to the answer, body read included.
- `gpuplace_admission_denials_total{endpoint,reason}`: denials by machine reason.
- `gpuplace_admission_patch_operations_total{endpoint}`: JSON Patch operations sent.
- `gpuplace_webhook_certificate_reloads_total{result}` and
  `gpuplace_webhook_certificate_expiry_timestamp_seconds`: serving certificate.

No pod, namespace or user names as labels: label values come from fixed small sets.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RESULTS = (
    "allowed",
    "denied",
    "malformed",
    "too_large",
    "timeout",
    "unsupported_encoding",
    "dropped",
    "error",
)
ENDPOINTS = ("mutate", "validate")


class WebhookMetrics:
    __slots__ = (
        "certificate_expiry",
        "certificate_reloads",
        "denials",
        "duration",
        "patch_operations",
        "reviews",
    )

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reviews = Counter(
            "gpuplace_admission_reviews_total",
            "Admission reviews answered, by endpoint and result.",
            ("endpoint", "result"),
            registry=registry,
        )
        self.duration = Histogram(
            "gpuplace_admission_duration_seconds",
            "Time to answer an admission review, body read included.",
            ("endpoint", "operation", "result"),
            buckets=BUCKETS,
            registry=registry,
        )
        self.denials = Counter(
            "gpuplace_admission_denials_total",
            "Admission reviews denied, by endpoint and reason.",
            ("endpoint", "reason"),
            registry=registry,
        )
        self.patch_operations = Counter(
            "gpuplace_admission_patch_operations_total",
            "JSON Patch operations sent in mutating answers.",
            ("endpoint",),
            registry=registry,
        )
        self.certificate_reloads = Counter(
            "gpuplace_webhook_certificate_reloads_total",
            "Serving certificate reloads after the files changed, by result.",
            ("result",),
            registry=registry,
        )
        self.certificate_expiry = Gauge(
            "gpuplace_webhook_certificate_expiry_timestamp_seconds",
            "notAfter of the serving certificate in use, Unix time.",
            registry=registry,
        )
        for endpoint in ENDPOINTS:
            for result in RESULTS:
                self.reviews.labels(endpoint, result)
        for result in ("ok", "failed"):
            self.certificate_reloads.labels(result)

    def observe(
        self, endpoint: str, operation: str, result: str, seconds: float, reason: str = ""
    ) -> None:
        self.reviews.labels(endpoint, result).inc()
        self.duration.labels(endpoint, operation or "none", result).observe(seconds)
        if result == "denied":
            self.denials.labels(endpoint, reason).inc()
