"""The decisions: what `/mutate` and `/validate` answer for one AdmissionRequest.

`Reviewer.mutate` and `Reviewer.validate` return a `Decision` — allowed with an optional
patch, or denied with an HTTP-like status code, a machine reason and a message that names
the annotation and the accepted form. They raise `reviews.ReviewError` only for a request
that is not a usable review (→ HTTP 400). Every reason string is stable: it labels the
metrics and the audit log.

Which way a GPU pod goes (`Reviewer.path`): with `--dra-claims` off, the device-plugin path
(extended resources, the extender); otherwise to DRA nodes (a ResourceClaim) when a DRA node
could hold it and, with `fallback`, no device-plugin node could; the webhook cannot know the
node, only what each path's nodes could ever hold. A pod the webhook sent to DRA nodes is
known by its claim entry (`gpuplace.cluster.dra_claims`), so `/validate` judges it on the
path it took, whatever the inventory says a moment later.

Fast path: a pod without any `gpuplace.io/` annotation is allowed unpatched after one scan
of its annotation keys. Nothing here does I/O or keeps state between reviews; `dryRun`
reviews get exactly the same decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuplace.cluster import dra_claims, grammar, keys
from gpuplace.webhook import capacity, mutating, patches, pods
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import CapabilitySource
from gpuplace.webhook.queueing import QueueSource
from gpuplace.webhook.reviews import AdmissionRequest, ReviewError

# Allowed.
NOT_A_POD = "not-a-pod"
IGNORED_OPERATION = "ignored-operation"
NO_ANNOTATIONS = "no-gpuplace-annotations"
NO_GPU_REQUEST = "no-gpu-request"
MUTATED = "mutated"
UNCHANGED = "already-mutated"
UPDATE = "update"
VALID = "valid"
# Denied.
INVALID_ANNOTATION = "invalid-annotation"
INVALID_POD = "invalid-pod"
UNSATISFIABLE = "unsatisfiable"
INVENTORY_UNKNOWN = "inventory-unknown"
NOT_MUTATED = "not-mutated"
FORGED = "forged-system-annotation"
CHANGED = "annotation-changed"
UNMANAGED = "managed-label-removed"
FOREIGN_RESOURCE = "foreign-resource"
QUEUE_UNKNOWN = "queue-unknown"
"""The pod's queue does not exist or cannot be used (or queues are off)."""
QUEUE_FORBIDDEN = "queue-forbidden"
"""The pod's namespace may not use its queue."""
QUEUES_UNKNOWN = "queues-unknown"
"""gpuplace has not read the queues and namespaces yet."""

DENIAL_REASONS = (
    INVALID_ANNOTATION,
    INVALID_POD,
    UNSATISFIABLE,
    INVENTORY_UNKNOWN,
    NOT_MUTATED,
    FORGED,
    CHANGED,
    FOREIGN_RESOURCE,
    QUEUE_UNKNOWN,
    QUEUE_FORBIDDEN,
    QUEUES_UNKNOWN,
)
MAX_PATHS_SHOWN = 6

DEVICE_PLUGIN = "device-plugin"
DRA = "dra"
PATHS = (DEVICE_PLUGIN, DRA)
"""A GPU pod's way to its GPUs: extended resources and the extender, or a ResourceClaim."""


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reason: str
    """Stable machine reason (see the constants above)."""
    message: str = ""
    """For a denial: what is wrong and the accepted form."""
    code: int = 200
    status_reason: str = ""
    """metav1 StatusReason of a denial: Invalid, Forbidden, ServiceUnavailable."""
    ops: list[dict[str, Any]] = field(default_factory=list)
    warnings: tuple[str, ...] = ()
    spec: grammar.PodGpuSpec | None = None
    queue: str = ""
    """The GpuQueue the pod waits in ("" for none): for the audit annotations and log."""

    @property
    def paths(self) -> list[str]:
        return [op["path"] for op in self.ops]


def _allow(reason: str, **extra: Any) -> Decision:
    return Decision(True, reason, **extra)


def _invalid(reason: str, message: str, spec: grammar.PodGpuSpec | None = None) -> Decision:
    return Decision(False, reason, message, 422, "Invalid", spec=spec)


