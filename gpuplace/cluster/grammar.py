"""The user-annotation grammar: a pod's `gpuplace.io/` annotations → a typed `PodGpuSpec`.

Stable API (the webhook and the extender both rely on it):

- `parse(annotations) -> PodGpuSpec | None`: None when the pod has no gpuplace *user*
  annotation (system annotations alone do not make a GPU pod); raises `AnnotationError`
  (`.field` = the annotation key at fault, `.problems` = every problem found) otherwise.
- `request_for(pod) -> GpuRequest | None`: the engine's request for a pod dict as the API
  server sends it (GPU share from the annotations, CPU and memory from the pod's requests).
- `PodGpuSpec.to_request(cpu_milli, host_memory_mib) -> GpuRequest`.
- `pod_requests(pod)`, `container_requests(container)`, `gpu_container(pod, spec)`.

Grammar, defaults and combinations are documented in docs/annotations.md. Every error
names the annotation and the accepted form. This module never reads anything but the
mapping/dict it is given: no I/O, no logging, no clock.
"""

from __future__ import annotations

import difflib
import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpuplace.cluster import keys, quantities
from gpuplace.placement.requests import WHOLE, GpuRequest, Topology

E = TypeVar("E", bound=enum.StrEnum)

MAX_GPU_COUNT = 1024
MAX_GANG_SIZE = 10_000
MAX_MEMORY_MIB = 1024 * 1024 * 1024
"""1 PiB per GPU: anything larger is a typo, not a GPU."""
DEFAULT_GANG_TIMEOUT_SECONDS = 600.0
"""`gang-timeout` when absent: ten minutes for all members to exist and fit."""
MIN_GANG_TIMEOUT_SECONDS = 1.0
MAX_GANG_TIMEOUT_SECONDS = 24 * 3600.0
MAX_SHOWN_CHARS = 40
"""Values quoted in messages are cut to this many characters."""

_INTEGER = re.compile(r"[0-9]{1,9}")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_QUEUE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?")
"""A GpuQueue's name that also fits a label value (the pod label and the namespace label
carry it): a DNS subdomain of at most 63 characters."""
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""The prefix of a label key: a DNS subdomain (at most 253 characters)."""
_DURATION = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?(?:h|ms|m|s))+")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(h|ms|m|s)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}

_GPU_KEYS = (keys.GPU_MEMORY, keys.GPU_MODEL, keys.GPU_TOPOLOGY, keys.CONTAINER, keys.QUEUE)
_GANG_KEYS = (
    keys.GANG_NAME,
    keys.GANG_SIZE,
    keys.GANG_TIMEOUT,
    keys.GANG_MIN,
    keys.GANG_ON_FAILURE,
    keys.GANG_DOMAIN,
    keys.GANG_DOMAIN_POLICY,
)
_KNOWN = frozenset(keys.USER_ANNOTATIONS) | frozenset(keys.SYSTEM_ANNOTATIONS)


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a pod's annotations."""

    field: str
    """The annotation key at fault (`gpuplace.io/gpu-percent`)."""
    message: str
    """A sentence naming the annotation and the accepted form."""


class AnnotationError(ValueError):
    """The annotations cannot be read; `field` names the first culprit, `problems` all."""

    def __init__(self, problems: tuple[Problem, ...] | list[Problem]) -> None:
        if not problems:
            raise ValueError("AnnotationError needs at least one problem")
        self.problems = tuple(problems)
        super().__init__("; ".join(problem.message for problem in self.problems))

    @property
    def field(self) -> str:
        return self.problems[0].field

    @property
    def message(self) -> str:
        return str(self)

    @classmethod
    def one(cls, field: str, message: str) -> AnnotationError:
        return cls((Problem(field, message),))


class GpuTopology(enum.StrEnum):
    """`gpuplace.io/gpu-topology`: what a multi-GPU pod wants of NVLink between its GPUs."""

    NONE = "none"
    PREFERRED = "preferred"
    REQUIRED = "required"

    def engine(self) -> Topology:
        if self is GpuTopology.NONE:
            return Topology.ANY
        return Topology(self.value)


