"""MPS, run and supervised: one `nvidia-cuda-mps-control` daemon per GPU that may hold
shares, started by the agent, watched, restarted with backoff when it dies or stops
answering, and reported (metrics, readiness) so that the device plugin hands out a share of
a GPU only while that GPU's daemon answers (a client that starts without one runs with no
limits at all: `shared/fixtures/gpu/README.md`).

Why one daemon per GPU rather than one for the node:
- MPS runs one server per user ID at a time *per control daemon*: with one daemon for the
  node, a pod running as UID 1000 on GPU 3 would wait for every UID-0 client on GPU 0 to
  exit. Per GPU, the wait is confined to pods that share that GPU.
- A fatal fault in one client can take down the server and with it the other clients of
  that server; a server per GPU keeps that blast radius to one GPU.
- A restart (crash, hang, upgrade) of one daemon touches one GPU's shares only.

Layout on the host (the same path inside the agent's container, a hostPath): under the root
(default `/run/gpuplace/mps`), `<GPU UUID>/pipe` (CUDA_MPS_PIPE_DIRECTORY, the directory a
share's container gets mounted) and `<GPU UUID>/log` (CUDA_MPS_LOG_DIRECTORY), and `shm`,
which the agent's container and every share's container mount at `/dev/shm` (the server
and its clients exchange memory handles there). `Layout` is the contract with the device
plugin.

The daemon runs in the foreground (`-f`) as the agent's child: its death is seen at once
(no PID file to poll, no orphan after an agent restart). Readiness is the control daemon
answering `get_server_list` through its pipe, the way the real client does (the server PIDs
it answers are kept: `Supervisor.server_pids`, which the usage sampler never charges to a
pod, an idle server included); a daemon whose
process lives but that fails `probe_failures` probes in a row is killed and restarted.

Never: decides who gets a share (the plugin does, from the pod's grant); runs a daemon for
a whole-GPU grant (a whole GPU never goes through MPS: its container gets no pipe
directory); reads `os.environ` (the composition root passes the base environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
PROBE_COMMAND = "get_server_list"
QUIT_COMMAND = "quit"
MAX_PIPE_DIRECTORY = 80
"""The daemon and its servers create unix sockets in the pipe directory; a socket path is
at most 107 bytes, and the longest name MPS adds is under 27."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each GPU's daemon keeps its pipe and log directories, and the shared /dev/shm."""

    root: Path = Path("/run/gpuplace/mps")

    def __post_init__(self) -> None:
        longest = self.pipe_directory("GPU-" + "0" * 8 + "-0000-0000-0000-" + "0" * 12)
        if len(str(longest)) > MAX_PIPE_DIRECTORY:
            raise ValueError(
                f"MPS root {self.root} is too long: pipe directories would exceed "
                f"{MAX_PIPE_DIRECTORY} characters (unix socket paths are limited)"
            )

    def pipe_directory(self, uuid: str) -> Path:
        return self.root / uuid / "pipe"

    def log_directory(self, uuid: str) -> Path:
        return self.root / uuid / "log"

    @property
    def shm_directory(self) -> Path:
        return self.root / "shm"


@dataclass(frozen=True, slots=True)
class MpsConfig:
    """How the daemons are run and watched (built by the composition root from settings)."""

    layout: Layout = field(default_factory=Layout)
    command: tuple[str, ...] = ("nvidia-cuda-mps-control",)
    """The control binary; `command + ("-f",)` runs the daemon, `command` alone is the
    client that sends it commands on stdin."""
    base_env: Mapping[str, str] = field(default_factory=dict)
    """The environment the daemon and its client start with (PATH, LD_LIBRARY_PATH)."""
    probe_interval_seconds: float = 5.0
    probe_timeout_seconds: float = 5.0
    probe_failures: int = 3
    """Failed probes in a row after which a live but silent daemon is killed."""
    start_timeout_seconds: float = 30.0
    """A started daemon that has not answered within this time is killed and restarted."""
    backoff_initial_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    stable_seconds: float = 60.0
    """A daemon that ran this long before dying restarts after the initial backoff again."""
    stop_timeout_seconds: float = 10.0

    def daemon_env(self, uuid: str) -> dict[str, str]:
        return {
            **self.base_env,
            VISIBLE_ENV: uuid,
            PIPE_ENV: str(self.layout.pipe_directory(uuid)),
            LOG_ENV: str(self.layout.log_directory(uuid)),
        }


def next_backoff(previous: float, uptime: float, config: MpsConfig) -> float:
    """The wait before the next start: doubles after each quick death, up to the maximum;
    back to the initial value after a daemon that ran `stable_seconds`. O(1)."""
    if uptime >= config.stable_seconds or previous <= 0:
        return config.backoff_initial_seconds
    return min(previous * 2, config.backoff_max_seconds)


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DOWN = "down"
    STOPPED = "stopped"


