"""What the node's GPUs are and whether they are fit for new work, read through NVML.

`discover(nvml, xids)` reads every GPU once through the `gpuplace.agent.nvml.Nvml` seam and
returns a `Discovery`: per GPU its index, UUID, model, memory, PCI bus id, NUMA node,
NVLink peers and domain, MIG mode and health. What NVML cannot answer is recorded as
unknown (None), never guessed: a real H100 answers "Not Supported" for its NUMA node
and NVLink state (`../shared/fixtures/gpu/nvml-idle.json`).

Health: a GPU is unhealthy when NVML cannot identify it (its UUID or memory cannot be
read), when NVML says it is lost or needs a reset, when it counts uncorrectable ECC
errors since the driver loaded, or when a critical XID event arrived for it (`XidLog`,
fed from NVML's event set where the GPUs support it). XIDs that an application causes
on itself (13, 31, 43, 45, 68, 109: the set NVIDIA's own device plugin skips) do not
make a GPU unhealthy. An XID is kept until the agent restarts, as the driver needs a
GPU reset to clear the condition it reports.

NVLink: for each GPU, each link is asked whether it is up and for the PCI bus id at
its far end (another GPU, or an NVSwitch). GPUs joined by links, directly or through
a common switch, form a domain; a domain's id is its lowest GPU index, and a GPU with
no NVLink to another GPU is in none (`NO_NVLINK`).

Memory for packing (`gpuplace.agent.capacity`): per GPU, what a client can get with MPS
running (`packable_mib`: NVML's total less the driver's reservation and the MPS server's
memory), and what each MPS client's CUDA context takes inside its limit (`context`, from
`mps_limits.figures` of its model unless the operator measured it).

Pure over the seam: no I/O but the NVML calls, no clock, no logging. O(GPUs × (links +
processes)).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from gpuplace.agent import capacity
from gpuplace.agent import nvml as nvml_seam
from gpuplace.cluster import mps_limits
from gpuplace.placement.inventory import NO_NVLINK, ClientContext

T = TypeVar("T")

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs an application causes on its own GPU context (graphics engine exception, MMU
fault, reset channel, preemptive cleanup, video processor exception, context switch
timeout): they do not make a GPU unhealthy (as in NVIDIA's k8s-device-plugin)."""

FATAL_MESSAGES = frozenset({"GPU is lost", "GPU requires restart", "Corrupted infoROM"})


@dataclass(frozen=True, slots=True)
class Health:
    """Whether a GPU takes new work, and why not."""

    healthy: bool = True
    reasons: tuple[str, ...] = ()

    @property
    def word(self) -> str:
        return "healthy" if self.healthy else "unhealthy"


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as NVML describes it; None = NVML could not say."""

    index: int
    uuid: str | None
    model: str | None
    memory_mib: int | None
    pci_bus_id: str | None
    numa: int | None
    nvlink_peers: tuple[int, ...] | None
    """Other GPUs of its NVLink domain, by index (empty: no NVLink to another GPU)."""
    nvlink_domain: int | None
    """Lowest GPU index of its domain; `NO_NVLINK` (-1) when in none."""
    mig: bool | None
    """MIG mode currently enabled."""
    health: Health = field(default_factory=Health)
    packable_mib: int | None = None
    """What a client can get with MPS running: NVML's total less the driver's reservation
    and the MPS server's memory (`gpuplace.agent.capacity`); None when not known."""
    reserved_mib: int | None = None
    """The driver's reservation (None: not known)."""
    mps_server_mib: int | None = None
    """The MPS server's own memory counted against it."""
    context: ClientContext = mps_limits.UNMEASURED.context
    """What each MPS client's CUDA context takes inside its limit (`mps_limits`)."""


