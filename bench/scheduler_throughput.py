"""Throughput against the stock scheduler (issue 27, point 5), on real Kubernetes v1.36.2.

One run on the real-cluster tier's control plane (`tests/realcluster`: `../shared/k8s`,
gpuplace installed as README says, `gpuplace serve` and the gpuplace kube-scheduler with
the shipped configuration running as in the tier; no kubelet): N GPU nodes for gpuplace
(GFD labels, `gpuplace.io/enabled`, 8 GPUs, a kubelet-like status) and N plain nodes
(`nvidia.com/gpu: 8`, as NVIDIA's device plugin advertises), made through the API; then
P gated GPU pods (`gpuplace.io/gpu-count: 1`, scheduled by the gpuplace profile through
the sidecar's filter, prioritize and bind) and P gated plain pods (`nvidia.com/gpu: 1`,
the cluster's kube-scheduler with the default profile), all ungated together, kinds
interleaved. A watch on the pods times each bind.

Per kind: pods/s (P over first ungate → last bind) and per-pod ungate → bind p50/p99/max
(ungate: when the API answered the pod's ungate patch; bind: when the watch delivered the
pod with `spec.nodeName`), plus the sidecar's own latency per extender verb from its /metrics and,
per FlowSchema, kube-apiserver's request count, mean queue wait and mean execution over
the burst (API Priority and Fairness: which identity waited where), and each
kube-scheduler's mean time per scheduling attempt and per extension point, and the
cores each process used during the burst (what the machine spent where). Prints one JSON document.

    .venv/bin/python -m bench.scheduler_throughput --nodes 300   # 300 + 300 nodes, 600 + 600 pods
    .venv/bin/python -m bench.scheduler_throughput --nodes 1000 --pods 2000
    .venv/bin/python -m bench.scheduler_throughput --nodes 300 --dra --percent 50   # + DRA

`measure` is what the tier's smoke test runs at a tiny size on the session's cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import ssl
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpuplace.cluster import dra, keys
from tests.realcluster import install, kit
from tests.realcluster.install import Installation
from tests.realcluster.objects import H100_MIB, SLOTS_PER_GPU, gpu_node
from tests.realcluster.processes import HostProcess

GPUS = 8
GATE = "bench.gpuplace.io/hold"
PLAIN = "nvidia.com/gpu"
CONCURRENCY = 32
JSON_PATCH = "application/json-patch+json"

Obj = dict[str, Any]
T = TypeVar("T")


@dataclass
class Api:
    """The tier's kube-apiserver as an admin (client certificate), over aiohttp."""

    url: str
    session: aiohttp.ClientSession
    tls: ssl.SSLContext

    async def call(self, method: str, path: str, body: Any = None, **headers: str) -> Any:
        content = headers.pop("content_type", "application/json")
        async with self.session.request(
            method,
            self.url + path,
            data=None if body is None else json.dumps(body),
            headers={"Content-Type": content},
            ssl=self.tls,
        ) as response:
            answer = await response.json(content_type=None)
            if response.status >= 300:
                raise RuntimeError(f"{method} {path}: {response.status} {answer}")
            return answer


def admin_tls(installation: Installation) -> ssl.SSLContext:
    cluster = installation.cluster
    tls = ssl.create_default_context(cafile=str(cluster.ca_file))
    pki = cluster.state / "pki"
    tls.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return tls


def kubelet_status(extra: Mapping[str, str]) -> Obj:
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", **extra}
    ready = {"type": "Ready", "status": "True", "reason": "NoKubelet", "message": "bench"}
    return {"status": {"capacity": resources, "allocatable": resources, "conditions": [ready]}}


async def each(
    job: Callable[[T], Awaitable[Any]], items: Iterable[T], limit: int = CONCURRENCY
) -> list[Any]:
    """`job(item)` for every item, at most `limit` at a time."""
    gate = asyncio.Semaphore(limit)

    async def one(item: T) -> Any:
        async with gate:
            return await job(item)

    return await asyncio.gather(*(one(item) for item in items))


async def add_node(api: Api, node: Obj, extra: Mapping[str, str]) -> Obj:
    """Create `node` with a kubelet-like status offering `extra`; the Node as created."""
    name = node["metadata"]["name"]
    created: Obj = await api.call("POST", "/api/v1/nodes", node)
    merge = "application/merge-patch+json"
    await api.call(
        "PATCH", f"/api/v1/nodes/{name}/status", kubelet_status(extra), content_type=merge
    )
    # the API server taints every new Node not-ready; no node-lifecycle controller lifts it
    await api.call("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": None}}, content_type=merge)
    return created


