"""Node objects → the engine's nodes: the node agent's GPU names in the form users and the
webhook use (GPU Feature Discovery's product label), and the taints, cordon and pod
tolerations the gang planner needs, read carefully."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.cluster import keys, nodes, taints
from gpuplace.placement.requests import GpuRequest
from gpuplace.placement.taints import Taint, Toleration


def agent_node(name: str, model: str) -> dict[str, Any]:
    entries = [{"index": 0, "uuid": "GPU-0", "model": model, "memoryMiB": 81559}]
    return {
        "metadata": {
            "name": name,
            "labels": {
                keys.NODE_ENABLED: "true",
                keys.GFD_COUNT: "1",
                keys.GFD_PRODUCT: "NVIDIA-H100-80GB-HBM3",
                keys.GFD_MEMORY: "81559",
            },
            "annotations": {
                keys.NODE_GPUS: json.dumps(entries),
                keys.AGENT_HEARTBEAT: "2026-11-26T20:00:00Z",
            },
        },
        "status": {"allocatable": {"cpu": "8", "memory": "64Gi", "pods": "110"}},
    }


def test_the_agents_nvml_name_reads_as_gpu_feature_discoverys_product_label() -> None:
    """Caught on the real cluster: the agent publishes NVML's "NVIDIA H100 80GB HBM3",
    users and the webhook's affinity say "NVIDIA-H100-80GB-HBM3" (the label), and every
    pod naming the model was refused as "wrong GPU model" on a node with an agent."""
    node = nodes.parse(agent_node("gpu-1", "NVIDIA H100 80GB HBM3"))
    assert node.model == "NVIDIA-H100-80GB-HBM3"
    asks = GpuRequest(milli=1000, count=1, models=frozenset({"NVIDIA-H100-80GB-HBM3"}))
    assert asks.allows(node.gpus[0].model)
    assert nodes.parse(agent_node("gpu-2", "")).model == "NVIDIA-H100-80GB-HBM3"  # the label
    assert nodes.product("  Tesla T4 ") == "Tesla-T4" and nodes.product(None) == ""


def test_taints_and_cordon_reach_the_engines_node() -> None:
    body = agent_node("gpu-1", "NVIDIA H100 80GB HBM3")
    body["spec"] = {
        "unschedulable": True,
        "taints": [
            {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
            "not an object",
            {"key": 7, "effect": None},
        ],
    }
    node = nodes.parse(body)
    assert node.unschedulable
    assert node.taints == (
        Taint("nvidia.com/gpu", "present", "NoSchedule"),
        Taint("node.kubernetes.io/unschedulable", "", "NoSchedule"),
        Taint("", "", ""),
    )
    assert not node.admits([])
    record = nodes.record(body)
    assert record.node is not None and record.node.taints == node.taints


def test_pod_tolerations_default_to_equal_as_the_api_does() -> None:
    pod = {
        "spec": {
            "tolerations": [
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                {"operator": "Exists"},
                None,
            ]
        }
    }
    assert taints.of_pod(pod) == (
        Toleration("nvidia.com/gpu", "Equal", "present", "NoSchedule"),
        Toleration("", "Exists", "", ""),
    )
    assert taints.of_pod({}) == () and taints.of_pod({"spec": []}) == ()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(spec=JSON)
def test_any_spec_reads_without_raising(spec: object) -> None:
    found, cordoned = taints.of_node({"spec": spec})
    assert all(isinstance(taint, Taint) for taint in found) and isinstance(cordoned, bool)
    assert all(isinstance(item, Toleration) for item in taints.of_pod({"spec": spec}))
