"""`gpuplace.controllers.evictions`: a refused eviction that needs none (the pod is going)."""

from __future__ import annotations

from gpuplace.cluster import kube
from gpuplace.controllers import evictions


def test_an_eviction_of_a_pod_on_its_way_out_needs_none() -> None:
    """What a gang restart meets when the gang's namespace is deleted (the real tier's
    words): a member already gone, and one its namespace takes with it."""
    going = (
        'pods "tolerant-3" is forbidden: unable to create new content in namespace '
        "rc-gang-plans-skip-cordon-b796 because it is being terminated"
    )
    assert evictions.already_going(kube.ApiError(404, "NotFound", 'pods "t1" not found'))
    assert evictions.already_going(kube.ApiError(403, "Forbidden", going))
    rbac = 'pods "t1" is forbidden: User "x" cannot create resource "pods/eviction"'
    assert not evictions.already_going(kube.ApiError(403, "Forbidden", rbac))
    assert not evictions.already_going(kube.ApiError(429, "TooManyRequests", "budget"))