def dra_gpus(name: str, model: str) -> list[dra.GpuDevice]:
    """What the DRA node agent would publish for a bench DRA node: its GPUs with the UUIDs
    `gpu_node` writes to `gpuplace.io/gpus` (the claims are pinned by them), no NVLink."""
    return [
        dra.GpuDevice(index, f"GPU-{name}-{index}", H100_MIB, model=model, numa=0, nvlink_domain=-1)
        for index in range(GPUS)
    ]


async def add_slice(api: Api, node: Obj, model: str) -> None:
    """The node's ResourceSlice as the DRA node agent writes it (owned by the Node)."""
    meta = node["metadata"]
    body = dra.resource_slice(meta["name"], meta["uid"], dra_gpus(meta["name"], model))
    await api.call("POST", "/apis/resource.k8s.io/v1/resourceslices", body)


def gpu_pod(name: str, model: str, percent: int | None = None) -> Obj:
    """A pod of gpuplace's: one whole GPU, or a share of `percent` of one, of `model`."""
    spec = pod_spec({})
    ask = {keys.GPU_PERCENT: str(percent)} if percent else {keys.GPU_COUNT: "1"}
    annotations = {**ask, keys.GPU_MODEL: model}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations},
        "spec": spec,
    }


def plain_pod(name: str) -> Obj:
    spec = pod_spec({PLAIN: "1"})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def pod_spec(limits: Mapping[str, str]) -> Obj:
    box: Obj = {"name": "main", "image": "localhost/busybox:local", "command": ["sleep", "3600"]}
    if limits:
        box["resources"] = {"limits": dict(limits)}
    return {
        "terminationGracePeriodSeconds": 0,
        "containers": [box],
        "schedulingGates": [{"name": GATE}],
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Timing:
    ungated: dict[str, float] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)


def summary(names: list[str], timing: Timing) -> Obj:
    done = [name for name in names if name in timing.bound and name in timing.ungated]
    # The watch may deliver a pod bound before this process reads the answer to its ungate
    # patch (seen on an idle machine): it was bound within that round trip, so 0.
    latencies = [max(0.0, timing.bound[name] - timing.ungated[name]) for name in done]
    if not done:
        return {"pods": len(names), "bound": 0}
    start = min(timing.ungated[name] for name in names if name in timing.ungated)
    span = max(timing.bound[name] for name in done) - start
    return {
        "pods": len(names),
        "bound": len(done),
        "seconds": round(span, 3),
        "pods_per_second": round(len(done) / span, 2) if span > 0 else None,
        "ungate_to_bind_s": {
            "p50": round(percentile(latencies, 0.50), 3),
            "p99": round(percentile(latencies, 0.99), 3),
            "max": round(max(latencies), 3),
            "mean": round(statistics.fmean(latencies), 3),
        },
    }


def kinds_of(pods: list[str], timing: Timing, namespace: str) -> str:
    """Which kind of node `pods` went to: "gpu", "plain", or "mixed"."""
    kinds = {
        timing.nodes[name].removeprefix(namespace + "-").split("-")[0]
        for name in pods
        if name in timing.nodes
    }
    return kinds.pop() if len(kinds) == 1 else "mixed"


Totals = dict[tuple[str, str], tuple[float, float]]
"""(histogram, series key) -> (sum, count)."""


def scrape(url: str, tls: ssl.SSLContext | None = None) -> str:
    """One /metrics page as text; raises OSError when it cannot be read."""
    with urllib.request.urlopen(url, timeout=30, context=tls) as answer:
        return str(answer.read().decode())


def totals(
    text: str, histograms: Collection[str], key: Callable[[Mapping[str, str]], str]
) -> Totals:
    """The sum and count of each of `histograms` in a /metrics page (prometheus_client's
    parser), per `key(labels)`, added over the series a key does not tell apart."""
    found: Totals = {}
    for family in text_string_to_metric_families(text):
        if family.name not in histograms:
            continue
        for sample in family.samples:
            kind = sample.name.removeprefix(family.name + "_")
            if kind in ("sum", "count"):
                at = (family.name, key(sample.labels))
                total, count = found.get(at, (0.0, 0.0))
                if kind == "sum":
                    found[at] = (total + sample.value, count)
                else:
                    found[at] = (total, count + sample.value)
    return found


