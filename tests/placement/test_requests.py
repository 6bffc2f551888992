"""How a request is worded (`gpuplace.placement.requests.describe`): one wording for every
message, exact for each kind of request, and never the same words for different demands."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuplace.placement.requests import WHOLE, GpuRequest, Topology, describe


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (GpuRequest(), "no GPU"),
        (GpuRequest(milli=500, memory_mib=20480, count=1), "50% of one GPU with 20480 MiB"),
        (GpuRequest(milli=125, count=1), "12.5% of one GPU"),
        (
            GpuRequest(memory_mib=8192, count=1),
            "memory only (no compute) of one GPU with 8192 MiB",
        ),
        (GpuRequest(milli=WHOLE, count=1), "1 whole GPU"),
        (
            GpuRequest(milli=WHOLE, count=1, models=frozenset({"NVIDIA-L4"})),
            "1 whole GPU of NVIDIA-L4",
        ),
        (
            GpuRequest(milli=WHOLE, memory_mib=81920, count=4, topology=Topology.REQUIRED),
            "4 whole GPUs in one NVLink domain with 81920 MiB each",
        ),
        (
            GpuRequest(milli=WHOLE, count=2, models=frozenset({"B", "A"})),
            "2 whole GPUs of A/B",
        ),
        (GpuRequest(milli=WHOLE, count=2, topology=Topology.PREFERRED), "2 whole GPUs"),
        (
            GpuRequest(milli=500, memory_mib=4096, count=1, models=frozenset({"NVIDIA-A100"})),
            "50% of one GPU with 4096 MiB of NVIDIA-A100",
        ),
    ],
)
def test_each_kind_of_request_reads_as_written(request_: GpuRequest, words: str) -> None:
    assert describe(request_) == words


REQUESTS = st.one_of(
    st.builds(
        lambda milli, memory: GpuRequest(milli=milli, memory_mib=memory, count=1),
        st.integers(1, WHOLE),
        st.integers(0, 4),
    ),
    st.builds(lambda memory: GpuRequest(memory_mib=memory, count=1), st.integers(1, 4)),
    st.builds(
        lambda count, memory, required: GpuRequest(
            milli=WHOLE,
            memory_mib=memory,
            count=count,
            topology=Topology.REQUIRED if required else Topology.ANY,
        ),
        st.integers(2, 4),
        st.integers(0, 4),
        st.booleans(),
    ),
)


@given(REQUESTS, REQUESTS)
def test_different_demands_never_read_alike(one: GpuRequest, other: GpuRequest) -> None:
    demand = (one.milli, one.memory_mib, one.count, one.topology is Topology.REQUIRED)
    other_demand = (other.milli, other.memory_mib, other.count, other.topology is Topology.REQUIRED)
    if demand != other_demand:
        assert describe(one) != describe(other)