@dataclass(frozen=True, slots=True)
class Discovery:
    """Every GPU of the node (index order) and what could not be read at all."""

    gpus: tuple[Gpu, ...]
    driver: str | None = None
    problems: tuple[str, ...] = ()
    """Node-level failures ("nvml: gpu count: Driver Not Loaded"); empty when none."""

    def domains(self) -> dict[int, tuple[int, ...]]:
        """GPU indices per NVLink domain (GPUs in none or unknown left out). O(GPUs)."""
        found: dict[int, list[int]] = {}
        for gpu in self.gpus:
            if gpu.nvlink_domain is not None and gpu.nvlink_domain != NO_NVLINK:
                found.setdefault(gpu.nvlink_domain, []).append(gpu.index)
        return {domain: tuple(members) for domain, members in found.items()}

    @property
    def unhealthy(self) -> tuple[int, ...]:
        return tuple(gpu.index for gpu in self.gpus if not gpu.health.healthy)


class XidLog:
    """Critical XID events seen since the agent started, per GPU index. `poll` drains
    NVML's event set without blocking; where events are not supported it records why
    (`problem`) and stops asking."""

    def __init__(self) -> None:
        self.by_index: dict[int, tuple[int, ...]] = {}
        self.problem = ""
        """Why XID events cannot be read ("" while they can)."""

    def poll(self, nvml: nvml_seam.Nvml) -> bool:
        """Read the events that arrived; True when a GPU gained a critical XID. O(events)."""
        if self.problem:
            return False
        try:
            events = nvml.xid_events()
        except nvml_seam.NvmlError as error:
            self.problem = f"XID events: {error}"
            return False
        gained = False
        for event in events:
            if event.xid in APPLICATION_XIDS:
                continue
            known = self.by_index.get(event.index, ())
            if event.xid not in known:
                self.by_index[event.index] = (*known, event.xid)
                gained = True
        return gained


def _optional(call: Callable[[int], T], index: int, reasons: list[str], what: str) -> T | None:
    try:
        return call(index)
    except nvml_seam.NvmlError as error:
        if str(error) in FATAL_MESSAGES:
            reasons.append(f"nvml {what}: {error}")
        return None


def _required(call: Callable[[int], T], index: int, reasons: list[str], what: str) -> T | None:
    try:
        return call(index)
    except nvml_seam.NvmlError as error:
        reasons.append(f"nvml {what}: {error}")
        return None


def _links(nvml: nvml_seam.Nvml, index: int) -> list[str] | None:
    """The far ends of the GPU's active links; None when NVML answered for no link."""
    try:
        count = nvml.nvlink_links(index)
    except nvml_seam.NvmlError:
        return None
    remotes: list[str] = []
    answered = False
    for link in range(count):
        try:
            remote = nvml.nvlink_remote(index, link)
        except nvml_seam.NvmlError:
            continue
        answered = True
        if remote is not None:
            remotes.append(remote)
    return remotes if answered else None


