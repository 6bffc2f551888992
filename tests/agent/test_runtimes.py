"""DRA mode only on a runtime that passes CDI devices on (gpuplace.agent.runtimes), decided
from what the kubelet reports in `status.nodeInfo.containerRuntimeVersion`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuplace.agent import runtimes


@pytest.mark.parametrize(
    "reported",
    ["containerd://1.7.2", "containerd://1.7.24", "containerd://v1.7.13", "containerd://2.0.0",
     "containerd://2.1.4-k3s1", "cri-o://1.23.0", "cri-o://1.30.2"],
)  # fmt: skip
def test_runtimes_with_cdi_are_accepted(reported: str) -> None:
    assert runtimes.cdi_refusal(reported) is None


@pytest.mark.parametrize(
    ("reported", "why"),
    [
        ("containerd://1.6.20", "containerd://1.6.20 drops CDI devices"),  # the kit's default
        ("containerd://1.7.1", "needs containerd >= 1.7.2"),
        ("cri-o://1.22.5", "needs cri-o >= 1.23.0"),
        ("docker://24.0.7", "not one gpuplace knows to pass CDI devices on"),
        ("", "cannot be read"),
        ("containerd://", "cannot be read"),
        ("1.7.24", "cannot be read"),
    ],
)
def test_runtimes_without_cdi_are_refused_with_the_versions_that_would_do(
    reported: str, why: str
) -> None:
    refusal = runtimes.cdi_refusal(reported)
    assert refusal is not None and why in refusal


def test_containerd_1_7_is_reminded_of_enable_cdi() -> None:
    caveat = runtimes.caveat("containerd://1.7.24")
    assert caveat is not None and "enable_cdi = true" in caveat
    assert runtimes.caveat("containerd://2.0.1") is None
    assert runtimes.caveat("cri-o://1.30.0") is None


@given(st.text(max_size=200))
def test_any_report_is_accepted_or_refused_in_words(reported: str) -> None:
    refusal = runtimes.cdi_refusal(reported)
    assert refusal is None or (refusal and len(refusal) < 400)
