"""The webhook's own settings, a frozen value built by the composition root from the
process settings (the webhook never reads the environment or `gpuplace.wiring.settings`)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 3 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    scheduler_name: str = "gpuplace"
    """schedulerName set on GPU pods: the kube-scheduler profile that calls the extender."""
    sidecar_user: str = "system:serviceaccount:gpuplace:gpuplace"
    """The only user allowed to set or change the system (assignment) annotations."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Larger review bodies are answered 413."""
    read_timeout_seconds: float = 10.0
    """A body not received within this time is answered 408."""
    node_agent: bool = False
    """GPU nodes run `gpuplace node-agent`: GPU containers request `gpuplace.io/gpu` and get
    their GPUs and MPS env from its device plugin; the webhook writes no GPU env vars."""
    place_gate: bool = False
    """The sidecar of this process plans every GPU pod that is neither a gang member nor
    queued (`--plan-pin`): such a pod gets the scheduling gate `gpuplace.io/place`, which
    the planner removes once it has handed kube-scheduler the planned node."""
    dra_claims: str = "off"
    """Which annotated pods go to DRA nodes (`--dra-claims`): `off` (none), `fallback`
    (those no device-plugin node could hold and a DRA node could), `prefer` (every one a
    DRA node could hold); see `gpuplace.webhook.admission.Reviewer.path`."""
    dra_scheduler_name: str = "default-scheduler"
    """`spec.schedulerName` of a pod sent to DRA nodes: the cluster's DRA allocator."""
