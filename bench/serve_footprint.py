"""What `gpuplace serve` costs to hold a cluster's pods with gangs and queues on: RSS, CPU.

The local API (`gpuplace.dev.localapi`, in a forked process: it shares neither the GIL nor
the event loop with what is measured) holds `--nodes` nodes of 8 GPUs, three GpuQueues
over three namespaces, and `--pods` managed pods as the webhook, the controllers and the
scheduler leave them (each a realistic mutated pod, ~3.5 KB of JSON:
bench/ledger_rebuild.py's), in five kinds of equal number:

- alone: bound and running, one whole GPU granted;
- gang members: gangs of 4 (`gang-name`, `gang-size`, the gang label), placed: the plan
  mark and count, ungated, bound and running;
- queued: admitted by their GpuQueue (the queue label, no gate left), bound and running;
- queued gang members: gangs of 4 in a queue, admitted and started the same way;
- waiting: queued pods still behind the queue gate (their queue's quota is used up, so
  every round keeps them waiting and writes nothing).

`gpuplace serve` runs as a subprocess, as the Deployment runs it (`python -m gpuplace.cli
serve`, gangs and queues on), by default as a replica that follows (another replica's
kube-scheduler holds the Lease `gpuplace/gpuplace-scheduler`): what holding the pods
costs (informers, ledger, the controllers' indexes) without the rounds, whose work is the
engine's and grows with the churn's wall time; `--role leader` lets it decide
(`--scheduler-lease ""`), rounds included. Measured from /proc: the CPU seconds from its
start until it is ready and quiet (every informer listed: its CPU below 2% of a core for
2 s), its resident memory then; then `--churn` pods (spread over the five kinds) get one
label changed each, as status updates and relabels do in a live cluster (each a MODIFIED
event on every watch that selects the pod), and the CPU seconds until it is quiet again,
and its resident memory after. Prints one JSON document.

    .venv/bin/python -m bench.serve_footprint [--pods 10000 --nodes 1400 --churn 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from bench.ledger_rebuild import pod_template
from gpuplace.cluster import assignments, keys
from gpuplace.cluster.gang_marks import PlanMark
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.placement.ledger import Grant, GrantState
from tests.gpuplace.test_serve_cluster import scheduler_lease
from tests.webhook import helpers

REPO = Path(__file__).resolve().parent.parent
AT = datetime(2026, 11, 21, 5, 44, 24, tzinfo=UTC)
TICKS = os.sysconf("SC_CLK_TCK")
SEEN = (
    "gpuplace_queue_admitted_workloads",
    "gpuplace_queue_waiting_pods",
    "gpuplace_gangs_waiting",
    "gpuplace_ledger_grants",
)
KINDS = ("alone", "gang", "queued", "queued-gang", "waiting")
QUEUES = 3
GANG = 4


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid`, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def message(line: str) -> str:
    """A log line's message (the JSON log's, or the line itself)."""
    try:
        return str(json.loads(line).get("message", line))
    except (ValueError, AttributeError):
        return line


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def build(pod_count: int, node_count: int) -> tuple[localapi.FakeApi, list[tuple[str, str]]]:
    """The cluster (module docstring); returns the API and every pod's (namespace, name)."""
    api = localapi.FakeApi()
    api.load("nodes", (objects.node(f"node-{i:05d}", gpus=8) for i in range(node_count)))
    per_kind = pod_count // len(KINDS) // (GANG * QUEUES) * (GANG * QUEUES)  # whole gangs
    used = [0] * QUEUES
    template = pod_template()
    bodies: list[dict[str, Any]] = []
    names: list[tuple[str, str]] = []
    slot = 0
    for kind in KINDS:
        for index in range(per_kind):
            queued = kind in ("queued", "queued-gang", "waiting")
            namespace = f"team-{index % QUEUES}" if queued else f"apps-{index // GANG % 20}"
            name = f"{kind}-{index:06d}"
            uid = f"uid-{kind}-{index:06d}"
            labels = {keys.MANAGED: "true", "app": f"{kind}-{index // 8}"}
            notes: dict[str, str] = {keys.GPU_COUNT: "1"}
            spec = copy.deepcopy(template["spec"])
            status: dict[str, Any] = template["status"]
            if queued:
                labels[keys.QUEUE_LABEL] = f"queue-{index % QUEUES}"
            if kind in ("gang", "queued-gang"):
                gang = f"{kind}-{index // (GANG * QUEUES) if queued else index // GANG}"
                notes[keys.GANG_NAME] = gang
                notes[keys.GANG_SIZE] = str(GANG)
                labels[keys.GANG_LABEL] = gang
            if kind == "waiting":
                spec["schedulingGates"] = [{"name": keys.QUEUE_GATE}]
                status = {"phase": "Pending"}
            else:
                node = f"node-{slot // 8:05d}"
                grant = Grant(uid, node, (slot % 8,), 1000, 0, 1000, 1024, GrantState.CONFIRMED)
                slot += 1
                if queued:
                    used[index % QUEUES] += 1
                notes.update(assignments.annotations_for(grant, None, AT))
                spec["nodeName"] = node
                if keys.GANG_NAME in notes:
                    notes[keys.GANG_PLAN] = PlanMark(
                        f"plan-{notes[keys.GANG_NAME]}", GANG, node
                    ).encode()
                    notes[keys.GANG_COUNT] = str(GANG)
            bodies.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": name,
                        "namespace": namespace,
                        "uid": uid,
                        "creationTimestamp": "2026-11-21T05:44:20Z",
                        "labels": labels,
                        "annotations": notes,
                    },
                    "spec": spec,
                    "status": status,
                }
            )
            names.append((namespace, name))
    api.load("pods", bodies)
    for index, gpus in enumerate(used):  # each queue's quota used up: the waiting wait
        api.create(
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": f"team-{index}", "labels": {"team": str(index)}},
            }
        )
        api.create(
            {
                "apiVersion": "gpuplace.io/v1alpha1",
                "kind": "GpuQueue",
                "metadata": {"name": f"queue-{index}"},
                "spec": {
                    "namespaceSelector": {"matchLabels": {"team": str(index)}},
                    "resources": [{"name": "gpus", "nominal": str(gpus)}],
                },
            }
        )
    return api, names


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


