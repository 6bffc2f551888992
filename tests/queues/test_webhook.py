"""The webhook queues GPU pods through the sidecar's queue directory (the GpuQueue and
namespace informers against the local API): the queue label and gate on a pod whose
annotation or namespace names a queue; a clear refusal of a queue that does not exist or
that the pod's namespace may not use; the queue in the audit line; GPU pods refused with
503 until the queues and namespaces have been read. Served over HTTP on
127.0.0.1 as `gpuplace serve` serves it; then the controller admits what it queued."""

from __future__ import annotations

import base64
import contextlib
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import jsonpatch
from aiohttp import web
from prometheus_client import CollectorRegistry

from gpuplace.cluster import keys
from gpuplace.cluster import nodes as nodes_
from gpuplace.cluster.gang_marks import gated
from gpuplace.cluster.queue_directory import QueueDirectory, namespace_record, queue_record
from gpuplace.dev import localapi
from gpuplace.webhook import admission
from gpuplace.webhook import app as webhook_app
from gpuplace.webhook.auditing import AuditLog, StreamSink
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import FixedCapabilities
from gpuplace.webhook.metrics import WebhookMetrics
from tests.queues.rig import Rig, gpuqueue, namespace, nodes, rig
from tests.webhook import helpers


@contextlib.asynccontextmanager
async def webhook(r: Rig) -> AsyncIterator[tuple[str, AuditLog, io.StringIO]]:
    """The webhook app reading `r`'s queue directory, on 127.0.0.1; its URL, audit log
    and the stream the log writes to."""
    stream = io.StringIO()
    audit = AuditLog(StreamSink(stream))
    app = webhook_app.create_app(
        WebhookConfig(),
        r.h.sidecar,  # as `gpuplace serve` wires it: the live inventory
        audit,
        WebhookMetrics(CollectorRegistry()),
        queues=r.directory,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", audit, stream
    finally:
        await runner.cleanup()
        audit.close()


async def review(url: str, verb: str, pod: dict[str, Any]) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/{verb}", json=helpers.review(pod)) as answer,
    ):
        assert answer.status == 200
        body: dict[str, Any] = (await answer.json())["response"]
        return body


def gpu_pod(name: str, namespace: str, queue: str | None = None) -> dict[str, Any]:
    annotations = {keys.GPU_COUNT: "1"}
    if queue is not None:
        annotations[keys.QUEUE] = queue
    pod = helpers.pod(annotations)
    pod["metadata"]["name"] = name
    pod["metadata"]["namespace"] = namespace
    return pod