def means(before: Totals, after: Totals, histogram: str) -> dict[str, tuple[int, float]]:
    """Per series key of `histogram`, over what `after` added to `before`: (calls, mean
    seconds)."""
    found: dict[str, tuple[int, float]] = {}
    for (name, key), (total, count) in sorted(after.items()):
        old_total, old_count = before.get((name, key), (0.0, 0.0))
        if name == histogram and count > old_count:
            found[key] = (int(count - old_count), (total - old_total) / (count - old_count))
    return found


EXTENDER = "gpuplace_extender_request_duration_seconds"
PLAN_WAIT = "gpuplace_plan_wait_seconds"
PLAN_ROUND = "gpuplace_plan_round_duration_seconds"
COUNTERS = ("gpuplace_plan_releases", "gpuplace_extender_stale_plans", "gpuplace_dra_claims")


def extender_samples(installation: Installation) -> Totals | None:
    """The sidecar's extender-verb histograms now (its /metrics); None when unreadable."""
    try:
        text = scrape(f"http://127.0.0.1:{installation.ports.metrics}/metrics")
    except OSError:
        return None
    return totals(text, [EXTENDER], lambda labels: f"{labels['verb']} {labels['result']}")


def extender_histograms(installation: Installation, before: Totals | None) -> Obj:
    """The sidecar's own latency per extender verb over the burst (since `before`, a
    reading of `extender_samples`): calls and mean seconds, by verb and result (the
    session's sidecar may have served other tests' pods before)."""
    after = extender_samples(installation)
    if after is None:
        return {"error": "the sidecar's /metrics could not be read"}
    return {
        key: {"calls": calls, "mean_s": round(mean, 4)}
        for key, (calls, mean) in means(before or {}, after, EXTENDER).items()
    }


def planner_report(installation: Installation) -> Obj:
    """The sidecar's planner since it started (its /metrics): releases by result, plans
    the extender's filter found stale and chose again, the planner's rounds (count, mean
    CPU ms) and its wait from a pod being plannable to its release written (mean ms)."""
    try:
        text = scrape(f"http://127.0.0.1:{installation.ports.metrics}/metrics")
    except OSError as error:
        return {"error": str(error)}
    report: Obj = {}
    for family in text_string_to_metric_families(text):
        if family.name in COUNTERS:
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.value:
                    label = sample.labels.get("result", "")
                    report[f"{family.name}{'/' + label if label else ''}"] = int(sample.value)
    found = totals(text, [PLAN_WAIT, PLAN_ROUND], lambda _: "")
    for name, short in ((PLAN_ROUND, "rounds"), (PLAN_WAIT, "wait")):
        for _, (calls, mean) in means({}, found, name).items():
            report[short] = {"count": calls, "mean_ms": round(1000 * mean, 2)}
    return report


LOOP_LAG = "gpuplace_event_loop_lag_seconds"


def loop_lag_samples(installation: Installation) -> dict[str, float]:
    """The sidecar's event-loop lag histogram (its /metrics): count, sum and each bucket's
    cumulative count by upper edge ("le"); empty when it cannot be read."""
    try:
        text = scrape(f"http://127.0.0.1:{installation.ports.metrics}/metrics")
    except OSError:
        return {}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != LOOP_LAG:
            continue
        for sample in family.samples:
            kind = sample.name.removeprefix(LOOP_LAG + "_")
            found[sample.labels["le"] if kind == "bucket" else kind] = sample.value
    return found


def loop_lag_report(before: Mapping[str, float], after: Mapping[str, float]) -> Obj:
    """Over the burst: the probes, their mean lag (ms) and the share of them that ran more
    than 5 and 20 ms late: how long a verb arriving at a random moment waited for the
    sidecar's loop before its handler started."""
    probes = after.get("count", 0.0) - before.get("count", 0.0)
    if probes <= 0:
        return {}

    def late(edge: str) -> float:
        within = after.get(edge, 0.0) - before.get(edge, 0.0)
        return round((probes - within) / probes, 3)

    mean = (after.get("sum", 0.0) - before.get("sum", 0.0)) / probes
    return {
        "probes": int(probes),
        "mean_ms": round(1000 * mean, 2),
        "share_over_5ms": late("0.005"),
        "share_over_20ms": late("0.02"),
    }


FLOW_METRICS = (
    "apiserver_flowcontrol_request_wait_duration_seconds",
    "apiserver_flowcontrol_request_execution_seconds",
)