def _domains(
    buses: Mapping[int, str | None], links: Mapping[int, list[str] | None]
) -> dict[int, int]:
    """GPU index → domain id (lowest index of the GPUs joined to it), for GPUs whose
    links are known. Union-find over GPUs and far ends. O(GPUs × links)."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        root = key
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[key] != root:
            parent[key], key = root, parent[key]
        return root

    def gpu_key(index: int) -> str:
        bus = buses.get(index)
        return f"bus:{bus}" if bus else f"gpu:{index}"

    for index, remotes in links.items():
        if remotes is None:
            continue
        mine = find(gpu_key(index))
        for remote in remotes:
            other = find(f"bus:{remote}")
            if other != mine:
                parent[other] = mine
    members: dict[str, list[int]] = {}
    for index, remotes in links.items():
        if remotes is not None:
            members.setdefault(find(gpu_key(index)), []).append(index)
    domain: dict[int, int] = {}
    for group in members.values():
        for index in group:
            domain[index] = min(group) if len(group) > 1 else NO_NVLINK
    return domain


def discover(
    nvml: nvml_seam.Nvml,
    xids: XidLog | None = None,
    *,
    readings: capacity.Readings | None = None,
    context: ClientContext | None = None,
) -> Discovery:
    """Read every GPU through `nvml`; XIDs from `xids` (not polled here); what earlier
    readings saw of its memory from `readings` (`gpuplace.agent.capacity`; None: nothing);
    every GPU's MPS client context `context` where the operator measured it, else its
    model's (`mps_limits.figures`). O(GPUs × (links + processes))."""
    seen_memory = readings if readings is not None else capacity.Readings()
    try:
        count = nvml.gpu_count()
    except nvml_seam.NvmlError as error:
        return Discovery(gpus=(), problems=(f"nvml gpu count: {error}",))
    try:
        driver: str | None = nvml.driver()
    except nvml_seam.NvmlError:
        driver = None
    seen = xids.by_index if xids is not None else {}
    read: list[Gpu] = []
    buses: dict[int, str | None] = {}
    links: dict[int, list[str] | None] = {}
    for index in range(count):
        reasons: list[str] = []
        uuid = _required(nvml.uuid, index, reasons, "uuid")
        total = _required(nvml.memory_total, index, reasons, "memory")
        model = _optional(nvml.name, index, reasons, "name")
        bus = _optional(nvml.pci_bus_id, index, reasons, "pci bus id")
        numa = _optional(nvml.numa_node, index, reasons, "numa node")
        mig = _optional(nvml.mig_mode, index, reasons, "mig mode")
        ecc = _optional(nvml.ecc_uncorrected, index, reasons, "ecc")
        if ecc:
            reasons.append(f"uncorrectable ECC errors: {ecc}")
        reasons.extend(f"XID {xid}" for xid in seen.get(index, ()))
        buses[index] = bus
        links[index] = _links(nvml, index)
        figures = mps_limits.figures(model or "")
        memory = (
            None
            if total is None
            else capacity.read(nvml, index, total, figures.server_mib, seen_memory)
        )
        read.append(
            Gpu(
                index=index,
                uuid=uuid,
                model=model,
                memory_mib=None if total is None else total // (1 << 20),
                pci_bus_id=bus,
                numa=numa if numa is not None and numa >= 0 else None,
                nvlink_peers=None,
                nvlink_domain=None,
                mig=None if mig is None else bool(mig[0]),
                health=Health(not reasons, tuple(reasons)),
                packable_mib=None if memory is None else memory.packable_mib,
                reserved_mib=None if memory is None else memory.reserved_mib,
                mps_server_mib=None if memory is None else memory.server_mib,
                context=context if context is not None else figures.context,
            )
        )
    domain_of = _domains(buses, links)
    members: dict[int, list[int]] = {}
    for index, domain in domain_of.items():
        if domain != NO_NVLINK:
            members.setdefault(domain, []).append(index)
    gpus = []
    for gpu in read:
        joined = domain_of.get(gpu.index)
        if joined is None:
            gpus.append(gpu)
            continue
        peers = tuple(other for other in members.get(joined, ()) if other != gpu.index)
        gpus.append(replace(gpu, nvlink_domain=joined, nvlink_peers=peers))
    problems = (xids.problem,) if xids is not None and xids.problem else ()
    return Discovery(gpus=tuple(gpus), driver=driver, problems=problems)


def summary(found: Discovery) -> Sequence[str]:
    """One line per GPU, for logs and `--help`-style output: 'gpu 0 GPU-… NVIDIA H100
    81559 MiB (80960 packable) healthy'."""
    return [
        f"gpu {gpu.index} {gpu.uuid or '?'} {gpu.model or '?'} "
        f"{gpu.memory_mib if gpu.memory_mib is not None else '?'} MiB "
        f"({gpu.packable_mib if gpu.packable_mib is not None else '?'} packable) "
        f"{gpu.health.word}"
        for gpu in found.gpus
    ]
