"""The `gpuplace` command line: every command listed with its help, and only the chosen
command's module loaded (so `serve`, `node-agent` and `certs` never load the development
room or matplotlib), checked in fresh interpreters."""

from __future__ import annotations

import argparse
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuplace import cli, commands

REPO = Path(__file__).resolve().parents[2]
DEVELOPMENT = ("gpuplace.dev", "gpuplace.commands.demo", "matplotlib")

# Runs `gpuplace ARGV` in this interpreter (an exit from --help included), or only parses
# it, then prints the modules it loaded as JSON on the last line.
LOADED = """
import json, sys
from gpuplace import cli
mode, argv = sys.argv[1], sys.argv[2:]
try:
    cli.main(argv) if mode == "run" else cli.build_parser(argv).parse_args(argv)
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def loaded(*argv: str, run: bool = True) -> list[str]:
    completed = subprocess.run(
        [sys.executable, "-c", LOADED, "run" if run else "parse", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    names: list[str] = json.loads(completed.stdout.splitlines()[-1])
    return names


def development(modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith(DEVELOPMENT)]


@pytest.mark.parametrize(
    "argv",
    [
        ("serve", "--help"),
        ("node-agent", "--help"),
        ("certs", "--help"),
        ("certs", "check", "--cert-file", "/nonexistent"),
        ("serve", "--webhook-port", "70000"),  # parsed, then refused: exit 2
    ],
)
def test_what_runs_in_a_cluster_loads_no_development_tools(argv: tuple[str, ...]) -> None:
    modules = loaded(*argv)
    assert f"gpuplace.commands.{argv[0].replace('-', '_')}" in modules
    assert development(modules) == []


@pytest.mark.parametrize("command", ["serve", "node-agent", "certs"])
def test_parsing_a_cluster_command_loads_no_development_tools(command: str) -> None:
    """Their parsers as the process builds them (without running: `serve` would serve)."""
    modules = loaded(command, *(["check"] if command == "certs" else []), run=False)
    assert commands.module_name(command) in modules
    assert development(modules) == []


def test_the_list_of_commands_loads_none_of_them() -> None:
    modules = loaded("--help")
    assert [m for m in modules if m.startswith("gpuplace.commands.")] == []


def test_the_chosen_command_is_loaded_and_no_other() -> None:
    modules = loaded("demo", "--help")
    assert "gpuplace.commands.demo" in modules and "gpuplace.dev.demo" in modules
    others = {commands.module_name(name) for name in commands.HELP} - {"gpuplace.commands.demo"}
    assert others.isdisjoint(modules)


def test_help_lists_every_command_with_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, summary in commands.HELP.items():
        assert f"{name} {summary}" in text


def test_the_index_names_every_command_module_and_its_own_help() -> None:
    """HELP is the one list: every module of gpuplace.commands is in it, and each module
    registers its command under that name with that help."""
    modules = {info.name for info in pkgutil.iter_modules(commands.__path__)}
    assert modules == {commands.module_name(n).rpartition(".")[2] for n in commands.HELP}
    parser = cli.build_parser()  # every command loaded
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    listed = {choice.dest: choice.help for choice in subparsers._choices_actions}
    assert listed == commands.HELP


def test_a_command_whose_module_is_not_installed_is_not_offered(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As in the image, which leaves out the demo's module."""
    monkeypatch.setitem(commands.HELP, "absent", "a command whose module is not installed")
    assert "absent" not in commands.installed()
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0 and "absent" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        cli.main(["absent"])
    assert exited.value.code == 2 and "invalid choice: 'absent'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "command"),
    [(("demo", "--seed", "2"), "demo"), (("simulate", "--plot", "x.png"), "simulate --plot")],
)
def test_without_matplotlib_one_line_says_what_to_install(
    argv: tuple[str, ...], command: str, tmp_path: Path
) -> None:
    """matplotlib is the `demo` extra: without it, the commands that draw stop before they
    start, with exit code 2."""
    hidden = "import sys; sys.modules['matplotlib'] = None; from gpuplace import cli; "
    completed = subprocess.run(
        [sys.executable, "-c", hidden + "sys.exit(cli.main(sys.argv[1:]))", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2 and completed.stdout == ""
    assert completed.stderr == (
        f"gpuplace {command}: needs matplotlib, which is not installed: "
        "pip install 'gpuplace[demo]'\n"
    )
    assert list(tmp_path.iterdir()) == []  # nothing drawn, nothing run
