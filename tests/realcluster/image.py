"""The image on the kit's node (docs/realcluster.md, "From the image"): gpuplace's image built
from the shipped Dockerfile by `deploy/image/build.py` (the script a user runs too), the
kube-scheduler image made from the kit's own binary, both imported into the node's
containerd with `ctr`; and `kubernetes_service`, the one route this cluster lacks that a
pod needs: from the pod network to the API server.

Skips: where the build cannot run here (not root, buildah, runc or mmdebstrap missing) the
tests that need the image skip with the reason, and FAIL under `CI=true` (`./dev test`
installs the three as root). A build that runs and fails is a failure everywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.realcluster.kit import KIT, ROOT, Cluster, Kubectl, tail
from tests.realcluster.sessions import unusable

BUILD = ROOT / "deploy" / "image" / "build.py"
MKIMAGE = KIT / "reference" / "mkimage.py"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuplace-image"
"""The build script's default cache (base image, wheels, buildah's store); the kube-scheduler
image tarball is kept here too."""
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
NAME = "localhost/gpuplace"
TAG = f"{NAME}:{VERSION}"
UPGRADE_TAG = f"{NAME}:{VERSION}-next"
"""The same image under a second tag: what `kubectl apply` of an upgrade points at."""
TOOLS = {"buildah": "buildah", "runc": "runc", "mmdebstrap": "mmdebstrap"}
"""Command -> Debian package, for the build."""
BUILD_TIMEOUT = 900
OFFLINE = re.compile(
    r"(Temporary failure resolving|Could not resolve|Could not connect|Network is unreachable|"
    r"Temporary failure in name resolution|Failed to establish a new connection|"
    r"No route to host|Could not fetch URL)"
)
"""What apt, mmdebstrap and pip print when the network is not there (the build then
cannot run here, as tests/deploy/test_image.py skips offline)."""


@dataclass(frozen=True)
class Built:
    """gpuplace's image as build.py made it: its report and a docker-archive of it."""

    tag: str
    archive: Path
    report: dict[str, Any]
    log: Path


def build_problem() -> str | None:
    """Why the image cannot be built on this machine, or None."""
    if os.geteuid() != 0:
        return "building the image needs root (buildah's storage, mmdebstrap's chroot)"
    missing = [package for command, package in TOOLS.items() if shutil.which(command) is None]
    if missing:
        names = ", ".join(missing)
        return f"not installed: {names} (apt-get install them; ./dev test does, as root)"
    return None


