"""The `gpuplace` command line: the commands of `gpuplace.commands.HELP`, in alphabetical
order. Only the chosen command's module is imported (`gpuplace serve` never loads the
demo or matplotlib); the others are listed by their one-line help."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from gpuplace import commands


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: every installed command listed with its help, and the full
    parser of the command `argv` names; with `argv` None, of every command (tests and the
    documentation checks read them all). O(commands)."""
    parser = argparse.ArgumentParser(
        prog="gpuplace",
        description="GPU sharing and binpacking for Kubernetes beside the stock kube-scheduler.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    for name in commands.installed():
        if chosen is None or name == chosen:
            importlib.import_module(commands.module_name(name)).register(subparsers)
        else:
            subparsers.add_parser(name, help=commands.HELP[name])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
