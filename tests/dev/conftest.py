"""The `server` fixture of the local API's contract tests: each runs against the local
API and against the real kube-apiserver of the tier (`tests.dev.servers`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.dev import servers
from tests.dev.servers import RealApi, Served
from tests.realcluster.install import Installation
from tests.realcluster.sessions import real_param


@pytest.fixture(scope="session")
def real_api(installed: Installation) -> RealApi:
    return RealApi(installed)


@pytest.fixture(params=["local", real_param("real")])
async def server(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    namespace = servers.namespace_of(request.node.name)
    if request.param == "local":
        async with servers.local(namespace) as served:
            yield served
    else:
        api: RealApi = request.getfixturevalue("real_api")
        async with servers.real(api, namespace) as served:
            yield served