def scrape(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """The sums of the named series on the ops port's /metrics (is the process doing what
    the bench says it does: queues and gangs seen)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in found:
            found[name] += float(line.rsplit(" ", 1)[1])
    return found


def quiet(pid: int, *, below: float = 0.02, window: float = 2.0, cap: float = 120.0) -> float:
    """Wait until `pid` used less than `below` of a core over `window` seconds (at most
    `cap` seconds); returns its CPU seconds then."""
    deadline = time.monotonic() + cap
    last = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(window)
        now = cpu_seconds(pid)
        if now - last < below * window:
            return now
        last = now
    return cpu_seconds(pid)


async def churn(url: str, names: list[tuple[str, str]], count: int) -> None:
    """Change one label on `count` pods spread over the kinds (merge patches, 16 at once)."""
    step = max(len(names) // count, 1)
    chosen = names[::step][:count]
    limit = asyncio.Semaphore(16)
    async with aiohttp.ClientSession() as session:

        async def one(index: int, namespace: str, name: str) -> None:
            patch = {"metadata": {"labels": {"bench/touched": str(index)}}}
            async with (
                limit,
                session.patch(
                    f"{url}/api/v1/namespaces/{namespace}/pods/{name}",
                    json=patch,
                    headers={"Content-Type": "application/merge-patch+json"},
                ) as answer,
            ):
                answer.raise_for_status()

        await asyncio.gather(*(one(i, ns, n) for i, (ns, n) in enumerate(chosen)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1400)
    parser.add_argument("--churn", type=int, default=5_000)
    parser.add_argument("--role", choices=("follower", "leader"), default="follower")
    args = parser.parse_args()

    api, names = build(args.pods, args.nodes)
    if args.role == "follower":
        api.create(scheduler_lease("another-replica"))  # its kube-scheduler leads
    with tempfile.TemporaryDirectory() as scratch, localapi.serve_in_subprocess(api) as server:
        folder = Path(scratch)
        cert, key = helpers.write_certificate(folder / "tls")
        ops = free_port()
        flags = {
            "kubeconfig": server.kubeconfig(folder / "kubeconfig"),
            "cert-file": cert,
            "key-file": key,
            "webhook-address": "127.0.0.1",
            "webhook-port": free_port(),
            "extender-port": free_port(),
            "metrics-address": "127.0.0.1",
            "metrics-port": ops,
            "audit-log": folder / "audit.jsonl",
            "log-level": "WARNING",
            **({"scheduler-lease": ""} if args.role == "leader" else {}),  # always decides
        }
        command = [sys.executable, "-m", "gpuplace.cli", "serve"]
        command.extend(f"--{name}={value}" for name, value in flags.items())
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPLACE_")}
        started = time.monotonic()
        log = folder / "serve.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(
                command, env=env, stdout=subprocess.DEVNULL, stderr=sink, cwd=REPO
            )
        try:
            while not ready(ops):
                if process.poll() is not None:
                    raise SystemExit(log.read_text())
                time.sleep(0.1)
            ready_seconds = time.monotonic() - started
            synced_cpu = quiet(process.pid)
            synced_rss = rss_mib(process.pid)
            seen = scrape(ops, SEEN)
            changed = time.monotonic()
            asyncio.run(churn(server.url, names, args.churn))
            churn_cpu = quiet(process.pid) - synced_cpu
            churn_seconds = time.monotonic() - changed
            churned_rss = rss_mib(process.pid)
        finally:
            process.terminate()
            process.wait(15)
        warnings = [message(line) for line in log.read_text().splitlines() if line.strip()]
    print(
        json.dumps(
            {
                "benchmark": "gpuplace serve holding managed pods, gangs and queues on",
                "api": "local API (gpuplace.dev.localapi) in a forked process, HTTP on 127.0.0.1",
                "pods": len(names),
                "kinds": {kind: sum(n.startswith(f"{kind}-0") for _, n in names) for kind in KINDS},
                "nodes": args.nodes,
                "role": args.role,
                "ready_seconds": round(ready_seconds, 2),
                "synced_cpu_seconds": round(synced_cpu, 2),
                "synced_rss_mib": round(synced_rss, 1),
                "seen_when_synced": seen,
                "churned_pods": args.churn,
                "churn_cpu_seconds": round(churn_cpu, 2),
                "churn_wall_seconds": round(churn_seconds, 2),
                "churned_rss_mib": round(churned_rss, 1),
                "log_warnings": len(warnings),
                "first_warnings": sorted(set(warnings))[:5],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
