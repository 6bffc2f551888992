"""The mutation of a GPU pod: resources, scheduler, affinity merge, env, labels, gates."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplace.cluster import grammar, keys
from gpuplace.webhook import mutating, patches
from tests.webhook import helpers

REQUIRED = mutating.REQUIRED_AFFINITY[1:]


def spec(**values: str) -> grammar.PodGpuSpec:
    parsed = grammar.parse({keys.PREFIX + k.replace("_", "-"): v for k, v in values.items()})
    assert parsed is not None
    return parsed


def mutate(
    pod: dict[str, Any], gpu: grammar.PodGpuSpec, container: int = 0, **options: Any
) -> dict[str, Any]:
    before = copy.deepcopy(pod)
    mutation = mutating.build(pod, gpu, container, "gpuplace", **options)
    assert pod == before
    patched: dict[str, Any] = jsonpatch.apply_patch(pod, mutation.ops)
    assert patched == mutation.patch.doc
    again = mutating.build(patched, gpu, container, "gpuplace", **options)
    assert not again.ops, "not idempotent"
    kubernetes_validate.validate(patched, helpers.schema_version(), strict=True)
    return patched


def terms(pod: dict[str, Any]) -> list[dict[str, Any]]:
    node = pod["spec"]
    for key in REQUIRED:
        node = node[key]
    result: list[dict[str, Any]] = node["nodeSelectorTerms"]
    return result


def test_share_with_memory() -> None:
    gpu = spec(gpu_percent="50", gpu_memory="20Gi")
    pod = mutate(helpers.pod(), gpu)
    container = pod["spec"]["containers"][0]
    for part in ("requests", "limits"):
        assert container["resources"][part] == {
            keys.RESOURCE_PERCENT: "50",
            keys.RESOURCE_MEMORY: "20480",
        }
    assert pod["spec"]["schedulerName"] == "gpuplace"
    assert pod["metadata"]["labels"] == {keys.MANAGED: "true"}
    assert {env["name"]: env.get("value") for env in container["env"]} == {
        "NVIDIA_VISIBLE_DEVICES": None,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        # the limit covers the CUDA context of the GPU model the pod lands on: written by
        # the sidecar at bind (issue 43), read through the downward API
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": None,
    }
    assert container["env"][2]["valueFrom"] == {
        "fieldRef": {
            "apiVersion": "v1",
            "fieldPath": "metadata.annotations['gpuplace.io/mps-memory-limit']",
        }
    }
    assert container["env"][0]["valueFrom"] == {
        "fieldRef": {
            "apiVersion": "v1",
            "fieldPath": "metadata.annotations['gpuplace.io/visible-devices']",
        }
    }
    (term,) = terms(pod)
    assert term["matchExpressions"] == [
        {"key": keys.NODE_ENABLED, "operator": "In", "values": ["true"]},
        {"key": keys.GFD_COUNT, "operator": "Gt", "values": ["0"]},
        {"key": keys.GFD_MEMORY, "operator": "Gt", "values": ["20479"]},
    ]


def test_memory_only_share_requests_memory_alone_with_mps_limits() -> None:
    gpu = spec(gpu_memory="8Gi")
    mutation = mutating.build(helpers.pod(), gpu, 0, "gpuplace")
    pod = mutate(helpers.pod(), gpu)
    container = pod["spec"]["containers"][0]
    for part in ("requests", "limits"):
        assert container["resources"][part] == {keys.RESOURCE_MEMORY: "8192"}
    assert {env["name"]: env.get("value") for env in container["env"]} == {
        "NVIDIA_VISIBLE_DEVICES": None,
        # No compute of its own to cap: it never shares its GPU with a compute share.
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": None,  # the bind's gpuplace.io/mps-memory-limit
    }
    (term,) = terms(pod)
    assert {"key": keys.GFD_COUNT, "operator": "Gt", "values": ["0"]} in term["matchExpressions"]
    assert {"key": keys.GFD_MEMORY, "operator": "Gt", "values": ["8191"]} in term[
        "matchExpressions"
    ]
    (warning,) = mutation.warnings
    assert warning.startswith("memory-only share: 8192 MiB of GPU memory and no compute reserved")
    assert "time-sliced with the other memory-only pods of its GPU" in warning
    assert "\n" not in warning and len(warning) <= 200


def test_whole_gpus_count_models_and_required_nvlink() -> None:
    gpu = spec(
        gpu_count="4",
        gpu_model="NVIDIA-H100-80GB-HBM3,NVIDIA-A100-SXM4-80GB",
        gpu_topology="required",
    )
    pod = mutate(helpers.pod(), gpu)
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"] == {keys.RESOURCE_PERCENT: "400"}
    assert [env["name"] for env in container["env"]] == ["NVIDIA_VISIBLE_DEVICES"]
    (term,) = terms(pod)
    assert {"key": keys.GFD_COUNT, "operator": "Gt", "values": ["3"]} in term["matchExpressions"]
    assert {
        "key": keys.GFD_PRODUCT,
        "operator": "In",
        "values": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB"],
    } in term["matchExpressions"]
    assert {"key": keys.NVLINK_DOMAIN_SIZE, "operator": "Gt", "values": ["3"]} in term[
        "matchExpressions"
    ]


def test_whole_gpu_with_memory_floor_counts_memory_per_gpu() -> None:
    gpu = spec(gpu_count="2", gpu_memory="40Gi")
    pod = mutate(helpers.pod(), gpu)
    assert pod["spec"]["containers"][0]["resources"]["requests"][keys.RESOURCE_MEMORY] == "81920"


def test_user_affinity_terms_are_each_narrowed() -> None:
    zone = {"key": "zone", "operator": "In", "values": ["a"]}
    fields = {"key": "metadata.name", "operator": "In", "values": ["n1"]}
    affinity: dict[str, Any] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [zone]},
                    {"matchFields": [fields]},
                    {},
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [zone]}}
            ],
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
    }
    gpu = spec(gpu_percent="10")
    pod = mutate(helpers.pod(affinity=affinity), gpu)
    first, second, empty = terms(pod)
    ours = mutating.node_expressions(gpu)
    assert first["matchExpressions"] == [zone, *ours]
    assert second == {"matchFields": [fields], "matchExpressions": ours}
    assert empty == {}, "an empty term matches nothing and must stay so"
    assert (
        pod["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        == affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    )
    assert pod["spec"]["affinity"]["podAntiAffinity"] == affinity["podAntiAffinity"]


def test_expression_user_already_wrote_is_not_duplicated() -> None:
    gpu = spec(gpu_percent="10")
    enabled = mutating.node_expressions(gpu)[0]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [enabled]}]
            }
        }
    }
    pod = mutate(helpers.pod(affinity=affinity), gpu)
    (term,) = terms(pod)
    assert term["matchExpressions"].count(enabled) == 1


def test_gang_member_gets_gate_and_label() -> None:
    gpu = spec(gpu_count="1", gang_name="train-7", gang_size="4")
    pod = mutate(helpers.pod(schedulingGates=[{"name": "other.io/x"}]), gpu)
    assert pod["spec"]["schedulingGates"] == [{"name": "other.io/x"}, {"name": keys.GANG_GATE}]
    assert pod["metadata"]["labels"] == {keys.MANAGED: "true", keys.GANG_LABEL: "train-7"}
    pod = mutate(helpers.pod(), gpu)
    assert pod["spec"]["schedulingGates"] == [{"name": keys.GANG_GATE}]


def test_with_the_planner_every_other_gpu_pod_gets_its_gate() -> None:
    """Plan, then pin: a pod that is neither a gang member nor queued waits behind
    `gpuplace.io/place` (after any gate it had); gang members and queued pods keep their
    own controllers' gates only (those plan them), and so does a pod sent to DRA nodes (the
    claim controller's gate: it plans the pod and pins its claim)."""
    share = spec(gpu_percent="25")
    pod = mutate(helpers.pod(schedulingGates=[{"name": "other.io/x"}]), share, place_gate=True)
    assert pod["spec"]["schedulingGates"] == [{"name": "other.io/x"}, {"name": keys.PLACE_GATE}]
    assert not mutate(helpers.pod(), share)["spec"].get("schedulingGates")
    member = spec(gpu_count="1", gang_name="train-7", gang_size="4")
    gates = mutate(helpers.pod(), member, place_gate=True)["spec"]["schedulingGates"]
    assert gates == [{"name": keys.GANG_GATE}]
    queued = mutate(helpers.pod(), share, place_gate=True, queue="team-a")
    assert queued["spec"]["schedulingGates"] == [{"name": keys.QUEUE_GATE}]
    # a pod sent to DRA nodes: the claim controller plans it and pins its claim
    dra = mutate(helpers.pod(), share, place_gate=True, claim="p-gpu")
    assert dra["spec"]["schedulingGates"] == [{"name": keys.DRA_GATE}]


