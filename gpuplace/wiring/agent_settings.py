"""The node agent's settings (`gpuplace node-agent`): one frozen object per process, built
once in the entry point, like `gpuplace.wiring.settings` for `gpuplace serve`.

Every field is a flag (`--node-name`) and an environment variable (`GPUPLACE_NODE_NAME`); a
flag wins over the variable, which wins over the default.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuplace.agent import mps as agent_mps
from gpuplace.agent import overgrant, usage_sampling
from gpuplace.placement.inventory import ClientContext
from gpuplace.wiring.settings import ENV_PREFIX


class AgentSettings(BaseSettings):
    """What one node agent needs to know; see docs/node-agent.md."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")

    # --- the node and the API ---------------------------------------------------------------
    node_name: str = Field(
        min_length=1,
        description="the Node this agent runs on (the DaemonSet passes spec.nodeName)",
    )
    kubeconfig: Path | None = Field(
        None, description="kubeconfig for the API (default: in-cluster service account)"
    )
    kube_timeout_seconds: float = Field(10.0, gt=0, description="seconds for one API request")

    # --- discovery and publishing ------------------------------------------------------------
    nvml_replay: Path | None = Field(
        None,
        description="answer NVML from this captured reading (nvml-*.json) instead of the "
        "driver, read again when the file changes: for tests, demos and benchmarks, never "
        "on a real node",
    )
    discover_seconds: float = Field(
        5.0, gt=0, description="how often NVML is read (health, XID events)"
    )
    heartbeat_seconds: float = Field(
        30.0,
        gt=0,
        description="the Node's gpuplace.io/agent-heartbeat is renewed this often; keep the "
        "sidecar's --agent-silence-seconds a few times larger",
    )

    # --- how the kubelet asks: device plugin or DRA -----------------------------------------
    kubelet_plugin: Literal["device-plugin", "dra"] = Field(
        "device-plugin",
        description="the kubelet API this node is served through (a node is on one): "
        "device-plugin (gpuplace.io/gpu slots, the sidecar's grants) or dra (a DRA kubelet "
        "plugin, driver gpu.gpuplace.io: the node's ResourceSlice, claims prepared through "
        "CDI; needs containerd >= 1.7.2 with CDI on, or CRI-O >= 1.23: docs/dra.md)",
    )
    kubelet_plugins_dir: Path = Field(
        Path("/var/lib/kubelet/plugins"),
        description="DRA: the kubelet's plugins directory (the agent serves "
        "<dir>/gpu.gpuplace.io/dra.sock and keeps its checkpoint there)",
    )
    kubelet_registry_dir: Path = Field(
        Path("/var/lib/kubelet/plugins_registry"),
        description="DRA: the kubelet's plugin registration directory (gpu.gpuplace.io-reg.sock)",
    )
    cdi_dir: Path = Field(
        Path("/var/run/cdi"),
        description="DRA: where the runtime reads CDI specs (one per prepared claim)",
    )

    # --- the device plugin -------------------------------------------------------------------
    device_plugin_dir: Path = Field(
        Path("/var/lib/kubelet/device-plugins"),
        description="the kubelet's device-plugin directory (its kubelet.sock and ours)",
    )
    device_list_strategy: Literal["volume-mounts", "cdi", "envvar"] = Field(
        "volume-mounts",
        description="how a container's GPUs reach the runtime: volume-mounts (the NVIDIA "
        "runtime with deploy/node/'s settings), cdi (a runtime with CDI on and a spec from "
        "nvidia-ctk cdi generate), envvar (only where no pod can set NVIDIA_VISIBLE_DEVICES)",
    )
    allocate_wait_seconds: float = Field(
        5.0,
        gt=0,
        description="how long Allocate waits for its pod (and a share for its MPS daemon) "
        "before it refuses; with DRA, how long NodePrepareResources waits for a share's "
        "MPS daemon",
    )

    # --- MPS -------------------------------------------------------------------------------------
    mps: bool = Field(
        True,
        description="run an MPS control daemon per GPU so that shares' limits hold; off: "
        "no daemon, and shares are refused (whole GPUs still served)",
    )
    mps_root: Path = Field(
        agent_mps.Layout().root,
        description="host directory of the daemons' pipe, log and shm directories (the "
        "same path inside the agent's container)",
    )
    mps_control: str = Field(
        "nvidia-cuda-mps-control",
        min_length=1,
        description="the MPS control binary (a command line; the agent adds -f)",
    )
    mps_start_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="a daemon that does not answer within this time after its start is "
        "killed and started again; the device plugin waits as long for the first start",
    )
    mps_probe_seconds: float = Field(
        5.0, gt=0, description="how often each daemon is asked get_server_list"
    )

    # --- what pods use ---------------------------------------------------------------------
    usage_seconds: float = Field(
        usage_sampling.USAGE_SECONDS,
        gt=0,
        description="how often the pods' GPU use (memory, SM) is sampled for /metrics",
    )
    usage_peak_seconds: float = Field(
        usage_sampling.PEAK_SECONDS,
        gt=0,
        description="gpuplace_pod_gpu_memory_peak_bytes is the most memory used in the "
        "samples of this many seconds; keep it at least Prometheus' scrape interval",
    )
    proc_root: Path = Field(
        Path("/proc"),
        description="the proc file system whose <pid>/cgroup maps a GPU process to its pod "
        "(the host's: the DaemonSet runs with hostPID)",
    )

    over_grant_tolerance_mib: int = Field(
        overgrant.TOLERANCE_MIB,
        ge=0,
        description="a share's pod is over its grant when its processes together hold more "
        "than its grant, one CUDA context and this many MiB on a GPU",
    )
    evict_over_grant: bool = Field(
        False,
        description="evict a pod caught over its grant (memory, or more than one MPS "
        "client) through the Eviction API, which respects its PodDisruptionBudgets; off: "
        "an Event, a metric and an audit line only",
    )
    mps_context_mib: str | None = Field(
        None,
        pattern=r"^[0-9]{1,6},[0-9]{1,4}$",
        description="BASE,PER_PERCENT: the MiB an MPS client's CUDA context takes on this "
        "node's GPUs, BASE + PER_PERCENT x its thread percentage, as measured there "
        "(default: the GPU model's figures, docs/node-agent.md)",
    )
    audit_log: str = Field(
        "-",
        min_length=1,
        description="audit log file, one JSON line per decision about a pod; - = stdout",
    )
    audit_log_max_bytes: int = Field(
        100 * 1024 * 1024, ge=0, description="rotate the audit log file at this size (0 = never)"
    )
    audit_log_backups: int = Field(5, ge=0, description="rotated audit log files kept")

    pod_uid: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
        description="the agent's own pod UID (the DaemonSet passes metadata.uid): its "
        "processes, the MPS servers, are never charged to a pod (default: read from its "
        "own /proc/self/cgroup, which names no pod inside a private cgroup namespace)",
    )

    # --- operations ------------------------------------------------------------------------
    metrics_address: str = Field("0.0.0.0", description="address of /metrics /healthz /readyz")
    metrics_port: int = Field(9090, ge=0, le=65535, description="plain HTTP port of the above")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="threshold of the JSON process log (stderr)"
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _dra_strategy(self) -> AgentSettings:
        if self.kubelet_plugin == "dra" and self.device_list_strategy == "envvar":
            raise ValueError(
                "--device-list-strategy=envvar cannot serve DRA: each device of a claim "
                "is its own CDI device, and one NVIDIA_VISIBLE_DEVICES list cannot be "
                "split among them; use volume-mounts or cdi"
            )
        return self

    @field_validator("mps_root")
    @classmethod
    def _short_enough(cls, value: Path) -> Path:
        agent_mps.Layout(value)  # raises ValueError when socket paths would not fit
        return value

    def context(self) -> ClientContext | None:
        """The operator's `--mps-context-mib`, or None (each GPU model's figures)."""
        if self.mps_context_mib is None:
            return None
        base, per_percent = self.mps_context_mib.split(",")
        return ClientContext(int(base), int(per_percent))

    def mps_config(self, base_env: dict[str, str]) -> agent_mps.MpsConfig:
        """The supervisor's configuration; `base_env` is what the daemons inherit."""
        return agent_mps.MpsConfig(
            layout=agent_mps.Layout(self.mps_root),
            command=tuple(shlex.split(self.mps_control)),
            base_env=base_env,
            probe_interval_seconds=self.mps_probe_seconds,
            start_timeout_seconds=self.mps_start_timeout_seconds,
        )
