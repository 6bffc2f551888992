"""The process settings: one frozen object per process, built once in the entry point.

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

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuplace.wiring.sidecar import SidecarSettings

ENV_PREFIX = "GPUPLACE_"
S = TypeVar("S", bound=BaseSettings)


class Settings(SidecarSettings):
    """Webhook, ops and cluster flags; the scheduler sidecar's flags come from
    `gpuplace.wiring.sidecar.SidecarSettings` (the sidecar is handed this object itself: one
    settings object per process)."""

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