class OnFailure(enum.StrEnum):
    """`gpuplace.io/gang-on-failure`: what a member's failure does to its running gang."""

    RESTART = "restart"
    """The others are evicted; the members its owner recreates start again as one gang."""
    CONTINUE = "continue"
    """The others run on (a replacement joins them)."""


class DomainPolicy(enum.StrEnum):
    """`gpuplace.io/gang-domain-policy`: how strictly the gang keeps to one domain."""

    REQUIRED = "required"
    """All members in one domain, or the gang waits (never split)."""
    PREFERRED = "preferred"
    """One domain when one holds the gang, else as few as hold it."""


class Gang(BaseModel):
    """`gang-name`, `gang-size`, `gang-timeout`, `gang-min`: pods that start together or
    not at all (an elastic gang: at least `gang-min` of them); `gang-on-failure`: whether
    they end together; `gang-domain` and its policy: whether they sit together."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=63)
    size: int = Field(ge=2, le=MAX_GANG_SIZE)
    timeout_seconds: float = Field(
        default=DEFAULT_GANG_TIMEOUT_SECONDS,
        ge=MIN_GANG_TIMEOUT_SECONDS,
        le=MAX_GANG_TIMEOUT_SECONDS,
    )
    minimum: int = Field(default=0, ge=0, le=MAX_GANG_SIZE)
    """`gang-min`: the fewest members it may start with; 0 (absent) or `size`: all."""
    on_failure: OnFailure | None = None
    """`gang-on-failure` as written; None: the default (`failure_policy`)."""
    domain: str | None = None
    """`gang-domain`: the node label key whose values are the domains; None: any nodes."""
    domain_policy: DomainPolicy = DomainPolicy.REQUIRED

    @property
    def failure_policy(self) -> OnFailure:
        """`gang-on-failure`, or its default: `restart` for a gang that needs every member
        (a data-parallel job hangs without one), `continue` for an elastic one (it runs
        with fewer by design)."""
        if self.on_failure is not None:
            return self.on_failure
        return OnFailure.CONTINUE if self.elastic else OnFailure.RESTART

    @model_validator(mode="after")
    def _minimum_fits(self) -> Self:
        if self.minimum > self.size:
            raise ValueError(_minimum_above(self.minimum, self.size))
        return self

    @property
    def elastic(self) -> bool:
        """It may run with fewer than `size` members (`gang-min` below `gang-size`)."""
        return 0 < self.minimum < self.size

    @property
    def elastic_minimum(self) -> int:
        """`minimum` when the gang is elastic, else 0 (every member is needed)."""
        return self.minimum if self.elastic else 0


class PodGpuSpec(BaseModel):
    """What a pod's annotations ask for, defaults applied. Always a valid combination."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    percent: int = Field(ge=0, le=100)
    """Share of each GPU's compute; 100 for whole GPUs; 0 for a memory-only share (one
    GPU, `memory_mib` > 0, no compute reserved: see docs/annotations.md)."""
    memory_mib: int = Field(default=0, ge=0, le=MAX_MEMORY_MIB)
    """GPU memory per GPU in MiB; 0 = not asked (a whole GPU then brings all of its own)."""
    memory_rounded: bool = False
    """True when `gpu-memory` was not a whole number of MiB and was rounded up."""
    count: int = Field(default=1, ge=1, le=MAX_GPU_COUNT)
    models: tuple[str, ...] = ()
    """Acceptable `nvidia.com/gpu.product` values, in the order written; empty = any."""
    topology: GpuTopology = GpuTopology.NONE
    gang: Gang | None = None
    container: str | None = None
    """Name of the container that gets the GPU; None = the first container (the webhook
    keeps the one already carrying the gpuplace resources, if exactly one does)."""
    queue: str | None = None
    """`gpuplace.io/queue`: the GpuQueue the pod asks for (None: its namespace's default
    queue, if any; docs/queues.md)."""

    @model_validator(mode="after")
    def _combination(self) -> Self:
        if self.count > 1 and self.percent != 100:
            raise ValueError(_several_whole(self.percent, self.count))
        if self.percent == 0 and (self.count != 1 or self.memory_mib <= 0):
            raise ValueError("a memory-only share (percent 0) is memory on one GPU")
        return self

    @property
    def milli(self) -> int:
        """Share of each GPU in milli-GPU (the engine's unit): percent × 10."""
        return self.percent * (WHOLE // 100)

    @property
    def shares(self) -> bool:
        """True for a fraction of one GPU (the GPU may be shared with other pods)."""
        return self.count == 1 and self.percent < 100

    @property
    def memory_only(self) -> bool:
        """True for a memory-only share: `gpu-memory` alone, no compute reserved."""
        return self.percent == 0

    @property
    def resource_percent(self) -> int:
        """Value of the extended resource `gpuplace.io/gpu-percent`: percent × count (0 for
        a memory-only share, which then requests `gpuplace.io/gpu-memory` alone)."""
        return self.percent * self.count

    @property
    def resource_memory_mib(self) -> int:
        """Value of the extended resource `gpuplace.io/gpu-memory`: MiB × count (0 = none)."""
        return self.memory_mib * self.count

    def to_request(self, cpu_milli: int = 0, host_memory_mib: int = 0) -> GpuRequest:
        return GpuRequest(
            milli=self.milli,
            memory_mib=self.memory_mib,
            count=self.count,
            models=frozenset(self.models),
            cpu_milli=cpu_milli,
            host_memory_mib=host_memory_mib,
            topology=self.topology.engine(),
        )


# --- parsing --------------------------------------------------------------------------------


def _cut(value: str) -> str:
    return value if len(value) <= MAX_SHOWN_CHARS else value[:MAX_SHOWN_CHARS] + "…"


def _shown(value: str) -> str:
    return repr(_cut(value))


def _several_whole(percent: int, count: int) -> str:
    return (
        f"{keys.GPU_PERCENT}={percent} with {keys.GPU_COUNT}={count}: several GPUs are always "
        f'whole GPUs; remove {keys.GPU_PERCENT} or set {keys.GPU_COUNT}: "1"'
    )


def _integer(key: str, raw: str, low: int, high: int, form: str) -> int:
    text = raw.strip()
    if _INTEGER.fullmatch(text):
        value = int(text)
        if low <= value <= high:
            return value
    raise AnnotationError.one(key, f"{key} must be {form}; got {_shown(raw)}")


def _percent(raw: str) -> int:
    return _integer(keys.GPU_PERCENT, raw, 1, 100, 'an integer from 1 to 100 (e.g. "50")')


def _count(raw: str) -> int:
    return _integer(
        keys.GPU_COUNT, raw, 1, MAX_GPU_COUNT, f'an integer from 1 to {MAX_GPU_COUNT} (e.g. "2")'
    )


def _minimum_above(minimum: int, size: int) -> str:
    return (
        f"{keys.GANG_MIN}={minimum} is above {keys.GANG_SIZE}={size}: an elastic gang starts "
        f"with at least {keys.GANG_MIN} and at most {keys.GANG_SIZE} members"
    )


def _gang_min(raw: str) -> int:
    return _integer(
        keys.GANG_MIN,
        raw,
        1,
        MAX_GANG_SIZE,
        f'an integer from 1 to {keys.GANG_SIZE} (e.g. "2": the fewest members it may start with)',
    )


def _queue(raw: str) -> str:
    text = raw.strip()
    if _QUEUE_NAME.fullmatch(text):
        return text
    raise AnnotationError.one(
        keys.QUEUE,
        f"{keys.QUEUE} must name a GpuQueue: 1-63 lowercase letters, digits, '-' or '.', "
        f'starting and ending with a letter or digit (e.g. "team-a"); got {_shown(raw)}',
    )


def queue_name(raw: str) -> str | None:
    """`raw` as a GpuQueue name a label can carry (a namespace's `gpuplace.io/queue`), or
    None when it is not one. O(len(raw))."""
    text = raw.strip()
    return text if _QUEUE_NAME.fullmatch(text) else None


def _gang_size(raw: str) -> int:
    return _integer(
        keys.GANG_SIZE, raw, 2, MAX_GANG_SIZE, f'an integer from 2 to {MAX_GANG_SIZE} (e.g. "4")'
    )


def _memory(raw: str) -> tuple[int, bool]:
    form = 'a Kubernetes quantity of bytes per GPU, e.g. "20Gi", "512Mi" or "10G"'
    try:
        mib, rounded = quantities.to_mib(raw.strip())
    except quantities.QuantityError:
        raise AnnotationError.one(
            keys.GPU_MEMORY, f"{keys.GPU_MEMORY} must be {form}; got {_shown(raw)}"
        ) from None
    if mib <= 0:
        raise AnnotationError.one(
            keys.GPU_MEMORY, f"{keys.GPU_MEMORY} must be positive ({form}); got {_shown(raw)}"
        )
    if mib > MAX_MEMORY_MIB:
        raise AnnotationError.one(
            keys.GPU_MEMORY, f"{keys.GPU_MEMORY} must be at most 1Pi per GPU; got {_shown(raw)}"
        )
    return mib, rounded


def _models(raw: str) -> tuple[str, ...]:
    form = (
        "comma-separated GPU products as GPU Feature Discovery labels them in "
        'nvidia.com/gpu.product (e.g. "NVIDIA-A100-SXM4-80GB,NVIDIA-H100-80GB-HBM3")'
    )
    models: list[str] = []
    for part in raw.split(","):
        model = part.strip()
        if not model:
            continue
        if len(model) > 63 or not _LABEL_VALUE.fullmatch(model):
            raise AnnotationError.one(
                keys.GPU_MODEL,
                f"{keys.GPU_MODEL} must be {form}; {_shown(model)} is not a label value",
            )
        if model not in models:
            models.append(model)
    if not models:
        raise AnnotationError.one(keys.GPU_MODEL, f"{keys.GPU_MODEL} must be {form}; it is empty")
    return tuple(models)


def _topology(raw: str) -> GpuTopology:
    return _choice(keys.GPU_TOPOLOGY, GpuTopology, raw)


def _gang_name(raw: str) -> str:
    text = raw.strip()
    if len(text) <= 63 and _LABEL_VALUE.fullmatch(text):
        return text
    raise AnnotationError.one(
        keys.GANG_NAME,
        f"{keys.GANG_NAME} must be a label value: 1-63 letters, digits, '-', '_' or '.', "
        f'starting and ending with a letter or digit (e.g. "train-7"); got {_shown(raw)}',
    )


def duration_seconds(text: str) -> float | None:
    """Seconds of a duration written with units h, m, s or ms ("90s", "1h30m"), or None
    when `text` is not one. O(len(text)), at most `MAX_SHOWN_CHARS` characters read."""
    text = text.strip()
    if len(text) > MAX_SHOWN_CHARS or not _DURATION.fullmatch(text):
        return None
    return math.fsum(
        float(Decimal(number)) * _UNIT_SECONDS[unit]
        for number, unit in _DURATION_PART.findall(text)
    )


def _duration(raw: str) -> float:
    form = (
        f"a duration from {MIN_GANG_TIMEOUT_SECONDS:g}s to {MAX_GANG_TIMEOUT_SECONDS / 3600:g}h "
        'with units h, m, s or ms (e.g. "90s", "10m", "1h30m")'
    )
    seconds = duration_seconds(raw)
    if seconds is not None and MIN_GANG_TIMEOUT_SECONDS <= seconds <= MAX_GANG_TIMEOUT_SECONDS:
        return seconds
    raise AnnotationError.one(
        keys.GANG_TIMEOUT, f"{keys.GANG_TIMEOUT} must be {form}; got {_shown(raw)}"
    )


def _choice(key: str, kind: type[E], raw: str) -> E:
    """`raw` as one of `kind`'s values (case and surrounding spaces ignored)."""
    try:
        return kind(raw.strip().lower())
    except ValueError:
        choices = "|".join(member.value for member in kind)
        raise AnnotationError.one(
            key, f"{key} must be one of {choices}; got {_shown(raw)}"
        ) from None


def _on_failure(raw: str) -> OnFailure:
    return _choice(keys.GANG_ON_FAILURE, OnFailure, raw)


def _domain_policy(raw: str) -> DomainPolicy:
    return _choice(keys.GANG_DOMAIN_POLICY, DomainPolicy, raw)


def label_key(raw: str) -> str | None:
    """`raw` as a Kubernetes label key (an optional DNS-subdomain prefix and `/`, then a
    name of 1-63 characters), or None when it is not one. O(len(raw))."""
    text = raw.strip()
    prefix, slash, name = text.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _LABEL_PREFIX.fullmatch(prefix)):
        return None
    if not name or len(name) > 63 or not _LABEL_VALUE.fullmatch(name):
        return None
    return text


