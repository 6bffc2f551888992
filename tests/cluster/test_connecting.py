"""gpuplace.cluster.connecting: the API client resolves proxies once and never per request."""

from __future__ import annotations

import asyncio
import threading

import pytest
from kubernetes_asyncio import client

from gpuplace.cluster import connecting, kube
from gpuplace.dev.localapi import FakeApi, objects, serve

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy")


@pytest.fixture
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_env_proxy_follows_the_environment(no_proxies: pytest.MonkeyPatch) -> None:
    assert connecting.env_proxy("https://10.0.0.1:6443") is None
    no_proxies.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert connecting.env_proxy("https://10.0.0.1:6443") == "http://proxy.example:3128"
    assert connecting.env_proxy("http://10.0.0.1:8080") is None  # no HTTP_PROXY set
    no_proxies.setenv("NO_PROXY", "10.0.0.1,.cluster.local")
    assert connecting.env_proxy("https://10.0.0.1:6443") is None
    assert connecting.env_proxy("https://kubernetes.default.svc.cluster.local") is None
    assert connecting.env_proxy("https://api.example:6443") == "http://proxy.example:3128"


async def test_client_for_takes_the_proxy_once(no_proxies: pytest.MonkeyPatch) -> None:
    no_proxies.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    configuration = client.Configuration(host="https://api.example:6443")
    async with connecting.client_for(configuration) as api:
        assert configuration.proxy == "http://proxy.example:3128"
        assert api.rest_client.proxy == "http://proxy.example:3128"
        assert api.rest_client.pool_manager.trust_env is False
    named = client.Configuration(host="https://api.example:6443")
    named.proxy = "http://other.example:8080"
    async with connecting.client_for(named) as api:
        assert api.rest_client.proxy == "http://other.example:8080"


async def test_requests_stay_on_the_event_loop_thread(no_proxies: pytest.MonkeyPatch) -> None:
    """No request hops to a worker thread (the GIL would make it wait behind scoring)."""
    fake = FakeApi()
    fake.create(objects.node("gpu-a"))
    hops: list[str] = []
    loop = asyncio.get_running_loop()
    original = loop.run_in_executor

    def watched(executor: object, function: object, *args: object) -> asyncio.Future[object]:
        hops.append(threading.current_thread().name)
        return original(executor, function, *args)  # type: ignore[arg-type]

    no_proxies.setattr(loop, "run_in_executor", watched)
    async with serve(fake) as server:
        api = kube.Kube(connecting.client_for(server.configuration()), timeout=5.0)
        try:
            for _ in range(3):
                page = await api.list_page("nodes", label_selector="", limit=10, token="")
                assert [item["metadata"]["name"] for item in page["items"]] == ["gpu-a"]
        finally:
            await api.close()
    assert hops == []
