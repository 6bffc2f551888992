"""The `gpuplace serve` process's settings: one frozen object per process, built once in
the entry point, and how any process's settings become flags.

`SidecarSettings` holds the scheduler sidecar's flags (`gpuplace.wiring.sidecar` and the
builders it composes read them); `Settings`, the process's one settings object, extends
it with the webhook's, the ops site's and the cluster's, and is what `gpuplace serve`
hands every builder (the node agent's process has its own,
`gpuplace.wiring.agent_settings.AgentSettings`). The settings live here and the modules
that are wired from them import them, never the other way round.

Every field is a command-line flag (`--webhook-port`) and an environment variable
(`GPUPLACE_WEBHOOK_PORT`); a flag wins over the variable, which wins over the default.
Nothing else in gpuplace reads `os.environ`: components get the values they need, as
arguments or as their own small config values built from this object.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuplace.cluster import nodes
from gpuplace.controllers import leader
from gpuplace.extender import repeating
from gpuplace.placement import choosing, policies
from gpuplace.usage import prometheus

ENV_PREFIX = "GPUPLACE_"
S = TypeVar("S", bound=BaseSettings)

LEASE_PATTERN = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


PLAN_PIN_HELP = (
    "plan, then pin: the webhook gates every GPU pod that is neither a gang member nor "
    "queued (gpuplace.io/place), the sidecar plans it with the engine and releases it "
    "with the planned node handed to kube-scheduler: nominate = as its nominated node "
    "(status.nominatedNodeName: tried first, every other node if it no longer fits), "
    "affinity = as its only node (metadata.name pinned in its node affinity: one write, "
    "but a node that fills meanwhile keeps the pod pending); off = no gate, the "
    "extender's filter chooses among every node (docs/placement.md)"
)
PLAN_PIN_DEFAULT = (
    "; off by default in serve: measured at 1,000 + 1,000 nodes (docs/performance.md), "
    "neither pin had per-pod p50 and p99 as good as plain pods' (its API writes cost the "
    "API server more than they save kube-scheduler)"
)


class SidecarSettings(BaseSettings):
    """The scheduler sidecar's flags (`gpuplace.wiring.sidecar` and its builders read
    them); each is also an env var GPUPLACE_<NAME>. `gangs` and `queues` are off here (a
    bare sidecar, as the extender tests build it); `Settings`, the `gpuplace serve`
    process's, turns them on. `plan_pin` is off in both (measured: `PLAN_PIN_DEFAULT`)."""

    model_config = SettingsConfigDict(env_prefix="GPUPLACE_", frozen=True, extra="ignore")

    kubeconfig: Path | None = Field(
        None, description="kubeconfig for the API (default: in-cluster service account)"
    )
    policy: Literal["default", "fgd", "best-fit", "first-fit", "random"] = Field(
        "default", description=f"placement policy, one of {', '.join(policies.NAMES)}"
    )
    workload_window: int = Field(
        10_000, ge=1, description="recent managed pods whose requests form the typical workload"
    )
    workload_refresh_seconds: float = Field(
        60.0,
        ge=0,
        description="rebuild the typical workload at most this often (0: whenever a pod "
        "arrived; every node is then scored anew for each new pod)",
    )
    reservation_timeout_seconds: float = Field(
        300.0,
        gt=0,
        description="a reservation whose pod is not bound within this time is released",
    )
    reap_interval_seconds: float = Field(
        10.0, gt=0, description="how often expired reservations are looked for"
    )
    filter_reasons: Literal["kind", "detail"] = Field(
        "kind",
        description="per-node filter reasons: the misfit kind (aggregates well in "
        "kube-scheduler's event) or each node's detail",
    )
    sync_wait_seconds: float = Field(
        5.0, gt=0, description="how long a verb waits for the informers' first sync"
    )
    kube_timeout_seconds: float = Field(
        4.0, gt=0, description="timeout of one API request (keep below the extender httpTimeout)"
    )
    watch_timeout_seconds: int = Field(
        300, ge=10, description="server-side timeout of one watch request"
    )
    list_page_size: int = Field(500, ge=1, description="objects per list page")
    advertise_resources: bool = Field(
        True, description="write gpu-percent/gpu-memory on managed nodes' status"
    )
    node_status_min_interval_seconds: float = Field(
        30.0, ge=0, description="at most one node status patch per node this often"
    )
    pod_events: bool = Field(True, description="write Events on pods (placement failures...)")
    extender_max_body_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="larger extender requests get HTTP 413"
    )
    extender_max_nodes: int = Field(
        20_000,
        ge=1,
        description="filter and prioritize requests naming more nodes than this get HTTP 413",
    )
    extender_read_timeout_seconds: float = Field(
        10.0, gt=0, description="an extender request body not received within this gets HTTP 408"
    )
    warm_shapes: int = Field(
        64,
        ge=0,
        le=choosing.EVALUATIONS_KEPT // 2,
        description="score every node ahead for this many of the most common request "
        "shapes, and fill a rebuilt policy before it decides (0 = off: a shape's first "
        "filter scores every node)",
    )
    warm_pending_shapes: int = Field(
        16,
        ge=0,
        le=choosing.EVALUATIONS_KEPT // 4,
        description="also score ahead this many other request shapes of pods waiting for "
        "a node, most waiting first (a backlog's rare shapes; needs --warm-shapes > 0)",
    )
    warm_interval_seconds: float = Field(
        0.2,
        gt=0,
        description="bring the shapes scored ahead up to date this often (a filter re-scores "
        "the nodes changed since itself)",
    )
    filter_answers_kept: int = Field(
        repeating.KEPT,
        ge=0,
        description="keep this many filter answers that no node passed, and send one again "
        "when kube-scheduler repeats that filter (same request, same nodes) and none of "
        "those nodes changed since (0 = off: every filter decides anew)",
    )
    gc_young_seconds: float = Field(
        0.1,
        ge=0,
        description="collect the young generations this often, while they are small "
        "(0 = only when CPython decides)",
    )
    gc_freeze_seconds: float = Field(
        10.0,
        ge=0,
        description="freeze long-lived objects for the collector this often (0 = never)",
    )
    gc_full_seconds: float = Field(
        3600.0, ge=0, description="a full unfrozen collection this often (0 = never)"
    )
    gangs: bool = Field(
        False,
        description="run the gang controller: plan complete gangs all at once, reserve "
        "their GPUs and remove their scheduling gates together",
    )
    plan_pin: Literal["nominate", "affinity", "off"] = Field(
        "off",
        description=PLAN_PIN_HELP,
    )
    scheduler_lease: str = Field(
        f"{leader.LEASE_NAMESPACE}/{leader.LEASE_NAME}",
        pattern=LEASE_PATTERN,
        description="kube-scheduler's leader-election Lease (NAMESPACE/NAME): the gang "
        "controller plans only while this pod's kube-scheduler holds it; empty = always "
        "(a single replica)",
    )
    queues: bool = Field(
        False,
        description="run the queue controller: GPU pods whose namespace or annotation names "
        "a GpuQueue wait behind its gate until the queue's quota and a free GPU cover them "
        "(needs the GpuQueue CRD; the webhook reads the queues from this sidecar)",
    )
    queue_window: int = Field(
        100,
        ge=1,
        description="waiting workloads per queue one admission round looks at (the most "
        "urgent; the rest wait their turn)",
    )
    queue_min_round_seconds: float = Field(
        1.0,
        ge=0,
        description="admission rounds that decide are at least this far apart (a round at "
        "1,000 nodes costs 1-2 s on the event loop the extender shares)",
    )
    queue_fair_sharing_half_life_seconds: float = Field(
        0.0,
        ge=0,
        description="fair sharing over time: each GpuQueue's share is remembered, decayed "
        "with this half-life, and added to its share while it borrows, so a queue held "
        "below the others for long goes first and may preempt past their share (0: off; "
        "docs/queues.md)",
    )
    queue_hold_after_seconds: float = Field(
        0.0,
        ge=0,
        description="capacity holds for queues: a queued workload of several GPUs that "
        "has waited this long, of the queue furthest below its fair share, gets nodes "
        "kept for it (no new pod there) while they drain (0: off; docs/queues.md)",
    )
    gang_starve_after_seconds: float = Field(
        120.0,
        gt=0,
        description="a complete gang at the head of the queue that has not fit for this "
        "long gets a capacity hold: its nodes are not offered to other pods",
    )
    preempt_beyond_offered: bool = Field(
        True,
        description="preempt: where no selection of kube-scheduler's victims on a node frees "
        "one GPU set, also consider the node's other pods of lower priority than the "
        "preemptor (kube-scheduler picks on node totals; false: drop such nodes)",
    )
    preempt_max_nodes: int = Field(
        1000,
        ge=1,
        description="preempt: candidate nodes one call considers, in kube-scheduler's order "
        "(it sends at most max(100, a tenth of the nodes) by default); the others are left out",
    )
    preempt_max_victims: int = Field(
        1000,
        ge=1,
        description="preempt: a node offered with more victims than this is left out (a "
        "node holds at most its kubelet's max-pods, 110 by default)",
    )
    preempt_max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="larger preempt requests get HTTP 413 (~90,000 victims; decoding one "
        "holds the event loop, ~25 ms per MiB)",
    )
    agent_silence_seconds: float = Field(
        nodes.DEFAULT_AGENT_SILENCE,
        ge=0,
        description="no new GPU pods go on a node whose node agent has not renewed its "
        "heartbeat for this long (pods already there keep their GPUs; 0 = never close a "
        "node for silence); nodes no agent ever reported on are not affected unless "
        "--require-node-agent",
    )
    dra_silence_taints: bool = Field(
        False,
        description="some nodes run the node agent as a DRA kubelet plugin: when one's "
        "heartbeat is older than --agent-silence-seconds, taint its ResourceSlice's "
        "devices NoSchedule (gpu.gpuplace.io/agent-silent) so that kube-scheduler allocates "
        "none of them; needs deploy/components/dra's RBAC (docs/dra.md)",
    )
    dra_claims: Literal["off", "fallback", "prefer"] = Field(
        "off",
        description="which annotated GPU pods the webhook sends to DRA nodes (nodes "
        "labelled gpuplace.io/dra=true, deploy/components/dra), as a ResourceClaim the "
        "sidecar creates, instead of the device-plugin path: off = none; fallback = those "
        "no device-plugin node could ever hold and a DRA node could (on a cluster of DRA "
        "nodes only: all); prefer = every pod a DRA node could hold; the sidecar then also "
        "mirrors every ResourceClaim into its ledger (docs/dra.md)",
    )
    dra_pin: Literal["engine", "first-fit"] = Field(
        "engine",
        description="with --dra-claims: where a DRA pod's claim lands: engine = on the GPUs "
        "gpuplace's engine plans (the policy, gangs' and queues' plans), the claim pinned "
        "to their UUIDs, planned anew when they are taken meanwhile; first-fit = no pin, "
        "kube-scheduler's DRA allocator takes the first device that fits (docs/dra.md)",
    )
    require_node_agent: bool = Field(
        False,
        description="place GPU pods only on nodes whose node agent reports (else nodes "
        "without one are placed on from GPU Feature Discovery labels alone)",
    )
    load_aware: bool = Field(
        False,
        description="among nodes and GPUs the policy scores exactly alike, prefer those "
        "whose measured load (GPU utilisation, from Prometheus) is lower; never changes "
        "which nodes fit nor admits more than was granted",
    )
    load_window_seconds: float = Field(
        300.0, gt=0, description="with --load-aware: GPU load is averaged over this window"
    )
    load_refresh_seconds: float = Field(
        30.0,
        gt=0,
        description="with --load-aware: read GPU loads this often (a read taking longer fails)",
    )
    load_max_age_seconds: float = Field(
        120.0,
        gt=0,
        description="with --load-aware: loads older than this (reads failing) break no "
        "ties; decisions are then the policy's alone",
    )
    usage_prometheus: str | None = Field(
        None,
        description="Prometheus base URL to read measured GPU use from (needed by "
        "--load-aware), e.g. http://prometheus.monitoring:9090",
    )
    usage_metrics: Literal["gpuplace", "dcgm"] = Field(
        "gpuplace",
        description="which series --usage-prometheus holds: the node agent's (gpuplace) or "
        "NVIDIA dcgm-exporter's (dcgm)",
    )
    usage_token_file: Path | None = Field(
        None,
        description="file with a bearer token for --usage-prometheus (read at each query, "
        "never logged)",
    )
    usage_step_seconds: float = Field(
        prometheus.STEP_SECONDS,
        ge=0.001,
        le=3600,
        description="the scrape interval of the --usage-prometheus series: loads are "
        "averaged over the de-duplicated series at this step",
    )

    @field_validator("usage_prometheus")
    @classmethod
    def _prometheus_url(cls, value: str | None) -> str | None:
        """An http(s) URL with a host, checked before anything connects (empty: none)."""
        return prometheus.check_url(value) if value else None

    @field_validator("usage_token_file")
    @classmethod
    def _one_credential(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return prometheus.check_credentials(info.data.get("usage_prometheus"), value)


class Settings(SidecarSettings):
    """Webhook, ops and cluster flags; the scheduler sidecar's flags come from
    `SidecarSettings` (the sidecar is handed this object itself: one settings object per
    process)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")

    # --- webhook (TLS) --------------------------------------------------------------------
    webhook_address: str = Field("0.0.0.0", description="address the webhook listens on")
    webhook_port: int = Field(8443, ge=0, le=65535, description="webhook HTTPS port")
    cert_file: Path = Field(
        Path("/etc/gpuplace/tls/tls.crt"), description="serving certificate (PEM, with chain)"
    )
    key_file: Path = Field(Path("/etc/gpuplace/tls/tls.key"), description="its private key (PEM)")
    tls_reload_seconds: float = Field(
        10.0, gt=0, description="how often the cert and key files are checked for changes"
    )
    scheduler_name: str = Field(
        "gpuplace", min_length=1, description="kube-scheduler profile set on GPU pods"
    )
    sidecar_user: str = Field(
        "system:serviceaccount:gpuplace:gpuplace",
        min_length=1,
        description="the only user allowed to write the system (assignment) annotations",
    )
    max_body_bytes: int = Field(
        3 * 1024 * 1024, ge=1024, description="larger admission review bodies get HTTP 413"
    )
    read_timeout_seconds: float = Field(
        10.0, gt=0, description="a review body not received within this time gets HTTP 408"
    )
    node_agent: bool = Field(
        False,
        description="GPU nodes run gpuplace node-agent: GPU containers request gpuplace.io/gpu "
        "(its device plugin gives them their GPUs and MPS limits) and the webhook writes no "
        "GPU env vars",
    )
    dra_scheduler_name: str = Field(
        "default-scheduler",
        min_length=1,
        description="with --dra-claims: spec.schedulerName of the pods sent to DRA nodes, the "
        "cluster's scheduler that allocates ResourceClaims (one DRA allocator for every "
        "claim: two schedulers do not see each other's allocations in flight)",
    )
    audit_log: str = Field(
        "-", min_length=1, description="audit log file, one JSON line per review; - = stdout"
    )
    audit_log_max_bytes: int = Field(
        100 * 1024 * 1024, ge=0, description="rotate the audit log file at this size (0 = never)"
    )
    audit_log_backups: int = Field(5, ge=0, description="rotated audit log files kept")

    # --- scheduler extender (plain HTTP on loopback) -----------------------------------------
    extender_address: str = Field("127.0.0.1", description="address the extender listens on")
    extender_port: int = Field(8888, ge=0, le=65535, description="extender HTTP port")

    # --- every site (ops, webhook, extender) ----------------------------------------------
    http_head_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="a request head (request line and headers) not received in full within "
        "this long of its first byte, or of a new connection, closes the connection; also "
        "the TLS handshake's deadline",
    )
    http_idle_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description="close a connection idle between two requests after this long (keep it "
        "above the 90 s Go clients keep theirs: kube-scheduler, the API server)",
    )

    # --- operations ----------------------------------------------------------------------
    metrics_address: str = Field("0.0.0.0", description="address of /metrics /healthz /readyz")
    metrics_port: int = Field(9090, ge=0, le=65535, description="plain HTTP port of the above")
    shutdown_delay_seconds: float = Field(
        0.0,
        ge=0,
        description="on SIGTERM, answer /readyz 503 this long before closing the listeners",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="threshold of the JSON process log (stderr)"
    )

    # --- cluster ---------------------------------------------------------------------------
    inventory: Path | None = Field(
        None,
        description="offline node inventory (`kubectl get nodes -o json`) instead of the API; "
        "the webhook alone then runs (no scheduler extender)",
    )
    inventory_reload_seconds: float = Field(
        10.0, gt=0, description="how often --inventory is checked for changes"
    )
    gangs: bool = Field(
        True,
        description="run the gang controller: plan complete gangs all at once, reserve "
        "their GPUs and remove their scheduling gates together",
    )
    plan_pin: Literal["nominate", "affinity", "off"] = Field(
        "off", description=PLAN_PIN_HELP + PLAN_PIN_DEFAULT
    )
    queues: bool = Field(
        True,
        description="run the queue controller: GPU pods whose namespace or annotation names "
        "a GpuQueue wait behind its gate until the queue's quota and a free GPU cover them "
        "(needs the GpuQueue CRD; the webhook reads the queues from this sidecar)",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, model: type[BaseSettings] = Settings) -> None:
    """One flag per field of `model`; absent flags leave the field to the env or default."""
    for name, info in model.model_fields.items():
        default = "required" if info.is_required() else info.default
        parser.add_argument(
            flag(name),
            dest=name,
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            help=f"{info.description} (env {ENV_PREFIX}{name.upper()}, default {default})",
        )


def from_arguments(args: argparse.Namespace | Mapping[str, Any]) -> Settings:
    """Settings from parsed flags (only those given), the environment and the defaults."""
    return build(Settings, args)


def build_or_explain(
    model: type[S], args: argparse.Namespace | Mapping[str, Any], command: str
) -> S | None:
    """`build`, or None after printing each invalid setting by its flag to stderr
    (`gpuplace COMMAND: --flag: why`); the command then exits 2."""
    try:
        return build(model, args)
    except ValidationError as error:
        for item in error.errors(include_url=False):
            name = ".".join(str(part) for part in item["loc"])
            message = item["msg"].removeprefix("Value error, ")
            print(f"gpuplace {command}: {flag(name)}: {message}", file=sys.stderr)
        return None


def build(model: type[S], args: argparse.Namespace | Mapping[str, Any]) -> S:
    """`model` from parsed flags (only those given), the environment and the defaults."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    given = {name: value for name, value in values.items() if name in model.model_fields}
    return model(**given)
