"""Every Kubernetes key gpuplace reads or writes, spelled once.

User annotations are what researchers write; system annotations are written only
by the sidecar's service account (the validating webhook refuses anyone else).
"""

from __future__ import annotations

PREFIX = "gpuplace.io/"

# --- user annotations on pods -------------------------------------------------
GPU_PERCENT = PREFIX + "gpu-percent"
GPU_MEMORY = PREFIX + "gpu-memory"
GPU_COUNT = PREFIX + "gpu-count"
GPU_MODEL = PREFIX + "gpu-model"
GPU_TOPOLOGY = PREFIX + "gpu-topology"
GANG_NAME = PREFIX + "gang-name"
GANG_SIZE = PREFIX + "gang-size"
GANG_TIMEOUT = PREFIX + "gang-timeout"
GANG_MIN = PREFIX + "gang-min"
"""An elastic gang: it may start with this many members (below `gang-size`) when that is
all that fits, and grows as GPUs free (docs/queues.md, "Elastic gangs")."""
GANG_ON_FAILURE = PREFIX + "gang-on-failure"
"""What a member's failure does to its running gang: `restart` (the others are evicted and
the gang starts again as one when its owner recreates the members) or `continue` (the
others run on); docs/gangs.md, "When a member fails"."""
GANG_DOMAIN = PREFIX + "gang-domain"
"""A node label key (`example.com/rack`): the gang's members land on nodes with one value
of it (docs/gangs.md, "One rack or block")."""
GANG_DOMAIN_POLICY = PREFIX + "gang-domain-policy"
"""`required` (never split across values of `gang-domain`) or `preferred` (as few as fit)."""
CONTAINER = PREFIX + "container"
QUEUE = PREFIX + "queue"
"""The GpuQueue a GPU pod uses (docs/queues.md). The same key is the namespace label that
names its default queue, the pod label the webhook sets to the queue it chose (informers
select on it, and the pod keeps its queue whatever the namespace's label becomes), and
the scheduling gate a queued pod waits behind until its queue admits it."""

USER_ANNOTATIONS = (
    GPU_PERCENT,
    GPU_MEMORY,
    GPU_COUNT,
    GPU_MODEL,
    GPU_TOPOLOGY,
    GANG_NAME,
    GANG_SIZE,
    GANG_TIMEOUT,
    GANG_MIN,
    GANG_ON_FAILURE,
    GANG_DOMAIN,
    GANG_DOMAIN_POLICY,
    CONTAINER,
    QUEUE,
)

# --- system annotations on pods (written by the sidecar at bind) --------------
ASSIGNED_NODE = PREFIX + "assigned-node"
"""Node the GPUs were granted on."""
ASSIGNED_GPUS = PREFIX + "assigned-gpus"
"""GPU indices on that node, comma-separated ("0,3")."""
ASSIGNED_UUIDS = PREFIX + "assigned-uuids"
"""GPU UUIDs in the same order, comma-separated; NVIDIA_VISIBLE_DEVICES reads this."""
VISIBLE_DEVICES = PREFIX + "visible-devices"
"""What NVIDIA_VISIBLE_DEVICES must hold: the UUIDs when the node publishes them, else the
indices, comma-separated. The webhook points the env var here through the downward API."""
ASSIGNED_MILLI = PREFIX + "assigned-milli"
"""milli-GPU granted on each GPU (1000 = whole, 0 = a memory-only share)."""
ASSIGNED_MEMORY = PREFIX + "assigned-memory-mib"
"""GPU memory granted on each GPU, MiB."""
ASSIGNED_AT = PREFIX + "assigned-at"
"""RFC 3339 time of the grant."""
MPS_MEMORY_LIMIT = PREFIX + "mps-memory-limit"
"""What CUDA_MPS_PINNED_DEVICE_MEM_LIMIT must hold for a share with memory ("0=2317M": the
ask plus the GPU model's CUDA context, `gpuplace.cluster.mps_limits`); "" otherwise. The
webhook points the env var here through the downward API (nodes without the node agent)."""
GANG_PLAN = PREFIX + "gang-plan"
"""JSON plan mark `{"id", "members", "node"}` the gang controller writes with the assignment
annotations before ungating (see docs/gangs.md)."""
GANG_COUNT = PREFIX + "gang-count"
"""How many members of the member's gang run once its plan starts (written with the plan;
an elastic gang's members read it through the downward API: docs/gangs.md)."""

