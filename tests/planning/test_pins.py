"""The pins' writes, one by one, on a pod kept in memory: what each writes, in which order,
with which preconditions, and that a plan found stale writes nothing."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any

import pytest

from gpuplace.cluster import keys, kube, pods
from gpuplace.controllers.writing import Writer
from gpuplace.dev.localapi import objects, patching
from gpuplace.planning import pins


class OnePod:
    """A PodApi holding one pod: merge patches with UID and resourceVersion preconditions,
    as kube-apiserver applies them; every write recorded."""

    def __init__(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        self.writes: list[tuple[str, dict[str, Any]]] = []

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.pod)

    def _apply(self, kind: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        wanted = patch.get("metadata") or {}
        current = self.pod["metadata"]
        if wanted.get("resourceVersion") not in (None, current["resourceVersion"]):
            raise kube.ApiError(409, "Conflict", "the object has been modified")
        self.writes.append((kind, copy.deepcopy(dict(patch))))
        body = {k: v for k, v in patch.items() if k != "metadata"}
        if kind == "status":
            body = {"status": body.get("status")}
        self.pod = patching.merge(self.pod, body)
        self.pod["metadata"]["resourceVersion"] = str(int(current["resourceVersion"]) + 1)
        return copy.deepcopy(self.pod)

    async def patch_pod(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        return self._apply("pod", patch)

    async def patch_pod_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        return self._apply("status", patch)

    async def evict_pod(self, namespace: str, name: str, *, uid: str) -> None:
        raise AssertionError("no eviction here")

    async def disruption_budgets(self, namespace: str) -> list[dict[str, Any]]:
        return []


def gated_pod(gates: tuple[str, ...] = (keys.PLACE_GATE,)) -> dict[str, Any]:
    pod = objects.pod("p", gates=list(gates))
    pod["metadata"].update(uid="u1", resourceVersion="7")
    return pod


def record(pod: dict[str, Any]) -> pods.PodRecord:
    return pods.Reader().record(pod)


def never_stale() -> None:
    return None


def stale() -> None:
    raise pins.Stale()


def run(pin: pins.Pin, api: OnePod, node: str | None, check: pins.Check) -> Any:
    writer = Writer(api, concurrency=4, attempts=3)
    return asyncio.run(pin.release(writer, record(api.pod), node, check))


def test_nominate_writes_the_node_first_then_removes_the_gate() -> None:
    api = OnePod(gated_pod())
    after = run(pins.Nominate(), api, "gpu-3", never_stale)
    assert [kind for kind, _ in api.writes] == ["status", "pod"]
    (_, first), (_, second) = api.writes
    assert first == {
        "metadata": {"uid": "u1", "resourceVersion": "7"},
        "status": {"nominatedNodeName": "gpu-3"},
    }
    assert second["metadata"] == {"uid": "u1", "resourceVersion": "8"}
    assert second["spec"] == {"schedulingGates": None}
    assert after["status"]["nominatedNodeName"] == "gpu-3"
    assert not after["spec"].get("schedulingGates")


def test_without_a_node_only_the_gate_goes_and_other_gates_stay() -> None:
    for pin in (pins.Nominate(), pins.Narrow()):
        api = OnePod(gated_pod(("other.io/x", keys.PLACE_GATE)))
        after = run(pin, api, None, stale)  # no plan: nothing to go stale
        assert [kind for kind, _ in api.writes] == ["pod"]
        assert after["spec"]["schedulingGates"] == [{"name": "other.io/x"}]
        assert not (after.get("status") or {}).get("nominatedNodeName")


@pytest.mark.parametrize("pin", [pins.Nominate(), pins.Narrow()], ids=["nominate", "affinity"])
def test_a_stale_plan_writes_nothing(pin: pins.Pin) -> None:
    api = OnePod(gated_pod())
    with pytest.raises(pins.Stale):
        run(pin, api, "gpu-3", stale)
    assert api.writes == []


def test_narrow_is_one_write_that_pins_and_ungates() -> None:
    pod = gated_pod()
    term = {"matchExpressions": [{"key": keys.NODE_ENABLED, "operator": "In", "values": ["true"]}]}
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
        }
    }
    api = OnePod(pod)
    after = run(pins.Narrow(), api, "gpu-3", never_stale)
    ((kind, patch),) = api.writes
    assert kind == "pod" and patch["metadata"]["resourceVersion"] == "7"
    (term_after,) = after["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert term_after["matchExpressions"] == term["matchExpressions"]
    assert term_after["matchFields"] == [
        {"key": "metadata.name", "operator": "In", "values": ["gpu-3"]}
    ]
    assert not after["spec"].get("schedulingGates")


def test_a_pod_released_by_someone_else_is_left_alone() -> None:
    api = OnePod(gated_pod(()))  # no gate of ours any more (a user removed it)
    for pin in (pins.Nominate(), pins.Narrow()):
        run(pin, api, "gpu-3", never_stale)
    assert api.writes == []


def test_a_stale_resource_version_is_read_again() -> None:
    """The informer's resourceVersion lags the pod: the first write gets a 409, the pod is
    read again and the release goes on from it."""
    pod = gated_pod()
    api = OnePod(pod)
    seen = record(pod)
    api.pod["metadata"]["resourceVersion"] = "9"  # changed since the informer's copy
    writer = Writer(api, concurrency=4, attempts=3)
    asyncio.run(pins.Nominate().release(writer, seen, "gpu-1", never_stale))
    assert [kind for kind, _ in api.writes] == ["status", "pod"]
    assert api.writes[0][1]["metadata"]["resourceVersion"] == "9"
