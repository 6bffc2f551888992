"""Every command of `gpuplace` as its parser builds it, sub-commands (`certs rotate`) included:
the documentation checks read flags, defaults and help from here, never from a copy."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from gpuplace import cli


def _children(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def parser_of(*path: str) -> argparse.ArgumentParser:
    """The parser of `gpuplace PATH…` (`parser_of("certs", "check")`)."""
    parser = cli.build_parser(list(path[:1]))
    for name in path:
        parser = _children(parser)[name]
    return parser


def commands() -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every runnable command, deepest first met: (("certs", "check"), its parser), …"""

    def walk(
        path: tuple[str, ...], parser: argparse.ArgumentParser
    ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
        children = _children(parser)
        if not children:
            yield path, parser
        for name, child in children.items():
            yield from walk((*path, name), child)

    yield from walk((), cli.build_parser())


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's optional arguments but --help."""
    return [
        action
        for action in parser._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    ]


def long_flag(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))
