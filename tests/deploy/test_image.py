"""The Dockerfile without a Docker engine: its structure, and the package built and
installed the way its stages do it (wheel of gpuplace, wheels of the pinned dependencies,
a clean virtualenv without pip, install from those wheels only), then `gpuplace` run from
that virtualenv.

The install test talks to the package index (through pip's cache, which makes a second
run take seconds) and is skipped, saying so, when the index cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import c_helpers_built
from tests.deploy import rendering

ROOT = rendering.ROOT
DOCKERFILE = ROOT / "Dockerfile"
PINNED_BASE = re.compile(r"^python:3\.11\.\d+-slim-bookworm$")
BUILD_TOOLS = re.compile(
    r"\b(gcc|g\+\+|cc|clang|make|build-essential|apt-get|apk|pip wheel|python3?-dev)\b"
)


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages of a Dockerfile (continuations joined)."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), parts[0])
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(base=base, name=name))
        elif not stages and keyword == "ARG":
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip()
        else:
            stages[-1].instructions.append((keyword, rest))
    return args, stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse(DOCKERFILE.read_text())[1]


def test_multi_stage_on_a_pinned_slim_python(stages: list[Stage]) -> None:
    assert len(stages) >= 2
    for stage in stages:
        assert PINNED_BASE.match(stage.base), stage.base
    assert stages[0].base == stages[-1].base  # the wheels are built for the runtime's Python
    names = [s.name for s in stages]
    assert len(set(names)) == len(names)


def test_runtime_stage_has_no_build_tools_and_no_source(stages: list[Stage]) -> None:
    runtime, build = stages[-1], stages[0]
    for command in runtime.all("RUN"):
        assert not BUILD_TOOLS.search(command), command
        assert "--no-index" in command and "--find-links=/wheels" in command
        assert f"from={build.name},source=/wheels" in command
        assert "--without-pip" in command  # the venv never holds pip or setuptools
    assert runtime.all("COPY") == [] and runtime.all("ADD") == []


def test_the_venv_goes_on_path_only_after_the_base_pip_installed_into_it(
    stages: list[Stage],
) -> None:
    """`python -m pip --python VENV install` must run the base image's python: with the venv
    already first on PATH (an earlier ENV), `python` is the venv's own, which has no pip,
    and the step fails with "No module named pip" (found by the first real build,
    tests/realcluster/test_image_install.py)."""
    runtime = stages[-1]
    venv_made = None
    for index, (keyword, args) in enumerate(runtime.instructions):
        found = re.search(r"python -m venv --without-pip (\S+)", args)
        if keyword == "RUN" and found:
            venv_made = (index, found[1])
    assert venv_made is not None
    index, venv = venv_made
    puts_first = [
        i
        for i, (keyword, args) in enumerate(runtime.instructions)
        if keyword == "ENV" and re.search(rf"PATH={re.escape(venv)}/bin:", args)
    ]
    assert puts_first, "the venv's bin is never put on PATH"
    assert min(puts_first) > index, runtime.instructions


def test_runs_as_a_numeric_non_root_user_with_the_gpuplace_entrypoint(stages: list[Stage]) -> None:
    runtime = stages[-1]
    (user,) = runtime.all("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and (not gid or int(gid) > 0)
    (entrypoint,) = runtime.all("ENTRYPOINT")
    assert json.loads(entrypoint) == ["gpuplace"]  # exec form: signals reach gpuplace
    deployment = rendering.one(rendering.render("base"), "Deployment", "gpuplace")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(uid)  # the manifests agree


def copied_sources(stage: Stage) -> list[str]:
    sources: list[str] = []
    for args in stage.all("COPY"):
        parts = shlex.split(args)
        sources += [p.rstrip("/") for p in parts[:-1] if not p.startswith("--")]
    return sources


def test_build_stage_copies_every_package_and_the_metadata(stages: list[Stage]) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = top_level_packages(project)
    sources = set(copied_sources(stages[0]))
    assert packages <= sources
    assert {
        "pyproject.toml",
        "setup.py",
        project["project"]["readme"],
        "constraints.txt",
    } <= sources
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not sources & set(ignored)
    assert {".git", ".venv", "tests"} <= set(ignored)


def dockerignore() -> list[re.Pattern[str]]:
    """The patterns of .dockerignore as Docker reads them (Go's filepath.Match per path
    element, `**` any number of elements); a matched folder is left out whole."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = []
    for line in (line.strip().strip("/") for line in lines):
        if not line or line.startswith("#"):
            continue
        assert not line.startswith("!"), "exceptions are not emulated here"
        elements = [
            ".*" if e == "**" else re.escape(e).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
            for e in line.split("/")
        ]
        patterns.append(re.compile("/".join(elements).replace(".*/", "(.*/)?")))
    return patterns


def ignored(relative: str, patterns: list[re.Pattern[str]]) -> bool:
    return any(pattern.fullmatch(relative) for pattern in patterns)


def test_dockerignore_reads_as_docker_does() -> None:
    patterns = dockerignore()
    for path in ("gpuplace/dev", "gpuplace/commands/demo.py", "gpuplace/x/__pycache__",
                 "gpuplace/placement/_names.cpython-311-x86_64-linux-gnu.so", "tests"):  # fmt: skip
        assert ignored(path, patterns), path
    for path in ("gpuplace/devices.py", "gpuplace/commands/serve.py", "gpuplace/data/nodes.csv"):
        assert not ignored(path, patterns), path


def top_level_packages(project: dict[str, Any]) -> set[str]:
    """The packages setuptools finds (`[tool.setuptools.packages.find] include`)."""
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    return {pattern.rstrip("*").rstrip(".") for pattern in patterns}


