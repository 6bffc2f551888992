"""Every flag of every command is documented, and a documented default is the flag's own
(issue 46).

Each command has its pages (`PAGES`): every option its parser takes (sub-commands such as
`certs check` included) appears there in backticks (`--flag`, or `--flag VALUE` within a
longer span). Every flags table (a table whose header starts `| flag | default |`) belongs
to the commands named `gpuplace COMMAND [VERB]` in backticks in the nearest heading above
it, else to its page's (`TABLES`); each of its rows names one or more flags in backticks,
and for each of those commands that has the flag, the default cell must be the flag's
default: a number or a boolean equal to it, its value as the flag would read it
(`1h` for 3600 s, `32 MiB`), or, for a flag with no default (None, a required flag, an
empty list), words that say so (`none`, `—`, `required`, `in-cluster`, ...). The defaults of
`serve` and `node-agent` are their settings models' (the flags themselves default to
"unset", so that the env can speak).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError
from pydantic_settings import BaseSettings

from gpuplace.wiring.agent_settings import AgentSettings
from gpuplace.wiring.settings import Settings
from tests.docs import clitree

DOCS = Path(__file__).resolve().parents[2] / "docs"
Command = tuple[str, ...]

PAGES: dict[str, tuple[str, ...]] = {
    "certs": ("certs.md",),
    "demo": ("demo.md",),
    "explain": ("extender.md", "usage.md"),
    "node-agent": ("node-agent.md",),
    "preflight": ("deploy.md",),
    "queues": ("queues.md",),
    "serve": ("extender.md", "webhook.md"),
    "simulate": ("placement.md", "performance.md"),
    "usage": ("usage.md",),
}
"""Where each command's flags are documented."""
TABLES: dict[str, tuple[Command, ...]] = {
    "certs.md": (),
    "demo.md": (("demo",),),
    "extender.md": (("serve",),),
    "webhook.md": (("serve",),),
    "node-agent.md": (("node-agent",),),
    "placement.md": (("serve",),),
    "queues.md": (("queues",),),
    "usage.md": (("usage",),),
}
"""The commands of a page's flags tables whose heading names none."""
SETTINGS: dict[Command, type[BaseSettings]] = {("serve",): Settings, ("node-agent",): AgentSettings}
"""The commands whose flags are their settings model's fields (`gpuplace.wiring.settings`)."""
UNSET_WORDS = ("none", "—", "-", "required", "in-cluster", "all", "now", "(required", "$")
"""How a doc says a flag has no default value: the cell starts with one of these."""
SIZE = re.compile(r"^(\d+(?:\.\d+)?) ?(KiB|MiB|GiB)$")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
HEADING = re.compile(r"^#+ ")
COMMAND = re.compile(r"`gpuplace ([a-z-]+)((?: [a-z-]+)*)")
FLAG = re.compile(r"`(--[a-z0-9-]+)")


def flags_of(command: Command) -> dict[str, argparse.Action]:
    return {
        option: action
        for action in clitree.options(clitree.parser_of(*command))
        for option in action.option_strings
        if option.startswith("--")
    }


def default_of(command: Command, action: argparse.Action) -> Any:
    model = SETTINGS.get(command)
    if model is None:
        return action.default
    field = model.model_fields[action.dest]
    return None if field.is_required() else field.default


def spans(text: str) -> set[str]:
    """Every flag written in backticks: `--flag`, `--flag VALUE`, `-o json --flag`."""
    return {
        token.split("=", 1)[0]
        for span in re.findall(r"`([^`\n]+)`", text)
        for token in span.split()
        if token.startswith("--")
    }


@pytest.mark.parametrize("command", sorted(dict(clitree.commands())), ids=" ".join)
def test_every_flag_of_the_command_is_in_its_pages(command: Command) -> None:
    assert command[0] in PAGES, f"gpuplace {command[0]}: add its pages to PAGES"
    written = set().union(*(spans((DOCS / page).read_text()) for page in PAGES[command[0]]))
    missing = sorted(set(flags_of(command)) - written)
    assert missing == [], f"gpuplace {' '.join(command)}: not in docs/{PAGES[command[0]]}"


