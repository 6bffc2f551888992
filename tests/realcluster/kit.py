"""The real Kubernetes of `../shared/k8s` for the real-cluster tier: `cluster.sh up|down`,
kubectl, and waits that follow watches rather than sleep.

`Cluster.up(state_dir)` starts a control plane (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager v1.36.2 on 127.0.0.1, ports chosen free so that a cluster someone
started by hand is left alone) and then adds the one real kubelet node (containerd >= 1.7.2
with CDI, `up --cdi`, + runc) in a second `up`, so that a machine whose kubelet is taken
still runs the control-plane tests (`Cluster.node_problem` says why there is no node).
`down()` stops both by their recorded PIDs (`cluster.sh down`); the binaries are unpacked
by the kit's `unpack.sh` into its default cache directory, outside the repository.

`Kubectl` runs the kit's kubectl as a user would (`apply -f pod.yaml`, `create token`,
...) and `Kubectl.watch` follows `kubectl get --watch --output-watch-events -o json` until
a predicate over the objects seen holds: no fixed sleeps, and a failed wait says what it
saw last. Nothing here knows gpuplace.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT.parent / "shared" / "k8s"
"""The kit: cluster.sh, unpack.sh and the xz-compressed v1.36.2 binaries."""

T = TypeVar("T")
Objects = dict[str, dict[str, Any]]
"""What a watch has seen, by `namespace/name` (cluster-scoped: `/name`)."""

BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kubelet",
)


class ClusterError(RuntimeError):
    """`cluster.sh up` failed; the message holds the tail of its log."""


def kit_missing() -> str | None:
    """Why the kit cannot be used on this checkout, or None."""
    if not (KIT / "cluster.sh").is_file():
        return f"no Kubernetes kit at {KIT} (../shared/k8s beside the checkout)"
    sums = KIT / "bin" / "SHA256SUMS"
    if not sums.is_file():
        return f"{sums} missing"
    missing = [name for name in BINARIES if not (KIT / "bin" / f"{name}.xz").is_file()]
    if missing:
        return f"binaries missing from {KIT / 'bin'}: {', '.join(missing)}"
    return None


PORT_TRIES = 3
"""Control-plane starts tried with fresh ports when a component exits at start."""
APISERVER_FLAGS = ("--enable-aggregator-routing=true",)
"""Added to the kit's kube-apiserver: it then calls a webhook's Service at one of the
Service's ready endpoints (a pod's address on the node's bridge, reachable from the host)
instead of its ClusterIP, which no kube-proxy leads anywhere here (the kit's fact 9). Only
gpuplace's pods installed from the image (`tests/realcluster/pods.py`) are called through
a Service; every other webhook of the tier has a `url`."""


def control_plane_ports() -> dict[str, str]:
    """cluster.sh's port variables: four distinct ports free now, none of them etcd's
    peer port (the client port's successor)."""
    etcd = free_port(pair=True)
    taken = {etcd, etcd + 1}
    ports = {}
    for name in ("K8S_APISERVER_PORT", "K8S_SCHEDULER_PORT", "K8S_KCM_PORT"):
        port = free_port()
        while port in taken:
            port = free_port()
        taken.add(port)
        ports[name] = str(port)
    return {**ports, "K8S_ETCD_PORT": str(etcd)}


def free_port(host: str = "127.0.0.1", *, pair: bool = False) -> int:
    """A TCP port free on `host` now (and its successor with `pair`, as etcd's peer
    port needs); the caller binds it soon after."""
    while True:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        if not pair:
            return port
        with socket.socket() as probe:
            try:
                probe.bind((host, port + 1))
            except OSError:
                continue
        return port


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} unreadable)"


@dataclass
class Result:
    """One kubectl run."""

    args: tuple[str, ...]
    code: int
    out: str
    err: str

    def check(self) -> Result:
        if self.code != 0:
            raise AssertionError(
                f"kubectl {' '.join(self.args)} exited {self.code}: {self.err or self.out}"
            )
        return self


