"""What one Prometheus scrape of the sidecar's ledger gauges costs the event loop.

`--nodes` nodes × `--gpus` GPUs, each GPU granted with probability one half to a pod of
a mixed shape (a quarter, a half or a whole GPU), and the typical workload built from
those pods' requests as the sidecar builds it; the collector frozen as the sidecar
leaves it after its first sync (`gpuplace.runtime.gc_tuning.freeze_survivors`). The ledger collector
(`gpuplace.cluster.metering.LedgerCollector`: allocation, pending pods, fragmentation) is
scraped with prometheus_client's own `generate_latest`, as /metrics does:

- `first_ms`: the first scrape, which measures every node (cold memos: as after a
  rebuilt typical workload or a relist);
- `steady_ms`: a scrape with nothing changed in between;
- `after_binds_ms`: a scrape after `--binds` new grants on as many nodes.

Checks that the scraped fragmentation equals a fresh pass over every node. Prints one
JSON document (median of `--repeat` runs for the last two).

    .venv/bin/python -m bench.metrics_scrape [--nodes 10000 --gpus 8 --binds 200]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuplace.cluster.metering import LedgerCollector
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.extender.workloads import typical
from gpuplace.placement.fragmentation_totals import ClusterMeasure
from gpuplace.placement.inventory import Gpu, Node
from gpuplace.placement.ledger import Grant
from gpuplace.placement.requests import GpuRequest
from gpuplace.runtime import gc_tuning

SHAPES = (250, 500, 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--binds", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(7)
    sync = LedgerSync()
    requests: list[GpuRequest] = []
    for n in range(args.nodes):
        gpus = tuple(Gpu(i, "NVIDIA-H100-80GB-HBM3", 81920) for i in range(args.gpus))
        sync.ledger.put_node(Node(f"gpu-{n}", 64_000, 1_024_000, gpus))
    pod = 0
    for n in range(args.nodes):
        for i in range(args.gpus):
            if rng.random() < 0.5:
                milli = rng.choice(SHAPES)
                sync.ledger.reserve(Grant(f"p{pod}", f"gpu-{n}", (i,), milli, 8192, 1000))
                requests.append(GpuRequest(milli=milli, count=1, memory_mib=8192, cpu_milli=1000))
                pod += 1
    workload = typical(requests[-10_000:])
    gc_tuning.freeze_survivors()  # as the sidecar leaves the long-lived state after its first sync
    registry = CollectorRegistry()
    registry.register(LedgerCollector(sync, lambda: workload))

    def scrape() -> float:
        started = time.perf_counter()
        generate_latest(registry)
        return (time.perf_counter() - started) * 1000

    first = scrape()
    steady = statistics.median(scrape() for _ in range(args.repeat))
    after: list[float] = []
    for _ in range(args.repeat):
        for _ in range(args.binds):
            node = f"gpu-{rng.randrange(args.nodes)}"
            sync.ledger.reserve(Grant(f"p{pod}", node, (0,), 10, 10), overcommit=True)
            pod += 1
        after.append(scrape())
    fresh = ClusterMeasure().totals(sync.ledger, workload)
    scraped = {
        sample.labels["measure"]: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        if family.name == "gpuplace_fragmentation_milligpus"
        for sample in family.samples
    }
    assert scraped == {"fgd": fresh.fgd, "stranded": fresh.stranded}, (scraped, fresh)
    print(
        json.dumps(
            {
                "nodes": args.nodes,
                "gpus_per_node": args.gpus,
                "grants": len(sync.ledger),
                "workload_types": len(workload.types),
                "first_ms": round(first, 1),
                "steady_ms": round(steady, 2),
                "binds_between_scrapes": args.binds,
                "after_binds_ms": round(statistics.median(after), 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
