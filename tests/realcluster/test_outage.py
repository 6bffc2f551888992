"""gpuplace down, and back: README "What fails how" and docs/webhook.md ("What is sent, and
what an outage blocks") on the real API server; a restart rebuilding the same ledger from
the API (DESIGN: nothing is kept only in memory)."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

from tests.realcluster.conftest import Agent, Scope
from tests.realcluster.install import Installation
from tests.realcluster.kit import Kubectl
from tests.realcluster.objects import REAL_NODE_MODEL, gpu_node, grant, pod, wait_bound

REFUSED = 'failed calling webhook "validate.gpuplace.io"'


def job(scope: Scope, node: str) -> dict[str, Any]:
    template = pod(
        "unused",
        scope.namespace,
        {"gpuplace.io/gpu-percent": "25", "gpuplace.io/gpu-model": REAL_NODE_MODEL},
        node_selector={"kubernetes.io/hostname": node},
        command=("sleep", "12"),
    )
    del template["apiVersion"], template["kind"]
    del template["metadata"]["name"], template["metadata"]["namespace"]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "train", "namespace": scope.namespace},
        "spec": {"backoffLimit": 0, "template": template},
    }


def test_an_outage_refuses_only_gpuplaces_own_changes(
    scope: Scope, kubectl: Kubectl, gpuplace: Installation, node_agent: Agent
) -> None:
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=1))
    share = {"gpuplace.io/gpu-percent": "25", "gpuplace.io/gpu-model": scope.model}
    kubectl.apply(pod("placed", scope.namespace, share))
    wait_bound(kubectl, scope.namespace, "placed")
    kubectl.apply(job(scope, node_agent.node))
    running = kubectl.watch(
        ["pods", "-n", scope.namespace, "-l", "job-name=train"],
        lambda seen: next(
            (o for o in seen.values() if (o.get("status") or {}).get("phase") == "Running"), None
        ),
        timeout=120,
        what="the Job's GPU pod running",
    )
    assert grant(running)["node"] == node_agent.node
    assert "batch.kubernetes.io/job-tracking" in running["metadata"]["finalizers"]
    gpuplace.serve.stop()
    try:
        # a new GPU pod: refused, with the error docs/webhook.md quotes
        refused = kubectl.apply(pod("new", scope.namespace, share), check=False)
        assert refused.code == 1 and REFUSED in refused.err, refused.err
        # a change of gpuplace's own keys: refused too
        changed = kubectl.run(
            "-n",
            scope.namespace,
            "annotate",
            "pod",
            "placed",
            "gpuplace.io/gpu-percent=30",
            "--overwrite",
            check=False,
        )
        assert changed.code == 1 and REFUSED in changed.err, changed.err
        # everything else passes: a label on a GPU pod, a pod without GPUs
        kubectl.run("-n", scope.namespace, "label", "pod", "placed", "team=research")
        plain = kubectl.run(
            "apply",
            "--dry-run=server",
            "-f",
            "-",
            input=json.dumps(pod("plain", scope.namespace)),
            check=False,
        )
        assert plain.code == 0, plain.err
        # the Job's GPU pod finishes: the kubelet's status writes and the Job controller
        # removing its tracking finalizer are never sent to gpuplace, so the Job completes
        done = kubectl.wait_object(
            "jobs",
            "train",
            lambda obj: (
                obj is not None
                and any(
                    c["type"] == "Complete" and c["status"] == "True"
                    for c in (obj.get("status") or {}).get("conditions") or []
                )
            ),
            namespace=scope.namespace,
            timeout=120,
        )
        assert done is not None
        finished = kubectl.json("-n", scope.namespace, "get", "pods", "-l", "job-name=train")
        assert [p["status"]["phase"] for p in finished["items"]] == ["Succeeded"]
        assert not finished["items"][0]["metadata"].get("finalizers")
    finally:
        gpuplace.serve.start()
    accepted = kubectl.apply(pod("new", scope.namespace, share), check=False)
    assert accepted.code == 0, accepted.err


def ledger_lines(gpuplace: Installation) -> list[str]:
    url = f"http://127.0.0.1:{gpuplace.ports.metrics}/metrics"
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    return [line for line in text.splitlines() if re.match(r"gpuplace_ledger_\w+(\{| )", line)]


def test_a_restart_rebuilds_the_same_ledger(
    scope: Scope, kubectl: Kubectl, gpuplace: Installation
) -> None:
    name = scope.node("a")
    scope.add_nodes(gpu_node(name, model=scope.model, gpus=2))
    model = {"gpuplace.io/gpu-model": scope.model}
    kubectl.apply(pod("sixty", scope.namespace, {"gpuplace.io/gpu-percent": "60", **model}))
    sixty = grant(wait_bound(kubectl, scope.namespace, "sixty"))
    kubectl.apply(pod("memory", scope.namespace, {"gpuplace.io/gpu-memory": "8Gi", **model}))
    memory = grant(wait_bound(kubectl, scope.namespace, "memory"))
    assert sixty["gpus"] != memory["gpus"]
    before = ledger_lines(gpuplace)
    gpuplace.serve.kill()  # a crash: nothing written on the way out
    gpuplace.serve.start()
    assert ledger_lines(gpuplace) == before
    # the rebuilt ledger knows both grants: 50% fits neither GPU (40% left on one, the
    # other holds a memory-only share), 40% joins the first
    kubectl.apply(pod("fifty", scope.namespace, {"gpuplace.io/gpu-percent": "50", **model}))
    kubectl.wait_event(scope.namespace, "fifty", "FailedGpuPlacement", timeout=90)
    kubectl.apply(pod("forty", scope.namespace, {"gpuplace.io/gpu-percent": "40", **model}))
    assert grant(wait_bound(kubectl, scope.namespace, "forty"))["gpus"] == sixty["gpus"]
    assert not kubectl.json("-n", scope.namespace, "get", "pod", "fifty")["spec"].get("nodeName")