def _forbidden(reason: str, message: str, spec: grammar.PodGpuSpec | None = None) -> Decision:
    return Decision(False, reason, message, 403, "Forbidden", spec=spec)


def describe(spec: grammar.PodGpuSpec) -> str:
    """The request in one line, for audit annotations: `count=1 percent=50 memory=20Gi`."""
    parts = [f"count={spec.count}", f"percent={spec.percent}"]
    if spec.memory_only:
        parts.append("memory-only")
    if spec.memory_mib:
        parts.append(f"memory={capacity.memory_text(spec.memory_mib)}")
    if spec.models:
        parts.append(f"models={'|'.join(spec.models)}")
    if spec.count > 1:
        parts.append(f"topology={spec.topology.value}")
    if spec.gang is not None:
        low = f"{spec.gang.minimum}.." if spec.gang.elastic else ""
        parts.append(f"gang={spec.gang.name}/{low}{spec.gang.size}")
    return " ".join(parts)


class Reviewer:
    """Decides reviews for one configuration, one source of capabilities and, where
    queues are on, one source of queues."""

    __slots__ = ("config", "queues", "source")

    def __init__(
        self, config: WebhookConfig, source: CapabilitySource, queues: QueueSource | None = None
    ) -> None:
        self.config = config
        self.source = source
        self.queues = queues
        """Which queue a pod uses (None: queues are off; `gpuplace.webhook.queueing`)."""

    def _queue(self, namespace: str, spec: grammar.PodGpuSpec) -> tuple[str, str] | Decision:
        """(queue, where it came from) for a GPU pod ("" for none), or the denial."""
        if self.queues is None:
            if spec.queue is None:
                return "", ""
            return _invalid(
                QUEUE_UNKNOWN,
                f"{keys.QUEUE}={spec.queue}: this gpuplace runs without GpuQueues (serve "
                f"--queues false, or an offline webhook), so nothing would admit the pod; "
                f"remove {keys.QUEUE}",
                spec,
            )
        if not self.queues.synced():
            return Decision(
                False,
                QUEUES_UNKNOWN,
                "gpuplace has not read the cluster's GpuQueues and namespaces yet, so it "
                "cannot tell which queue this pod waits in; retry in a minute",
                503,
                "ServiceUnavailable",
                spec=spec,
            )
        found = self.queues.resolve(namespace, spec.queue)
        if found.refusal:
            if found.forbidden:
                return _forbidden(QUEUE_FORBIDDEN, found.refusal, spec)
            return _invalid(QUEUE_UNKNOWN, found.refusal, spec)
        return found.queue, found.source

    def path(self, spec: grammar.PodGpuSpec) -> str:
        """`DRA` or `DEVICE_PLUGIN`: where a new pod asking `spec` goes (module
        docstring). Not knowing the inventory yet, `prefer` says DRA (the validating
        webhook then refuses the pod until it is known). O(models)."""
        mode = self.config.dra_claims
        if mode == "off":
            return DEVICE_PLUGIN
        paths = self.source.paths()
        if paths is None:
            return DRA if mode == "prefer" else DEVICE_PLUGIN
        if capacity.misfit(spec, paths.dra) is not None:
            return DEVICE_PLUGIN
        if mode == "prefer" or capacity.misfit(spec, paths.device_plugin) is not None:
            return DRA
        return DEVICE_PLUGIN

    def taken(self, pod: Mapping[str, Any]) -> str:
        """The path a mutated pod took: DRA when it carries gpuplace's claim entry (and
        claims are on: off, such a pod is judged as the device-plugin path wants it)."""
        if self.config.dra_claims != "off" and dra_claims.entry(pod) is not None:
            return DRA
        return DEVICE_PLUGIN

    # --- /mutate ----------------------------------------------------------------------------

    def mutate(self, request: AdmissionRequest) -> Decision:
        if not request.is_pod:
            return _allow(NOT_A_POD)
        if request.operation != "CREATE":
            # Most of a pod's spec is immutable after creation: never patch an UPDATE.
            return _allow(UPDATE if request.operation == "UPDATE" else IGNORED_OPERATION)
        pod = _object(request)
        values = pods.annotations_of(pod)
        if not pods.has_gpuplace_key(values):
            return _allow(NO_ANNOTATIONS)
        try:
            spec = grammar.parse(values)
        except grammar.AnnotationError as error:
            return _invalid(INVALID_ANNOTATION, error.message)
        if spec is None:
            return _allow(NO_GPU_REQUEST)
        try:
            container, problems = pods.problems(pod, spec)
        except grammar.AnnotationError as error:
            return _invalid(INVALID_ANNOTATION, error.message, spec)
        if problems:
            return _invalid(INVALID_POD, "; ".join(problems), spec)
        queued = self._queue(request.namespace, spec)
        if isinstance(queued, Decision):
            return queued
        queue, source = queued
        claim = ""
        if self.path(spec) == DRA:
            metadata = pod.get("metadata") or {}
            base = str(metadata.get("name") or metadata.get("generateName") or "")
            claim = dra_claims.claim_name(base, request.uid)
        mutation = _build(
            pod, spec, container, self.config, queue=queue, source=source, claim=claim
        )
        return _allow(
            MUTATED if mutation.ops else UNCHANGED,
            ops=mutation.ops,
            warnings=mutation.warnings,
            spec=spec,
            queue=queue,
        )

    # --- /validate --------------------------------------------------------------------------

    def validate(self, request: AdmissionRequest) -> Decision:
        if not request.is_pod:
            return _allow(NOT_A_POD)
        if request.operation == "CREATE":
            return self._validate_create(request)
        if request.operation == "UPDATE":
            return self._validate_update(request)
        return _allow(IGNORED_OPERATION)

    def _validate_create(self, request: AdmissionRequest) -> Decision:
        pod = _object(request)
        values = pods.annotations_of(pod)
        if not pods.has_gpuplace_key(values):
            return self._plain_pod(pod)
        forged = pods.system_annotations(values)
        if forged and request.user_info.username != self.config.sidecar_user:
            return _forbidden(FORGED, _forged_message(sorted(forged)))
        try:
            spec = grammar.parse(values)
        except grammar.AnnotationError as error:
            return _invalid(INVALID_ANNOTATION, error.message)
        if spec is None:
            return self._plain_pod(pod)
        try:
            container, problems = pods.problems(pod, spec)
        except grammar.AnnotationError as error:
            return _invalid(INVALID_ANNOTATION, error.message, spec)
        if problems:
            return _invalid(INVALID_POD, "; ".join(problems), spec)
        capabilities = self.source.capabilities()
        if capabilities is None:
            return Decision(
                False,
                INVENTORY_UNKNOWN,
                "gpuplace has not read the cluster's GPU inventory yet, so it cannot tell "
                "whether any GPU could hold this pod; retry in a minute",
                503,
                "ServiceUnavailable",
                spec=spec,
            )
        why = capacity.misfit(spec, capabilities)
        if why is None and spec.gang is not None and spec.gang.domain is not None:
            try:
                asked = spec.to_request(*grammar.pod_requests(pod))
            except grammar.AnnotationError as error:
                return _invalid(INVALID_POD, error.message, spec)
            why = capacity.domain_misfit(spec, asked, capabilities)
        if why is not None:
            return _invalid(UNSATISFIABLE, why, spec)
        queued = self._queue(request.namespace, spec)
        if isinstance(queued, Decision):
            return queued
        queue, source = queued
        if self.taken(pod) == DRA and not dra_claims.named(pod):
            return _invalid(
                INVALID_POD,
                f"spec.resourceClaims[{dra_claims.ENTRY}] is gpuplace's: it names the "
                "ResourceClaim gpuplace creates for the pod (resourceClaimName); remove it, "
                "gpuplace writes it",
                spec,
            )
        leftover = _build(
            pod,
            spec,
            container,
            self.config,
            queue=queue,
            source=source,
            claim=dra_claims.named(pod) or "-" if self.taken(pod) == DRA else "",
        )
        if leftover.ops:
            shown = ", ".join(_parts(leftover.patch.paths()))
            return _forbidden(
                NOT_MUTATED,
                "this pod has gpuplace annotations but the gpuplace mutating webhook did not "
                f"process it (still to set: {shown}); check that the "
                "MutatingWebhookConfiguration of gpuplace is installed and matches this "
                "namespace",
                spec,
            )
        return _allow(VALID, spec=spec, queue=queue)

    def _plain_pod(self, pod: Mapping[str, Any]) -> Decision:
        for index, container in enumerate(pods.containers(pod)):
            names = pods.requests_our_resources(container)
            if names:
                return _invalid(
                    FOREIGN_RESOURCE,
                    f"spec.containers[{index}] ({container['name']}) requests "
                    f"{', '.join(names)} without gpuplace annotations: ask for GPUs with the "
                    f"annotations {keys.GPU_PERCENT} or {keys.GPU_COUNT} instead",
                )
        return _allow(NO_ANNOTATIONS)

    def _validate_update(self, request: AdmissionRequest) -> Decision:
        new = pods.annotations_of(_object(request))
        old = pods.annotations_of(request.old_object)
        if not pods.has_gpuplace_key(new) and not pods.has_gpuplace_key(old):
            return _allow(NO_ANNOTATIONS)
        new_system, old_system = pods.system_annotations(new), pods.system_annotations(old)
        if new_system != old_system and request.user_info.username != self.config.sidecar_user:
            changed = sorted(
                key
                for key in new_system.keys() | old_system.keys()
                if new_system.get(key) != old_system.get(key)
            )
            return _forbidden(FORGED, _forged_message(changed))
        if (
            pods.string_map(request.old_object or {}, "labels").get(keys.MANAGED) == "true"
            and pods.string_map(_object(request), "labels").get(keys.MANAGED) != "true"
            and request.user_info.username != self.config.sidecar_user
        ):
            return _forbidden(
                UNMANAGED,
                f"the label {keys.MANAGED}=true cannot be removed or changed while the pod "
                "carries gpuplace annotations: gpuplace would stop seeing the pod and give its "
                "GPUs to others while it still runs; delete the pod instead",
            )
        new_user = _user_keys(new)
        old_user = _user_keys(old)
        if new_user != old_user:
            try:
                grammar.parse(new)
            except grammar.AnnotationError as error:
                return _invalid(INVALID_ANNOTATION, error.message)
            changed = sorted(
                key
                for key in new_user.keys() | old_user.keys()
                if new_user.get(key) != old_user.get(key)
            )
            return _invalid(
                CHANGED,
                f"{', '.join(changed)} cannot change once the pod exists (its resources, "
                "scheduler and affinity were set from them at creation); delete the pod and "
                "create it again",
            )
        return _allow(UPDATE)