SYSTEM_ANNOTATIONS = (
    ASSIGNED_NODE,
    ASSIGNED_GPUS,
    ASSIGNED_UUIDS,
    VISIBLE_DEVICES,
    ASSIGNED_MILLI,
    ASSIGNED_MEMORY,
    ASSIGNED_AT,
    MPS_MEMORY_LIMIT,
    GANG_PLAN,
    GANG_COUNT,
)

# --- labels -------------------------------------------------------------------
MANAGED = PREFIX + "managed"
"""Pod label: "true" on every pod the webhook mutated; the sidecar watches these."""
GANG_LABEL = PREFIX + "gang"
"""Pod label: the gang name of a gang member."""
QUEUE_LABEL = QUEUE
"""Pod label: the queue the webhook chose for a queued pod; namespace label: the default
queue of the namespace's GPU pods."""
NODE_ENABLED = PREFIX + "enabled"
"""Node label: "true" opts a node in; gpuplace manages no other node."""
GPU_SYSTEM = PREFIX + "gpu-system"
"""Namespace label: "true" trusts the namespace's pods with every GPU of a node (the GPU
Operator's, DCGM's, GPU Feature Discovery's): the node agent's no-bypass admission policy
does not judge them (deploy/components/node-agent/admission-policy.yaml; `gpuplace
preflight` names the namespaces that need it)."""
NODE_DRA = PREFIX + "dra"
"""Node label: "true" puts an opted-in node on the DRA path: its node agent is the DRA
kubelet plugin (DaemonSet gpuplace-node-agent-dra), not the device plugin (docs/dra.md)."""

CLAIM_PINNED = PREFIX + "pinned-gpus"
"""ResourceClaim annotation: the UUIDs of the GPUs the engine planned the claim on, comma
separated (the claim's selector asks exactly them; `gpuplace.claims`); absent on a claim
left to kube-scheduler's first fit."""

# --- scheduling gates ---------------------------------------------------------
GANG_GATE = PREFIX + "gang"
QUEUE_GATE = QUEUE
"""A queued pod waits behind it until its queue admits it (then the gang gate, if any)."""
PLACE_GATE = PREFIX + "place"
"""Every other gpuplace pod waits behind it (a moment) until the sidecar's planner has
chosen its node and GPUs with the engine and handed kube-scheduler that node
(`gpuplace.planning`, docs/placement.md "Plan, then pin")."""
DRA_GATE = PREFIX + "dra-claim"
"""A pod on the DRA path waits behind it until the sidecar has created the ResourceClaim
it names (`gpuplace.cluster.dra_claims`); kube-scheduler never sees a pod whose claim does
not exist yet (it would wait with no word)."""

# --- extended resources -------------------------------------------------------
RESOURCE_PERCENT = PREFIX + "gpu-percent"
RESOURCE_MEMORY = PREFIX + "gpu-memory"
RESOURCE_GPU = PREFIX + "gpu"
"""The node agent's device-plugin resource: the GPU container of a gpuplace pod requests its
GPU count of it, so that the kubelet asks the agent (Allocate) what the container gets.
Each device is a slot on one GPU (docs/node-agent.md, "Allocate")."""

# --- node inventory ------------------------------------------------------------
GFD_COUNT = "nvidia.com/gpu.count"
GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_MEMORY = "nvidia.com/gpu.memory"
"""MiB per GPU, as GPU Feature Discovery labels it."""
NODE_GPUS = PREFIX + "gpus"
"""Node annotation, JSON list, one object per GPU, written by the node agent from NVML (or
by hand): [{"index": 0, "uuid": "GPU-…", "numa": 0, "nvlink": 0}, …]; nvlink -1 or absent
= none. The agent adds "model", "memoryMiB", "pci", "peers", "mig", "health" ("healthy" |
"unhealthy") and "reasons", and writes null where NVML could not say (see
docs/node-discovery.md)."""
AGENT_HEARTBEAT = PREFIX + "agent-heartbeat"
"""Node annotation: RFC 3339 UTC time the node agent last renewed it (every
--heartbeat-seconds); the sidecar stops placing new GPU pods on the node once it is older
than its --agent-silence-seconds."""
NVLINK_DOMAIN_SIZE = PREFIX + "nvlink-domain-size"
"""Node label the sidecar keeps: GPUs in the node's largest NVLink domain (for affinity)."""

# --- gang scheduling (appended by the gang controller) --------------------------
GANG_CONDITION = PREFIX + "GangReady"
"""Pod condition type the gang controller writes on gang members (pods/status): False
with a reason (GangIncomplete, GangUnschedulable) once the gang's timeout passed,
True (GangPlaced) when the gang is placed and ungated."""
