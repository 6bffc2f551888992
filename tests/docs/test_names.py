"""No doc names a module or a file that does not exist (issue 46).

In README.md and docs/*.md: every dotted name `gpuplace.x.y[.Attr]` is a module of the
package (a file under gpuplace/), and what follows the module an attribute of it; every
path in backticks that starts with a folder of this repository (`gpuplace/`, `docs/`,
`deploy/`, `bench/`, `tests/`, `.ci/`) or with `../shared/` is there (resolved from the
repository's root; a glob must match something). A path written `shared/…` is wrong: the
shared folder sits beside the checkout, `../shared/…`. So a module moved or renamed, a
file deleted, breaks this test until the docs follow.

Not checked: docs/comparison.md's paths (they are other projects' files); a path is read up
to a placeholder (`gpuplace/…`, `tests/<room>`: the folder before it); the `../shared/`
paths where ../shared is absent are skipped, saying so (they fail under CI=true like every
missing part of ../shared).
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OTHER_PROJECTS = {"comparison.md"}
"""Pages whose paths are other repositories' files."""
SPAN = re.compile(r"`([^`\n]+)`")
MODULE = re.compile(r"(?<![\w./-])gpuplace(?:\.(?!io\b)[A-Za-z_]\w*)+")
"""A dotted name under the package (not the annotation domain `gpuplace.io`)."""
PATH = re.compile(
    r"(?<![\w.:/~-])((?:\.\./shared|shared|gpuplace|docs|deploy|bench|tests|\.ci)/[\w./*-]*)"
)


def module_of(parts: list[str]) -> int:
    """How many leading parts of a dotted name are a module of the repository (0: none)."""
    for count in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:count])
        if (
            base.with_suffix(".py").is_file()
            or (base / "__init__.py").is_file()
            or base.with_suffix(".c").is_file()  # a C helper, built at install
        ):
            return count
    return 0


def resolves(name: str) -> bool:
    parts = name.split(".")
    count = module_of(parts)
    if count == 0:
        return False
    if count == len(parts):
        return True
    value: object = importlib.import_module(".".join(parts[:count]))
    for attribute in parts[count:]:
        if not hasattr(value, attribute):
            return False
        value = getattr(value, attribute)
    return True


def test_every_dotted_name_is_a_module_and_its_attributes() -> None:
    wrong = sorted(
        {
            f"{page.name}: {name}"
            for page in PAGES
            for name in MODULE.findall(page.read_text())
            if not resolves(name.rstrip("."))
        }
    )
    assert wrong == []


def paths() -> list[tuple[str, str]]:
    """(page, path) for every checkable path in backticks."""
    found = []
    for page in PAGES:
        if page.name in OTHER_PROJECTS:
            continue
        for span in SPAN.findall(page.read_text()):
            for written in PATH.findall(span):
                path = written.rstrip(".,:;")
                parts = path.rstrip("/").split("/")
                # `gpuplace/gpuplace-scheduler`, `deploy/gpuplace`: a namespace/name or a
                # kubectl kind/name, not a file; a file has a suffix, a folder a slash
                if len(parts) == 2 and "." not in parts[1] and not path.endswith("/"):
                    continue
                found.append((page.name, path))
    return found


def exists(path: str) -> bool:
    target = ROOT / path
    if "*" in path:
        return any(ROOT.glob(path))
    return target.exists()


def test_every_path_is_in_the_repository_or_beside_it() -> None:
    wrong = sorted(
        {
            f"{page}: {path}"
            for page, path in paths()
            if not path.startswith("../shared/") and not exists(path)
        }
    )
    assert wrong == []


def test_every_path_in_the_shared_folder_is_there() -> None:
    if not SHARED.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{SHARED} is absent under CI")
        pytest.skip(f"{SHARED} absent (the shared folder beside the checkout)")
    named = [(page, path) for page, path in paths() if path.startswith("../shared/")]
    assert named, "the docs name the shared fixtures"
    assert sorted({f"{page}: {path}" for page, path in named if not exists(path)}) == []


def test_the_checks_can_fail() -> None:
    assert not resolves("gpuplace.localapi")
    assert not resolves("gpuplace.dev.localapi.NoSuchThing")
    assert resolves("gpuplace.dev.localapi.FakeApi")
    assert resolves("gpuplace.extender._node_names")
    assert not exists("shared/fixtures/gpu/README.md")