def applied(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    ops = json.loads(base64.b64decode(response["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(pod, ops)
    return result


async def test_the_webhook_queues_refuses_and_the_controller_admits(
    server: localapi.Server,
) -> None:
    nodes(server.api, 1, gpus=4)
    namespace(server.api, "team-a", team="a", **{keys.QUEUE_LABEL: "team-a"})
    namespace(server.api, "team-b", team="b")
    namespace(server.api, "plain")
    server.api.create(gpuqueue("team-a", "4"))
    server.api.create(gpuqueue("team-b", "4"))
    async with rig(server) as r, webhook(r) as (url, audit, stream):
        # the namespace's default queue
        answer = await review(url, "mutate", gpu_pod("by-default", "team-a"))
        assert answer["allowed"], answer["status"]["message"]
        pod = applied(gpu_pod("by-default", "team-a"), answer)
        assert pod["metadata"]["labels"][keys.QUEUE_LABEL] == "team-a"
        assert gated(pod, keys.QUEUE_GATE)
        assert any("queued in GpuQueue team-a" in w for w in answer.get("warnings") or [])
        # the mutated pod validates
        validated = await review(url, "validate", pod)
        assert validated["allowed"], validated
        # a queue that does not exist: refused, naming the queues there are
        answer = await review(url, "mutate", gpu_pod("typo", "team-a", queue="team-z"))
        assert not answer["allowed"]
        message = answer["status"]["message"]
        assert "GpuQueue team-z" in message and "does not exist" in message
        assert "team-a, team-b" in message
        # a queue the namespace may not use: refused (403), with its selector
        answer = await review(url, "mutate", gpu_pod("foreign", "team-a", queue="team-b"))
        assert not answer["allowed"] and answer["status"]["code"] == 403
        assert "namespace team-a may not use GpuQueue team-b" in answer["status"]["message"]
        assert "team=b" in answer["status"]["message"]
        # a namespace without a default and a pod without a queue: not queued
        answer = await review(url, "mutate", gpu_pod("free", "plain"))
        assert answer["allowed"]
        free = applied(gpu_pod("free", "plain"), answer)
        assert not gated(free, keys.QUEUE_GATE)
        audit.flush()  # lines are written by a thread, in batches
        lines = [json.loads(line) for line in stream.getvalue().splitlines() if line]
        assert [line.get("queue") for line in lines][:1] == ["team-a"]
        assert any(line["reason"] == admission.QUEUE_UNKNOWN for line in lines)
        assert any(line["reason"] == admission.QUEUE_FORBIDDEN for line in lines)
        # what the webhook queued, the controller admits (the API server assigns a UID)
        for key in ("uid", "resourceVersion", "creationTimestamp"):
            pod["metadata"].pop(key, None)
        r.api.create(pod)
        await r.quiet()
        assert r.admitted("team-a") == ["by-default"]
        assert await r.schedule() == []


@contextlib.asynccontextmanager
async def bare_webhook(directory: QueueDirectory) -> AsyncIterator[str]:
    """The webhook app on 127.0.0.1 with a known GPU inventory and `directory` as its
    queue source; its URL."""
    capabilities = nodes_.inventory(helpers.node_list()["items"]).capabilities()
    app = webhook_app.create_app(
        WebhookConfig(),
        FixedCapabilities(capabilities),
        AuditLog(StreamSink(io.StringIO())),
        WebhookMetrics(CollectorRegistry()),
        queues=directory,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_gpu_pods_are_refused_with_503_until_the_queues_are_read() -> None:
    """Before the GpuQueue and namespace informers have listed, the webhook cannot tell
    which queue a GPU pod waits in (its namespace may name a default queue it has not
    seen): every GPU pod is refused, 503 ServiceUnavailable, nothing is patched or
    queued, and the API server's retry succeeds once both have listed. A pod without a
    GPU request is not held up."""
    directory = QueueDirectory()
    async with bare_webhook(directory) as url:
        for pod in (gpu_pod("named", "team-a", queue="team-a"), gpu_pod("plain", "team-a")):
            for verb in ("mutate", "validate"):
                answer = await review(url, verb, pod)
                assert not answer["allowed"], (verb, answer)
                assert answer["status"]["code"] == 503, answer
                assert answer["status"]["reason"] == "ServiceUnavailable"
                assert "not read the cluster's GpuQueues" in answer["status"]["message"]
                assert "patch" not in answer
        cpu_only = helpers.pod({})
        assert (await review(url, "mutate", cpu_only))["allowed"]
        # only the queues listed: still 503 (the namespace labels are not known)
        directory.queue_handler.replace([queue_record(gpuqueue("team-a", "4"))])
        answer = await review(url, "mutate", gpu_pod("named", "team-a", queue="team-a"))
        assert not answer["allowed"] and answer["status"]["code"] == 503
        ns = {"metadata": {"name": "team-a", "labels": {"team": "a"}}}
        directory.namespace_handler.replace([namespace_record(ns)])
        pod = gpu_pod("named", "team-a", queue="team-a")
        answer = await review(url, "mutate", pod)
        assert answer["allowed"], answer
        queued = applied(pod, answer)
        assert queued["metadata"]["labels"][keys.QUEUE_LABEL] == "team-a"
        assert gated(queued, keys.QUEUE_GATE)