class MpsMetrics:
    """The daemons' state, by GPU UUID (a bounded label: the node's GPUs)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ready = Gauge(
            "gpuplace_mps_daemon_ready",
            "1 while the GPU's MPS control daemon answers, else 0",
            ["gpu"],
            registry=registry,
        )
        self.restarts = Counter(
            "gpuplace_mps_daemon_restarts",
            "MPS control daemon restarts after it died or stopped answering",
            ["gpu"],
            registry=registry,
        )
        self.probe_failures = Counter(
            "gpuplace_mps_probe_failures",
            "get_server_list probes the daemon did not answer",
            ["gpu"],
            registry=registry,
        )


async def send(config: MpsConfig, uuid: str, command: str) -> str | None:
    """`command` sent to the GPU's daemon through its client; its answer, or None when the
    daemon cannot be reached (client exit status not 0, or no answer in time)."""
    process = await asyncio.create_subprocess_exec(
        *config.command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=config.daemon_env(uuid),
    )
    try:
        out, _ = await asyncio.wait_for(
            process.communicate(command.encode() + b"\n"), config.probe_timeout_seconds
        )
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        return None
    if process.returncode != 0:
        return None
    return out.decode(errors="replace")


def server_pids(answer: str) -> frozenset[int]:
    """The PIDs in a `get_server_list` answer (one per line: `663\\n`)."""
    return frozenset(int(word) for word in answer.split() if word.isdecimal())


class Daemon:
    """The control daemon of one GPU: started, probed, restarted until `stop()`."""

    def __init__(
        self,
        uuid: str,
        config: MpsConfig,
        metrics: MpsMetrics,
        changed: Callable[[], None],
    ) -> None:
        self.uuid = uuid
        self.config = config
        self.metrics = metrics
        self.changed = changed
        self.state = State.STOPPED
        self.restarts = 0
        self.process: asyncio.subprocess.Process | None = None
        self.servers: frozenset[int] = frozenset()
        """The MPS servers' PIDs in the daemon's last `get_server_list` answer."""
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        metrics.ready.labels(uuid).set(0)
        metrics.restarts.labels(uuid)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"mps {self.uuid}")

    async def stop(self) -> None:
        """Quit the daemon (its servers and their clients end with it) and stop watching."""
        self._stopping.set()
        if self._task is not None:
            await self._task
        self._set(State.STOPPED)

    def _set(self, state: State) -> None:
        if state is self.state:
            return
        was_ready = self.state is State.READY
        self.state = state
        self.metrics.ready.labels(self.uuid).set(1 if state is State.READY else 0)
        log.info("mps daemon state", extra={"gpu": self.uuid, "state": state.value})
        if was_ready != (state is State.READY):
            self.changed()

    def _prepare(self) -> None:
        """Fresh pipe directory (a dead daemon's sockets would refuse the new one), kept
        log directory."""
        layout = self.config.layout
        pipe = layout.pipe_directory(self.uuid)
        if pipe.exists():
            shutil.rmtree(pipe)
        pipe.mkdir(parents=True, mode=0o755)
        layout.log_directory(self.uuid).mkdir(parents=True, exist_ok=True, mode=0o755)
        layout.shm_directory.mkdir(parents=True, exist_ok=True)
        # Clients of any user create their shared memory here (sticky, like /dev/shm); the
        # umask, or the kubelet creating the hostPath, leaves it narrower.
        layout.shm_directory.chmod(0o1777)

    async def _supervise(self) -> None:
        backoff = 0.0
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                await self._run_once()
            except OSError as error:
                log.error("mps daemon cannot start", extra={"gpu": self.uuid, "error": str(error)})
            if self._stopping.is_set():
                break
            self._set(State.DOWN)
            self.restarts += 1
            self.metrics.restarts.labels(self.uuid).inc()
            backoff = next_backoff(backoff, time.monotonic() - started, self.config)
            log.warning(
                "mps daemon down, restarting",
                extra={"gpu": self.uuid, "restarts": self.restarts, "backoff_seconds": backoff},
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)

    async def _run_once(self) -> None:
        """One life of the daemon: start, wait until it answers, probe until it dies, stops
        answering, or `stop()` is called."""
        self._set(State.STARTING)
        self._prepare()
        self.process = process = await asyncio.create_subprocess_exec(
            *self.config.command,
            "-f",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.config.daemon_env(self.uuid),
            start_new_session=True,  # a ^C to the agent is not the daemon's
        )
        log.info("mps daemon started", extra={"gpu": self.uuid, "pid": process.pid})
        relay = asyncio.create_task(self._relay(process))
        exited = asyncio.create_task(process.wait())
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            deadline = time.monotonic() + self.config.start_timeout_seconds
            failures = 0
            while True:
                interval = (
                    self.config.probe_interval_seconds
                    if self.state is State.READY
                    else min(0.1, self.config.probe_interval_seconds)
                )
                done, _ = await asyncio.wait(
                    {exited, stopping}, timeout=interval, return_when=asyncio.FIRST_COMPLETED
                )
                if stopping in done:
                    await self._quit(process)
                    return
                if exited in done:
                    log.warning(
                        "mps daemon exited",
                        extra={"gpu": self.uuid, "returncode": process.returncode},
                    )
                    return
                answer = await send(self.config, self.uuid, PROBE_COMMAND)
                if answer is not None:
                    self.servers = server_pids(answer)
                    failures = 0
                    self._set(State.READY)
                    continue
                self.metrics.probe_failures.labels(self.uuid).inc()
                if self.state is State.READY:
                    failures += 1
                    if failures < self.config.probe_failures:
                        continue
                    log.warning("mps daemon stopped answering", extra={"gpu": self.uuid})
                elif time.monotonic() < deadline:
                    continue
                else:
                    log.warning("mps daemon never answered", extra={"gpu": self.uuid})
                self._set(State.DOWN)
                await self._kill(process)
                return
        finally:
            for task in (exited, stopping):
                task.cancel()
            await self._kill(process)  # its servers with it
            self.servers = frozenset()
            await relay

    async def _relay(self, process: asyncio.subprocess.Process) -> None:
        """The daemon's own output, at DEBUG (it logs every command, probes included)."""
        assert process.stdout is not None
        async for line in process.stdout:
            log.debug("mps daemon says", extra={"gpu": self.uuid, "line": line.decode().rstrip()})

    async def _quit(self, process: asyncio.subprocess.Process) -> None:
        await send(self.config, self.uuid, QUIT_COMMAND)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), self.config.stop_timeout_seconds)

    async def _kill(self, process: asyncio.subprocess.Process) -> None:
        """SIGTERM, then SIGKILL; the session too (the servers the daemon started)."""
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), self.config.stop_timeout_seconds)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


