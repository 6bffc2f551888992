"""`gpuplace explain` of a gang member (issue 45): for a gang that keeps to one rack,
which racks were tried and why none holds it; for a gang that restarts, what its new
members wait for. The real CLI against the local API server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpuplace import cli
from gpuplace.cluster import keys
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.gangs import explaining
from tests.extender.test_explain import place
from tests.gangs.rig import member, nodes, rig
from tests.gangs.test_evicting import SETTINGS, evicted
from tests.gangs.test_restarting import EXITED, started

RACK = "example.com/rack"


def explain(server: localapi.ThreadedServer, tmp_path: Path, *args: str) -> int:
    config = server.server.kubeconfig(tmp_path / "kubeconfig")
    return cli.main(["explain", *args, "--kubeconfig", str(config)])


def test_a_gang_kept_to_one_rack_says_which_racks_were_tried(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with localapi.serve_in_thread() as server:

        def build() -> None:
            api = server.api
            api.create(objects.node("a1", gpus=3, labels={RACK: "a"}))
            api.create(objects.node("b1", gpus=2, labels={RACK: "b"}))
            api.create(objects.node("b2", gpus=2, labels={RACK: "b"}))
            api.create(objects.node("x", gpus=8))
            place(api, "busy", "b1", (0,), 100)
            for i in range(4):
                api.create(
                    member(f"t{i}", "train", 4, count=1, annotations={keys.GANG_DOMAIN: RACK})
                )

        server.call(build)
        assert explain(server, tmp_path, "default/t0") == 0
        out = capsys.readouterr().out
        assert (
            f"Gang train keeps to one {RACK} (required): 2 domains tried, none holds all 4 "
            "members now:"
        ) in out
        assert f"  {RACK}=a (1 node): the gang can never fit" in out
        assert f"  {RACK}=b (2 nodes): 3 of 4 gang members fit now" in out

        server.call(lambda: server.api.delete("pods", "busy", "default"))
        assert explain(server, tmp_path, "default/t0") == 0
        out = capsys.readouterr().out
        assert (
            f"Gang train keeps to one {RACK} (required): its 4 waiting members fit now in "
            f"{RACK}=b (b1 ×2, b2 ×2)."
        ) in out


async def test_a_restarting_gangs_new_member_is_told_what_it_waits_for(
    server: localapi.Server,
) -> None:
    """The lines explain adds, on the state the controller decides on: a new member of a
    gang whose member failed waits for the old run's members still holding GPUs."""
    nodes(server.api, 1, gpus=4)
    async with rig(server, settings=SETTINGS) as r:
        await started(r, "t", 3)
        r.api.patch("pods", "t1", {"status": EXITED}, "default", subresource="status")
        await r.h.synced(lambda: evicted(r.api) == ["t0", "t2"])
        r.api.create(member("n0", "t", 3, count=1))
        await r.quiet()
        sync = r.h.sidecar.sync
        (record,) = [pod for pod in sync.pods.values() if pod.name == "n0"]
        said = explaining.lines(sync, record, r.controller.policy(), now=time.time())
        assert said == [
            "Gang t restarts (member default/t1 failed: its container main exited with code "
            "3): its new members start as one gang once the 2 members of its last run still "
            "holding GPUs (default/t0, default/t2) have stopped."
        ]
        (other,) = [pod for pod in sync.pods.values() if pod.name == "t0"]
        assert explaining.lines(sync, other, r.controller.policy(), now=time.time()) == []
