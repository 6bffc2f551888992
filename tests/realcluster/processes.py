"""Host processes of the real-cluster tier: `gpuplace serve`, the second kube-scheduler
and `gpuplace node-agent`, each with the command line its shipped manifest gives it.

The image cannot run here (no registry), so the containers of the shipped Deployment and
DaemonSet run as processes of this machine instead: the arguments are read from the
rendered manifests (`kubectl kustomize`), and only what a host process must change is
changed: ports (chosen free), file paths (TLS pair, MPS root) and the credentials, which
are a kubeconfig holding the token of the container's own ServiceAccount instead of the
mounted one. `HostProcess` starts one in its own session, logs to a file, and stops it by
its PID (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.realcluster.kit import tail


@dataclass
class HostProcess:
    """One long-running process of the tier."""

    name: str
    argv: Sequence[str]
    log: Path
    env: Mapping[str, str] | None = None
    ready_url: str | None = None
    """An HTTP URL that answers 200 once the process is ready."""
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, *, ready_timeout: float = 120) -> None:
        if self.alive:
            return
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(self.env) if self.env is not None else None,
                start_new_session=True,
            )
        if self.ready_url is not None:
            self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float) -> None:
        assert self.ready_url is not None
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive:
                raise AssertionError(f"{self.name} exited at start:\n{tail(self.log)}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.ready_url, timeout=2) as answer,
            ):
                if answer.status == 200:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not ready after {timeout:g}s:\n{tail(self.log)}")
            time.sleep(0.2)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds; by PID, this process only."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def with_flags(args: Sequence[str], overrides: Mapping[str, str | None]) -> list[str]:
    """`args` (`--flag=value` items) with each flag of `overrides` set to its value, or
    dropped when the value is None; flags not in `args` are appended."""
    result: list[str] = []
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in overrides:
            continue
        result.append(arg)
    result += [f"{name}={value}" for name, value in overrides.items() if value is not None]
    return result


def container(
    objects: Sequence[Mapping[str, Any]], kind: str, name: str, box: str
) -> dict[str, Any]:
    """Container `box` of the rendered object `kind`/`name`."""
    for obj in objects:
        if obj.get("kind") == kind and obj.get("metadata", {}).get("name") == name:
            for item in obj["spec"]["template"]["spec"]["containers"]:
                if item["name"] == box:
                    return dict(item)
    raise AssertionError(f"no container {box} in {kind}/{name} of the rendered overlay")
