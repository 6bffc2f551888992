"""The sidecar wires the queue controller itself (`--queues`): its GpuQueue and namespace
informers (the directory the webhook reads), the index of queued pods (fed by its one pod
informer) and the controller, against the local API with the shipped RBAC."""

from __future__ import annotations

from gpuplace.cluster import keys
from gpuplace.cluster.gang_marks import gated
from gpuplace.dev import localapi
from tests.cluster.conftest import eventually
from tests.extender.conftest import harness
from tests.queues.rig import gpuqueue, namespace, nodes, queued


async def test_the_sidecar_runs_the_queue_controller_with_queues_on(
    server: localapi.Server,
) -> None:
    nodes(server.api, 1, gpus=4)
    namespace(server.api, "team-a", team="a")
    server.api.create(gpuqueue("team-a", "1"))
    async with harness(server, queues=True, queue_min_round_seconds=0.0, scheduler_lease="") as h:
        directory, queues = h.sidecar.directory, h.sidecar.queues
        assert directory is not None and queues is not None
        await eventually(lambda: h.sidecar.not_ready_reason() is None, 30.0)
        assert directory.synced()
        assert directory.resolve("team-a", None).queue == ""
        assert directory.resolve("team-a", "team-a").queue == "team-a"
        h.api.create(queued("a0", "team-a"))
        h.api.create(queued("a1", "team-a"))

        def one_admitted() -> bool:
            pods = [h.pod("team-a", name) for name in ("a0", "a1")]
            return sum(not gated(pod, keys.QUEUE_GATE) for pod in pods) == 1

        await eventually(one_admitted, 30.0)

        def shown() -> dict[str, object]:
            return dict(h.api.get("gpuplace.io/gpuqueues", "team-a").get("status") or {})

        await eventually(lambda: shown().get("waitingPods") == 1, 30.0)
        assert shown()["admittedWorkloads"] == 1


async def test_without_queues_the_sidecar_reads_no_gpuqueues(server: localapi.Server) -> None:
    nodes(server.api, 1, gpus=4)
    async with harness(server) as h:
        assert h.sidecar.directory is None and h.sidecar.queues is None
        assert h.api.calls_to("GET", r"/gpuqueues") == []