def test_user_env_var_is_replaced_and_warned() -> None:
    gpu = spec(gpu_percent="30", gpu_memory="1Gi")
    container = {
        "name": "c",
        "image": "x",
        "env": [
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "KEEP", "value": "1"},
            {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "100"},
        ],
    }
    pod = helpers.pod(containers=[container])
    mutation = mutating.build(pod, gpu, 0, "gpuplace")
    patched = mutate(pod, gpu)
    env = patched["spec"]["containers"][0]["env"]
    assert env[0]["name"] == "NVIDIA_VISIBLE_DEVICES" and "valueFrom" in env[0]
    assert env[1] == {"name": "KEEP", "value": "1"}
    assert env[2] == {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "30"}
    assert env[3] == {
        "name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
        "valueFrom": {
            "fieldRef": {
                "apiVersion": "v1",
                "fieldPath": "metadata.annotations['gpuplace.io/mps-memory-limit']",
            }
        },
    }
    assert any("NVIDIA_VISIBLE_DEVICES replaced" in w for w in mutation.warnings)


@pytest.mark.parametrize(
    ("values", "by_hand", "expected"),
    [
        ({"gpu_count": "1"}, keys.RESOURCE_MEMORY, {keys.RESOURCE_PERCENT: "100"}),
        # A memory-only share reserves no compute: no gpu-percent resource either.
        ({"gpu_memory": "1Gi"}, keys.RESOURCE_PERCENT, {keys.RESOURCE_MEMORY: "1024"}),
    ],
)
def test_our_resource_left_by_hand_is_removed_when_not_asked(
    values: dict[str, str], by_hand: str, expected: dict[str, str]
) -> None:
    container = {
        "name": "c",
        "image": "x",
        "resources": {"requests": {by_hand: "5", "cpu": "1"}, "limits": {by_hand: "5"}},
    }
    pod = mutate(helpers.pod(containers=[container]), spec(**values))
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "1", **expected}, "limits": expected}


