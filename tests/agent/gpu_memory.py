"""An H100's memory under MPS as the captures measured it, for tests and benchmarks that
check packing without a GPU (issue 43): every figure is read from
`../shared/fixtures/gpu/` (and the H100 run recorded in docs/node-agent.md, "On a GPU"),
none is typed in here.

`Gpu` plays the device: NVML's total; the driver's reservation (used with nothing
running); the MPS server's memory (the compute process that is no MPS client); memory the
driver charges to no process under load (used less the processes' memory less the
reservation, beside the captured clients), counted per client; and each client's CUDA
context, which MPS counts inside its limit, by its thread percentage (`measured_contexts`,
interpolated between the measured points; above the largest MPS point, up to the plain,
non-MPS context at 100 %). A client's allocation succeeds when its context, what it
holds and the allocation fit its `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, and the device has
the memory; otherwise it fails, as `cudaMalloc` does.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.agent.kubelet import gpu_fixture

MIB = 1 << 20
DOCS = Path(__file__).resolve().parents[2] / "docs" / "node-agent.md"
"""Where the H100 run's figures are recorded ("On a GPU")."""


def _reading(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(gpu_fixture(f"nvml-{name}.json").read_text())
    return loaded


def measured_contexts() -> dict[int, float]:
    """Thread percentage → MiB a client's CUDA context took, from every measurement:

    - `nvml-mps-clients.json` with the README's limits and holdings of its two clients
      (NVML's per-process memory less what each held);
    - the README's "`0=2048M`, `25`" row (the limit less the free memory the client saw);
    - docs/node-agent.md's H100 run: free memory seen under 2048M/25 % and
      8192M/50 %, and NVML's figure for the 50 % client holding 4,096 MiB.

    Where two measurements name one percentage, the larger counts."""
    readme = gpu_fixture("README.md").read_text()
    docs_text = DOCS.read_text()
    found: dict[int, float] = {}

    def keep(percent: int, mib: float) -> None:
        found[percent] = max(found.get(percent, 0.0), mib)

    held = re.search(
        r"limits (\d+)M/(\d+)% and (\d+)M/(\d+)%\) holding (\d+) and (\d+) GiB", readme
    )
    assert held, "the README no longer describes the MPS clients' capture"
    _, first_pct, _, second_pct, first_gib, second_gib = map(int, held.groups())
    clients = sorted(
        (p["usedGpuMemory"] for p in _reading("mps-clients")["gpus"][0]["mps_processes"]),
        reverse=True,
    )
    keep(first_pct, clients[0] / MIB - first_gib * 1024)
    keep(second_pct, clients[1] / MIB - second_gib * 1024)
    seen = re.search(r"`0=(\d+)M`, `(\d+)` \|[^|]*reports ([\d.]+) GiB free", readme)
    assert seen, "the README no longer has the 2048M client's free memory"
    limit, percent, free_gib = int(seen.group(1)), int(seen.group(2)), float(seen.group(3))
    keep(percent, limit - (free_gib - 0.005) * 1024)  # "1.86": at most 1.865 GiB less
    row = re.search(
        r"\| a client with exactly that env: free memory it sees;[^|]*\| ([\d,]+) MiB;[^|]*\| "
        r"([\d,]+) MiB;",
        docs_text,
    )
    assert row, "docs/node-agent.md no longer has the H100 run's free memory"
    keep(25, 2048 - int(row.group(1).replace(",", "")))
    keep(50, 8192 - int(row.group(2).replace(",", "")))
    nvml_row = re.search(
        r"yes; ([\d,]+) MiB \(holds ([\d,]+)\) \| yes; ([\d,]+) MiB \(holds ([\d,]+)\)", docs_text
    )
    assert nvml_row, "docs/node-agent.md no longer has the H100 run's NVML figures"
    numbers = [int(group.replace(",", "")) for group in nvml_row.groups()]
    keep(25, numbers[0] - numbers[1])
    keep(50, numbers[2] - numbers[3])
    return found


def plain_context_mib() -> float:
    """A plain (non-MPS) CUDA context at all SMs: `nvml-plain-client.json`'s process less
    the 3 GiB the README says it held."""
    (process,) = _reading("plain-client")["gpus"][0]["compute_processes"]
    return float(process["usedGpuMemory"] / MIB - 3 * 1024)


@dataclass
class Figures:
    """The device's figures, MiB."""

    total: float
    reserved: float
    server: float
    unattributed_per_client: float
    contexts: dict[int, float]
    plain_context: float

    def context(self, percent: int) -> float:
        """A client's context at `percent`: interpolated between the measured points, the
        smallest one below them, and towards the plain context at 100 % above them."""
        points = sorted(self.contexts.items())
        if percent >= 100:
            return self.plain_context
        points.append((100, self.plain_context))
        if percent <= points[0][0]:
            return points[0][1]
        for (low, low_mib), (high, high_mib) in itertools.pairwise(points):
            if low <= percent <= high:
                return low_mib + (high_mib - low_mib) * (percent - low) / (high - low)
        return self.plain_context


def figures() -> Figures:
    idle = _reading("idle")["gpus"][0]
    loaded = _reading("mps-clients")["gpus"][0]
    client_pids = {p["pid"] for p in loaded["mps_processes"]}
    server = sum(
        p["usedGpuMemory"] for p in loaded["compute_processes"] if p["pid"] not in client_pids
    )
    attributed = sum(p["usedGpuMemory"] for p in loaded["compute_processes"])
    unattributed = (loaded["memory"]["used"] - attributed - idle["memory"]["used"]) / MIB
    return Figures(
        total=idle["memory"]["total"] / MIB,
        reserved=idle["memory"]["used"] / MIB,
        server=server / MIB,
        unattributed_per_client=unattributed / len(client_pids),
        contexts=measured_contexts(),
        plain_context=plain_context_mib(),
    )


class OutOfMemory(Exception):
    pass


@dataclass
class Client:
    percent: int
    limit_mib: float | None
    """None: no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (no memory limit)."""
    context: float
    held: float = 0.0


@dataclass
class Gpu:
    """The device, with MPS running and its server up."""

    figures: Figures
    clients: list[Client] = field(default_factory=list)

    @property
    def used(self) -> float:
        f = self.figures
        return (
            f.reserved
            + f.server
            + sum(c.context + c.held + f.unattributed_per_client for c in self.clients)
        )

    def start(self, percent: int, limit_mib: float | None) -> Client:
        """A client connects: its context is made (inside its limit)."""
        client = Client(percent, limit_mib, self.figures.context(percent))
        if limit_mib is not None and client.context > limit_mib:
            raise OutOfMemory(f"context {client.context:.0f} MiB over the limit {limit_mib}")
        if self.used + client.context + self.figures.unattributed_per_client > self.figures.total:
            raise OutOfMemory("the device is full")
        self.clients.append(client)
        return client

    def allocate(self, client: Client, mib: float) -> None:
        if client.limit_mib is not None and client.context + client.held + mib > client.limit_mib:
            raise OutOfMemory(
                f"{mib:.0f} MiB over the client's limit ({client.limit_mib:.0f} MiB, "
                f"{client.context:.0f} of it its context, {client.held:.0f} held)"
            )
        if self.used + mib > self.figures.total:
            raise OutOfMemory(f"{mib:.0f} MiB: the device is full ({self.used:.0f} used)")
        client.held += mib
