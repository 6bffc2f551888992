"""Fuzzing the real TLS endpoints: arbitrary annotations, pod shapes and review bodies never
get a 5xx, and every denial carries a message.

The webhook runs in a thread with its own event loop so that hypothesis can drive it
from ordinary (synchronous) tests over one keep-alive HTTPS connection.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import http.client
import io
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gpuplace.cluster import keys
from gpuplace.placement.inventory import Capabilities
from gpuplace.webhook import app as webhook_app
from gpuplace.webhook.auditing import AuditLog, StreamSink
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import FixedCapabilities
from gpuplace.webhook.metrics import WebhookMetrics
from gpuplace.webhook.tls import CertificateReloader
from tests.webhook import helpers

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class Client:
    def __init__(self, port: int, cafile: Path) -> None:
        self.port = port
        self.context = ssl.create_default_context(cafile=str(cafile))
        self.connection = self._connect()

    def _connect(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context, timeout=10)

    def post(self, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        for attempt in range(2):
            try:
                self.connection.request("POST", path, body, {"Content-Type": "application/json"})
                response = self.connection.getresponse()
                payload = response.read()
                break
            except (http.client.HTTPException, ConnectionError):
                self.connection.close()
                self.connection = self._connect()
                if attempt:
                    raise
        assert response.getheader("Content-Type", "").startswith("application/json")
        answer: dict[str, Any] = json.loads(payload)
        return response.status, answer


@pytest.fixture(scope="module")
def client(tls_files: tuple[Path, Path], capabilities: Capabilities) -> Iterator[Client]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def start() -> None:
        registry = CollectorRegistry()
        metrics = WebhookMetrics(registry)
        certificates = CertificateReloader(*tls_files, metrics=metrics)
        holder["audit"] = AuditLog(StreamSink(io.StringIO()))
        app = webhook_app.create_app(
            WebhookConfig(max_body_bytes=256 * 1024),
            FixedCapabilities(capabilities),
            holder["audit"],
            metrics,
        )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=certificates.context)
        await site.start()
        holder["runner"] = runner
        holder["port"] = runner.addresses[0][1]
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    ready.wait(10)
    client = Client(holder["port"], tls_files[0])
    yield client
    client.connection.close()
    asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    holder["audit"].close()


def check(status: int, answer: dict[str, Any], uid: str | None = None) -> dict[str, Any]:
    assert status < 500, answer
    if status != 200:
        assert status in (400, 413) and answer["error"]
        event(f"http {status}")
        return {}
    response: dict[str, Any] = answer["response"]
    if uid is not None:
        assert response["uid"] == uid
    event("patched" if "patch" in response else "allowed" if response["allowed"] else "denied")
    if not response["allowed"]:
        assert response["status"]["message"].strip()
        assert response["status"]["code"] in (403, 422, 503)
    return response


_keys = st.one_of(
    st.sampled_from([*keys.USER_ANNOTATIONS, *keys.SYSTEM_ANNOTATIONS]),
    st.text(min_size=1, max_size=20).map(lambda s: keys.PREFIX + s),
    st.text(min_size=1, max_size=20),
)
_values = st.one_of(
    st.text(max_size=40),
    st.integers(-10, 300).map(str),
    st.sampled_from(
        [
            "20Gi",
            "10G",
            "1e3",
            "0.5",
            "required",
            "1h",
            "g",
            "c",
            "main",
            "NVIDIA-L4",
            "NVIDIA-A100-SXM4-80GB",
            "x" * 2000,
        ]
    ),
)
_users = st.sampled_from(["alice", WebhookConfig().sidecar_user])
_valid = st.one_of(
    st.fixed_dictionaries(
        {keys.GPU_PERCENT: st.integers(1, 100).map(str)},
        optional={
            keys.GPU_MEMORY: st.sampled_from(["1", "512Mi", "10G", "20Gi", "100Gi"]),
            keys.GPU_MODEL: st.sampled_from(["NVIDIA-L4", "NVIDIA-A100-SXM4-80GB", "Tesla-T4"]),
            keys.CONTAINER: st.sampled_from(["main", "other"]),
        },
    ),
    st.fixed_dictionaries(
        {keys.GPU_COUNT: st.integers(1, 10).map(str)},
        optional={
            keys.GPU_TOPOLOGY: st.sampled_from(["none", "preferred", "required"]),
            keys.GANG_NAME: st.just("g"),
            keys.GANG_SIZE: st.just("3"),
            keys.GANG_TIMEOUT: st.sampled_from(["5m", "soon"]),
        },
    ),
)
_annotations = st.one_of(
    _valid,
    st.dictionaries(_keys, _values, max_size=6),
    st.tuples(_valid, st.dictionaries(_keys, _values, max_size=2)).map(
        lambda pair: {**pair[0], **pair[1]}
    ),
)


@FUZZ
@given(
    annotations=_annotations,
    user=_users,
    operation=st.sampled_from(["CREATE", "UPDATE"]),
)
def test_any_annotations(
    client: Client, annotations: dict[str, str], user: str, operation: str
) -> None:
    pod = helpers.pod(annotations)
    old = helpers.pod() if operation == "UPDATE" else None
    body = helpers.review(pod, old=old, operation=operation, user=user, uid="fuzz")
    for path in ("/mutate", "/validate"):
        status, answer = client.post(path, json.dumps(body).encode())
        assert status == 200
        response = check(status, answer, "fuzz")
        if "patch" in response:
            ops = json.loads(base64.b64decode(response["patch"]))
            patched = jsonpatch.apply_patch(pod, ops)
            again = helpers.review(patched, user=user, uid="fuzz")
            status, answer = client.post("/mutate", json.dumps(again).encode())
            assert "patch" not in check(status, answer, "fuzz")
            status, answer = client.post("/validate", json.dumps(again).encode())
            check(status, answer, "fuzz")


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
_PLACES: tuple[tuple[str | int, ...], ...] = (
    ("spec", "affinity"),
    ("spec", "schedulingGates"),
    ("spec", "schedulerName"),
    ("spec", "nodeName"),
    ("spec", "containers"),
    ("spec", "initContainers"),
    ("spec", "containers", 0, "env"),
    ("spec", "containers", 0, "resources"),
    ("spec", "containers", 0, "name"),
    ("metadata", "labels"),
    ("metadata", "annotations"),
    ("metadata",),
    ("spec",),
)
_plausible = st.one_of(
    _json,
    st.just([{"matchExpressions": [{"key": "z", "operator": "Exists"}]}]),
    st.just(
        {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{}, {"matchExpressions": "bad"}]
                }
            }
        }
    ),
    st.just([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, "junk"]),
    st.just({"limits": {keys.RESOURCE_PERCENT: "7"}, "requests": None}),
    st.just([{"name": "gpuplace.io/gang"}, 3]),
)


@st.composite
def _mangled(draw: st.DrawFn) -> dict[str, Any]:
    """A valid GPU pod with one to three fields replaced by odd values."""
    pod = helpers.pod(draw(_valid))
    for place in draw(st.lists(st.sampled_from(_PLACES), min_size=1, max_size=3, unique=True)):
        node: Any = pod
        for token in place[:-1]:
            if isinstance(node, dict) and isinstance(token, str):
                node = node.get(token)
            elif isinstance(node, list) and isinstance(token, int) and token < len(node):
                node = node[token]
            else:
                node = None
        last = place[-1]
        if isinstance(node, dict) and isinstance(last, str):
            node[last] = copy.deepcopy(draw(_plausible))
    return pod


@FUZZ
@given(pod=_mangled())
def test_any_pod_shape(client: Client, pod: dict[str, Any]) -> None:
    body = helpers.review(pod, uid="shape")
    for path in ("/mutate", "/validate"):
        status, answer = client.post(path, json.dumps(body).encode())
        response = check(status, answer, "shape")
        if "patch" in response:
            jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=200),
        _json.map(lambda value: json.dumps(value).encode()),
        st.fixed_dictionaries(
            {
                "apiVersion": st.sampled_from(["admission.k8s.io/v1", "v1", ""]),
                "kind": st.sampled_from(["AdmissionReview", "Pod"]),
                "request": st.one_of(
                    _json,
                    st.fixed_dictionaries(
                        {
                            "uid": st.one_of(st.text(max_size=5), _json),
                            "kind": st.one_of(
                                _json, st.just({"group": "", "version": "v1", "kind": "Pod"})
                            ),
                            "operation": st.one_of(
                                st.sampled_from(["CREATE", "UPDATE", "DELETE"]), _json
                            ),
                        },
                        optional={
                            "object": _json,
                            "oldObject": _json,
                            "userInfo": _json,
                            "dryRun": _json,
                        },
                    ),
                ),
            }
        ).map(lambda value: json.dumps(value).encode()),
    )
)
def test_any_body(client: Client, body: bytes) -> None:
    for path in ("/mutate", "/validate"):
        status, answer = client.post(path, body)
        check(status, answer)