def test_warnings() -> None:
    pod = helpers.pod(schedulerName="volcano")
    mutation = mutating.build(pod, spec(gpu_percent="10", gpu_memory="10G"), 0, "gpuplace")
    text = " | ".join(mutation.warnings)
    assert "rounded up to whole MiB: 9537Mi" in text
    assert "'volcano' replaced by 'gpuplace'" in text
    quiet = mutating.build(helpers.pod(), spec(gpu_count="2"), 0, "gpuplace")
    assert quiet.warnings == ()
    unreserved = mutating.build(helpers.pod(), spec(gpu_percent="5"), 0, "gpuplace")
    assert "no GPU memory is reserved" in unreserved.warnings[0]
    ignored = mutating.build(helpers.pod(), spec(gpu_count="1", gpu_topology="required"), 0, "g")
    assert ignored.warnings == (f"{keys.GPU_TOPOLOGY} is ignored for a single GPU",)
    for warning in (*mutation.warnings, *unreserved.warnings):
        assert "\n" not in warning and len(warning) <= 120


def test_named_container() -> None:
    first = {"name": "a", "image": "x"}
    second = {"name": "b", "image": "x"}
    gpu = spec(gpu_count="1", container="b")
    pod = mutate(helpers.pod(containers=[first, second]), gpu, container=1)
    assert pod["spec"]["containers"][0] == first
    assert pod["spec"]["containers"][1]["resources"]["limits"] == {keys.RESOURCE_PERCENT: "100"}


# --- property: for any valid spec and pod shape, the patch applies, validates, is a fixpoint -

