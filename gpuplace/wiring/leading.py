"""The leader gate the gang and queue controllers share, wired from `--scheduler-lease`.

`follower(api, "NAMESPACE/NAME")` is the `gpuplace.controllers.leader.LeaseFollower` of
kube-scheduler's leader-election Lease: both controllers decide only while this pod's
kube-scheduler holds it, so one replica's ledger decides at a time. "" (a single replica):
none, and the controllers always decide. Its `run()` is background work of whoever holds
it (the sidecar, once for both controllers).
"""

from __future__ import annotations

from gpuplace.cluster import kube
from gpuplace.controllers.leader import LeaseFollower


def follower(api: kube.Kube, lease: str) -> LeaseFollower | None:
    """The follower of kube-scheduler's Lease `lease` ("NAMESPACE/NAME"; "": none)."""
    if not lease:
        return None
    namespace, _, name = lease.partition("/")
    return LeaseFollower(api, namespace=namespace, name=name)