def _parts(paths: list[str]) -> list[str]:
    """Patch paths as the pod fields a user knows: `/spec/containers/0/env/-` → `env`."""
    parts: list[str] = []
    for path in paths:
        tokens = [*path.split("/"), "", "", ""]
        part = tokens[4] if tokens[2] == "containers" else tokens[2]
        if part not in parts:
            parts.append(part)
    return parts


def _object(request: AdmissionRequest) -> dict[str, Any]:
    if request.object is None:
        raise ReviewError(f"request.object is required for {request.operation}")
    return request.object


def _user_keys(values: Mapping[str, str]) -> dict[str, str]:
    """gpuplace keys that are not system annotations (user ones and unknown ones)."""
    return {
        key: value
        for key, value in values.items()
        if key.startswith(keys.PREFIX) and key not in keys.SYSTEM_ANNOTATIONS
    }


def _forged_message(names: list[str]) -> str:
    shown = ", ".join(name[:80] for name in names[:MAX_PATHS_SHOWN])
    return (
        f"{shown} may only be set or changed by gpuplace itself: they record which GPUs the "
        "scheduler granted, and a hand-written value would hand out GPUs nobody granted"
    )


def _build(
    pod: Mapping[str, Any],
    spec: grammar.PodGpuSpec,
    container: int,
    config: WebhookConfig,
    *,
    queue: str = "",
    source: str = "",
    claim: str = "",
) -> mutating.Mutation:
    try:
        return mutating.build(
            pod,
            spec,
            container,
            config.scheduler_name,
            node_agent=config.node_agent,
            place_gate=config.place_gate,
            queue=queue,
            queue_source=source,
            claim=claim,
            dra_scheduler_name=config.dra_scheduler_name,
            dra_nodes=config.dra_claims != "off",
        )
    except patches.PatchError as error:
        raise ReviewError(f"request.object has an impossible shape: {error}") from None
