"""docs/usage.md documents every flag `gpuplace usage --help` lists, and no other."""

from __future__ import annotations

import re
from pathlib import Path

from gpuplace import cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "usage.md"


def test_every_flag_documented() -> None:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    usage = action.choices["usage"]  # type: ignore[index]
    flags = {
        option
        for item in usage._actions
        for option in item.option_strings
        if option.startswith("--") and option != "--help"
    }
    table = DOC.read_text().split("## The command", 1)[1].split("## The over-ask rule")[0]
    documented = set(re.findall(r"^\| `(--[a-z-]+)", table, re.MULTILINE))
    documented |= set(re.findall(r"`(--[a-z-]+)`", table))
    assert flags == documented & flags and documented <= flags, (flags, documented)
