"""MPS supervision against a stand-in control daemon (tests/agent/mps_standin.py, which
behaves as the real `nvidia-cuda-mps-control` of shared/fixtures/gpu/mps-control.*): each
GPU's daemon is started with its own pipe and log directories, is ready only once it
answers, comes back after it is killed, hangs or never starts, and quits on stop."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gpuplace.agent import mps

STANDIN = Path(__file__).with_name("mps_standin.py")
GPU0 = "GPU-2f5b3c4e-5f1a-9c2e-1d7b-4a8e6c0b9d11"
GPU1 = "GPU-7c1e0d2a-3b4f-4e5d-8a9b-0c1d2e3f4a5b"


@pytest.fixture
def root() -> Iterator[Path]:
    # Short on purpose: unix socket paths are limited (mps.MAX_PIPE_DIRECTORY).
    path = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config(root: Path, **env: str) -> mps.MpsConfig:
    return mps.MpsConfig(
        layout=mps.Layout(root),
        command=(sys.executable, str(STANDIN)),
        base_env={"PATH": "/usr/bin:/bin", **env},
        probe_interval_seconds=0.05,
        probe_timeout_seconds=1.0,
        probe_failures=2,
        start_timeout_seconds=3.0,
        backoff_initial_seconds=0.05,
        backoff_max_seconds=0.4,
        stable_seconds=30.0,
        stop_timeout_seconds=2.0,
    )


@pytest.fixture
async def supervisor(root: Path) -> AsyncIterator[mps.Supervisor]:
    made = mps.Supervisor(config(root), CollectorRegistry())
    yield made
    await made.stop()


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def metric(supervisor: mps.Supervisor, name: str, gpu: str) -> float:
    for family in supervisor.metrics.ready, supervisor.metrics.restarts:
        for collected in family.collect():
            for sample in collected.samples:
                if sample.name == name and sample.labels["gpu"] == gpu:
                    return float(sample.value)
    raise KeyError(name)


async def test_each_gpu_gets_its_own_daemon_pipe_and_log(
    supervisor: mps.Supervisor, root: Path
) -> None:
    await supervisor.set_gpus([GPU0, GPU1])
    assert await supervisor.wait_ready(10)
    assert supervisor.not_ready_reason() is None
    for gpu in (GPU0, GPU1):
        assert supervisor.ready(gpu)
        assert (root / gpu / "pipe" / "control").is_socket()
        lines = (root / gpu / "log" / "control.log").read_text()
        assert f"CUDA_VISIBLE_DEVICES={gpu}\n" in lines  # one GPU per daemon
        assert f"CUDA_MPS_PIPE_DIRECTORY={root / gpu / 'pipe'}" in lines
        assert "Cmd:get_server_list" in lines  # readiness is an answer, not a pid
        assert metric(supervisor, "gpuplace_mps_daemon_ready", gpu) == 1
    assert supervisor.layout.shm_directory.stat().st_mode & 0o7777 == 0o1777  # any user
    assert not supervisor.ready("GPU-unknown")


async def test_a_killed_daemon_comes_back(supervisor: mps.Supervisor) -> None:
    changes: list[bool] = []
    supervisor.subscribe(lambda: changes.append(supervisor.ready(GPU0)))
    await supervisor.set_gpus([GPU0])
    assert await supervisor.wait_ready(10)
    daemon = supervisor.daemons[GPU0]
    first = daemon.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    await until(lambda: daemon.pid != first and supervisor.ready(GPU0))
    assert daemon.restarts == 1
    assert metric(supervisor, "gpuplace_mps_daemon_restarts_total", GPU0) == 1
    assert changes == [True, False, True]  # the plugin hears of both changes


async def test_a_daemon_that_dies_on_command_comes_back(
    supervisor: mps.Supervisor, root: Path
) -> None:
    await supervisor.set_gpus([GPU0])
    assert await supervisor.wait_ready(10)
    await mps.send(supervisor.config, GPU0, "die")  # exits at once, without an answer
    await until(lambda: supervisor.daemons[GPU0].restarts == 1 and supervisor.ready(GPU0))


async def test_a_hung_daemon_is_killed_and_restarted(supervisor: mps.Supervisor) -> None:
    await supervisor.set_gpus([GPU0])
    assert await supervisor.wait_ready(10)
    daemon = supervisor.daemons[GPU0]
    first = daemon.pid
    hang = asyncio.create_task(mps.send(supervisor.config, GPU0, "hang"))
    await until(lambda: not supervisor.ready(GPU0))
    await until(lambda: supervisor.ready(GPU0) and daemon.pid != first)
    assert daemon.restarts == 1
    await hang


async def test_a_daemon_that_never_starts_backs_off(root: Path) -> None:
    supervisor = mps.Supervisor(config(root, STANDIN_EXIT_AT_START="1"), CollectorRegistry())
    await supervisor.set_gpus([GPU0])
    await asyncio.sleep(1.0)
    restarts = supervisor.daemons[GPU0].restarts
    # waits 0.05, 0.1, 0.2, 0.4, 0.4 ... : at most ~5 restarts in a second, never a spin
    assert 2 <= restarts <= 7
    assert not supervisor.ready(GPU0)
    assert supervisor.not_ready_reason() == f"MPS daemon not ready on {GPU0}"
    assert not await supervisor.wait_ready(0.1)
    await supervisor.stop()


async def test_a_slow_daemon_is_not_ready_until_it_answers(root: Path) -> None:
    supervisor = mps.Supervisor(config(root, STANDIN_START_DELAY="0.5"), CollectorRegistry())
    await supervisor.set_gpus([GPU0])
    await asyncio.sleep(0.2)
    assert not supervisor.ready(GPU0)  # the plugin must not hand out a share yet
    assert await supervisor.wait_ready(10)
    assert supervisor.daemons[GPU0].restarts == 0
    await supervisor.stop()


async def test_stale_pipe_directory_is_replaced(supervisor: mps.Supervisor, root: Path) -> None:
    pipe = supervisor.layout.pipe_directory(GPU0)
    pipe.mkdir(parents=True)
    (pipe / "control").write_text("left by a dead daemon")
    await supervisor.set_gpus([GPU0])
    assert await supervisor.wait_ready(10)
    assert (pipe / "control").is_socket()


async def test_stop_quits_the_daemon(supervisor: mps.Supervisor, root: Path) -> None:
    await supervisor.set_gpus([GPU0, GPU1])
    assert await supervisor.wait_ready(10)
    process = supervisor.daemons[GPU0].process
    assert process is not None
    await supervisor.set_gpus([GPU1])  # GPU0 holds no shares any more
    assert process.returncode == 0  # quit, not killed
    assert "Cmd:quit" in (root / GPU0 / "log" / "control.log").read_text()
    assert set(supervisor.daemons) == {GPU1} and not supervisor.ready(GPU0)
    assert supervisor.ready(GPU1)


async def test_the_real_daemon_refuses_a_second_instance(supervisor: mps.Supervisor) -> None:
    """Why the supervisor owns its pipe directories: the binary will not share one."""
    await supervisor.set_gpus([GPU0])
    assert await supervisor.wait_ready(10)
    made = supervisor.config
    second = await asyncio.create_subprocess_exec(
        *made.command, "-f", env=made.daemon_env(GPU0), stderr=asyncio.subprocess.PIPE
    )
    _, err = await second.communicate()
    assert second.returncode == 1 and b"already running" in err
    assert supervisor.ready(GPU0)


def test_layout_refuses_a_root_too_long_for_sockets() -> None:
    with pytest.raises(ValueError, match="too long"):
        mps.Layout(Path("/run/" + "x" * 60))
    assert mps.Layout().pipe_directory(GPU0) == Path(f"/run/gpuplace/mps/{GPU0}/pipe")


@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), min_size=1, max_size=30))
def test_backoff_doubles_to_its_bound_and_resets_after_a_stable_run(
    uptimes: list[float],
) -> None:
    made = replace(mps.MpsConfig(), backoff_initial_seconds=1.0, backoff_max_seconds=60.0)
    wait = 0.0
    for uptime in uptimes:
        before, wait = wait, mps.next_backoff(wait, uptime, made)
        assert made.backoff_initial_seconds <= wait <= made.backoff_max_seconds
        if uptime >= made.stable_seconds or before == 0:
            assert wait == made.backoff_initial_seconds
        else:
            assert wait == min(before * 2, made.backoff_max_seconds)


async def test_a_missing_binary_is_retried_and_never_ready(root: Path) -> None:
    made = replace(config(root), command=(str(root / "no-such-mps-control"),))
    supervisor = mps.Supervisor(made, CollectorRegistry())
    await supervisor.set_gpus([GPU0])
    await until(lambda: supervisor.daemons[GPU0].restarts >= 2)
    assert not supervisor.ready(GPU0)
    await supervisor.stop()


async def test_the_servers_the_daemons_answer_are_kept_and_end_with_them(root: Path) -> None:
    """get_server_list answers the servers' PIDs (mps-control.txt: `663`), one per line;
    the usage sampler excludes them, so a daemon that dies takes them out too."""
    supervisor = mps.Supervisor(config(root, STANDIN_SERVERS="663 664"), CollectorRegistry())
    try:
        assert supervisor.server_pids() == frozenset()
        await supervisor.set_gpus([GPU0])
        assert await supervisor.wait_ready(10)
        await until(lambda: supervisor.server_pids() == {663, 664})
        daemon = supervisor.daemons[GPU0]
    finally:
        await supervisor.stop()
    assert daemon.servers == frozenset()  # quit, its servers with it
    assert mps.server_pids("663\n") == {663} and mps.server_pids("") == frozenset()
    assert mps.server_pids("Cannot find MPS control daemon process\n") == frozenset()
