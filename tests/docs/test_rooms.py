"""The design map the docs describe is the code's (issue 46): every module says what it
owns in a docstring; docs/README.md's list of rooms names every room of the package and
nothing else; the rooms the README and docs/README.md call pure import no I/O framework,
logging or clock."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gpuplace"
IMPURE = {"asyncio", "logging", "aiohttp", "kubernetes_asyncio", "socket", "subprocess", "time",
          "threading", "grpc", "prometheus_client"}  # fmt: skip
"""What a pure room never imports: I/O, a log, a clock of its own."""


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_docstring() -> None:
    missing = [
        str(path.relative_to(ROOT))
        for path in modules()
        if not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert missing == []


def rooms() -> set[str]:
    """The rooms of pyproject.toml's layers contract (exhaustive: every module and package
    directly inside gpuplace)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["type"] == "layers" and c["containers"] == ["gpuplace"]
    )
    return {room.strip() for layer in contract["layers"] for room in re.split(r"[|:]", layer)}


def test_the_rooms_are_every_module_of_the_package() -> None:
    on_disk = {
        path.stem if path.is_file() else path.name
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").is_file()
    }
    assert rooms() == on_disk


def test_the_docs_index_names_every_room() -> None:
    text = (ROOT / "docs" / "README.md").read_text()
    listing = text[text.index("The rooms, bottom to top:") :]
    named = set(re.findall(r"`([a-z0-9_]+)`", listing))
    assert rooms() - named == set(), "rooms docs/README.md does not list"
    assert named - rooms() == set(), "docs/README.md lists rooms that do not exist"


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_what_the_docs_call_pure_is() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    index = " ".join((ROOT / "docs" / "README.md").read_text().split())
    pure = set(re.findall(r"pure `([a-z_]+)`(?: and `([a-z_]+)`)?", readme)[0]) - {""}
    pure |= set(re.findall(r"`([a-z_]+)` \(pure\)", index))
    assert pure == {"placement", "certs"}, pure
    for room in pure:
        where = PACKAGE / room
        files = sorted(where.rglob("*.py")) if where.is_dir() else [where.with_suffix(".py")]
        impure = {
            str(f.relative_to(ROOT)): imports(f) & IMPURE for f in files if imports(f) & IMPURE
        }
        assert impure == {}, room