class Supervisor:
    """The daemons of the node's share-holding GPUs, by UUID."""

    def __init__(self, config: MpsConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.metrics = MpsMetrics(registry)
        self.daemons: dict[str, Daemon] = {}
        self._listeners: list[Callable[[], None]] = []
        self._changed = asyncio.Event()

    @property
    def layout(self) -> Layout:
        return self.config.layout

    def subscribe(self, listener: Callable[[], None]) -> None:
        """`listener()` runs whenever a GPU's daemon becomes ready or stops being ready
        (the device plugin re-sends its device list then)."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        self._changed.set()
        for listener in self._listeners:
            listener()

    def ready(self, uuid: str) -> bool:
        """Whether a share of `uuid` may be handed out now: its daemon answers."""
        daemon = self.daemons.get(uuid)
        return daemon is not None and daemon.state is State.READY

    def not_ready_reason(self) -> str | None:
        """For /readyz: the GPUs whose daemon does not answer, or None."""
        waiting = sorted(u for u, d in self.daemons.items() if d.state is not State.READY)
        return f"MPS daemon not ready on {', '.join(waiting)}" if waiting else None

    def server_pids(self) -> frozenset[int]:
        """Every daemon's MPS servers (the usage sampler never charges them to a pod).
        Safe from another thread: the daemons are copied in one step."""
        return frozenset().union(*(daemon.servers for daemon in tuple(self.daemons.values())))

    async def set_gpus(self, uuids: Iterable[str]) -> None:
        """Run a daemon for exactly these GPUs: start the new ones, quit the others."""
        wanted = set(uuids)
        # Concurrently: on SIGTERM every daemon quits within one stop timeout, not eight.
        leaving = [self.daemons.pop(uuid) for uuid in sorted(set(self.daemons) - wanted)]
        await asyncio.gather(*(daemon.stop() for daemon in leaving))
        for uuid in sorted(wanted - set(self.daemons)):
            daemon = Daemon(uuid, self.config, self.metrics, self._notify)
            self.daemons[uuid] = daemon
            daemon.start()

    async def wait_ready(self, timeout: float) -> bool:
        """Wait until every daemon answers, at most `timeout` seconds; whether they do."""
        deadline = time.monotonic() + timeout
        while True:
            self._changed.clear()  # before looking: a change after the look wakes the wait
            if self.not_ready_reason() is None:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def stop(self) -> None:
        await self.set_gpus(())

    @contextlib.asynccontextmanager
    async def running(self, uuids: Iterable[str]) -> AsyncIterator[Supervisor]:
        """The daemons of `uuids` for the life of the context; quit on exit."""
        await self.set_gpus(uuids)
        try:
            yield self
        finally:
            await self.stop()
