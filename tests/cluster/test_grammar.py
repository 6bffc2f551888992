"""The annotation grammar (`gpuplace.cluster.grammar`): defaults, combinations, messages."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplace.cluster import grammar, keys
from gpuplace.placement.requests import GpuRequest, Topology

P = keys.PREFIX


def parse(**values: str) -> grammar.PodGpuSpec | None:
    return grammar.parse({P + key.replace("_", "-"): value for key, value in values.items()})


def error(**values: str) -> grammar.AnnotationError:
    with pytest.raises(grammar.AnnotationError) as caught:
        parse(**values)
    return caught.value


def test_no_gpuplace_annotations_is_none() -> None:
    assert grammar.parse({}) is None
    assert grammar.parse({"app": "web", "example.com/gpu-percent": "50"}) is None


def test_system_annotations_alone_are_not_a_gpu_pod() -> None:
    assert grammar.parse({keys.ASSIGNED_GPUS: "0", keys.VISIBLE_DEVICES: "GPU-1"}) is None


def test_share_defaults() -> None:
    spec = parse(gpu_percent="50")
    assert spec is not None
    assert (spec.percent, spec.count, spec.memory_mib, spec.models) == (50, 1, 0, ())
    assert spec.topology is grammar.GpuTopology.NONE
    assert spec.gang is None and spec.container is None
    assert spec.shares and spec.milli == 500


def test_count_alone_means_whole_gpus_with_preferred_topology() -> None:
    spec = parse(gpu_count="4")
    assert spec is not None
    assert (spec.percent, spec.count) == (100, 4)
    assert spec.topology is grammar.GpuTopology.PREFERRED
    assert spec.resource_percent == 400 and not spec.shares


def test_memory_alone_is_a_memory_only_share_of_one_gpu() -> None:
    spec = parse(gpu_memory="8Gi")
    assert spec is not None
    assert (spec.percent, spec.count, spec.memory_mib, spec.milli) == (0, 1, 8192, 0)
    assert spec.memory_only and spec.shares
    assert (spec.resource_percent, spec.resource_memory_mib) == (0, 8192)
    request = spec.to_request(cpu_milli=500)
    assert request.memory_only and request.shares
    assert (request.milli, request.memory_mib, request.count) == (0, 8192, 1)
    assert spec.topology is grammar.GpuTopology.NONE


def test_memory_only_takes_models_gangs_and_a_container() -> None:
    spec = parse(
        gpu_memory="20Gi",
        gpu_model="NVIDIA-L4",
        container="trainer",
        gang_name="g",
        gang_size="2",
    )
    assert spec is not None and spec.memory_only
    assert spec.models == ("NVIDIA-L4",) and spec.container == "trainer"
    assert spec.gang is not None and spec.gang.size == 2


def test_memory_with_percent_or_count_is_not_memory_only() -> None:
    share = parse(gpu_memory="8Gi", gpu_percent="30")
    assert share is not None and not share.memory_only and share.percent == 30
    # gpu-count keeps its meaning: whole GPUs, gpu-memory a floor on each of them.
    whole = parse(gpu_memory="8Gi", gpu_count="2")
    assert whole is not None and not whole.memory_only and whole.percent == 100
    one = parse(gpu_memory="8Gi", gpu_count="1")
    assert one is not None and not one.memory_only and not one.shares


def test_a_memory_only_spec_needs_one_gpu_and_memory() -> None:
    with pytest.raises(ValueError, match="memory-only"):
        grammar.PodGpuSpec(percent=0)
    with pytest.raises(ValueError, match="several GPUs"):
        grammar.PodGpuSpec(percent=0, memory_mib=1024, count=2)


def test_one_whole_gpu_has_no_topology_by_default() -> None:
    spec = parse(gpu_count="1")
    assert spec is not None and spec.topology is grammar.GpuTopology.NONE


@pytest.mark.parametrize(
    ("raw", "mib", "rounded"),
    [
        ("20Gi", 20480, False),
        ("512Mi", 512, False),
        ("10G", 9537, True),
        ("1", 1, True),
        (" 1Ti ", 1024 * 1024, False),
        ("1.5Gi", 1536, False),
    ],
)
def test_memory_rounds_up_to_whole_mib(raw: str, mib: int, rounded: bool) -> None:
    spec = parse(gpu_percent="10", gpu_memory=raw)
    assert spec is not None
    assert (spec.memory_mib, spec.memory_rounded) == (mib, rounded)
    assert spec.resource_memory_mib == mib


def test_models_are_split_trimmed_and_deduplicated() -> None:
    spec = parse(
        gpu_count="1",
        gpu_model=" NVIDIA-A100-SXM4-80GB, NVIDIA-H100-80GB-HBM3,,NVIDIA-A100-SXM4-80GB",
    )
    assert spec is not None
    assert spec.models == ("NVIDIA-A100-SXM4-80GB", "NVIDIA-H100-80GB-HBM3")


@pytest.mark.parametrize(
    ("raw", "seconds"), [("90s", 90.0), ("10m", 600.0), ("1h30m", 5400.0), ("1500ms", 1.5)]
)
def test_gang(raw: str, seconds: float) -> None:
    spec = parse(gpu_count="1", gang_name="train-7", gang_size="4", gang_timeout=raw)
    assert spec is not None and spec.gang is not None
    assert (spec.gang.name, spec.gang.size, spec.gang.timeout_seconds) == ("train-7", 4, seconds)


def test_gang_timeout_default() -> None:
    spec = parse(gpu_percent="20", gang_name="g", gang_size="2")
    assert spec is not None and spec.gang is not None
    assert spec.gang.timeout_seconds == grammar.DEFAULT_GANG_TIMEOUT_SECONDS == 600


def test_to_request() -> None:
    spec = parse(gpu_percent="25", gpu_memory="8Gi", gpu_model="NVIDIA-L4")
    assert spec is not None
    assert spec.to_request(2000, 4096) == GpuRequest(
        milli=250,
        memory_mib=8192,
        count=1,
        models=frozenset({"NVIDIA-L4"}),
        cpu_milli=2000,
        host_memory_mib=4096,
        topology=Topology.ANY,
    )
    whole = parse(gpu_count="8", gpu_topology="required")
    assert whole is not None
    assert whole.to_request().topology is Topology.REQUIRED
    assert whole.to_request().total_milli == 8000


@pytest.mark.parametrize(
    ("values", "field", "fragment"),
    [
        (
            {"gpu_precent": "50"},
            P + "gpu-precent",
            "unknown annotation gpuplace.io/gpu-precent; did you mean gpu-percent?",
        ),
        ({"gpu_percent": "5", "gang_nmae": "x"}, P + "gang-nmae", "did you mean gang-name?"),
        ({"gpu_percent": "fifty"}, P + "gpu-percent", "an integer from 1 to 100"),
        ({"gpu_percent": "0"}, P + "gpu-percent", "an integer from 1 to 100"),
        ({"gpu_percent": "101"}, P + "gpu-percent", "an integer from 1 to 100"),
        ({"gpu_percent": "-5"}, P + "gpu-percent", "an integer from 1 to 100"),
        ({"gpu_percent": "50.5"}, P + "gpu-percent", "an integer from 1 to 100"),
        ({"gpu_count": "0"}, P + "gpu-count", "an integer from 1 to"),
        ({"gpu_percent": "5", "gpu_memory": "lots"}, P + "gpu-memory", "Kubernetes quantity"),
        ({"gpu_percent": "5", "gpu_memory": "0"}, P + "gpu-memory", "positive"),
        ({"gpu_percent": "5", "gpu_memory": "-1Gi"}, P + "gpu-memory", "positive"),
        ({"gpu_percent": "5", "gpu_memory": "2Ei"}, P + "gpu-memory", "at most 1Pi"),
        ({"gpu_percent": "5", "gpu_memory": "x" * 2000}, P + "gpu-memory", "xxxx…"),
        ({"gpu_count": "1", "gpu_model": "A 100"}, P + "gpu-model", "nvidia.com/gpu.product"),
        ({"gpu_count": "1", "gpu_model": " , "}, P + "gpu-model", "it is empty"),
        (
            {"gpu_count": "2", "gpu_topology": "nvlink"},
            P + "gpu-topology",
            "none|preferred|required",
        ),
        ({"gpu_count": "1", "container": "Trainer!"}, P + "container", "DNS label"),
        ({"gpu_count": "2", "gpu_percent": "50"}, P + "gpu-percent", "always whole GPUs"),
        ({"gpu_memory": "0"}, P + "gpu-memory", "positive"),
        (
            {"gpu_model": "NVIDIA-L4", "container": "c"},
            P + "gpu-model",
            "gpuplace.io/gpu-memory (GPU memory alone",
        ),
        ({"gpu_model": "NVIDIA-L4"}, P + "gpu-model", "without a GPU request"),
        ({"container": "c"}, P + "container", "without a GPU request"),
        ({"gang_name": "g", "gang_size": "2"}, P + "gang-name", "without a GPU request"),
        ({"gpu_count": "1", "gang_name": "g"}, P + "gang-size", "required with"),
        ({"gpu_count": "1", "gang_size": "2"}, P + "gang-name", "needs gpuplace.io/gang-name"),
        ({"gpu_count": "1", "gang_timeout": "1m"}, P + "gang-name", "needs"),
        ({"gpu_count": "1", "gang_name": "g", "gang_size": "1"}, P + "gang-size", "from 2"),
        ({"gpu_count": "1", "gang_name": "-g", "gang_size": "2"}, P + "gang-name", "label value"),
        (
            {"gpu_count": "1", "gang_name": "g", "gang_size": "2", "gang_timeout": "10"},
            P + "gang-timeout",
            '"10m"',
        ),
        (
            {"gpu_count": "1", "gang_name": "g", "gang_size": "2", "gang_timeout": "0s"},
            P + "gang-timeout",
            "from 1s to 24h",
        ),
        (
            {"gpu_count": "1", "gang_name": "g", "gang_size": "2", "gang_timeout": "25h"},
            P + "gang-timeout",
            "from 1s to 24h",
        ),
    ],
)
def test_refused(values: dict[str, str], field: str, fragment: str) -> None:
    caught = error(**values)
    assert caught.field == field
    assert fragment in caught.message
    assert all(problem.message for problem in caught.problems)


def test_every_problem_is_reported() -> None:
    caught = error(gpu_percent="fifty", gpu_memory="x" * 2000, gpu_precent="1")
    fields = [problem.field for problem in caught.problems]
    assert fields == [P + "gpu-precent", P + "gpu-percent", P + "gpu-memory"]


def test_unknown_key_alone_is_refused_not_ignored() -> None:
    caught = error(gpu_uuids="GPU-0")
    assert "unknown annotation gpuplace.io/gpu-uuids" in caught.message


def test_messages_never_quote_huge_values() -> None:
    caught = error(gpu_percent="9" * 5000)
    assert len(caught.message) < 200


def test_spec_model_refuses_invalid_combination_directly() -> None:
    with pytest.raises(ValueError, match="always whole"):
        grammar.PodGpuSpec(percent=50, count=2)


# --- pods -------------------------------------------------------------------------------------


def pod(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"annotations": {keys.GPU_PERCENT: "50", keys.GPU_MEMORY: "10Gi"}},
        "spec": {
            "containers": [
                {"name": "a", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
                {"name": "b", "resources": {"limits": {"cpu": "2", "memory": "3Gi"}}},
            ]
        },
    }
    body["spec"].update(extra)
    return body


def test_request_for_uses_whole_pod_requests() -> None:
    request = grammar.request_for(pod())
    assert request == GpuRequest(
        milli=500, memory_mib=10240, count=1, cpu_milli=2500, host_memory_mib=4096
    )


def test_pod_requests_init_containers_sidecars_and_overhead() -> None:
    body = pod(
        initContainers=[
            {
                "name": "side",
                "restartPolicy": "Always",
                "resources": {"requests": {"cpu": "100m", "memory": "100Mi"}},
            },
            {"name": "big", "resources": {"requests": {"cpu": "8", "memory": "1Mi"}}},
        ],
        overhead={"cpu": "250m", "memory": "10Mi"},
    )
    # cpu: max(2.5 + 0.1, 0.1 + 8) + 0.25; memory: max(4096 + 100, 100 + 1) + 10
    assert grammar.pod_requests(body) == (8350, 4206)


def test_request_for_plain_pod_is_none() -> None:
    body = pod()
    body["metadata"]["annotations"] = {"app": "x"}
    assert grammar.request_for(body) is None
    assert grammar.request_for({}) is None


def test_gpu_container() -> None:
    body = pod()
    spec = grammar.parse({keys.GPU_COUNT: "1", keys.CONTAINER: "b"})
    assert spec is not None
    assert grammar.gpu_container(body, spec)[0] == 1
    default = grammar.parse({keys.GPU_COUNT: "1"})
    assert default is not None
    assert grammar.gpu_container(body, default)[0] == 0
    missing = grammar.parse({keys.GPU_COUNT: "1", keys.CONTAINER: "zzz"})
    assert missing is not None
    with pytest.raises(grammar.AnnotationError, match="its containers are: a, b") as caught:
        grammar.gpu_container(body, missing)
    assert caught.value.field == keys.CONTAINER


# --- properties -------------------------------------------------------------------------------

_keys = st.sampled_from(
    [
        *keys.USER_ANNOTATIONS,
        *keys.SYSTEM_ANNOTATIONS,
        P + "gpu-precent",
        P + "x",
        "app",
        "example.com/y",
    ]
)
_values = st.one_of(
    st.text(max_size=30),
    st.integers(-5, 2000).map(str),
    st.sampled_from(["20Gi", "10G", "1.5", "none", "required", "1h", "train-7", "NVIDIA-L4"]),
)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.dictionaries(_keys, _values, max_size=8))
def test_parse_either_returns_a_valid_spec_or_explains(values: dict[str, str]) -> None:
    try:
        spec = grammar.parse(values)
    except grammar.AnnotationError as caught:
        assert caught.problems
        for problem in caught.problems:
            assert problem.field and problem.message
            assert problem.field.startswith(P) or problem.field.startswith("spec")
        return
    if spec is None:
        assert not any(key in keys.USER_ANNOTATIONS for key in values)
        return
    request = spec.to_request(0, 0)
    assert request.count == spec.count >= 1
    assert 1 <= request.milli <= 1000 or (request.memory_only and request.memory_mib > 0)
    assert request.memory_only == (keys.GPU_PERCENT not in values and keys.GPU_COUNT not in values)
    assert spec.count == 1 or spec.percent == 100
    assert (spec.gang is None) == (keys.GANG_NAME not in values)


def test_queue_and_gang_min_join_the_grammar() -> None:
    spec = parse(gpu_count="1", queue=" team-a ", gang_name="g", gang_size="4", gang_min="2")
    assert spec is not None and spec.queue == "team-a"
    assert spec.gang is not None and spec.gang.minimum == 2 and spec.gang.elastic
    whole = parse(gpu_count="1", gang_name="g", gang_size="4", gang_min="4")
    assert whole is not None and whole.gang is not None and not whole.gang.elastic
    assert "gpuplace.io/gang-min=5 is above gpuplace.io/gang-size=4" in str(
        error(gpu_count="1", gang_name="g", gang_size="4", gang_min="5")
    )
    assert "must name a GpuQueue" in str(error(gpu_count="1", queue="Team_A"))
    assert "without a GPU request" in str(error(queue="team-a"))
    assert "gang-name" in str(error(gpu_count="1", gang_min="2"))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=80))
def test_any_queue_value_parses_to_a_label_value_or_a_named_refusal(raw: str) -> None:
    try:
        spec = parse(gpu_count="1", queue=raw)
    except grammar.AnnotationError as refused:
        assert keys.QUEUE in str(refused)
        return
    assert spec is not None and spec.queue is not None
    assert grammar.queue_name(spec.queue) == spec.queue and len(spec.queue) <= 63


GANG = {"gpu_count": "1", "gang_name": "g", "gang_size": "3"}


def test_failure_policy_and_domain_join_the_grammar() -> None:
    """Issue 45: `gang-on-failure` (default restart, continue for an elastic gang),
    `gang-domain` (a node label key) and `gang-domain-policy` (default required)."""
    plain = parse(**GANG)
    assert plain is not None and plain.gang is not None
    assert plain.gang.failure_policy is grammar.OnFailure.RESTART
    assert plain.gang.domain is None
    elastic = parse(**GANG, gang_min="2")
    assert elastic is not None and elastic.gang is not None
    assert elastic.gang.failure_policy is grammar.OnFailure.CONTINUE
    chosen = parse(**GANG, gang_min="2", gang_on_failure=" Restart ")
    assert chosen is not None and chosen.gang is not None
    assert chosen.gang.failure_policy is grammar.OnFailure.RESTART
    racked = parse(**GANG, gang_domain=" example.com/rack ", gang_domain_policy="preferred")
    assert racked is not None and racked.gang is not None
    assert racked.gang.domain == "example.com/rack"
    assert racked.gang.domain_policy is grammar.DomainPolicy.PREFERRED
    zoned = parse(**GANG, gang_domain="topology.kubernetes.io/zone")
    assert zoned is not None and zoned.gang is not None
    assert zoned.gang.domain_policy is grammar.DomainPolicy.REQUIRED
    assert parse(**GANG, gang_domain="rack") is not None  # no prefix is a label key too


@pytest.mark.parametrize(
    ("values", "field", "fragment"),
    [
        (
            {**GANG, "gang_on_failure": "stop"},
            P + "gang-on-failure",
            "gpuplace.io/gang-on-failure must be one of restart|continue; got 'stop'",
        ),
        (
            {**GANG, "gang_domain": "/rack"},
            P + "gang-domain",
            "gpuplace.io/gang-domain must be a node label key whose values are the domains",
        ),
        ({**GANG, "gang_domain": "Example.com/rack"}, P + "gang-domain", "DNS-subdomain"),
        ({**GANG, "gang_domain": "a/b/c"}, P + "gang-domain", "got 'a/b/c'"),
        ({**GANG, "gang_domain": "x" * 64}, P + "gang-domain", "1-63 letters"),
        (
            {**GANG, "gang_domain": "r", "gang_domain_policy": "must"},
            P + "gang-domain-policy",
            "must be one of required|preferred; got 'must'",
        ),
        (
            {**GANG, "gang_domain_policy": "required"},
            P + "gang-domain",
            "gpuplace.io/gang-domain-policy needs gpuplace.io/gang-domain",
        ),
        ({"gpu_count": "1", "gang_on_failure": "restart"}, P + "gang-name", "needs"),
        ({"gpu_count": "1", "gang_domain": "r"}, P + "gang-name", "needs gpuplace.io/gang-name"),
        ({"gang_domain": "r"}, P + "gang-domain", "without a GPU request"),
        ({**GANG, "gang_domainn": "r"}, P + "gang-domainn", "did you mean gang-domain?"),
    ],
)
def test_failure_policy_and_domain_refusals_name_the_annotation(
    values: dict[str, str], field: str, fragment: str
) -> None:
    caught = error(**values)
    assert caught.field == field
    assert fragment in caught.message


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_any_domain_value_parses_to_a_label_key_or_a_named_refusal(raw: str) -> None:
    try:
        spec = parse(**GANG, gang_domain=raw)
    except grammar.AnnotationError as refused:
        assert refused.field == keys.GANG_DOMAIN and keys.GANG_DOMAIN in str(refused)
        return
    assert spec is not None and spec.gang is not None and spec.gang.domain is not None
    assert grammar.label_key(spec.gang.domain) == spec.gang.domain
    prefix, _, name = spec.gang.domain.rpartition("/")
    assert 1 <= len(name) <= 63 and len(prefix) <= 253