def _domain(raw: str) -> str:
    found = label_key(raw)
    if found is not None:
        return found
    raise AnnotationError.one(
        keys.GANG_DOMAIN,
        f"{keys.GANG_DOMAIN} must be a node label key whose values are the domains (e.g. "
        '"example.com/rack" or "topology.kubernetes.io/zone"): an optional DNS-subdomain '
        "prefix and '/', then 1-63 letters, digits, '-', '_' or '.', starting and ending "
        f"with a letter or digit; got {_shown(raw)}",
    )


def _container(raw: str) -> str:
    text = raw.strip()
    if _DNS_LABEL.fullmatch(text):
        return text
    raise AnnotationError.one(
        keys.CONTAINER,
        f"{keys.CONTAINER} must name one of the pod's containers (a lowercase DNS label, "
        f'e.g. "trainer"); got {_shown(raw)}',
    )


def _unknown(key: str) -> Problem:
    suffix = key[len(keys.PREFIX) :]
    names = [name[len(keys.PREFIX) :] for name in keys.USER_ANNOTATIONS]
    close = difflib.get_close_matches(suffix, names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "gpuplace reads only " + ", ".join(names)
    return Problem(key, f"unknown annotation {_cut(key)}; {hint}")


def is_gpuplace_key(key: str) -> bool:
    return key.startswith(keys.PREFIX)


def user_annotations(annotations: Mapping[str, str]) -> dict[str, str]:
    """The gpuplace user annotations among `annotations` (system ones left out)."""
    return {key: value for key, value in annotations.items() if key in keys.USER_ANNOTATIONS}


def parse(annotations: Mapping[str, str]) -> PodGpuSpec | None:
    """The pod's GPU request, or None when it has no gpuplace user annotation.

    Raises `AnnotationError` listing every malformed value, unknown `gpuplace.io/` key and
    contradictory combination. O(annotations).
    """
    ours = {key: value for key, value in annotations.items() if key.startswith(keys.PREFIX)}
    if not ours:
        return None
    problems = [_unknown(key) for key in sorted(ours) if key not in _KNOWN]
    given = {key: str(value) for key, value in ours.items() if key in keys.USER_ANNOTATIONS}
    if not given:
        if problems:
            raise AnnotationError(problems)
        return None

    values: dict[str, Any] = {}
    converters: tuple[tuple[str, str, Any], ...] = (
        (keys.GPU_PERCENT, "percent", _percent),
        (keys.GPU_COUNT, "count", _count),
        (keys.GPU_MODEL, "models", _models),
        (keys.GPU_TOPOLOGY, "topology", _topology),
        (keys.CONTAINER, "container", _container),
        (keys.GANG_NAME, "gang_name", _gang_name),
        (keys.GANG_SIZE, "gang_size", _gang_size),
        (keys.GANG_TIMEOUT, "gang_timeout", _duration),
        (keys.GANG_MIN, "gang_min", _gang_min),
        (keys.GANG_ON_FAILURE, "on_failure", _on_failure),
        (keys.GANG_DOMAIN, "domain", _domain),
        (keys.GANG_DOMAIN_POLICY, "domain_policy", _domain_policy),
        (keys.QUEUE, "queue", _queue),
    )
    for key, name, convert in converters:
        if key in given:
            try:
                values[name] = convert(given[key])
            except AnnotationError as error:
                problems.extend(error.problems)
    if keys.GPU_MEMORY in given:
        try:
            values["memory_mib"], values["memory_rounded"] = _memory(given[keys.GPU_MEMORY])
        except AnnotationError as error:
            problems.extend(error.problems)

    problems.extend(_combination_problems(given, values))
    if problems:
        raise AnnotationError(problems)

    count = values.get("count", 1)
    # `gpu-memory` alone is a memory-only share: memory reserved, no compute (percent 0).
    memory_only = keys.GPU_PERCENT not in given and keys.GPU_COUNT not in given
    percent = values.get("percent", 0 if memory_only else 100)
    default_topology = GpuTopology.PREFERRED if count > 1 else GpuTopology.NONE
    gang = None
    if keys.GANG_NAME in given:
        gang = Gang(
            name=values["gang_name"],
            size=values["gang_size"],
            timeout_seconds=values.get("gang_timeout", DEFAULT_GANG_TIMEOUT_SECONDS),
            minimum=values.get("gang_min", 0),
            on_failure=values.get("on_failure"),
            domain=values.get("domain"),
            domain_policy=values.get("domain_policy", DomainPolicy.REQUIRED),
        )
    return PodGpuSpec(
        percent=percent,
        memory_mib=values.get("memory_mib", 0),
        memory_rounded=values.get("memory_rounded", False),
        count=count,
        models=values.get("models", ()),
        topology=values.get("topology", default_topology),
        gang=gang,
        container=values.get("container"),
        queue=values.get("queue"),
    )


def _combination_problems(given: Mapping[str, str], values: Mapping[str, Any]) -> list[Problem]:
    problems: list[Problem] = []
    asks_gpu = keys.GPU_PERCENT in given or keys.GPU_COUNT in given or keys.GPU_MEMORY in given
    if not asks_gpu:
        written = [key for key in (*_GPU_KEYS, *_GANG_KEYS) if key in given]
        needs = ", ".join(written)
        problems.append(
            Problem(
                written[0],
                f"{needs} without a GPU request: add {keys.GPU_PERCENT} (a share of one GPU, "
                f'e.g. "50"), {keys.GPU_MEMORY} (GPU memory alone, e.g. "8Gi") or '
                f'{keys.GPU_COUNT} (whole GPUs, e.g. "1")',
            )
        )
    percent, count = values.get("percent"), values.get("count")
    if percent is not None and count is not None and count > 1 and percent != 100:
        problems.append(Problem(keys.GPU_PERCENT, _several_whole(percent, count)))
    if keys.GANG_NAME in given and keys.GANG_SIZE not in given:
        problems.append(
            Problem(
                keys.GANG_SIZE,
                f"{keys.GANG_SIZE} is required with {keys.GANG_NAME}: the number of pods in the "
                'gang, an integer from 2 (e.g. "4")',
            )
        )
    size, minimum = values.get("gang_size"), values.get("gang_min")
    if size is not None and minimum is not None and minimum > size:
        problems.append(Problem(keys.GANG_MIN, _minimum_above(minimum, size)))
    if keys.GANG_DOMAIN_POLICY in given and keys.GANG_DOMAIN not in given:
        problems.append(
            Problem(
                keys.GANG_DOMAIN,
                f"{keys.GANG_DOMAIN_POLICY} needs {keys.GANG_DOMAIN}: the node label whose "
                'values are the domains the gang keeps to (e.g. "example.com/rack")',
            )
        )
    for key in _GANG_KEYS[1:]:
        if key in given and keys.GANG_NAME not in given:
            problems.append(
                Problem(
                    keys.GANG_NAME,
                    f"{key} needs {keys.GANG_NAME}: the gang's name, shared by all its "
                    'members (e.g. "train-7")',
                )
            )
            break
    return problems


# --- pods -----------------------------------------------------------------------------------


def gpu_container(pod: Mapping[str, Any], spec: PodGpuSpec) -> tuple[int, Mapping[str, Any]]:
    """Index and body of the container that gets the GPU (named, else the first).

    Raises `AnnotationError` on `gpuplace.io/container` when no container has that name.
    """
    containers = (pod.get("spec") or {}).get("containers") or []
    if spec.container is None:
        if containers:
            return 0, containers[0]
        raise AnnotationError.one(keys.CONTAINER, "the pod has no containers")
    for index, container in enumerate(containers):
        if isinstance(container, Mapping) and container.get("name") == spec.container:
            return index, container
    names = ", ".join(str(c.get("name")) for c in containers if isinstance(c, Mapping))
    raise AnnotationError.one(
        keys.CONTAINER,
        f"{keys.CONTAINER}: the pod has no container named {_shown(spec.container)}; "
        f"its containers are: {names or 'none'}",
    )


def _quantity(resources: Mapping[str, Any], name: str, where: str) -> Decimal:
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    raw = requests.get(name, limits.get(name))
    if raw is None:
        return Decimal(0)
    try:
        return quantities.parse(raw)
    except quantities.QuantityError as error:
        raise AnnotationError.one(
            f"{where}.resources", f"{where}.resources {name}: {error}"
        ) from None


def container_requests(
    container: Mapping[str, Any], where: str = "container"
) -> tuple[Decimal, Decimal]:
    """(CPU cores, memory bytes) a container requests; a limit stands in for a missing request."""
    resources = container.get("resources") or {}
    return _quantity(resources, "cpu", where), _quantity(resources, "memory", where)


def pod_requests(pod: Mapping[str, Any]) -> tuple[int, int]:
    """(CPU milli, memory MiB) the whole pod requests, rounded up, as kube-scheduler counts it.

    The sum of the containers plus restartable (sidecar) init containers, or the largest
    one-shot init container with the sidecars started before it, whichever is more; plus
    `spec.overhead`.
    """
    spec = pod.get("spec") or {}
    cpu = memory = Decimal(0)
    for index, container in enumerate(spec.get("containers") or []):
        c_cpu, c_memory = container_requests(container, f"spec.containers[{index}]")
        cpu += c_cpu
        memory += c_memory
    sidecar_cpu = sidecar_memory = Decimal(0)
    init_cpu = init_memory = Decimal(0)
    for index, container in enumerate(spec.get("initContainers") or []):
        c_cpu, c_memory = container_requests(container, f"spec.initContainers[{index}]")
        if container.get("restartPolicy") == "Always":
            sidecar_cpu += c_cpu
            sidecar_memory += c_memory
            init_cpu = max(init_cpu, sidecar_cpu)
            init_memory = max(init_memory, sidecar_memory)
        else:
            init_cpu = max(init_cpu, sidecar_cpu + c_cpu)
            init_memory = max(init_memory, sidecar_memory + c_memory)
    cpu = max(cpu + sidecar_cpu, init_cpu)
    memory = max(memory + sidecar_memory, init_memory)
    overhead = spec.get("overhead") or {}
    try:
        cpu += quantities.parse(overhead.get("cpu", 0))
        memory += quantities.parse(overhead.get("memory", 0))
    except quantities.QuantityError as error:
        raise AnnotationError.one("spec.overhead", f"spec.overhead: {error}") from None
    return math.ceil(cpu * 1000), math.ceil(memory / quantities.MIB)


def request_for(pod: Mapping[str, Any]) -> GpuRequest | None:
    """The engine's request for a pod, or None when it has no gpuplace user annotation.

    GPU share, memory, count, models and topology come from the annotations; CPU and host
    memory are the whole pod's requests (`pod_requests`). Raises `AnnotationError`.
    """
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return request_of(pod, parse(annotations))


def request_of(pod: Mapping[str, Any], spec: PodGpuSpec | None) -> GpuRequest | None:
    """`request_for(pod)` once its annotations are parsed into `spec` (None: none)."""
    if spec is None:
        return None
    cpu_milli, memory_mib = pod_requests(pod)
    return spec.to_request(cpu_milli, memory_mib)
