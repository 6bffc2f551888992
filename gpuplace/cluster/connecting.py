"""Where the Kubernetes API is and who we are to it: a kubernetes-asyncio `ApiClient`.

In order: an explicit kubeconfig file (`--kubeconfig`), the in-cluster service account
(the sidecar's normal case), then `$KUBECONFIG` / `~/.kube/config` (what `gpuplace
explain` uses on a laptop). The `Configuration` is private to the returned client:
nothing is installed as the library's process-wide default.

Proxy environment variables (`HTTPS_PROXY`, `NO_PROXY`, ...) are read once, here
(`client_for`), not on every request: kubernetes-asyncio's session otherwise looks
them (and `~/.netrc`) up per request in a worker thread, and while the sidecar
scores ahead the thread waits for the GIL: 40-60 ms added to one API call in thirty.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
import urllib.request
from pathlib import Path

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.config.config_exception import ConfigException

log = logging.getLogger(__name__)


class ConnectError(RuntimeError):
    """No usable API configuration; the message says what was tried."""


async def api_client(
    kubeconfig: Path | None = None, *, context: str | None = None, in_cluster: bool = True
) -> client.ApiClient:
    """An ApiClient for the cluster (see the module docstring for the order of sources)."""
    configuration = client.Configuration()
    if kubeconfig is not None:
        try:
            await config.load_kube_config(
                config_file=str(kubeconfig),
                context=context,
                client_configuration=configuration,
                persist_config=False,
            )
        except (ConfigException, OSError) as error:
            raise ConnectError(f"kubeconfig {kubeconfig}: {error}") from error
        return client_for(configuration)
    if in_cluster and "KUBERNETES_SERVICE_HOST" in os.environ:
        try:
            config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
            log.info("using the in-cluster service account")
            return client_for(configuration)
        except ConfigException as error:
            raise ConnectError(f"in-cluster configuration: {error}") from error
    default = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    first = default.split(os.pathsep)[0]
    try:
        await config.load_kube_config(
            config_file=first,
            context=context,
            client_configuration=configuration,
            persist_config=False,
        )
    except (ConfigException, OSError) as error:
        raise ConnectError(
            f"no Kubernetes API configuration: not in a cluster and {first}: {error}"
        ) from error
    return client_for(configuration)


def env_proxy(host: str) -> str | None:
    """The proxy the environment names for the API server at `host` (a URL), None when
    there is none or `NO_PROXY` exempts the host: what aiohttp's `trust_env` would pick."""
    parts = urllib.parse.urlsplit(host)
    if not parts.hostname or urllib.request.proxy_bypass(parts.hostname):
        return None
    return urllib.request.getproxies().get(parts.scheme or "https")


def client_for(configuration: client.Configuration) -> client.ApiClient:
    """An ApiClient for `configuration` whose requests do no per-request environment
    lookups (see the module docstring): the proxy is resolved now, once, unless the
    configuration names one. Call from a running event loop."""
    if not configuration.proxy:
        configuration.proxy = env_proxy(str(configuration.host))
    api = client.ApiClient(configuration)
    rest = api.rest_client
    session: aiohttp.ClientSession = rest.pool_manager
    connector = session.connector  # the library's TLS set-up, kept
    session.detach()  # closed without closing the connector
    rest.pool_manager = aiohttp.ClientSession(
        connector=connector, trust_env=False, read_bufsize=READ_BUFSIZE
    )
    return api


READ_BUFSIZE = 2**21
"""As kubernetes-asyncio sets it: watch events carry whole objects (etcd allows 1.5 MiB)."""