_specs = st.fixed_dictionaries(
    {},
    optional={
        keys.GPU_PERCENT: st.integers(1, 100).map(str),
        keys.GPU_MEMORY: st.sampled_from(["1", "512Mi", "10G", "20Gi", "1.5Gi"]),
        keys.GPU_MODEL: st.sampled_from(["NVIDIA-L4", "A,B", "NVIDIA-A100-SXM4-80GB"]),
        keys.GPU_TOPOLOGY: st.sampled_from(["none", "preferred", "required"]),
        keys.GANG_NAME: st.sampled_from(["g", "train-7"]),
        keys.GANG_SIZE: st.integers(2, 8).map(str),
    },
).map(lambda d: {**d, keys.GPU_COUNT: "1"} if keys.GPU_PERCENT in d else {**d, keys.GPU_COUNT: "2"})
_memory_only_specs = st.fixed_dictionaries(
    {keys.GPU_MEMORY: st.sampled_from(["1", "512Mi", "10G", "20Gi"])},
    optional={
        keys.GPU_MODEL: st.sampled_from(["NVIDIA-L4", "A,B"]),
        keys.GANG_NAME: st.sampled_from(["g", "train-7"]),
    },
)
_envs = st.lists(
    st.sampled_from(
        [
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "5"},
            {"name": "OTHER", "value": "x"},
        ]
    ),
    max_size=3,
)
_affinities: st.SearchStrategy[dict[str, Any] | None] = st.sampled_from(
    [
        None,
        {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "z", "operator": "Exists"}]},
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": ["n"]}
                            ]
                        },
                    ]
                }
            }
        },
        {"podAffinity": {}},
    ]
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.one_of(_specs, _memory_only_specs), _envs, _affinities, st.booleans(), st.booleans())
def test_any_gpu_pod_mutates_to_a_valid_fixpoint(
    values: dict[str, str], env: list[dict[str, str]], affinity: Any, labelled: bool, plan: bool
) -> None:
    if keys.GANG_NAME not in values:
        values.pop(keys.GANG_SIZE, None)
    elif keys.GANG_SIZE not in values:
        values[keys.GANG_SIZE] = "2"
    gpu = grammar.parse(values)
    assert gpu is not None
    container = {"name": "c", "image": "x", "env": env, "resources": {}}
    extra: dict[str, Any] = {"affinity": affinity} if affinity is not None else {}
    pod = helpers.pod(values, containers=[container], **extra)
    if labelled:
        pod["metadata"]["labels"] = {"app": "x"}
    patched = mutate(pod, gpu, place_gate=plan)
    gates = [gate["name"] for gate in patched["spec"].get("schedulingGates") or []]
    # every gpuplace pod is gated at admission when the planner runs: by its gang, or by it
    assert not plan or gates == [keys.GANG_GATE if gpu.gang is not None else keys.PLACE_GATE]


def test_mutation_refuses_impossible_shapes() -> None:
    pod = helpers.pod(
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": ["nonsense"]
                }
            }
        }
    )
    with pytest.raises(patches.PatchError):
        mutating.build(pod, spec(gpu_count="1"), 0, "gpuplace")


def mutate_for_agent(pod: dict[str, Any], gpu: grammar.PodGpuSpec) -> dict[str, Any]:
    mutation = mutating.build(pod, gpu, 0, "gpuplace", node_agent=True)
    patched: dict[str, Any] = jsonpatch.apply_patch(pod, mutation.ops)
    again = mutating.build(patched, gpu, 0, "gpuplace", node_agent=True)
    assert not again.ops, "not idempotent"
    kubernetes_validate.validate(patched, helpers.schema_version(), strict=True)
    return patched


@pytest.mark.parametrize(
    ("values", "slots"),
    [
        ({"gpu_percent": "50", "gpu_memory": "20Gi"}, "1"),
        ({"gpu_memory": "8Gi"}, "1"),
        ({"gpu_count": "4"}, "4"),
    ],
)
def test_with_the_node_agent_the_container_asks_for_slots_and_gets_no_gpu_env(
    values: dict[str, str], slots: str
) -> None:
    gpu = spec(**values)
    pod = mutate_for_agent(helpers.pod(), gpu)
    container = pod["spec"]["containers"][0]
    for part in ("requests", "limits"):
        assert container["resources"][part][keys.RESOURCE_GPU] == slots
    # the agent's Allocate answer is the one source of the container's GPU env
    assert "env" not in container
    without = mutate(helpers.pod(), gpu)
    assert keys.RESOURCE_GPU not in without["spec"]["containers"][0]["resources"]["limits"]


def test_slots_left_by_hand_are_removed_without_the_node_agent() -> None:
    gpu = spec(gpu_count="1")
    container = {
        "name": "c",
        "image": "x",
        "resources": {"limits": {keys.RESOURCE_GPU: "8"}, "requests": {keys.RESOURCE_GPU: "8"}},
    }
    patched = mutate(helpers.pod(containers=[container]), gpu)
    resources = patched["spec"]["containers"][0]["resources"]
    assert keys.RESOURCE_GPU not in resources["limits"]
    assert keys.RESOURCE_GPU not in resources["requests"]
    # and with the agent, a hand-written count is corrected to the granted GPU count
    fixed = mutate_for_agent(helpers.pod(containers=[container]), gpu)
    assert fixed["spec"]["containers"][0]["resources"]["limits"][keys.RESOURCE_GPU] == "1"
