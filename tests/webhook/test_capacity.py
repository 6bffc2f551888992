""" "Could any GPU ever hold this?" and the messages that say what the cluster has."""

from __future__ import annotations

import pytest

from gpuplace.cluster import grammar, keys, nodes
from gpuplace.placement.inventory import Capabilities
from gpuplace.webhook import capacity
from tests.webhook import helpers


def spec(**values: str) -> grammar.PodGpuSpec:
    parsed = grammar.parse({keys.PREFIX + k.replace("_", "-"): v for k, v in values.items()})
    assert parsed is not None
    return parsed


@pytest.mark.parametrize(
    "values",
    [
        # the A100s' 80Gi (GPU Feature Discovery, no node agent) less the 1 GiB margin
        {"gpu_percent": "100", "gpu_memory": "79Gi"},
        {"gpu_count": "8", "gpu_topology": "required"},
        {"gpu_count": "2", "gpu_model": "NVIDIA-L4", "gpu_memory": "23Gi"},
        {"gpu_percent": "1", "gpu_model": "Tesla-T4,NVIDIA-L4"},
    ],
)
def test_fits(capabilities: Capabilities, values: dict[str, str]) -> None:
    assert capacity.misfit(spec(**values), capabilities) is None


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"gpu_percent": "50", "gpu_memory": "100Gi"},
            "no GPU in the cluster has 100Gi of memory (gpuplace.io/gpu-memory); "
            "the largest has 79Gi",
        ),
        (
            {"gpu_count": "1", "gpu_model": "NVIDIA-L4", "gpu_memory": "30Gi"},
            "no GPU of model NVIDIA-L4 in the cluster has 30Gi of memory (gpuplace.io/gpu-memory); "
            "the largest has 23Gi",
        ),
        (
            {"gpu_count": "16"},
            "no node in the cluster has 16 GPUs (gpuplace.io/gpu-count); the most on one node is 8",
        ),
        (
            {"gpu_count": "1", "gpu_model": "Tesla-T4"},
            "no GPU in the cluster is a Tesla-T4 (gpuplace.io/gpu-model); the models present are: "
            "NVIDIA-A100-SXM4-80GB, NVIDIA-L4",
        ),
        (
            {"gpu_count": "2", "gpu_model": "NVIDIA-L4", "gpu_topology": "required"},
            "no node has 2 GPUs of model NVIDIA-L4 joined by NVLink (gpuplace.io/gpu-topology: "
            "required); the largest NVLink domain has 1; use gpuplace.io/gpu-topology: preferred "
            "to accept GPUs without NVLink",
        ),
        (
            {
                "gpu_count": "4",
                "gpu_memory": "30Gi",
                "gpu_model": "NVIDIA-L4,NVIDIA-A100-SXM4-80GB",
                "gpu_topology": "none",
            },
            None,
        ),
    ],
)
def test_misfit_messages(
    capabilities: Capabilities, values: dict[str, str], message: str | None
) -> None:
    assert capacity.misfit(spec(**values), capabilities) == message


def test_combined_misfit() -> None:
    # L4: 24Gi, 8 per node; A100: 80Gi, 2 per node → 4 × 40Gi fits neither
    items = [
        helpers.node("l", gpus=8, model="NVIDIA-L4", memory_mib=24576),
        helpers.node("a", gpus=2, model="NVIDIA-A100-SXM4-80GB", memory_mib=81920),
    ]
    caps = nodes.inventory(items).capabilities()
    assert capacity.misfit(spec(gpu_count="4", gpu_memory="40Gi"), caps) == (
        "no node in the cluster has 4 GPUs with 40Gi of memory each"
    )


def test_cluster_without_gpus() -> None:
    caps = nodes.inventory([helpers.node("cpu")]).capabilities()
    message = capacity.misfit(spec(gpu_percent="10"), caps)
    assert message is not None and "gpuplace.io/enabled=true" in message


@pytest.mark.parametrize(("mib", "text"), [(81920, "80Gi"), (1500, "1500Mi"), (1048576, "1Ti")])
def test_memory_text(mib: int, text: str) -> None:
    assert capacity.memory_text(mib) == text
