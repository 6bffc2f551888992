#!/usr/bin/env python3
"""Build gpuplace's image from the repository's Dockerfile, as shipped, without Docker or a
registry: buildah builds it; its base (the Dockerfile's PYTHON_IMAGE) is either an image you
name or, by default, a local equivalent of `python:3.11-slim-bookworm` made by mmdebstrap
from Debian's own packages. Prints one JSON report on stdout: the image's size, the packages
in it, what it lacks (no compiler, no pip or development tools in gpuplace's environment) and
the time each step took. Progress goes to stderr.

    ./dev image                                   # gpuplace:0.1.0 in buildah's store here
    ./dev image --tag gpuplace:0.1.0 --archive gpuplace.tar   # also a docker-archive for
                                                  # `ctr images import` / `docker load`
    ./dev image --base docker.io/library/python:3.11.14-slim-bookworm  # the official base

Needs root, buildah, runc (or buildah's own runtime) and, for the local base, mmdebstrap
(Debian: `apt-get install buildah runc mmdebstrap`). The local base holds Debian bookworm's
python3 (3.11), python3-venv, python3-pip (what python:slim's `pip` is to the Dockerfile),
python-is-python3 (`python`), Python's C headers only (the build stage compiles the C helpers
against them; python:slim has them too), ca-certificates, netbase and tzdata; documentation,
manuals and locales are left out as Debian's slim images leave them out. It is fetched from
the Debian mirror this machine's apt uses (/etc/apt/sources.list.d/debian.sources), or
--mirror.

Cached under --cache-dir (default ${XDG_CACHE_HOME:-~/.cache}/gpuplace-image), so a second
build takes seconds where nothing changed:
- the base image, remade after --base-max-days (security updates) or with --refresh-base;
- a wheelhouse of the pinned dependencies (constraints.txt) and the build backend, fetched
  once per set of pins by this machine's pip and mounted read-only into the build with a
  pip configuration (`no-index`, `find-links`): the build's pip then needs no network, and the
  Dockerfile stays as it is (--no-wheelhouse: the build's pip asks the package index itself);
- buildah's storage and its layer cache (the build stage's apt-get layer among them).

Exit codes: 0 built and every check held; 1 a step failed or a check did not hold (the
report says which); 2 bad usage or a missing tool.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
SUITE = "bookworm"
"""Debian's release the shipped base (python:3.11.x-slim-bookworm) is made of."""
PYTHON = "3.11"
BASE_NAME = f"localhost/gpuplace-base/python:{PYTHON}-slim-{SUITE}"
BASE_PACKAGES = (
    "python3",
    "python3-venv",
    "python3-pip",
    "python-is-python3",
    "ca-certificates",
    "netbase",
    "tzdata",
)
HEADERS_PACKAGE = f"libpython{PYTHON}-dev"
"""Only its /usr/include is unpacked into the base: its dependencies (libc6-dev, ...)
would put a C toolchain's headers into the runtime image, which python:slim does not have."""
SLIM = (
    # what Debian's slim images (debuerreotype --slimify) leave out
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/groff/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/lintian/*",
    "path-exclude=/usr/share/linda/*",
    "path-exclude=/usr/share/locale/*",
)
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_SECURITY = "http://deb.debian.org/debian-security"
MACHINE_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
BASE_RECIPE = 1
"""Bumped when the way the base is made changes, so that a cached one is remade."""
COMPILERS = re.compile(
    r"^((x86_64|aarch64|arm|i686)[-a-z0-9_]*-)?"
    r"(gcc|g\+\+|c\+\+|cc|cpp|clang|clang\+\+|tcc|as|ld|ld\.bfd|ld\.gold|make|cc1|cc1plus)"
    r"(-\d+(\.\d+)*)?$"
)
DEV_DISTRIBUTIONS = frozenset(
    {"pip", "setuptools", "wheel", "pytest", "mypy", "ruff", "hypothesis", "matplotlib"}
)


class Failure(RuntimeError):
    """A step failed; the message says which and why."""


def log(message: str) -> None:
    print(f"build.py: {message}", file=sys.stderr, flush=True)


def run(argv: Sequence[str], *, quiet: bool = False, progress: bool = False, **kwargs: Any) -> str:
    """Run a command; its stdout. Its stderr goes to ours unless `quiet` (then it is part of
    the error when it fails); with `progress` its stdout too (and "" is returned)."""
    done = subprocess.run(
        list(argv),
        stdout=sys.stderr if progress else subprocess.PIPE,
        stderr=subprocess.PIPE if quiet else None,
        text=True,
        check=False,
        **kwargs,
    )
    if done.returncode != 0:
        detail = (done.stderr or "")[-3000:] if quiet else "(its output is above)"
        raise Failure(f"{' '.join(argv[:4])} ... exited {done.returncode}: {detail}")
    return str(done.stdout or "")


@dataclass
class Timer:
    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = round(time.monotonic() - started, 1)


@dataclass
class Buildah:
    """buildah with this script's own storage (not the machine's /var/lib/containers)."""

    root: Path
    runroot: Path
    driver: str
    runtime: str | None

    def __call__(self, *args: str, quiet: bool = False, progress: bool = False) -> str:
        return run(self.argv(*args), quiet=quiet, progress=progress)

    def argv(self, *args: str) -> list[str]:
        base = ["buildah", "--root", str(self.root), "--runroot", str(self.runroot)]
        return [*base, "--storage-driver", self.driver, *args]

    def exists(self, image: str) -> bool:
        found = subprocess.run(
            self.argv("inspect", "--type", "image", image),
            capture_output=True,
            check=False,
        )
        return found.returncode == 0

    def inspect(self, image: str) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(self("inspect", "--type", "image", image, quiet=True))
        return found

    @contextlib.contextmanager
    def mount(self, container: str) -> Iterator[Path]:
        """A working container's root filesystem, read or written here (nothing runs)."""
        try:
            yield Path(self("mount", container, quiet=True).strip())
        finally:
            subprocess.run(self.argv("umount", container), capture_output=True, check=False)

    @contextlib.contextmanager
    def mounted(self, image: str) -> Iterator[Path]:
        """An image's root filesystem, read here."""
        container = self("from", "--pull-never", image, quiet=True).strip()
        try:
            with self.mount(container) as rootfs:
                yield rootfs
        finally:
            subprocess.run(self.argv("rm", container), capture_output=True, check=False)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One build at a time per cache (several checkouts share it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---- the base


def deb822(text: str) -> list[dict[str, str]]:
    """The stanzas of a deb822 sources file (continuation lines joined)."""
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key = ""
    for line in [*text.splitlines(), ""]:
        if not line.strip():
            if current:
                stanzas.append(current)
            current, key = {}, ""
        elif line.startswith("#"):
            continue
        elif line[0] in " \t" and key:
            current[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            current[key] = value.strip()
    return stanzas


def sources(mirror: str | None, machine: Path = MACHINE_SOURCES) -> str:
    """deb822 sources for the base: suite, -updates and -security, component main; from the
    machine's own Debian entries (their URIs and Signed-By) unless `mirror` is given."""
    archive, security, signed_by = mirror or DEFAULT_MIRROR, DEFAULT_SECURITY, ""
    if mirror is None and machine.is_file():
        for stanza in deb822(machine.read_text()):
            if "deb" not in stanza.get("types", "").split() or not stanza.get("uris"):
                continue
            uri = stanza["uris"].split()[0]
            suites = stanza.get("suites", "").split()
            if any(suite.endswith("-security") for suite in suites):
                security = uri
            elif suites:
                archive = uri
            signed_by = stanza.get("signed-by", signed_by)
    signed = f"Signed-By: {signed_by}\n" if signed_by and "\n" not in signed_by else ""
    return (
        f"Types: deb\nURIs: {archive}\nSuites: {SUITE} {SUITE}-updates\nComponents: main\n{signed}"
        f"\nTypes: deb\nURIs: {security}\nSuites: {SUITE}-security\nComponents: main\n{signed}"
    )


def base_key(source_text: str) -> str:
    recipe = json.dumps([BASE_RECIPE, SUITE, BASE_PACKAGES, HEADERS_PACKAGE, SLIM, source_text])
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def make_base(buildah: Buildah, cache: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The local base image (made, or found in the cache); its facts for the report."""
    source_text = sources(args.mirror)
    key = base_key(source_text)
    tag = f"{BASE_NAME}-{key}"
    tarball = cache / "base" / f"python{PYTHON}-{SUITE}-{key}.tar"
    fresh = tarball.is_file() and time.time() - tarball.stat().st_mtime < args.base_max_days * 86400
    made = False
    if args.refresh_base or not fresh:
        if shutil.which("mmdebstrap") is None:
            raise Failure("mmdebstrap not found (apt-get install mmdebstrap), or pass --base IMAGE")
        log(f"making the base from Debian {SUITE}'s packages (mmdebstrap; about a minute)")
        tarball.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="gpuplace-base-") as scratch:
            listing = Path(scratch) / "base.sources"
            listing.write_text(source_text)
            partial = tarball.with_suffix(".partial")
            headers = (
                'set -e; cd "$1/tmp"; version=$(chroot "$1" dpkg-query -W -f "\\${Version}" '
                f'libpython{PYTHON}-stdlib); chroot "$1" sh -c "cd /tmp && apt-get download -q '
                f'{HEADERS_PACKAGE}=$version"; dpkg-deb --fsys-tarfile {HEADERS_PACKAGE}_*.deb '
                f'| tar -x -C "$1" ./usr/include; rm -f {HEADERS_PACKAGE}_*.deb'
            )
            run(
                [
                    "mmdebstrap",
                    "--variant=minbase",
                    "--format=tar",
                    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
                    *(f"--dpkgopt={option}" for option in SLIM),
                    f"--include={','.join(BASE_PACKAGES)}",
                    f"--customize-hook={headers}",
                    SUITE,
                    str(partial),
                    str(listing),
                ]
            )
            partial.replace(tarball)
        made = True
        for older in tarball.parent.glob(f"python{PYTHON}-{SUITE}-*.tar"):
            if older != tarball:
                older.unlink()
    if made or not buildah.exists(tag):
        log(f"importing the base as {tag}")
        container = buildah("from", "scratch", quiet=True).strip()
        try:
            buildah("add", "--quiet", container, str(tarball), "/", quiet=True)
            version = ""
            with buildah.mount(container) as rootfs:
                version = dpkg_packages(rootfs).get(f"python{PYTHON}", "")
            buildah(
                "config",
                "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env", "LANG=C.UTF-8",
                "--env", f"PYTHON_VERSION={version.split('-')[0]}",
                "--cmd", '["python3"]',
                "--label", f"org.opencontainers.image.description=Python {PYTHON} from Debian "
                f"{SUITE}'s packages (mmdebstrap), python:{PYTHON}-slim-{SUITE}'s equivalent",
                container,
                quiet=True,
            )  # fmt: skip
            buildah("commit", "--quiet", "--rm", container, tag, quiet=True)
        except BaseException:
            subprocess.run(buildah.argv("rm", container), capture_output=True, check=False)
            raise
    with buildah.mounted(tag) as rootfs:
        packages = dpkg_packages(rootfs)
    return {
        "image": tag,
        "made": made,
        "tarball": str(tarball),
        "python": packages.get(f"python{PYTHON}", ""),
        "debian_packages": len(packages),
        "size_bytes": image_size(buildah, tag),
    }


# ---- the wheelhouse


def requirements() -> list[str]:
    """What the Dockerfile's build stage fetches: the build backend and the dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [*project["build-system"]["requires"], *project["project"]["dependencies"]]


def wheelhouse(cache: Path) -> tuple[Path, bool]:
    """The cached wheels for the current pins (made when missing): (directory, fetched)."""
    wanted = requirements()
    pins = (ROOT / "constraints.txt").read_text()
    key = hashlib.sha256(json.dumps([wanted, pins, PYTHON]).encode()).hexdigest()[:12]
    directory = cache / "wheels" / key
    if (directory / ".complete").is_file():
        return directory, False
    log("fetching the pinned wheels into the wheelhouse (once per set of pins)")
    partial = directory.with_name(key + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    machine = platform.machine()
    platforms = [f"manylinux_2_{minor}_{machine}" for minor in range(36, 16, -1)]
    platforms += [f"manylinux2014_{machine}", "any"]
    run(
        [
            sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
            "--dest", str(partial), "--only-binary=:all:",
            "--python-version", PYTHON, "--implementation", "cp",
            "--abi", f"cp{PYTHON.replace('.', '')}", "--abi", "abi3", "--abi", "none",
            *(f"--platform={name}" for name in platforms),
            "--constraint", str(ROOT / "constraints.txt"), *wanted,
        ],
        quiet=True,
    )  # fmt: skip
    (partial / ".complete").write_text("")
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
    for older in directory.parent.iterdir():
        if older != directory:
            shutil.rmtree(older, ignore_errors=True)  # the wheels of earlier pins
    return directory, True


# ---- the image


def dpkg_packages(rootfs: Path) -> dict[str, str]:
    """Installed Debian packages of a root filesystem: name -> version."""
    status = rootfs / "var" / "lib" / "dpkg" / "status"
    found: dict[str, str] = {}
    if not status.is_file():
        return found
    for stanza in deb822(status.read_text()):
        if stanza.get("status", "").endswith(" installed"):
            found[stanza["package"]] = stanza.get("version", "")
    return dict(sorted(found.items()))


def distributions(site: Path) -> dict[str, str]:
    """Python distributions of a site-packages directory: name -> version."""
    found: dict[str, str] = {}
    for info in sorted(site.glob("*.dist-info")) if site.is_dir() else []:
        name = version = ""
        metadata = info / "METADATA"
        for line in metadata.read_text(errors="replace").splitlines() if metadata.is_file() else []:
            if line.startswith("Name: "):
                name = line[6:].strip()
            elif line.startswith("Version: "):
                version = line[9:].strip()
            elif not line:
                break
        if name:
            found[re.sub(r"[-_.]+", "-", name).lower()] = version
    return found


def compilers(rootfs: Path) -> list[str]:
    """Executables named like a compiler, assembler, linker or make, anywhere in the image."""
    found = []
    for directory, _, files in os.walk(rootfs):
        for name in files:
            path = Path(directory) / name
            if COMPILERS.match(name) and os.access(path, os.X_OK, follow_symlinks=False):
                found.append("/" + str(path.relative_to(rootfs)))
    return sorted(found)


def image_size(buildah: Buildah, image: str) -> int:
    """Bytes of the image's layers, uncompressed (what `docker images` shows): the layers'
    diff sizes as buildah's storage records them."""
    diff_ids = buildah.inspect(image).get("OCIv1", {}).get("rootfs", {}).get("diff_ids", [])
    layers = json.loads((buildah.root / f"{buildah.driver}-layers" / "layers.json").read_text())
    sizes = {layer.get("diff-digest"): int(layer.get("diff-size", 0)) for layer in layers}
    return sum(sizes.get(diff_id, 0) for diff_id in diff_ids)


def inspect_image(buildah: Buildah, image: str) -> dict[str, Any]:
    """What the report says of the built image, read from its files and its configuration."""
    info = buildah.inspect(image)
    config = info.get("OCIv1", {}).get("config", {})
    with buildah.mounted(image) as rootfs:
        venv = rootfs / "opt" / "gpuplace"
        sites = sorted(venv.glob("lib/python*/site-packages"))
        site = sites[0] if sites else venv / "missing"
        in_venv = distributions(site)
        base_python = {}
        for directory in sorted(rootfs.glob("usr/lib/python3/dist-packages")) + sorted(
            rootfs.glob("usr/local/lib/python3*/site-packages")
        ):
            base_python.update(distributions(directory))
        helpers = sorted(p.name for p in (site / "gpuplace" / "extender").glob("_*.so"))
        checks = {
            "compilers": compilers(rootfs),
            "pip_in_gpuplace_venv": (venv / "bin" / "pip").exists() or "pip" in in_venv,
            "dev_tools_in_gpuplace_venv": sorted(DEV_DISTRIBUTIONS & set(in_venv)),
            "development_room": (site / "gpuplace" / "dev").exists()
            or (site / "gpuplace" / "commands" / "demo.py").exists(),
            "source_tree": (rootfs / "src").exists(),
            "c_helpers": helpers,
            "python_headers": (rootfs / "usr" / "include" / f"python{PYTHON}").is_dir()
            or bool(list(rootfs.glob("usr/local/include/python3*"))),
        }
        debian = dpkg_packages(rootfs)
    problems = []
    if checks["compilers"]:
        problems.append(f"compilers in the image: {checks['compilers']}")
    if checks["pip_in_gpuplace_venv"]:
        problems.append("pip in gpuplace's virtualenv")
    if checks["dev_tools_in_gpuplace_venv"]:
        problems.append(f"development tools in the venv: {checks['dev_tools_in_gpuplace_venv']}")
    if checks["development_room"] or checks["source_tree"]:
        problems.append("gpuplace's development room or source tree in the image")
    if len(helpers) != 2:
        problems.append(f"the C helpers are not both installed: {helpers}")
    if "gpuplace" not in in_venv:
        problems.append("gpuplace is not installed in /opt/gpuplace")
    return {
        "id": info.get("FromImageID", ""),
        "size_bytes": image_size(buildah, image),
        "layers": len(info.get("OCIv1", {}).get("rootfs", {}).get("diff_ids", [])),
        "user": config.get("User", ""),
        "entrypoint": config.get("Entrypoint", []),
        "cmd": config.get("Cmd", []),
        "exposed_ports": sorted(config.get("ExposedPorts", {})),
        "packages": {
            "debian": debian,
            "gpuplace_venv": in_venv,
            "base_python": base_python,
        },
        "checks": checks,
        "problems": problems,
    }


def prune(buildah: Buildah, base: str) -> None:
    """Drop what earlier builds left in this store (it is this script's own, and the lock
    is held): working containers of builds that died, images the tag has moved off, and
    local bases of an earlier recipe or mirror. Best effort: a failure is only reported."""
    try:
        buildah("rm", "--all", quiet=True)
        for listed in json.loads(buildah("images", "--json", quiet=True) or "[]"):
            names = listed.get("names") or []
            stale = [name for name in names if name.startswith(BASE_NAME) and name != base]
            if stale and not set(names) - set(stale):
                buildah("rmi", str(listed["id"]), quiet=True)
        buildah("rmi", "--prune", quiet=True)
    except Failure as failure:
        log(f"warning: could not prune earlier builds' images: {failure}")


def build(args: argparse.Namespace) -> dict[str, Any]:
    cache = args.cache_dir
    timer = Timer()
    runtime = args.runtime or ("runc" if shutil.which("runc") else None)
    buildah = Buildah(cache / "containers", args.runroot, args.storage_driver, runtime)
    report: dict[str, Any] = {"tag": args.tag, "dockerfile": str(DOCKERFILE)}
    with locked(cache / "build.lock"), timer.step("total"):
        if args.base:
            report["base"] = {"image": args.base, "made": False}
            base = args.base
        else:
            with timer.step("base"):
                report["base"] = make_base(buildah, cache, args)
            base = report["base"]["image"]
        volumes: list[str] = []
        if not args.no_wheelhouse:
            with timer.step("wheelhouse"):
                directory, fetched = wheelhouse(cache)
            conf = cache / "pip.conf"
            conf.write_text("[global]\nno-index = true\nfind-links = /wheelhouse\n")
            volumes = [f"--volume={directory}:/wheelhouse:ro", f"--volume={conf}:/etc/pip.conf:ro"]
            report["wheelhouse"] = {
                "dir": str(directory),
                "fetched": fetched,
                "wheels": len(list(directory.glob("*.whl"))),
            }
        # the build stage's `apt-get install gcc libc6-dev` keeps its packages here for the
        # next build (its `apt-get update` still asks the mirror for the package lists)
        archives = cache / "apt-archives"
        (archives / "partial").mkdir(parents=True, exist_ok=True)
        volumes.append(f"--volume={archives}:/var/cache/apt/archives")
        log(f"building {args.tag} from {DOCKERFILE.name} on {base}")
        with timer.step("build"):
            buildah(
                "build",
                # no --layers: buildah 1.28 cannot bind-mount a stage it took from its layer
                # cache (RUN --mount=...,from=build), nor does a change of that stage make it
                # rebuild the RUN that mounts it (buildah issues 4375 and 4522)
                "--layers=false",
                "--pull=never" if not args.base else "--pull=missing",
                # RUN steps in the host's network: no network of buildah's own, which would
                # leave its firewall chains on the machine
                "--network=host",
                *(["--runtime", runtime] if runtime else []),
                *volumes,
                "--build-arg", f"PYTHON_IMAGE={base}",
                "--file", str(DOCKERFILE),
                "--tag", args.tag,
                str(ROOT),
                progress=True,
            )  # fmt: skip
        with timer.step("inspect"):
            report.update(inspect_image(buildah, args.tag))
        prune(buildah, base)
        if args.archive is not None:
            with timer.step("archive"):
                args.archive.parent.mkdir(parents=True, exist_ok=True)
                partial = args.archive.with_name(args.archive.name + ".partial")
                partial.unlink(missing_ok=True)
                buildah("push", "--quiet", args.tag, f"docker-archive:{partial}:{args.tag}")
                partial.replace(args.archive)
            report["archive"] = {"path": str(args.archive), "bytes": args.archive.stat().st_size}
    report["seconds"] = timer.seconds
    report["size_mib"] = round(report["size_bytes"] / 2**20, 1)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build.py",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]) if __doc__ else None,
    )
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    parser.add_argument("--tag", default="gpuplace:0.1.0", help="the image's name and tag")
    parser.add_argument(
        "--base",
        metavar="IMAGE",
        help="the Dockerfile's PYTHON_IMAGE as is (pulled if missing); default: the local base",
    )
    parser.add_argument(
        "--mirror", metavar="URL", help="Debian mirror for the local base (default: apt's)"
    )
    parser.add_argument("--refresh-base", action="store_true", help="remake the local base")
    parser.add_argument(
        "--base-max-days",
        type=float,
        default=30,
        metavar="DAYS",
        help="remake a cached local base older than this (default 30)",
    )
    parser.add_argument(
        "--no-wheelhouse",
        action="store_true",
        help="no cached wheels: the build's pip asks the package index itself",
    )
    parser.add_argument("--archive", type=Path, help="also write a docker-archive tarball here")
    parser.add_argument("--report", type=Path, help="also write the JSON report here")
    parser.add_argument("--cache-dir", type=Path, default=cache_home / "gpuplace-image")
    parser.add_argument(
        "--runroot", type=Path, default=Path("/run/gpuplace-image"), help="buildah's run state"
    )
    parser.add_argument("--storage-driver", default="overlay", help="buildah's (overlay, vfs)")
    parser.add_argument("--runtime", help="OCI runtime for RUN steps (default: runc if found)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("build.py: needs root (buildah's storage, mmdebstrap's chroot)", file=sys.stderr)
        return 2
    if shutil.which("buildah") is None:
        print("build.py: buildah not found (apt-get install buildah runc)", file=sys.stderr)
        return 2
    args.cache_dir = args.cache_dir.expanduser().resolve()
    try:
        report = build(args)
    except Failure as failure:
        print(f"build.py: {failure}", file=sys.stderr)
        return 1
    text = json.dumps(report, indent=1)
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text + "\n")
    print(text)
    for problem in report["problems"]:
        print(f"build.py: check failed: {problem}", file=sys.stderr)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
