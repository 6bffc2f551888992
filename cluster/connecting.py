"""Where the Kubernetes API is and who we are to it: a kubernetes-asyncio `ApiClient`.

In order: an explicit kubeconfig file (`--kubeconfig`), the in-cluster service account
(the sidecar's normal case), then `$KUBECONFIG` / `~/.kube/config` (what `gpuplace
explain` uses on a laptop). The `Configuration` is private to the returned client:
nothing is installed as the library's process-wide default.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

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
        return client.ApiClient(configuration)
    if in_cluster and "KUBERNETES_SERVICE_HOST" in os.environ:
        try:
            config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
            log.info("using the in-cluster service account")
            return client.ApiClient(configuration)
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
    return client.ApiClient(configuration)