def flow_samples(installation: Installation) -> Totals:
    """kube-apiserver's API Priority and Fairness histograms per FlowSchema."""
    text = scrape(installation.cluster.server + "/metrics", admin_tls(installation))
    return totals(text, FLOW_METRICS, lambda labels: labels.get("flow_schema", ""))


WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE", "APPLY"})


def write_counts(installation: Installation) -> dict[str, float]:
    """kube-apiserver's writes so far (`apiserver_request_total`), by verb and resource
    (`PATCH pods/status`), whoever wrote them."""
    text = scrape(installation.cluster.server + "/metrics", admin_tls(installation))
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            labels = sample.labels
            if not sample.name.endswith("_total") or labels.get("verb") not in WRITES:
                continue
            resource = labels.get("resource", "")
            if labels.get("subresource"):
                resource += "/" + labels["subresource"]
            key = f"{labels['verb']} {resource}"
            found[key] = found.get(key, 0.0) + sample.value
    return found


def writes_report(before: Mapping[str, float], after: Mapping[str, float], pods: int) -> Obj:
    """The writes the burst made, by verb and resource, and per pod bound: what each
    path's pods cost the API server (the bench's own ungates among them)."""
    made = {key: int(after[key] - before.get(key, 0.0)) for key in sorted(after)}
    made = {key: count for key, count in made.items() if count > 0}
    return {
        "by_verb": made,
        "per_pod": round(sum(made.values()) / pods, 2) if pods else None,
    }


def flow_report(before: Totals, after: Totals) -> Obj:
    """Per FlowSchema, over the burst: requests, mean queue wait and mean execution (s):
    where kube-apiserver made each identity's requests wait."""
    report: Obj = {}
    for metric, short in zip(FLOW_METRICS, ("wait", "execution"), strict=True):
        for schema, (calls, mean) in means(before, after, metric).items():
            entry = report.setdefault(schema, {"requests": calls})
            entry[f"mean_{short}_s"] = round(mean, 4)
    return report


ATTEMPT, EXTENSION_POINT, ALGORITHM, PLUGIN = (
    "scheduler_scheduling_attempt_duration_seconds",
    "scheduler_framework_extension_point_duration_seconds",
    "scheduler_scheduling_algorithm_duration_seconds",
    "scheduler_plugin_execution_duration_seconds",
)
RATE_LIMITER = "rest_client_rate_limiter_duration_seconds"
"""client-go's wait in the process's own API rate limiter (`clientConnection.qps`/`burst`,
50/100 by default), per request: the time a write waited before it was even sent."""
DRA_PLUGIN = "DynamicResources"
"""kube-scheduler's DRA plugin: its time per extension point is DRA's allocator (plugin
times are sampled, one scheduling cycle in ten by default)."""


def scheduler_samples(installation: Installation, port: int) -> Totals:
    """One kube-scheduler's time per scheduling attempt and per extension point (its
    /metrics on the secure port, read with the admin's client certificate); empty when
    it cannot be read."""
    tls = admin_tls(installation)
    tls.check_hostname = False
    tls.verify_mode = ssl.CERT_NONE  # its serving certificate is self-signed
    try:
        text = scrape(f"https://127.0.0.1:{port}/metrics", tls)
    except OSError:
        return {}
    found = totals(
        text,
        (ATTEMPT, EXTENSION_POINT, ALGORITHM),
        lambda labels: labels.get("extension_point", "attempt"),
    )
    plugin = totals(
        text, (PLUGIN,), lambda labels: f"{labels['plugin']} {labels['extension_point']}"
    )
    found.update(
        {key: value for key, value in plugin.items() if key[1].startswith(DRA_PLUGIN + " ")}
    )
    found.update(totals(text, (RATE_LIMITER,), lambda labels: f"rate limiter {labels['verb']}"))
    return found


def scheduler_report(before: Totals, after: Totals) -> Obj:
    """Per extension point, whole attempts (the cycle and the bind) and the algorithm
    (filter, the extenders' calls and score: the part of the cycle a pod waits for
    alone) over the burst: calls and mean ms."""
    found = {
        **means(before, after, EXTENSION_POINT),
        **means(before, after, ATTEMPT),
        **means(before, after, PLUGIN),
        **means(before, after, RATE_LIMITER),
    }
    for value in means(before, after, ALGORITHM).values():  # one series: no labels
        found["algorithm"] = value
    return {
        key: {"calls": calls, "mean_ms": round(1000 * mean, 3)}
        for key, (calls, mean) in sorted(found.items())
    }


