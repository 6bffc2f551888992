"""`gpuplace queues` and `gpuplace explain` on a queued pod, against the local API: what
they print is one round decided on the API's state as the controller decides it."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpuplace import cli
from gpuplace.cluster import assignments
from gpuplace.dev import localapi
from gpuplace.placement.ledger import Grant
from tests.queues.rig import gpuqueue, namespace, nodes, queued


def admitted(api: localapi.FakeApi, name: str, queue: str, gpu: int) -> None:
    """What the controller leaves on a pod it admitted on gpu-0: the assignment, no gate."""
    pod = queued(name, queue)
    pod["spec"]["schedulingGates"] = []
    made = api.create(pod)
    grant = Grant(made["metadata"]["uid"], "gpu-0", (gpu,), 1000, 0)
    notes = assignments.annotations_for(grant, None, datetime(2026, 1, 1, tzinfo=UTC))
    api.patch("pods", name, {"metadata": {"annotations": notes}}, made["metadata"]["namespace"])


def run(server: localapi.ThreadedServer, tmp_path: Path, *args: str) -> int:
    config = server.server.kubeconfig(tmp_path / "kubeconfig")
    return cli.main([*args, "--kubeconfig", str(config)])


def research(api: localapi.FakeApi, **team_a: str) -> None:
    """One 4-GPU node; team-a and team-b, 2 GPUs each, cohort research."""
    nodes(api, 1, gpus=4)
    namespace(api, "team-a", team="a")
    namespace(api, "team-b", team="b")
    api.create(gpuqueue("team-a", "2", cohort="research", **team_a))
    api.create(gpuqueue("team-b", "2", cohort="research"))


def test_queues_and_explain_show_use_borrowing_and_why_a_pod_waits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with localapi.serve_in_thread() as server:

        def build() -> None:
            api = server.api
            research(api, borrowing="1")
            for gpu in range(3):
                admitted(api, f"a{gpu}", "team-a", gpu)
            api.create(queued("a3", "team-a"))
            api.create(queued("a4", "team-a"))
            api.create(queued("b0", "team-b", count=2))

        server.call(build)
        assert run(server, tmp_path, "queues", "-o", "json") == 0
        shown = {row["name"]: row for row in json.loads(capsys.readouterr().out)["queues"]}
        a, b = shown["team-a"], shown["team-b"]
        assert a["lines"] == [
            {
                "resource": "gpus",
                "model": "*",
                "nominal": "2",
                "used": "3",
                "borrowed": "1",
                "lent": "0",
            }
        ]
        assert b["lines"][0]["lent"] == "1" and b["lines"][0]["used"] == "0"
        assert (a["admitted"], a["waiting"], a["waiting_pods"]) == (3, 2, 2)
        assert a["share"] > 0 and b["share"] == 0
        assert (b["waiting"], b["waiting_pods"]) == (1, 1)
        assert run(server, tmp_path, "queues") == 0
        table = capsys.readouterr().out
        assert table.splitlines()[0].split() == [
            "QUEUE",
            "COHORT",
            "WEIGHT",
            "RESOURCE",
            "MODEL",
            "NOMINAL",
            "USED",
            "BORROWED",
            "LENT",
            "ADMITTED",
            "WAITING",
            "SHARE",
        ]
        assert table.splitlines()[1].split()[:9] == [
            "team-a",
            "research",
            "1",
            "gpus",
            "*",
            "2",
            "3",
            "1",
            "0",
        ]
        # a4 is second in team-a's line, behind a3, and waits for quota
        assert run(server, tmp_path, "explain", "team-a/a4") == 0
        out = capsys.readouterr().out
        first = out.splitlines()[0]
        assert first.startswith("queue: waiting in GpuQueue team-a, position 2 ("), first
        assert "Pending behind the scheduling gate gpuplace.io/queue: its GpuQueue" in out
        assert run(server, tmp_path, "explain", "team-a/a4", "-o", "json") == 0
        wait = json.loads(capsys.readouterr().out)["queue"]
        assert (wait["queue"], wait["admitted"], wait["position"]) == ("team-a", False, 2)
        assert wait["why"] in ("quota", "cohort", "behind", "place") and wait["reason"]
        # b0 fits b's nominal, but a borrows one of b's GPUs: it waits on the cohort
        assert run(server, tmp_path, "explain", "team-b/b0") == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert first.startswith("queue: waiting in GpuQueue team-b, position 1 (cohort): "), first
        assert run(server, tmp_path, "explain", "team-a/a0") == 0
        assert capsys.readouterr().out.startswith("queue: admitted by GpuQueue team-a\n")


def test_queues_shows_the_past_share_the_statuses_remember(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with localapi.serve_in_thread() as server:

        def build() -> None:
            api = server.api
            research(api)
            remembered = {
                "weightedShare": 0,
                "pastShare": 340,
                "pastShareTime": "2026-11-27T10:00:00Z",
            }
            api.patch(
                "gpuplace.io/gpuqueues", "team-a", {"status": remembered}, subresource="status"
            )

        server.call(build)
        assert run(server, tmp_path, "queues") == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split()[-2:] == ["SHARE", "PAST"]
        assert lines[1].split()[0] == "team-a" and lines[1].split()[-1] == "0.340"
        assert lines[2].split()[0] == "team-b" and lines[2].split()[-1] == "0.000"
        assert run(server, tmp_path, "queues", "-o", "json") == 0
        shown = {row["name"]: row for row in json.loads(capsys.readouterr().out)["queues"]}
        assert shown["team-a"]["past"] == pytest.approx(0.34)
        assert shown["team-b"]["past"] is None