@dataclass
class Kubectl:
    """The kit's kubectl with one kubeconfig."""

    binary: Path
    kubeconfig: Path
    cwd: Path

    def as_user(self, kubeconfig: Path) -> Kubectl:
        """The same kubectl acting with another identity."""
        return Kubectl(self.binary, kubeconfig, self.cwd)

    def run(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 90,
        cwd: Path | None = None,
    ) -> Result:
        done = subprocess.run(
            [str(self.binary), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd or self.cwd,
            check=False,
        )
        result = Result(tuple(args), done.returncode, done.stdout, done.stderr.strip())
        return result.check() if check else result

    def json(self, *args: str) -> dict[str, Any]:
        """`kubectl ARGS -o json`, parsed."""
        found: dict[str, Any] = json.loads(self.run(*args, "-o", "json").out)
        return found

    def apply(self, *objects: Mapping[str, Any], check: bool = True) -> Result:
        """`kubectl apply -f -` of the objects (a List)."""
        body = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
        return self.run("apply", "-f", "-", input=json.dumps(body), check=check)

    def exists(self, *args: str) -> bool:
        return self.run("get", *args, "--ignore-not-found", "-o", "name").out.strip() != ""

    def watch(
        self,
        args: Sequence[str],
        until: Callable[[Objects], T | None],
        *,
        timeout: float = 60,
        what: str = "",
    ) -> T:
        """Follow `kubectl get ARGS --watch` until `until(objects seen)` is truthy, and
        return it. `args` name a resource and its selectors (`pods -n ns
        --field-selector metadata.name=x`); a deletion removes the object from the map.
        AssertionError after `timeout` seconds, with the last objects seen."""
        deadline = time.monotonic() + timeout
        seen: Objects = {}
        found = until(seen)
        while True:
            with self._watching(args) as process:
                assert process.stdout is not None
                found = self._follow(process, seen, until, deadline)
            if found is not None and found is not False:
                return found
            if time.monotonic() >= deadline:
                last = json.dumps(_brief(seen), indent=1)[:4000]
                raise AssertionError(
                    f"timed out after {timeout:g}s waiting for {what or ' '.join(args)}; "
                    f"last seen: {last}"
                )

    def wait_object(
        self,
        resource: str,
        name: str,
        until: Callable[[dict[str, Any] | None], bool],
        *,
        namespace: str | None = None,
        timeout: float = 60,
        what: str = "",
    ) -> dict[str, Any] | None:
        """Watch one object until `until(object or None when absent)`; return it."""
        args = [resource, "--field-selector", f"metadata.name={name}"]
        if namespace is not None:
            args += ["-n", namespace]
        key = f"{namespace or ''}/{name}"
        box: list[dict[str, Any] | None] = []

        def check(seen: Objects) -> bool:
            obj = seen.get(key)
            if until(obj):
                box.append(obj)
                return True
            return False

        self.watch(args, check, timeout=timeout, what=what or f"{resource} {key}")
        return box[0]

    def wait_event(
        self,
        namespace: str,
        involved: str,
        reason: str,
        *,
        timeout: float = 60,
        contains: str = "",
    ) -> str:
        """Watch the Events of object `involved` until one with `reason` (and `contains`
        in its message) exists; return its message."""
        return self.watch(
            [
                "events",
                "-n",
                namespace,
                "--field-selector",
                f"involvedObject.name={involved},reason={reason}",
            ],
            lambda seen: next(
                (
                    str(event.get("message") or "")
                    for event in seen.values()
                    if contains in str(event.get("message") or "")
                ),
                None,
            ),
            timeout=timeout,
            what=f"an Event {reason} on {namespace}/{involved}",
        )

    @contextlib.contextmanager
    def _watching(self, args: Sequence[str]) -> Any:
        command = [str(self.binary), "--kubeconfig", str(self.kubeconfig), "get", *args]
        command += ["--watch", "--output-watch-events", "-o", "json"]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=self.cwd
        )
        try:
            yield process
        finally:
            process.kill()
            process.wait()

    @staticmethod
    def _follow(
        process: subprocess.Popen[bytes],
        seen: Objects,
        until: Callable[[Objects], T | None],
        deadline: float,
    ) -> T | None:
        assert process.stdout is not None
        decoder = json.JSONDecoder()
        buffer = ""
        fd = process.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                if not selector.select(timeout=left):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None  # the watch ended: the caller starts another
                buffer += chunk.decode(errors="replace")
                while buffer.strip():
                    buffer = buffer.lstrip()
                    try:
                        event, end = decoder.raw_decode(buffer)
                    except json.JSONDecodeError:
                        break
                    buffer = buffer[end:]
                    obj = event.get("object") or {}
                    meta = obj.get("metadata") or {}
                    key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
                    if event.get("type") == "DELETED":
                        seen.pop(key, None)
                    else:
                        seen[key] = obj
                    found = until(seen)
                    if found is not None and found is not False:
                        return found
        return None


def _brief(seen: Objects) -> dict[str, Any]:
    """What a failed wait prints: each object's metadata names, spec.nodeName, status."""
    return {
        key: {
            "annotations": (obj.get("metadata") or {}).get("annotations"),
            "nodeName": (obj.get("spec") or {}).get("nodeName"),
            "status": obj.get("status"),
            "message": obj.get("message"),
        }
        for key, obj in seen.items()
    }