def cpu_seconds(installation: Installation) -> dict[str, float]:
    """CPU seconds (user + system) each process of the run has used so far, from
    /proc/PID/stat: the control plane's (cluster.sh's pid files), the sidecar, the gpuplace
    kube-scheduler and this bench; a process already gone is left out."""
    pids: dict[str, int] = {"bench": os.getpid()}
    for name in ("etcd", "kube-apiserver", "kube-scheduler"):
        pid_file = installation.cluster.state / "pids" / f"{name}.pid"
        with contextlib.suppress(OSError, ValueError):
            pids["plain kube-scheduler" if name == "kube-scheduler" else name] = int(
                pid_file.read_text()
            )
    ours = (("sidecar", installation.serve), ("gpuplace kube-scheduler", installation.scheduler))
    for name, host in ours:
        if host.process is not None:
            pids[name] = host.process.pid
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            found[name] = (int(fields[11]) + int(fields[12])) / tick
    return found


async def watch_binds(api: Api, namespace: str, rv: str, timing: Timing, expected: int) -> None:
    """Record when each pod is first seen bound, until `expected` are; a watch that ends
    is resumed from the last resourceVersion it delivered (a 410: from a new list)."""
    path = f"{api.url}/api/v1/namespaces/{namespace}/pods"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    while len(timing.bound) < expected:
        params = {"watch": "true", "resourceVersion": rv, "allowWatchBookmarks": "true"}
        async with api.session.get(path, params=params, ssl=api.tls, timeout=timeout) as response:
            async for line in response.content:
                if not line.strip():
                    continue
                now = time.monotonic()
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    listed = await api.call("GET", f"/api/v1/namespaces/{namespace}/pods")
                    for item in listed["items"]:
                        seen(item, now, timing)
                    rv = listed["metadata"]["resourceVersion"]
                    break
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                seen(obj, now, timing)
                if len(timing.bound) >= expected:
                    return


async def events_written(api: Api, namespace: str, reason: str, count: int) -> None:
    """Until `count` Events of `reason` are in `namespace` (30 s at most)."""
    path = f"/api/v1/namespaces/{namespace}/events?fieldSelector=reason%3D{reason}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if len((await api.call("GET", path))["items"]) >= count:
            return
        await asyncio.sleep(0.2)


def seen(obj: Mapping[str, Any], now: float, timing: Timing) -> None:
    name = str((obj.get("metadata") or {}).get("name"))
    node = (obj.get("spec") or {}).get("nodeName")
    if node:
        timing.bound.setdefault(name, now)
        timing.nodes.setdefault(name, str(node))


def exited(installation: Installation) -> str | None:
    """Why the gpuplace kube-scheduler stopped during the run (None: it runs): it exits
    when it cannot renew its Lease in time, as a saturated API server makes it."""
    process = getattr(installation.scheduler, "process", None)
    if process is None or process.poll() is None:
        return None
    log = installation.workdir / "kube-scheduler.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    last = [line for line in lines if line.startswith(("E", "F"))][-1:]
    return f"exit {process.returncode}: {last[0] if last else ''}"[:300]


def log_problems(log: Path) -> dict[str, int]:
    """How often each WARNING or ERROR message of a JSON log was logged."""
    counts: dict[str, int] = {}
    if not log.exists():
        return counts
    for line in log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and str(record.get("level", "")).upper() in (
            "WARNING",
            "ERROR",
        ):
            key = f"{record.get('level')}: {record.get('message') or record.get('msg')}"
            counts[key] = counts.get(key, 0) + 1
    return counts


