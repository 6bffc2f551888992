"""The README a platform engineer reads in five minutes, and docs a reader can reach.

The README stays short (≤ 220 lines) with exactly the two set-up commands on its first
screen; CI runs the second of them; every page under docs/ is linked from the README or
the docs index; every relative link in them resolves; every script the README names as
measuring a figure exists.
"""

from __future__ import annotations

import re
from pathlib import Path

from gpuplace.cluster import keys
from tests.deploy import rendering

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


def flat(text: str) -> str:
    """`text` with its line breaks and runs of spaces as single spaces."""
    return " ".join(text.split())


def section(text: str, heading: str) -> str:
    """The part of `text` from `heading` to the next heading of any level."""
    start = text.index(heading)
    end = re.search(r"^#+ ", text[start + len(heading) :], re.MULTILINE)
    return text[start : start + len(heading) + end.start()] if end else text[start:]


def annotations_in_table(text: str) -> set[str]:
    """The annotations a table's first column names: `gpuplace.io/gang-name` / `gang-size`
    writes the second without its prefix."""
    named = set()
    for line in text.splitlines():
        if line.startswith("| `gpuplace.io/"):
            for key in re.findall(r"`([a-z.]*/?[a-z-]+)`", line.split("|")[1]):
                named.add(key if key.startswith(keys.PREFIX) else keys.PREFIX + key)
    return named


def test_every_user_annotation_is_in_the_readme_table_and_the_reference() -> None:
    """Issue 46: README's table lacked gpuplace.io/queue and gang-min."""
    readme = section(README.read_text(), "## Asking for GPUs")
    reference = section((DOCS / "annotations.md").read_text(), "## Reference")
    for table in (readme, reference):
        assert annotations_in_table(table) == set(keys.USER_ANNOTATIONS)


def test_the_allocation_figures_of_the_readme_are_recorded_in_placement_md() -> None:
    """Issue 46: best-fit's 92.89% was in no doc; every policy figure of the README's
    allocation row is placement.md's, where the runs behind it are."""
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| GPU allocation, openb"))
    figures = re.findall(r"\d+\.\d\d(?=%)", row)
    assert len(figures) >= 3, row
    placement = (DOCS / "placement.md").read_text()
    assert [figure for figure in figures if figure not in placement] == []


def test_the_node_agent_step_says_to_label_the_gpu_stack_and_how_to_find_it() -> None:
    """Issue 46: turning the node agent on without `gpuplace.io/gpu-system=true` on the GPU
    Operator's namespace loses its pods; the README's step and deploy.md say so and name
    the command that finds them."""
    step = flat(README.read_text()).split("overlays/self-managed-node-agent", 1)[1][:600]
    deploy = flat((DOCS / "deploy.md").read_text()).split("**The node agent is opt-in**", 1)[1]
    for text in (step, deploy[:2000]):
        assert f"{keys.GPU_SYSTEM}=true" in text and "gpuplace preflight" in text


def test_the_security_notes_say_what_each_workload_runs_with() -> None:
    """Issue 46: the README said every pod ran non-root with all capabilities dropped; the
    node agent runs as root with hostPID and adds SETUID and SETGID. The notes name
    exactly what the shipped manifests (the node-agent overlay, all workloads) give."""
    notes = flat(section(README.read_text(), "## Security notes"))
    objects = rendering.render(rendering.NODE_AGENT)
    specs = dict(rendering.pod_specs(objects))
    specs.update(
        {
            o["metadata"]["name"]: o["spec"]["template"]["spec"]
            for o in objects
            if o["kind"] == "DaemonSet"
        }
    )
    root = {name for name, spec in specs.items() if spec["securityContext"].get("runAsUser") == 0}
    assert root == {"gpuplace-node-agent"}
    assert "pods run non-root" in notes and "all capabilities dropped" in notes
    agent = specs["gpuplace-node-agent"]
    added = {
        cap
        for c in agent["containers"]
        for cap in c["securityContext"]["capabilities"].get("add", [])
    }
    assert "The node agent (opt-in) runs as root, not privileged" in notes
    assert f"adding only {' and '.join(sorted(added, reverse=True))}" in notes
    assert ("`hostPID`" in notes) is bool(agent.get("hostPID"))
    for name, spec in specs.items():
        if name in root:
            continue
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for c in spec["containers"]:
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}, name
