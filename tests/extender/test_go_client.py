"""The verbs as Go sends them: the benchmark's kube-scheduler stand-in
(bench/kube_scheduler_client: encoding/json and net/http, as kube-scheduler's HTTP
extender uses them) against a running sidecar. Skipped where no Go toolchain is
installed (CI has none; `apt-get install golang-go` gives one)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from bench import extender_latency
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.extender.wire import ExtenderArgs
from tests.extender.test_http import seeded

pytestmark = pytest.mark.skipif(
    shutil.which("go") is None, reason="no Go toolchain (`go`) on PATH to build the stand-in"
)


async def test_go_encoded_calls_are_answered_and_prioritize_takes_filters_list_back(
    server: localapi.Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Go's encoding of ExtenderArgs (Pod, Nodes, NodeNames) sends back filter's node list
    byte for byte: every prioritize takes it without parsing it and is the answer
    prepared ahead, and every pod is bound."""
    binary = await asyncio.to_thread(extender_latency.build_go_client, tmp_path)
    assert binary is not None
    taken: list[bool] = []
    with_names = ExtenderArgs.with_names

    def spy(raw: bytes, names: list[str], names_json: bytes) -> ExtenderArgs | None:
        args = with_names(raw, names, names_json)
        taken.append(args is not None)
        return args

    monkeypatch.setattr(ExtenderArgs, "with_names", spy)
    async with seeded(server) as h:
        registry = h.sidecar.registry
        used_before = registry.get_sample_value(
            "gpuplace_prioritize_ahead_total", {"result": "used"}
        )
        taken.clear()  # the seed pod's calls came from Python's client
        pods = [h.api.create(objects.pod(f"go-{index}", percent=30)) for index in range(3)]
        work = {"base": h.url, "names": ["n0", "n1", "n2", "n3"], "pods": pods, "seed": 1}
        process = await asyncio.create_subprocess_exec(
            str(binary),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(json.dumps(work).encode()), 60)
        assert process.returncode == 0, err.decode()
        figures = json.loads(out)
        assert figures["outcomes"] == {"bound": 3, "unschedulable": 0, "refused": 0}
        assert [len(figures["client_side"][verb]) for verb in ("filter", "prioritize", "bind")] == [
            3,
            3,
            3,
        ]
        used = registry.get_sample_value("gpuplace_prioritize_ahead_total", {"result": "used"})
        assert (used or 0.0) - (used_before or 0.0) == 3
        assert taken == [True, True, True]
        for index in range(3):
            assert h.pod("default", f"go-{index}")["spec"]["nodeName"] in {"n0", "n1", "n2", "n3"}