def run(command: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


OFFLINE = re.compile(
    r"(Temporary failure in name resolution|Failed to establish a new connection|"
    r"Network is unreachable|Max retries exceeded|Could not fetch URL|No route to host)"
)


@dataclass(frozen=True)
class Installed:
    """The wheel built as the image's build stage builds it, installed as its runtime
    stage installs it."""

    wheel: Path
    venv: Path
    workdir: Path


@pytest.fixture(scope="module")
def installed(stages: list[Stage], tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The Dockerfile's two stages, on this machine's Python: only the COPYed files form
    the context, less what .dockerignore leaves out (the development room); the runtime
    venv gets nothing but what the wheels install. (The one difference: --no-compile, to
    keep the test quick.)"""
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the image runs Python 3.11; this interpreter is not")
    tmp_path = tmp_path_factory.mktemp("image")
    context = tmp_path / "context"
    context.mkdir()
    patterns = dockerignore()

    def left_out(folder: str, names: list[str]) -> list[str]:
        relative = Path(folder).resolve().relative_to(ROOT)
        return [name for name in names if ignored((relative / name).as_posix(), patterns)]

    for source in copied_sources(stages[0]):
        path = ROOT / source
        if path.is_dir():
            shutil.copytree(path, context / source, ignore=left_out)
        else:
            shutil.copy2(path, context / source)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    built = run([*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), "./context"], tmp_path)
    if built.returncode != 0 and OFFLINE.search(built.stdout + built.stderr):
        pytest.skip("package index unreachable: cannot fetch the build backend (setuptools)")
    assert built.returncode == 0, built.stderr[-3000:]
    # our own packaging warns about nothing (deprecated or experimental setuptools tables)
    assert "BuildBackendWarning" not in built.stdout + built.stderr, built.stderr[-3000:]
    (wheel,) = wheels.glob("gpuplace-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        entries = archive.namelist()
    # one top-level package, without the development room (the Dockerfile checks that too)
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert {entry.split("/")[0] for entry in entries} == {"gpuplace", dist_info}
    assert not [n for n in entries if n.startswith("gpuplace/dev/") or n.endswith("/demo.py")]
    assert "gpuplace/commands/serve.py" in entries and "gpuplace/data/nodes.csv" in entries
    deps = run(
        [*pip, "wheel", "--only-binary=:all:", "--wheel-dir", str(wheels), "--constraint",
         str(context / "constraints.txt"), str(wheel)],
        tmp_path,
    )  # fmt: skip
    if deps.returncode != 0 and OFFLINE.search(deps.stdout + deps.stderr):
        pytest.skip("package index unreachable: cannot fetch the pinned dependency wheels")
    assert deps.returncode == 0, deps.stderr[-3000:]

    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path).returncode == 0
    done = run(
        [*pip, "--python", str(venv / "bin" / "python"), "install", "--no-compile",
         "--no-index", f"--find-links={wheels}", "gpuplace"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return Installed(wheel, venv, tmp_path)


@pytest.mark.timeout(600)
def test_wheel_installs_in_a_clean_venv_and_runs(installed: Installed) -> None:
    venv, tmp_path = installed.venv, installed.workdir
    assert not (venv / "bin" / "pip").exists()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    python = venv / "bin" / "python"
    freeze = run([*pip, "--python", str(python), "list", "--format=json"], tmp_path)
    names = {p["name"].lower() for p in json.loads(freeze.stdout)}
    assert "gpuplace" in names and not names & {"pip", "setuptools", "mypy", "pytest", "ruff"}
    assert "matplotlib" not in names  # the `demo` extra
    gpuplace = venv / "bin" / "gpuplace"
    for argv in (["--help"], ["serve", "--help"], ["certs", "--help"], ["node-agent", "--help"]):
        result = run([str(gpuplace), *argv], tmp_path, timeout=60)
        assert result.returncode == 0, (argv, result.stderr[-2000:])
    listed = run([str(gpuplace), "--help"], tmp_path, timeout=60).stdout
    assert "serve" in listed and "node-agent" in listed and "demo" not in listed
    demo = run([str(gpuplace), "demo"], tmp_path, timeout=60)
    assert demo.returncode == 2 and "invalid choice: 'demo'" in demo.stderr
    # Fresh certificates from the installed package (cryptography wheel works).
    out = tmp_path / "tls"
    made = run([str(gpuplace), "certs", "generate", "--out-dir", str(out)], tmp_path, timeout=60)
    assert made.returncode == 0, made.stderr
    assert (out / "tls.key").stat().st_mode & 0o777 == 0o600


@pytest.mark.timeout(600)
def test_the_image_has_both_c_helpers_in_use(installed: Installed) -> None:
    """The image's build stage has a C compiler (the Dockerfile fails without the helpers
    in the wheel): built, and used by the installed package unless switched off. Here
    only where the build is required: without a compiler the wheel has none."""
    c_helpers_built.skip_unless_required()
    with zipfile.ZipFile(installed.wheel) as archive:
        for helper in c_helpers_built.HELPERS:
            pattern = helper.replace(".", "/") + r"\..*\.so"
            assert any(re.fullmatch(pattern, n) for n in archive.namelist()), helper
    check = (
        "from gpuplace.extender import c_helpers as c;"
        " assert c.NAME_SET is not None and c.RANKED_JSON is not None"
    )
    env = {k: v for k, v in os.environ.items() if k != "GPUPLACE_NO_EXTENSIONS"}
    python = installed.venv / "bin" / "python"
    used = subprocess.run(
        [str(python), "-c", check],
        cwd=installed.workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert used.returncode == 0, used.stderr[-2000:]