def build(workdir: Path) -> Built:
    """`deploy/image/build.py --tag TAG --archive ...`; its JSON report (stdout)."""
    problem = build_problem()
    if problem is not None:
        unusable(problem)
    archive, log = workdir / "gpuplace.tar", workdir / "build.log"
    with log.open("w") as err:
        done = subprocess.run(
            [sys.executable, str(BUILD), "--tag", TAG, "--archive", str(archive)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=BUILD_TIMEOUT,
            check=False,
        )
    report: dict[str, Any] = json.loads(done.stdout) if done.stdout.strip() else {}
    if done.returncode != 0 and not report and OFFLINE.search(log.read_text(errors="replace")):
        unusable(f"the image build could not reach the Debian mirror or the package index:\n"
                 f"{tail(log, 10)}")  # fmt: skip
    assert done.returncode == 0, f"build.py exited {done.returncode}:\n{tail(log, 40)}"
    return Built(TAG, archive, report, log)


def scheduler_image(cluster: Cluster) -> tuple[str, Path]:
    """registry.k8s.io/kube-scheduler:VERSION made from the kit's binary (a single layer,
    the kit's reference/mkimage.py), cached by the binary's digest: (name, tarball). The
    name is the shipped Deployment's own, so `imagePullPolicy: IfNotPresent` finds it."""
    binary = cluster.bin_dir / "kube-scheduler"
    version = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()[-1]
    name = f"registry.k8s.io/kube-scheduler:{version}"
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()[:12]
    tarball = CACHE / f"kube-scheduler-{version}-{digest}.tar"
    if not tarball.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = tarball.with_suffix(".partial")
        subprocess.run(
            [
                sys.executable,
                str(MKIMAGE),
                str(partial),
                name,
                json.dumps(["/usr/local/bin/kube-scheduler"]),
                f"{binary}:/usr/local/bin/kube-scheduler",
            ],
            capture_output=True,
            check=True,
            timeout=120,
        )
        partial.replace(tarball)
    return name, tarball


def images_on_node(cluster: Cluster) -> set[str]:
    return set(cluster.ctr("images", "ls", "--quiet").split())


def load(cluster: Cluster, tarball: Path) -> None:
    """`ctr images import` into the node's containerd (its k8s.io namespace)."""
    cluster.ctr("images", "import", str(tarball), timeout=600)


def tag(cluster: Cluster, source: str, target: str) -> None:
    cluster.ctr("images", "tag", "--force", source, target)


def remove(cluster: Cluster, *names: str) -> None:
    """Drop the images from the node (containerd then collects their content), so that
    runs do not pile up images in the kit's store, which nothing else cleans."""
    present = images_on_node(cluster)
    gone = [name for name in names if name in present]
    if gone:
        cluster.ctr("images", "rm", *gone)


CHAIN = "GPUPLACE-RC-KUBERNETES"


def iptables(*args: str, check: bool = True) -> bool:
    done = subprocess.run(
        ["iptables", "-w", "-t", "nat", *args], capture_output=True, text=True, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"iptables -t nat {' '.join(args)}: {done.stderr.strip()}")
    return done.returncode == 0


@contextlib.contextmanager
def kubernetes_service(cluster: Cluster, kubectl: Kubectl) -> Iterator[None]:
    """What kube-proxy does for the Service `kubernetes` and nothing more: a pod's connection
    to its ClusterIP:443 (where in-cluster clients go: KUBERNETES_SERVICE_HOST/_PORT) is
    DNATed to the API server, which listens on 127.0.0.1 only (the kit's fact 9). One rule
    in a chain of its own, jumped to from PREROUTING for packets from the node's bridge, and
    `route_localnet` on that bridge so that the kernel routes them to 127.0.0.1 (kube-proxy
    sets it for the same reason; the kubelet's KUBE-FIREWALL lets DNATed ones through). All
    removed at the end; the bridge is the kit's and goes at `cluster.sh down`."""
    bridge = cluster.bridge
    made_bridge_pod = False
    if not Path(f"/sys/class/net/{bridge}").exists():
        # the CNI bridge plugin makes it when the node's first pod gets its network
        made_bridge_pod = True
        kubectl.run(
            "-n", "default", "run", "gpuplace-rc-bridge", "--image=localhost/busybox:local",
            "--image-pull-policy=Never", "--restart=Never", "--command", "--", "true",
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not Path(f"/sys/class/net/{bridge}").exists():
            assert time.monotonic() < deadline, f"no bridge {bridge} after the node's first pod"
            time.sleep(0.2)
    service = kubectl.json("-n", "default", "get", "service", "kubernetes")
    address, port = service["spec"]["clusterIP"], service["spec"]["ports"][0]["port"]
    apiserver = cluster.server.rsplit(":", 1)[1]
    setting = Path(f"/proc/sys/net/ipv4/conf/{bridge}/route_localnet")
    before = setting.read_text().strip()
    if not iptables("-N", CHAIN, check=False):
        iptables("-F", CHAIN)
    iptables(
        "-A", CHAIN, "-d", f"{address}/32", "-p", "tcp", "--dport", str(port),
        "-j", "DNAT", "--to-destination", f"127.0.0.1:{apiserver}",
    )  # fmt: skip
    if not iptables("-C", "PREROUTING", "-i", bridge, "-j", CHAIN, check=False):
        iptables("-I", "PREROUTING", "-i", bridge, "-j", CHAIN)
    setting.write_text("1")
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            setting.write_text(before)
        iptables("-D", "PREROUTING", "-i", bridge, "-j", CHAIN, check=False)
        iptables("-F", CHAIN, check=False)
        iptables("-X", CHAIN, check=False)
        if made_bridge_pod:
            kubectl.run("-n", "default", "delete", "pod", "gpuplace-rc-bridge", check=False)
