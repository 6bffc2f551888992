"""A kubelet stand-in for DRA: the plugin manager's and the DRA manager's side of the
kubelet plugin APIs, over real gRPC on unix sockets, as kubelet v1.36's
pkg/kubelet/pluginmanager and pkg/kubelet/cm/dra do it.

- `register()`: waits for `<registry dir>/<driver>-reg.sock` (the plugin watcher sees the
  socket appear), asks GetInfo, checks what the kubelet checks (type `DRAPlugin`, a
  supported version `v1.DRAPlugin`, an endpoint that exists), reports the verdict with
  NotifyRegistrationStatus and keeps the endpoint;
- `prepare(*claims)` / `unprepare(*claims)`: NodePrepareResources / NodeUnprepareResources
  on that endpoint, each claim named by namespace, name and UID only;
- `health()`: the first messages of the NodeWatchResources stream.

Plus `Claims`, the ResourceClaims the plugin reads (`get_resource_claim`), counting reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

from gpuplace.agent import kubeletplugin
from gpuplace.agent.draplugin import (
    dra_pb2,
    dra_pb2_grpc,
    health_pb2,
    health_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)
from gpuplace.cluster import dra, kube


class DraKubelet:
    def __init__(self, registry_dir: Path) -> None:
        self.registry_dir = registry_dir
        self.endpoint = ""
        self.info: registration_pb2.PluginInfo | None = None

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / f"{dra.DRIVER}-reg.sock"

    async def register(self, timeout: float = 10.0) -> registration_pb2.PluginInfo:
        deadline = time.monotonic() + timeout
        while not self.registration_socket.exists():
            assert time.monotonic() < deadline, "no registration socket appeared"
            await asyncio.sleep(0.02)
        async with grpc.aio.insecure_channel(f"unix://{self.registration_socket}") as channel:
            stub = registration_pb2_grpc.RegistrationStub(channel)
            info: registration_pb2.PluginInfo = await stub.GetInfo(
                registration_pb2.InfoRequest(), timeout=5
            )
            problem = ""
            if info.type != kubeletplugin.PLUGIN_TYPE:
                problem = f"plugin type {info.type!r}"
            elif "v1.DRAPlugin" not in info.supported_versions:
                problem = f"no supported version in {list(info.supported_versions)}"
            elif not Path(info.endpoint).exists():
                problem = f"endpoint {info.endpoint} does not exist"
            await stub.NotifyRegistrationStatus(
                registration_pb2.RegistrationStatus(plugin_registered=not problem, error=problem),
                timeout=5,
            )
            assert not problem, problem
        self.endpoint, self.info = info.endpoint, info
        return info

    def _channel(self) -> grpc.aio.Channel:
        assert self.endpoint, "register first"
        return grpc.aio.insecure_channel(f"unix://{self.endpoint}")

    async def prepare(self, *claims: tuple[str, str, str]) -> dra_pb2.NodePrepareResourcesResponse:
        request = dra_pb2.NodePrepareResourcesRequest(claims=_claims(claims))
        async with self._channel() as channel:
            stub = dra_pb2_grpc.DRAPluginStub(channel)
            answer: dra_pb2.NodePrepareResourcesResponse = await stub.NodePrepareResources(
                request, timeout=30
            )
            return answer

    async def unprepare(
        self, *claims: tuple[str, str, str]
    ) -> dra_pb2.NodeUnprepareResourcesResponse:
        request = dra_pb2.NodeUnprepareResourcesRequest(claims=_claims(claims))
        async with self._channel() as channel:
            stub = dra_pb2_grpc.DRAPluginStub(channel)
            answer: dra_pb2.NodeUnprepareResourcesResponse = await stub.NodeUnprepareResources(
                request, timeout=30
            )
            return answer

    async def health(self, count: int = 1) -> list[health_pb2.NodeWatchResourcesResponse]:
        found = []
        async with self._channel() as channel:
            stream = health_pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                health_pb2.NodeWatchResourcesRequest()
            )
            async for item in stream:
                found.append(item)
                if len(found) == count:
                    stream.cancel()
                    break
        return found


def _claims(claims: tuple[tuple[str, str, str], ...]) -> list[dra_pb2.Claim]:
    return [dra_pb2.Claim(namespace=n, name=m, uid=u) for n, m, u in claims]


class Claims:
    """ResourceClaims by (namespace, name), as the API would answer them."""

    def __init__(self, *claims: Mapping[str, Any]) -> None:
        self.claims: dict[tuple[str, str], Mapping[str, Any]] = {}
        self.reads = 0
        for claim in claims:
            self.put(claim)

    def put(self, claim: Mapping[str, Any]) -> None:
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = claim

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads += 1
        found = self.claims.get((namespace, name))
        if found is None:
            raise kube.ApiError(404, "NotFound", f'resourceclaims "{name}" not found')
        return dict(found)


def ref(claim: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = claim["metadata"]
    return (meta["namespace"], meta["name"], meta["uid"])
