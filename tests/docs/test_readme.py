"""The README a platform engineer reads in five minutes, and docs a reader can reach.

The README stays short (≤ 220 lines) with exactly the two set-up commands on its first
screen; CI runs the second of them; every page under docs/ is linked from the README or
the docs index; every relative link in them resolves; every script the README names as
measuring a figure exists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FIRST_SCREEN = 25
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 220


def test_first_screen_has_exactly_the_two_set_up_commands() -> None:
    screen = README.read_text().splitlines()[:FIRST_SCREEN]
    start = screen.index("```sh")
    end = screen.index("```", start + 1)
    commands = [line.split("#")[0].strip() for line in screen[start + 1 : end]]
    assert commands == ["./dev demo", "./dev test"]


def test_ci_runs_the_readme_test_command() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec \./dev test$", script, re.MULTILINE)


def links(page: Path) -> set[Path]:
    return {(page.parent / target).resolve() for target in LINK.findall(page.read_text())
            if "://" not in target}  # fmt: skip


def test_every_doc_is_linked_from_where_a_reader_starts() -> None:
    reachable = links(README) | links(DOCS / "README.md")
    pages = {page.resolve() for page in DOCS.glob("*.md")} - {(DOCS / "README.md").resolve()}
    assert pages - reachable == set()
    assert (DOCS / "README.md").resolve() in links(README)


def test_every_relative_link_resolves() -> None:
    for page in [README, *DOCS.glob("*.md")]:
        missing = [str(target) for target in links(page) if not target.exists()]
        assert missing == [], page.name


def test_every_figure_names_a_script_that_exists() -> None:
    text = README.read_text()
    section = text[text.index("## What it promises") : text.index("## How it compares")]
    scripts = set(re.findall(r"`(bench/[\w/]+\.py)", section))
    assert scripts, "the promises table names its scripts"
    assert [s for s in scripts if not (ROOT / s).exists()] == []


def sh_block_after(text: str, marker: str) -> list[str]:
    """The lines of the first ```sh block after `marker`, stripped of indentation."""
    lines = text[text.index(marker) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "```sh")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
    return [line.strip() for line in lines[start + 1 : end]]


def test_the_readme_installs_with_the_sequence_the_install_test_plays() -> None:
    """tests/deploy/test_install_sequence.py plays docs/deploy.md's marked commands on a
    model of a fresh cluster; the README must show the same ones."""
    deploy = (DOCS / "deploy.md").read_text()
    assert sh_block_after(README.read_text(), "Apply it") == sh_block_after(
        deploy, "<!-- install-sequence"
    )
