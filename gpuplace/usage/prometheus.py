"""Reading GPU use back from Prometheus: its HTTP API's instant queries
(`/api/v1/query`), over one of two metric sets, into `gpuplace.usage.readings` values.

- `gpuplace`: the node agent's series (`gpuplace.usage.names`), per pod per GPU from the agent's
  per-process accounting, with what each pod was granted;
- `dcgm`: NVIDIA dcgm-exporter's (`DCGM_FI_DEV_FB_USED` in MiB, `DCGM_FI_DEV_GPU_UTIL` in
  percent, `DCGM_FI_PROF_SM_ACTIVE` as a ratio where profiling metrics are on), node from
  `Hostname`, GPU from `gpu`, pod and namespace from `pod`/`namespace` or, where the scrape
  renamed them, `exported_pod`/`exported_namespace`. dcgm-exporter labels a GPU's readings
  with the pod(s) holding the device: they are the whole GPU's, so such pod rows are
  marked `gpu_reading` (docs/usage.md, "dcgm-exporter and shared GPUs").

Each figure is one PromQL instant query over the window, `max by` the identifying labels
so that duplicate series (two scrapes of one exporter, an agent restarted under another
instance) count once: peaks and last values (`max_over_time`, `last_over_time`) per
series, then the max; p95s, sample counts and means (`quantile_over_time(0.95, …)`,
`count_over_time`, `avg_over_time`) over a subquery of the de-duplicated series at
`Source.step_seconds` (`Reader._over`), so that a series split in two by a restart is
read whole. Every failure (down,
timeout, refused query, a body that is not the API's) is a `UsageUnavailable` whose
message names the server and the reason, never the bearer token.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import aiohttp
import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from yarl import URL

from gpuplace.usage import names
from gpuplace.usage.gpu_loads import GpuLoad, GpuLoads, UsageUnavailable
from gpuplace.usage.readings import GpuUse, PodGpuUse, Usage

_K = TypeVar("_K")
Metrics = Literal["gpuplace", "dcgm"]
METRICS: tuple[Metrics, ...] = ("gpuplace", "dcgm")
MIB = 1 << 20
STEP_SECONDS = 15.0
"""Default resolution of the p95s, sample counts and means (a common scrape interval)."""
MAX_BODY = 256 << 20
"""Largest answer read (bytes). One series of an answer is about 110 bytes (gpu_loads'
per-GPU ones) to 250 (`read`'s per-pod ones, all their labels): 10,000 nodes × 8 GPUs is
80,000 GPU series (~9 MB) and, with up to 7 pods sharing each GPU, 560,000 pod series
(~140 MB): both fit."""


class Source(BaseModel):
    """Where and what to read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str
    """Prometheus' base URL (`http://prometheus.monitoring:9090`, or a path prefix behind a
    proxy: the API is `<url>/api/v1/query`)."""
    metrics: Metrics = "gpuplace"
    """Which series: the node agent's (`gpuplace`) or dcgm-exporter's (`dcgm`)."""
    token_file: Path | None = None
    """File holding a bearer token (read at each query, so a rotated token is picked up);
    sent as `Authorization: Bearer`, never logged or shown."""
    timeout_seconds: float = Field(default=10.0, gt=0)
    """For one query, connect to last byte."""
    step_seconds: float = Field(default=STEP_SECONDS, ge=0.001, le=3600)
    """Resolution of the figures taken over the de-duplicated series (p95, sample counts,
    means): set it to the scrape interval of the series."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return check_url(value)

    @field_validator("token_file")
    @classmethod
    def _one_credential(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return check_credentials(info.data.get("url"), value)


def check_url(url: str) -> str:
    """`url` when it is an http(s) URL with a host; else ValueError with a message that
    names it (without any credentials in it)."""
    try:
        parsed = URL(url.rstrip("/"))
    except (TypeError, ValueError):
        parsed = URL()
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(
            f"the Prometheus URL {shown(url)!r} is not an http(s) URL with a host "
            "(e.g. http://prometheus.monitoring:9090)"
        )
    return url


def check_credentials(url: str | None, token_file: Path | None) -> Path | None:
    """`token_file`, unless `url` carries credentials too (ValueError: which to send?)."""
    try:
        parsed = URL(url or "")
    except (TypeError, ValueError):
        return token_file
    if (parsed.user or parsed.password) and token_file is not None:
        raise ValueError(
            "give Prometheus' credentials either in its URL or as a token file, not both"
        )
    return token_file


# -- the API's answer (https://prometheus.io/docs/prometheus/latest/querying/api/) ------------


class Sample(BaseModel):
    """One element of an instant vector."""

    metric: dict[str, str]
    value: tuple[float, str]
    """(evaluation time, the value as a string: "1.5", "NaN", "+Inf")."""


class _Data(BaseModel):
    resultType: str  # noqa: N815 (the API's spelling)
    result: list[Sample] | object


class Answer(BaseModel):
    status: Literal["success", "error"]
    data: _Data | None = None
    errorType: str = ""  # noqa: N815
    error: str = ""
    warnings: list[str] = []


def shown(url: str) -> str:
    """`url` without any user or password in it (fit for messages)."""
    try:
        parsed = URL(url)
    except (TypeError, ValueError):
        return "<an unreadable URL>"
    return str(parsed.with_user(None)) if parsed.user or parsed.password else str(parsed)


class Client:
    """Instant queries against one Prometheus. Use as `async with Client(source) as c`.
    Raises `UsageUnavailable`."""

    def __init__(self, source: Source, session: aiohttp.ClientSession | None = None) -> None:
        self.source = source
        self._session = session
        self._owned = session is None
        try:
            base = check_url(source.url).rstrip("/")
            check_credentials(base, source.token_file)
        except ValueError as error:
            raise UsageUnavailable(str(error)) from None
        url = URL(base)
        self.endpoint = url / "api" / "v1" / "query"
        self.where = shown(base)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict[str, str]:
        if self.source.token_file is None:
            return {}
        try:
            token = self.source.token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise UsageUnavailable(
                f"cannot read the token file {self.source.token_file}: {reason}"
            ) from None
        if not token:
            raise UsageUnavailable(f"the token file {self.source.token_file} is empty")
        return {"Authorization": f"Bearer {token}"}

    async def vector(self, promql: str, at: float) -> list[Sample]:
        """The instant vector `promql` evaluates to at POSIX time `at`."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = self._headers()
        timeout = aiohttp.ClientTimeout(total=self.source.timeout_seconds)
        params = {"query": promql, "time": f"{at:.3f}"}
        try:
            async with self._session.get(
                self.endpoint, params=params, headers=headers, timeout=timeout
            ) as response:
                body = await _bounded_body(response)
                status = response.status
        except TimeoutError:
            raise UsageUnavailable(
                f"Prometheus at {self.where} did not answer within "
                f"{self.source.timeout_seconds:g} s"
            ) from None
        except aiohttp.ClientError as error:
            raise UsageUnavailable(
                f"Prometheus at {self.where} cannot be reached: "
                f"{str(error) or type(error).__name__}"
            ) from None
        if body is None:
            raise UsageUnavailable(f"Prometheus at {self.where} answered over {MAX_BODY} bytes")
        return self._parse(promql, status, body)

    def _parse(self, promql: str, status: int, body: bytes) -> list[Sample]:
        try:
            answer = Answer.model_validate_json(body)
        except pydantic.ValidationError:
            if status in (401, 403):
                raise UsageUnavailable(
                    f"Prometheus at {self.where} refused the credentials (HTTP {status}); "
                    "give --token-file a valid bearer token"
                ) from None
            if status >= 500:
                text = "".join(
                    ch if ch.isprintable() else " " for ch in body[:200].decode("utf-8", "replace")
                )
                raise UsageUnavailable(
                    f"Prometheus at {self.where} failed: HTTP {status} {text.strip()}"
                ) from None
            raise UsageUnavailable(
                f"{self.where} answered HTTP {status} with something other than Prometheus' "
                "query API (is the URL Prometheus' base URL?)"
            ) from None
        if answer.status == "error" or status >= 400:
            raise UsageUnavailable(
                f"Prometheus at {self.where} refused the query "
                f"({answer.errorType or f'HTTP {status}'}: {answer.error[:300]}): {promql}"
            )
        if answer.data is None or answer.data.resultType != "vector":
            kind = answer.data.resultType if answer.data is not None else "no data"
            raise UsageUnavailable(f"Prometheus answered a {kind}, not a vector: {promql}")
        result = answer.data.result
        if not isinstance(result, list):
            raise UsageUnavailable(f"Prometheus answered a malformed vector: {promql}")
        return result


async def _bounded_body(response: aiohttp.ClientResponse) -> bytes | None:
    """The whole body, however many chunks it comes in; None past `MAX_BODY` bytes (the
    rest is not read). O(body)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def value_of(sample: Sample) -> float | None:
    """The sample's value, or None when it is not a finite number."""
    try:
        number = float(sample.value[1])
    except ValueError:
        return None
    return number if math.isfinite(number) else None


# -- the two metric sets -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MetricSet:
    """Where one exporter keeps each figure, and in which unit."""

    node: str
    gpu: str
    pods: tuple[str, ...]
    """Pod labels, in the order read (the first non-empty wins)."""
    namespaces: tuple[str, ...]
    pod_memory: str
    pod_memory_scale: float
    pod_util: tuple[tuple[str, float], ...]
    """(metric, scale to a 0-1 ratio), the first that has a series wins."""
    gpu_memory: str
    gpu_memory_scale: float
    gpu_total: str
    """PromQL (with `{w}` for the range) of each GPU's memory in bytes."""
    gpu_util: tuple[tuple[str, float], ...]
    load_util: tuple[str, float]
    """GpuLoad's utilisation: share of time a kernel ran."""
    granted_memory: str | None
    granted_share: str | None
    gpu_reading: bool
    pod_memory_peak: str | None = None
    """A series of each pod's highest memory over the exporter's own recent samples (the
    node agent's, kept over `--usage-peak-seconds`): a peak between two scrapes, which
    `pod_memory`'s samples miss, still shows there."""


GPUPLACE = MetricSet(
    node="node",
    gpu="gpu",
    pods=("pod",),
    namespaces=("namespace",),
    pod_memory=names.POD_MEMORY_USED,
    pod_memory_scale=1.0,
    pod_util=((names.POD_SM_UTILIZATION, 1.0),),
    gpu_memory=names.GPU_MEMORY_USED,
    gpu_memory_scale=1.0,
    gpu_total=f"last_over_time({names.GPU_MEMORY_TOTAL}[{{w}}])",
    gpu_util=((names.GPU_UTILIZATION, 1.0),),
    load_util=(names.GPU_UTILIZATION, 1.0),
    granted_memory=names.POD_MEMORY_GRANTED,
    granted_share=names.POD_SHARE_GRANTED,
    gpu_reading=False,
    pod_memory_peak=names.POD_MEMORY_PEAK,
)
DCGM = MetricSet(
    node=names.DCGM_HOSTNAME,
    gpu=names.DCGM_GPU,
    # exported_* first: where it exists, the scrape's own `pod` label names the exporter
    pods=tuple(reversed(names.DCGM_POD)),
    namespaces=tuple(reversed(names.DCGM_NAMESPACE)),
    pod_memory=names.DCGM_FB_USED,
    pod_memory_scale=MIB,
    pod_util=((names.DCGM_SM_ACTIVE, 1.0), (names.DCGM_GPU_UTIL, 0.01)),
    gpu_memory=names.DCGM_FB_USED,
    gpu_memory_scale=MIB,
    gpu_total=(
        f"(last_over_time({names.DCGM_FB_USED}[{{w}}]) + "
        f"last_over_time({names.DCGM_FB_FREE}[{{w}}])) * {MIB}"
    ),
    gpu_util=((names.DCGM_SM_ACTIVE, 1.0), (names.DCGM_GPU_UTIL, 0.01)),
    load_util=(names.DCGM_GPU_UTIL, 0.01),
    granted_memory=None,
    granted_share=None,
    gpu_reading=True,
)
SETS: Mapping[Metrics, MetricSet] = {"gpuplace": GPUPLACE, "dcgm": DCGM}

_SUBQUERIED = frozenset({"quantile", "count", "avg"})
"""Figures taken over the de-duplicated series (`Reader._over`)."""

PodKey = tuple[str, str, str, int]
"""(namespace, pod, node, gpu)"""
GpuKey = tuple[str, int]


def _range(window_seconds: float) -> str:
    if not math.isfinite(window_seconds) or window_seconds < 1:
        raise UsageUnavailable(f"the window must be at least 1 s, not {window_seconds!r}")
    return f"{round(window_seconds)}s"


class Reader:
    """Reads `Usage` (and, as a `gpuplace.usage.gpu_loads.LoadReader`, `GpuLoads`) from Prometheus.

    One read is 13 to 15 instant queries, sent together; each is O(series of its metric)
    on the server and here.
    """

    def __init__(self, source: Source, session: aiohttp.ClientSession | None = None) -> None:
        self.source = source
        self.set = SETS[source.metrics]
        self.client = Client(source, session)

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> Reader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- keys ----------------------------------------------------------------------------------

    def _gpu_key(self, labels: Mapping[str, str]) -> GpuKey | None:
        node = labels.get(self.set.node, "")
        gpu = labels.get(self.set.gpu, "")
        if not node or not gpu.isdigit():
            return None
        return (node, int(gpu))

    def _pod_key(self, labels: Mapping[str, str], renamed: bool) -> PodKey | None:
        """`renamed`: the series' scrape job renamed the exporter's pod labels (its own
        `pod` is the exporter's pod), so only the `exported_*` labels name the workload."""
        where = self._gpu_key(labels)
        pods = self.set.pods[:1] if renamed else self.set.pods
        namespaces = self.set.namespaces[:1] if renamed else self.set.namespaces
        pod = next((labels[key] for key in pods if labels.get(key)), "")
        namespace = next((labels[key] for key in namespaces if labels.get(key)), "")
        if where is None or not pod:
            return None
        return (namespace, pod, *where)

    def _pod_by(self) -> str:
        labels = (self.set.node, self.set.gpu, *self.set.pods, *self.set.namespaces)
        return ", ".join((*labels, "job") if len(self.set.pods) > 1 else labels)

    def _gpu_by(self) -> str:
        return f"{self.set.node}, {self.set.gpu}"

    # -- queries -------------------------------------------------------------------------------

    async def _pods(self, expr: str, at: float, scale: float = 1.0) -> dict[PodKey, float]:
        found: dict[PodKey, float] = {}
        samples = await self.client.vector(f"max by ({self._pod_by()}) ({expr})", at)
        exported = self.set.pods[0]
        renamed = {sample.metric.get("job", "") for sample in samples if exported in sample.metric}
        for sample in samples:
            key = self._pod_key(sample.metric, sample.metric.get("job", "") in renamed)
            number = value_of(sample)
            if key is not None and number is not None:
                found[key] = max(found.get(key, number), number)
        return {key: number * scale for key, number in found.items()}

    async def _gpus(self, expr: str, at: float, scale: float = 1.0) -> dict[GpuKey, float]:
        found: dict[GpuKey, float] = {}
        for sample in await self.client.vector(f"max by ({self._gpu_by()}) ({expr})", at):
            key = self._gpu_key(sample.metric)
            number = value_of(sample)
            if key is not None and number is not None:
                found[key] = number * scale
        return found

    def _over(self, function: str, metric: str, w: str, by: str) -> str:
        """`function` over the window `w` of `metric`.

        Peaks and last values are taken per series (then `max by`: the max of the parts
        is the max of the whole). A p95, a count or a mean of parts is not the whole's:
        an agent restarted under a new `instance` (a DaemonSet rollout) splits a pod's
        window into two series, so these are taken over the de-duplicated series,
        `max by` the identifying labels at each `step_seconds` (a subquery): the count
        is then the number of steps with a value."""
        if function not in _SUBQUERIED:
            return f"{function}_over_time({metric}[{w}])"
        step = f"{round(self.source.step_seconds * 1000)}ms"
        first = "0.95, " if function == "quantile" else ""
        return f"{function}_over_time({first}(max by ({by}) ({metric}))[{w}:{step}])"

    def _pod_over(self, function: str, metric: str, w: str) -> str:
        series = metric
        if function in _SUBQUERIED and len(self.set.pods) > 1:
            # where a scrape renamed the exporter's pod labels, `pod` names the exporter
            # (a new one after each rollout): let the workload's name stand in for it
            for target, source in zip(self.set.pods[1:], self.set.pods, strict=False):
                series = f'label_replace({series}, "{target}", "$1", "{source}", "(.+)")'
            for target, source in zip(self.set.namespaces[1:], self.set.namespaces, strict=False):
                series = f'label_replace({series}, "{target}", "$1", "{source}", "(.+)")'
        return self._over(function, series, w, self._pod_by())

    def _gpu_over(self, function: str, metric: str, w: str) -> str:
        return self._over(function, metric, w, self._gpu_by())

    async def read(self, window_seconds: float, at: float | None = None) -> Usage:
        """Peak, p95 and sample count of every pod's and GPU's memory and utilisation over
        the `window_seconds` ending at `at` (default: now)."""
        when = time.time() if at is None else at
        w = _range(window_seconds)
        s = self.set

        pod, gpu = self._pod_over, self._gpu_over
        pod_queries = [
            self._pods(pod("max", s.pod_memory, w), when, s.pod_memory_scale),
            self._pods(pod("quantile", s.pod_memory, w), when, s.pod_memory_scale),
            self._pods(pod("count", s.pod_memory, w), when),
        ]
        for metric, scale in s.pod_util:
            pod_queries.append(self._pods(pod("max", metric, w), when, scale))
            pod_queries.append(self._pods(pod("quantile", metric, w), when, scale))
        for granted in (s.granted_memory, s.granted_share):
            if granted is not None:
                pod_queries.append(self._pods(pod("last", granted, w), when))
        if s.pod_memory_peak is not None:
            pod_queries.append(self._pods(pod("max", s.pod_memory_peak, w), when))
        gpu_queries = [
            self._gpus(gpu("max", s.gpu_memory, w), when, s.gpu_memory_scale),
            self._gpus(gpu("quantile", s.gpu_memory, w), when, s.gpu_memory_scale),
            self._gpus(gpu("count", s.gpu_memory, w), when),
            self._gpus(s.gpu_total.format(w=w), when),
        ]
        for metric, scale in s.gpu_util:
            gpu_queries.append(self._gpus(gpu("max", metric, w), when, scale))
            gpu_queries.append(self._gpus(gpu("quantile", metric, w), when, scale))
        pods = asyncio.gather(*pod_queries)
        gpus = asyncio.gather(*gpu_queries)
        try:
            pod_results, gpu_results = await asyncio.gather(pods, gpus)
        except BaseException:
            pods.cancel()
            gpus.cancel()
            raise
        return Usage(
            source=self.source.metrics,
            window_seconds=float(round(window_seconds)),
            at=when,
            pods=self._pod_rows(pod_results),
            gpus=self._gpu_rows(gpu_results),
        )

    def _pod_rows(self, results: Sequence[Mapping[PodKey, float]]) -> tuple[PodGpuUse, ...]:
        peak, p95, count = results[0], results[1], results[2]
        utils = [(results[3 + 2 * i], results[4 + 2 * i]) for i in range(len(self.set.pod_util))]
        rest = results[3 + 2 * len(self.set.pod_util) :]
        granted_memory = rest[0] if self.set.granted_memory is not None else {}
        granted_share = rest[1] if self.set.granted_share is not None else {}
        if self.set.pod_memory_peak is not None:
            # the exporter's own peaks: what happened between scrapes
            peak = {key: max(value, rest[-1].get(key, value)) for key, value in peak.items()}
        rows = []
        for key in sorted(peak):
            namespace, pod, node, gpu = key
            util_peak, util_p95 = _first(utils, key)
            memory = granted_memory.get(key)
            rows.append(
                PodGpuUse(
                    namespace=namespace,
                    pod=pod,
                    node=node,
                    gpu=gpu,
                    memory_peak_bytes=round(peak[key]),
                    memory_p95_bytes=round(p95.get(key, peak[key])),
                    util_peak=util_peak,
                    util_p95=util_p95,
                    samples=round(count.get(key, 0)),
                    granted_memory_bytes=round(memory) if memory is not None else None,
                    granted_share=granted_share.get(key),
                    gpu_reading=self.set.gpu_reading,
                )
            )
        return tuple(rows)

    def _gpu_rows(self, results: Sequence[Mapping[GpuKey, float]]) -> tuple[GpuUse, ...]:
        peak, p95, count, total = results[0], results[1], results[2], results[3]
        utils = [(results[4 + 2 * i], results[5 + 2 * i]) for i in range(len(self.set.gpu_util))]
        rows = []
        for key in sorted(set(peak) | set(total)):
            util_peak, util_p95 = _first(utils, key)
            memory_total = total.get(key)
            rows.append(
                GpuUse(
                    node=key[0],
                    gpu=key[1],
                    memory_peak_bytes=round(peak.get(key, 0)),
                    memory_p95_bytes=round(p95.get(key, peak.get(key, 0))),
                    memory_total_bytes=round(memory_total) if memory_total is not None else None,
                    util_peak=util_peak,
                    util_p95=util_p95,
                    samples=round(count.get(key, 0)),
                )
            )
        return tuple(rows)

    async def gpu_loads(self, window_seconds: float) -> GpuLoads:
        """`gpuplace.usage.gpu_loads.LoadReader`: each GPU's mean utilisation and memory over the
        window."""
        now = time.time()
        w = _range(window_seconds)
        metric, scale = self.set.load_util
        util, memory = await asyncio.gather(
            self._gpus(self._gpu_over("avg", metric, w), now, scale),
            self._gpus(
                self._gpu_over("avg", self.set.gpu_memory, w), now, self.set.gpu_memory_scale
            ),
        )
        loads: GpuLoads = {}
        for (node, gpu), ratio in util.items():
            loads.setdefault(node, {})[gpu] = GpuLoad(
                node=node,
                gpu=gpu,
                utilization=min(max(ratio, 0.0), 1.0),
                memory_used_bytes=round(memory.get((node, gpu), 0.0)),
            )
        return loads


def _first(
    candidates: Sequence[tuple[Mapping[_K, float], Mapping[_K, float]]], key: _K
) -> tuple[float | None, float | None]:
    """(peak, p95) from the first candidate metric that has `key`."""
    for peak, p95 in candidates:
        if key in peak:
            return (peak[key], p95.get(key, peak[key]))
    return (None, None)