async def measure(
    installation: Installation,
    nodes: int,
    pods: int,
    *,
    timeout: float = 600,
    cleanup: bool = True,
    log: Path | None = None,
    dra_nodes: bool = False,
    percent: int | None = None,
) -> Obj:
    """One run: `nodes` GPU + `nodes` plain nodes (+ `nodes` DRA nodes with `dra_nodes`),
    `pods` pods of each kind, gpuplace's asking a share of `percent` (None: a whole GPU);
    see the module docstring. With `cleanup`, removes its namespace and nodes after; `log`:
    the sidecar's log (default the tier's serve.log)."""
    run = secrets.token_hex(3)
    namespace, model = f"bench-{run}", f"BENCH-{run.upper()}"
    dra_model = f"{model}-DRA"
    jar = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
    async with aiohttp.ClientSession(connector=jar) as session:
        api = Api(installation.cluster.server, session, admin_tls(installation))
        await api.call("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
        for _ in range(600):  # the ServiceAccount admission needs `default` first
            try:
                await api.call("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default")
                break
            except RuntimeError:
                await asyncio.sleep(0.1)
        gpu_names = [f"{namespace}-gpu-{i}" for i in range(nodes)]
        plain_names = [f"{namespace}-plain-{i}" for i in range(nodes)]
        dra_names = [f"{namespace}-dra-{i}" for i in range(nodes if dra_nodes else 0)]
        began = time.monotonic()
        slots = {"gpuplace.io/gpu": str(SLOTS_PER_GPU * GPUS)}
        plain_slots = {PLAIN: str(GPUS)}
        ours = {"bench-gpuplace": run}
        made_nodes: list[tuple[Obj, Mapping[str, str]]] = [
            (gpu_node(name, model=model, gpus=GPUS, labels=ours), slots) for name in gpu_names
        ]
        for name in plain_names:
            labels = {"kubernetes.io/hostname": name, "bench": run}
            plain = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": labels},
            }
            made_nodes.append((plain, plain_slots))
        dra_label = {keys.NODE_DRA: "true"}
        for name in dra_names:  # no device plugin: the kubelet offers no GPU resource
            labels = {**ours, **dra_label}
            made = gpu_node(name, model=dra_model, gpus=GPUS, nvlink=[-1] * GPUS, labels=labels)
            made_nodes.append((made, {}))

        async def create_node(made: tuple[Obj, Mapping[str, str]]) -> None:
            created = await add_node(api, *made)
            if created["metadata"]["name"] in dra_names:
                await add_slice(api, created, dra_model)

        timing = Timing()
        gpu_pods: list[str] = []
        dra_pods: list[str] = []
        try:
            await each(create_node, made_nodes)
            # the sidecar knows a GPU node once it advertises its GPUs on the node's status
            selector = f"bench-gpuplace={run}"
            expected = len(gpu_names) + len(dra_names)
            while True:
                listed = await api.call("GET", f"/api/v1/nodes?labelSelector={selector}")
                ready = [
                    n
                    for n in listed["items"]
                    if keys.RESOURCE_PERCENT in (n["status"].get("allocatable") or {})
                ]
                if len(ready) == expected:
                    break
                if time.monotonic() - began > timeout:
                    raise TimeoutError(
                        f"the sidecar advertised {len(ready)} of {expected} GPU nodes"
                    )
                await asyncio.sleep(0.5)
            nodes_s = time.monotonic() - began
            gpu_pods = [f"g{i}" for i in range(pods)]
            plain_pods = [f"p{i}" for i in range(pods)]
            dra_pods = [f"d{i}" for i in range(pods if dra_nodes else 0)]
            base = f"/api/v1/namespaces/{namespace}/pods"
            bodies = [gpu_pod(n, model, percent) for n in gpu_pods]
            bodies += [plain_pod(n) for n in plain_pods]
            bodies += [gpu_pod(n, dra_model, percent) for n in dra_pods]

            async def create_pod(body: Obj) -> None:
                await api.call("POST", base, body)

            await each(create_pod, bodies)
            rv = (await api.call("GET", base + "?limit=1"))["metadata"]["resourceVersion"]
            watching = asyncio.create_task(watch_binds(api, namespace, rv, timing, len(bodies)))
            await asyncio.sleep(0.5)  # the watch is open
            # the bench's own gate only (the first: the webhook appends gpuplace's after it)
            ungate = [
                {"op": "test", "path": "/spec/schedulingGates/0/name", "value": GATE},
                {"op": "remove", "path": "/spec/schedulingGates/0"},
            ]

            async def release(name: str) -> None:
                await api.call("PATCH", f"{base}/{name}", ungate, content_type=JSON_PATCH)
                timing.ungated[name] = time.monotonic()

            kinds = [gpu_pods, plain_pods] + ([dra_pods] if dra_pods else [])
            order = [name for row in zip(*kinds, strict=True) for name in row]
            ports = {
                "gpuplace": installation.ports.scheduler,
                "plain": int(installation.cluster.run_env["K8S_SCHEDULER_PORT"]),
            }

            def schedulers() -> dict[str, Totals]:
                return {kind: scheduler_samples(installation, port) for kind, port in ports.items()}

            flows_before = await asyncio.to_thread(flow_samples, installation)
            writes_before = await asyncio.to_thread(write_counts, installation)
            schedulers_before = await asyncio.to_thread(schedulers)
            lag_before = await asyncio.to_thread(loop_lag_samples, installation)
            verbs_before = await asyncio.to_thread(extender_samples, installation)
            cpu_before, burst_began = cpu_seconds(installation), time.monotonic()
            await each(release, order)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(watching, timeout)
            flows = flow_report(flows_before, await asyncio.to_thread(flow_samples, installation))
            writes = writes_report(
                writes_before,
                await asyncio.to_thread(write_counts, installation),
                len(timing.bound),
            )
            cpu_after, burst_s = cpu_seconds(installation), time.monotonic() - burst_began
            schedulers_after = await asyncio.to_thread(schedulers)
            lag = loop_lag_report(
                lag_before, await asyncio.to_thread(loop_lag_samples, installation)
            )
            cpu = {
                "burst_s": round(burst_s, 1),
                "cpu_seconds": {
                    name: round(cpu_after[name] - cpu_before[name], 1)
                    for name in cpu_after
                    if name in cpu_before
                },
                "cores_used": {
                    name: round((cpu_after[name] - cpu_before[name]) / burst_s, 2)
                    for name in cpu_after
                    if name in cpu_before
                },
            }
            scheduling = {
                kind: scheduler_report(schedulers_before[kind], schedulers_after[kind])
                for kind in ports
            }
            gpu, plain = summary(gpu_pods, timing), summary(plain_pods, timing)

            def ratio(kind: Obj) -> float | None:
                if kind.get("pods_per_second") and plain.get("pods_per_second"):
                    return round(float(kind["pods_per_second"] / plain["pods_per_second"]), 3)
                return None

            placed = {
                "gpuplace": kinds_of(gpu_pods, timing, namespace),
                "plain": kinds_of(plain_pods, timing, namespace),
            }
            through_dra: Obj = {}
            if dra_pods:
                dra_kind = summary(dra_pods, timing)
                through_dra = {"dra": dra_kind, "dra_throughput_ratio": ratio(dra_kind)}
                placed["dra"] = kinds_of(dra_pods, timing, namespace)
            return {
                "nodes": {
                    "gpu": nodes,
                    "plain": nodes,
                    "dra": len(dra_names),
                    "gpus_per_node": GPUS,
                    "setup_s": round(nodes_s, 1),
                },
                "ask": f"{percent}% of a GPU" if percent else "one whole GPU",
                "gpuplace": gpu,
                "plain": plain,
                "throughput_ratio": ratio(gpu),
                **through_dra,
                "placed_on": placed,
                "api_writes": writes,
                "sidecar_verbs": extender_histograms(installation, verbs_before),
                "planner": planner_report(installation),
                "sidecar_loop_lag": lag,
                "api_priority_and_fairness": flows,
                "kube_scheduler": scheduling,
                "cpu": cpu,
                "serve_log_problems": log_problems(log or installation.workdir / "serve.log"),
                "gpuplace_scheduler_exited": exited(installation),
                "logs": str(installation.workdir),
            }
        finally:
            if cleanup:
                # the sidecar's GpusAssigned events first: a namespace being deleted refuses
                # them (403), which the tier counts as RBAC refusing gpuplace a call
                assigned = sum(name in timing.bound for name in gpu_pods + dra_pods)
                await events_written(api, namespace, "GpusAssigned", assigned)
                await api.call("DELETE", f"/api/v1/namespaces/{namespace}")

                async def delete_node(name: str) -> None:
                    await api.call("DELETE", f"/api/v1/nodes/{name}")

                await each(delete_node, gpu_names + plain_names + dra_names)