def tables(page: str) -> Iterator[tuple[tuple[Command, ...], list[str]]]:
    """(its commands, its rows) for every flags table of `page`."""
    lines = (DOCS / page).read_text().splitlines()
    heading = ""
    index = 0
    while index < len(lines):
        line = lines[index]
        if HEADING.match(line):
            heading = line
        if re.match(r"^\| flag \| default \|", line):
            named = tuple(
                (first, *rest.split()) for first, rest in COMMAND.findall(heading)
            ) or TABLES.get(page, ())
            assert named, f"docs/{page}: a flags table under {heading!r} names no command"
            rows = []
            index += 2
            while index < len(lines) and lines[index].startswith("|"):
                rows.append(lines[index])
                index += 1
            yield named, rows
        index += 1


def documented(cell: str, action: argparse.Action, default: Any) -> bool:
    """Whether the default cell `cell` says `default`, the default of `action`."""
    text = cell.strip().replace("`", "").strip()
    unset = default is None or default == [] or default is argparse.SUPPRESS
    if text.lower().startswith(UNSET_WORDS):
        return unset
    if unset:
        return False
    if isinstance(default, bool):
        return text.lower() == str(default).lower()
    if isinstance(default, int | float):
        size = SIZE.match(text)
        if size:
            return float(size.group(1)) * UNITS[size.group(2)] == default
        try:
            value = float(Fraction(text.replace(",", "")))
        except ValueError:
            value = _as_the_flag_reads(text, action)
        return isinstance(value, int | float) and math.isclose(value, default, rel_tol=1e-3)
    return _as_the_flag_reads(text, action) == default or text == str(default)


def _as_the_flag_reads(text: str, action: argparse.Action) -> Any:
    if callable(action.type):
        try:
            return action.type(text)
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            return None
    return text


def _typed(command: Command, action: argparse.Action, text: str) -> Any:
    """`text` as the settings model reads the field (serve, node-agent)."""
    annotation: Any = SETTINGS[command].model_fields[action.dest].annotation
    try:
        return TypeAdapter(annotation).validate_python(text)
    except ValidationError:
        return None


def rows() -> list[tuple[str, Command, str, str]]:
    """(page, command, flag, default cell) of every flags table row of every page."""
    found = []
    for page in sorted({page for pages in PAGES.values() for page in pages}):
        for commands, lines in tables(page):
            for line in lines:
                cells = [cell.strip() for cell in line.strip("|").split("|")]
                flags = FLAG.findall(cells[0])
                assert flags, f"docs/{page}: a flags table row names no flag: {line}"
                anywhere = set().union(*(flags_of(command) for command in commands))
                assert set(flags) <= anywhere, f"docs/{page}: no such flag of {commands}: {line}"
                for command in commands:
                    known = flags_of(command)
                    for flag in flags:
                        if flag in known:
                            found.append((page, command, flag, cells[1]))
    return found


ROWS = rows()


def test_the_tables_document_defaults() -> None:
    assert len(ROWS) > 100
    pages = {page for page, *_ in ROWS}
    assert {
        "extender.md",
        "node-agent.md",
        "usage.md",
        "webhook.md",
        "certs.md",
        "demo.md",
    } <= pages


@pytest.mark.parametrize(
    ("page", "command", "flag", "cell"), ROWS, ids=[f"{p}:{' '.join(c)}:{f}" for p, c, f, _ in ROWS]
)
def test_a_documented_default_is_the_flags_default(
    page: str, command: Command, flag: str, cell: str
) -> None:
    action = flags_of(command)[flag]
    default = default_of(command, action)
    if command in SETTINGS and not isinstance(default, bool | int | float | type(None)):
        assert _typed(command, action, cell.replace("`", "").strip()) == default or (
            documented(cell, action, default)
        ), f"docs/{page}: {flag} default {cell!r}, gpuplace {' '.join(command)} has {default!r}"
        return
    assert documented(cell, action, default), (
        f"docs/{page}: {flag} default {cell!r}, gpuplace {' '.join(command)} has {default!r}"
    )


def test_the_default_check_can_fail() -> None:
    serve = flags_of(("serve",))
    assert not documented("false", serve["--gangs"], default_of(("serve",), serve["--gangs"]))
    assert documented("true", serve["--gangs"], True)
    assert documented("32 MiB", serve["--extender-max-body-bytes"], 32 * 1024 * 1024)
    usage = flags_of(("usage",))
    assert documented("`1h`", usage["--window"], 3600.0)
    assert not documented("`2h`", usage["--window"], 3600.0)
    assert not documented("none", usage["--threshold"], 0.5)
    assert not documented("15", usage["--at"], None)