@dataclass
class Cluster:
    """One cluster of the kit, started by `up` and stopped by `down`."""

    state: Path
    env: dict[str, str] = field(default_factory=dict)
    """cluster.sh's KEY=VALUE lines (KUBECONFIG, K8S_BIN_DIR, K8S_NODE_NAME, ...)."""
    run_env: dict[str, str] = field(default_factory=dict)
    node_problem: str | None = "not started"
    """Why there is no kubelet node (None: there is one)."""
    cdi_problem: str | None = "not started"
    """Why the kubelet node's containerd passes no CDI devices on (None: it does, `up
    --cdi`); the DRA tests need it, the device-plugin tests run either way."""
    kubelet: subprocess.Popen[bytes] | None = None
    """A kubelet `restart_kubelet` started (reaped at `down`)."""

    @classmethod
    def up(cls, state: Path, *, node: bool = True, wait_seconds: int = 300) -> Cluster:
        """Control plane, then (with `node`) the kubelet node (`add_node`). ClusterError
        when the control plane fails; a failed node leaves `node_problem` set instead."""
        state.mkdir(parents=True, exist_ok=True)
        cluster = cls(state)
        for attempt in range(1, PORT_TRIES + 1):
            cluster.run_env = {
                **os.environ,
                "K8S_STATE_DIR": str(state),
                "K8S_WAIT_SECONDS": str(wait_seconds),
                **control_plane_ports(),
                "NODES": "none",
                "APISERVER_EXTRA_ARGS": " ".join(
                    [os.environ.get("APISERVER_EXTRA_ARGS", ""), *APISERVER_FLAGS]
                ).strip(),
            }
            try:
                cluster.env = cluster._up("control-plane")
                break
            except ClusterError as error:
                # a port found free may be taken before the component binds it (any
                # process's outgoing connection may get it): it then exits at once
                if attempt == PORT_TRIES or "exited while waiting" not in str(error):
                    raise
        if node:
            cluster.add_node()
        return cluster

    def add_node(self) -> None:
        """The kubelet node, added to the running control plane by a second `up` (the
        machine's one kubelet: a kubelet already running elsewhere makes it fail), with
        CDI on (`--cdi`: containerd >= 1.7.2, fetched once by the kit: its README, fact
        14), so that the DRA tests and the device-plugin tests share the one node. Where
        `--cdi` fails (no containerd >= 1.7.2 to be had), the node is started without CDI
        and `cdi_problem` says why. A failure leaves `node_problem` set and the control
        plane running."""
        self._add_node(cdi=True)
        if self.node_problem is not None:
            self.cdi_problem = self.node_problem
            self._add_node(cdi=False)
        else:
            self.cdi_problem = None if self.env.get("K8S_CDI") == "1" else "no K8S_CDI=1 from up"

    def _add_node(self, *, cdi: bool) -> None:
        node_env = {
            "NODES": "kubelet",
            "K8S_CDI": "1" if cdi else "0",
            "K8S_KUBELET_PORT": str(free_port("0.0.0.0")),
            "K8S_KUBELET_HEALTHZ_PORT": str(free_port()),
            # a failed `up` would stop all it started, the control plane too once it got
            # as far as starting containerd, and with it what is installed there already;
            # kept, what the node stage started is stopped by `down` (by recorded PID)
            "K8S_KEEP_ON_FAILURE": "1",
        }
        self.run_env.update(node_env)
        try:
            self.env = self._up("node-cdi" if cdi else "node")
            self.node_problem = None
        except ClusterError as error:
            self.node_problem = str(error)
        finally:
            self.run_env["NODES"] = "kubelet" if self.node_problem is None else "none"
            self.run_env["K8S_CDI"] = "1" if cdi and self.node_problem is None else "0"
            self.run_env.pop("K8S_KEEP_ON_FAILURE")

    def _up(self, stage: str) -> dict[str, str]:
        log = self.state.parent / f"{self.state.name}-up-{stage}.log"
        with log.open("w") as err:
            done = subprocess.run(
                [str(KIT / "cluster.sh"), "up"],
                env=self.run_env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=900,
                check=False,
            )
        if done.returncode != 0:
            raise ClusterError(f"cluster.sh up ({stage}) exited {done.returncode}:\n{tail(log)}")
        return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)

    def down(self) -> None:
        """`cluster.sh down`: everything `up` started, by its recorded PID."""
        with (self.state.parent / f"{self.state.name}-down.log").open("w") as err:
            subprocess.run(
                [str(KIT / "cluster.sh"), "down"],
                env=self.run_env,
                stdout=subprocess.DEVNULL,
                stderr=err,
                timeout=300,
                check=False,
            )
        if self.kubelet is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.kubelet.wait(timeout=30)

    @property
    def etcd_url(self) -> str:
        """etcd's client URL (plain HTTP on 127.0.0.1, as cluster.sh starts it)."""
        return f"http://127.0.0.1:{self.run_env['K8S_ETCD_PORT']}"

    def compact(self) -> int:
        """An etcd compaction at the current revision (what kube-apiserver's compactor
        does every 5 minutes to the revision it saw 5 minutes before), through etcd's
        JSON gateway (`/v3/kv/range` for the revision, `/v3/kv/compaction`): a watch or a
        list `continue` from an older resourceVersion that etcd serves (not the watch
        cache: events, whose cache kube-apiserver turns off) then gets 410 Expired.
        Returns the revision."""

        def post(path: str, body: Mapping[str, Any]) -> dict[str, Any]:
            request = urllib.request.Request(
                self.etcd_url + path,
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as answer:
                found: dict[str, Any] = json.loads(answer.read())
                return found

        revision = int(post("/v3/kv/range", {"key": "Lw=="})["header"]["revision"])  # "/"
        post("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    @property
    def kubeconfig(self) -> Path:
        return Path(self.env["KUBECONFIG"])

    @property
    def bin_dir(self) -> Path:
        return Path(self.env["K8S_BIN_DIR"])

    @property
    def server(self) -> str:
        return self.env["K8S_APISERVER"]

    @property
    def ca_file(self) -> Path:
        return self.state / "pki" / "ca.crt"

    @property
    def node_name(self) -> str:
        return self.env["K8S_NODE_NAME"]

    @property
    def bridge(self) -> str:
        """The node's pod bridge (cluster.sh's K8S_BRIDGE)."""
        return self.run_env.get("K8S_BRIDGE", "gpk8s0")

    def ctr(self, *args: str, timeout: float = 300) -> str:
        """`ctr` on the node's containerd, in the kubelet's namespace (k8s.io); its stdout."""
        done = subprocess.run(
            [
                "ctr",
                "--address",
                self.env["CONTAINERD_ADDRESS"],
                "--namespace",
                self.env.get("CONTAINERD_NAMESPACE", "k8s.io"),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)} exited {done.returncode}: {done.stderr}")
        return done.stdout

    def kubectl(self, cwd: Path) -> Kubectl:
        return Kubectl(self.bin_dir / "kubectl", self.kubeconfig, cwd)

    def kubeconfig_for(self, path: Path, user: str, token: str) -> Path:
        """A kubeconfig for this cluster that authenticates with a bearer token."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "local",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
            "current-context": "local",
        }
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    def patch_as(self, kubeconfig: Path, path: str, body: Mapping[str, Any]) -> tuple[int, str]:
        """A merge PATCH of API `path` with the bearer token of `kubeconfig` and nothing
        else (kubectl patch reads the object first, which a patch-only role may not):
        (HTTP status, body)."""
        status, _, text = self.request_as(kubeconfig, "PATCH", path, body)
        return status, text

    def request_as(
        self,
        kubeconfig: Path,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        content_type: str = "application/merge-patch+json",
    ) -> tuple[int, Mapping[str, str], str]:
        """One request of API `path` with the bearer token of `kubeconfig`: (HTTP status,
        response headers, body). A body is sent as `content_type` (default a merge patch)."""
        config = json.loads(kubeconfig.read_text())
        token = config["users"][0]["user"]["token"]
        headers = {"Authorization": f"Bearer {token}"}
        if body is not None:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(
            self.server + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers=headers,
        )
        context = ssl.create_default_context(cafile=str(self.ca_file))
        try:
            with urllib.request.urlopen(request, timeout=30, context=context) as answer:
                return answer.status, dict(answer.headers), answer.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read().decode()

    def restart_kubelet(self) -> int:
        """Stop the node's kubelet (SIGTERM, by its recorded PID) and start it again with
        the same command line, as a node's service manager would; cluster.sh's record is
        updated so that `down` stops the new one. Returns its PID."""
        pid_file = self.state / "pids" / "kubelet.pid"
        pid = int(pid_file.read_text())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        os.kill(pid, signal.SIGTERM)
        if self.kubelet is not None and self.kubelet.pid == pid:
            self.kubelet.wait(timeout=60)  # started by an earlier restart: our child
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        with (self.state / "logs" / "kubelet.log").open("ab") as log:
            self.kubelet = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        pid_file.write_text(f"{self.kubelet.pid}\n")
        return self.kubelet.pid