def up(scratch: Path, tries: int = 3) -> kit.Cluster:
    """A control plane; again on failure (a free port taken by another process meanwhile)."""
    for attempt in range(1, tries + 1):
        try:
            return kit.Cluster.up(scratch / f"state-{attempt}", node=False)
        except kit.ClusterError:
            if attempt == tries:
                raise
    raise AssertionError("unreachable")


PINS = ("nominate", "affinity", "off")


def restart_cluster_scheduler(cluster: kit.Cluster, scratch: Path, qps: int) -> HostProcess:
    """The kit's own kube-scheduler (the default profile, the cluster's DRA allocator)
    again with `clientConnection.qps: qps`, `burst: 2 × qps` (the kit writes its
    configuration with client-go's defaults, 50 and 100, and kube-scheduler refuses a
    second `clientConnection` appended to it): the kit's process stopped, the same
    binary, configuration, port and identity started here, its PID in the kit's pid file
    (so the CPU figures and `cluster.sh down` find it)."""
    state = cluster.state
    config = yaml.safe_load((state / "scheduler-config.yaml").read_text())
    config["clientConnection"].update(qps=qps, burst=2 * qps)
    path = scratch / "cluster-scheduler-config.yaml"
    path.write_text(yaml.safe_dump(config))
    pid_file = state / "pids" / "kube-scheduler.pid"
    old = int(pid_file.read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(old, signal.SIGTERM)
    for _ in range(150):
        if not Path(f"/proc/{old}").exists():
            break
        time.sleep(0.2)
    kubeconfig = str(state / "scheduler.kubeconfig")
    port = cluster.run_env["K8S_SCHEDULER_PORT"]
    process = HostProcess(
        f"kube-scheduler (the cluster's, qps {qps})",
        [
            str(cluster.bin_dir / "kube-scheduler"),
            f"--config={path}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--v=1",
        ],
        scratch / "cluster-scheduler.log",
    )
    process.start()
    assert process.process is not None
    pid_file.write_text(f"{process.process.pid}\n")
    return process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=300, help="GPU nodes, and as many plain ones")
    parser.add_argument(
        "--pods", type=int, default=None, help="pods of each kind (default 2 × nodes)"
    )
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--plan-pin",
        default="",
        help="comma-separated `gpuplace serve --plan-pin` values, one run each on the same "
        f"control plane in this order ({', '.join(PINS)}; default: serve's own default)",
    )
    parser.add_argument(
        "--dra",
        action="store_true",
        help="also N DRA nodes (a ResourceSlice each, as the DRA node agent writes it) and P "
        "pods of gpuplace's on them, through the DRA component (`deploy/components/dra`: "
        "`--dra-claims=fallback`, the claim controller plans and pins each claim)",
    )
    parser.add_argument(
        "--percent",
        type=int,
        default=None,
        help="gpuplace's pods ask this share of a GPU (`gpuplace.io/gpu-percent`) instead of "
        "a whole one (`gpu-count: 1`)",
    )
    parser.add_argument(
        "--cluster-scheduler-qps",
        type=int,
        default=None,
        help="run the cluster's kube-scheduler (default profile, DRA allocator) with this "
        "`clientConnection.qps` (burst twice it) instead of client-go's 50",
    )
    args = parser.parse_args(argv)
    if args.percent is not None and not 1 <= args.percent <= 100:
        parser.error("--percent: 1 to 100")
    variants = [v for v in args.plan_pin.split(",") if v] or [""]
    unknown = [v for v in variants if v and v not in PINS]
    if unknown:
        parser.error(f"--plan-pin: unknown {', '.join(unknown)}; one of {', '.join(PINS)}")
    problem = kit.kit_missing()
    if problem is not None:
        print(json.dumps({"error": problem}))
        return 2
    scratch = tempfile.mkdtemp(prefix="gpuplace-bench-")  # kept: the processes' logs
    cluster = up(Path(scratch))
    results: list[Obj] = []
    try:
        if args.cluster_scheduler_qps:
            restart_cluster_scheduler(cluster, Path(scratch), args.cluster_scheduler_qps)
        installation = install.install(cluster, Path(scratch))
        rendered = None
        if args.dra:  # the DRA component on top of the install, as docs/dra.md says
            overlay = install.dra_overlay(installation)
            installation.kubectl.run("apply", "-k", str(overlay))
            text = installation.kubectl.run("kustomize", str(overlay)).out
            rendered = [item for item in yaml.safe_load_all(text) if item]
        installation.scheduler.start()
        try:
            for run, variant in enumerate(variants):
                flags = {"--plan-pin": variant} if variant else {}
                serve = install.serve_process(installation, flags=flags, rendered=rendered)
                serve.log = installation.workdir / f"serve-{run}-{variant or 'default'}.log"
                installation.serve = serve
                serve.start()
                try:
                    install.wait_leading(installation)
                    result = asyncio.run(
                        measure(
                            installation,
                            args.nodes,
                            args.pods or 2 * args.nodes,
                            timeout=args.timeout,
                            cleanup=run < len(variants) - 1,
                            log=serve.log,
                            dra_nodes=args.dra,
                            percent=args.percent,
                        )
                    )
                finally:
                    serve.stop()
                results.append(
                    {
                        "plan_pin": variant or "default",
                        "cluster_scheduler_qps": args.cluster_scheduler_qps or 50,
                        **result,
                    }
                )
        finally:
            installation.scheduler.stop()
    finally:
        cluster.down()
    print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
