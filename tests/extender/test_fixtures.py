"""Every payload kube-scheduler sent in ../shared/fixtures/extender/ is accepted as is,
and answered right for a cluster that has the nodes it names."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gpuplace.cluster import keys
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from tests.extender.conftest import harness

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT.parent / "shared" / "fixtures" / "extender"
FILES = sorted(FIXTURES.glob("*.json")) if FIXTURES.is_dir() else []

pytestmark = pytest.mark.skipif(
    not FILES, reason=f"captured extender payloads not present at {FIXTURES} (../shared)"
)


def load(kind: str) -> dict[str, Any]:
    for path in FILES:
        if f"-{kind}-" in path.name:
            document = json.loads(path.read_text())
            assert isinstance(document, dict)
            request = document["request"]
            assert isinstance(request, dict)
            return request
    raise AssertionError(f"no {kind} fixture")


def cluster(api: localapi.FakeApi, pod: dict[str, Any]) -> None:
    """The fixtures' two nodes (an A100 80GB and a T4 16GB) and their pod, with its UID."""
    api.create(objects.node("gpu-a100-0", gpus=1, model="NVIDIA-A100-SXM4-80GB"))
    api.create(objects.node("gpu-t4-0", gpus=1, model="Tesla-T4", gpu_memory_mib=15360, cpu="16"))
    metadata = pod["metadata"]
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            k: v for k, v in metadata.items() if k in ("name", "namespace", "labels", "annotations")
        },
        "spec": pod["spec"],
    }
    api.create(body, uid=metadata["uid"])


@pytest.mark.parametrize("path", FILES, ids=[path.name for path in FILES])
async def test_each_payload_is_accepted(server: localapi.Server, path: Path) -> None:
    request = json.loads(path.read_text())["request"]
    verb = path.stem.split("-")[1]
    async with harness(server) as h:
        status, body = await h.post(verb, request)
    assert status == 200, body
    if verb == "prioritize":
        assert isinstance(body, list)
    else:
        assert isinstance(body, dict)
        assert "Error" in body


async def test_fixture_flow_places_on_the_gpu_that_can_hold_it(server: localapi.Server) -> None:
    filter_args, prioritize_args, bind_args = load("filter"), load("prioritize"), load("bind")
    cluster(server.api, filter_args["Pod"])
    async with harness(server) as h:
        await asyncio.wait_for(h.sidecar.sync.ready.wait(), 5)
        status, verdict = await h.post("filter", filter_args)
        assert status == 200
        assert verdict["NodeNames"] == ["gpu-a100-0"]
        # a node passed: kube-scheduler reads no failed node, the answer lists none
        assert verdict["FailedAndUnresolvableNodes"] == verdict["FailedNodes"] == {}
        assert verdict["Error"] == ""
        # 20 GiB per GPU never fits a 16 GB T4: unresolvable, so preemption skips it
        status, t4 = await h.post("filter", {**filter_args, "NodeNames": ["gpu-t4-0"]})
        assert (status, t4["NodeNames"], t4["FailedNodes"]) == (200, [], {})
        assert t4["FailedAndUnresolvableNodes"] == {"gpu-t4-0": "gpuplace: GPU memory too small"}
        status, scores = await h.post("prioritize", prioritize_args)
        assert status == 200
        assert {entry["Host"]: entry["Score"] for entry in scores}["gpu-a100-0"] == 10
        # the captured bind names the T4: refused with the reason, nothing written
        status, result = await h.post("bind", bind_args)
        assert status == 200
        assert "too small" in result["Error"] or "MiB" in result["Error"]
        pod = server.api.get("pods", "share-mutated", "default")
        assert "nodeName" not in pod["spec"]
        assert keys.ASSIGNED_NODE not in pod["metadata"]["annotations"]
        status, result = await h.post("bind", {**bind_args, "Node": "gpu-a100-0"})
        assert result == {"Error": ""}
        assert (
            server.api.get("pods", "share-mutated", "default")["spec"]["nodeName"] == "gpu-a100-0"
        )
