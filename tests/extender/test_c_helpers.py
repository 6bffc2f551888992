"""The extender's wire with its C helpers in use and without them (`gpuplace.extender.
c_helpers`): the same answers either way, and `GPUPLACE_NO_EXTENSIONS` turns them off.

The comparisons put the C helpers in (imported directly, whatever the switch says) and
take them out again, so they test both paths in either of CI's runs; without a C
compiler they skip: there is nothing to compare the Python path with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev.localapi import objects
from gpuplace.extender import c_helpers, wire
from gpuplace.extender.deciding import Decider, Verdict
from gpuplace.extender.workloads import PolicyHolder
from tests.c_helpers_built import BUILT, built, in_use
from tests.cluster.test_syncing import node_record

# Node names as no DNS name looks: JSON escapes, non-ASCII, and the very bytes the byte
# comparison looks for (`"NodeNames":`, brackets, commas); a name filter is sent that no
# node has may hold a lone surrogate too (the API server's names are valid UTF-8).
_ODD = st.sampled_from(  # pieces of a name
    [
        *("a", "z", "0", ".", "-", ":", "_", "é", "中", "😀", " ", '"', "\\", "\n", "\u2028"),
        *("/", ",", "[", "]", "{", "}", '"NodeNames":', '"NodeNames":["a"]}'),
    ]
)
_NAME = st.lists(_ODD, min_size=1, max_size=6).map("".join)
_UNKNOWN = st.lists(_ODD | st.just("\ud800"), min_size=1, max_size=6).map("".join)
_NAMES = st.lists(_NAME, min_size=1, max_size=12, unique=True)
_DNS = st.lists(
    st.text("abcdefghijklmnopqrstuvwxyz0123456789.-", min_size=1, max_size=20),
    min_size=1,
    max_size=12,
    unique=True,
)


@st.composite
def _calls(draw: st.DrawFn) -> tuple[list[tuple[str, int]], list[str], int, bytes]:
    """Nodes (name, GPUs), the names filter is sent (every node in any order, or one
    missing, one twice, one unknown), the pod's percent, and the body as bytes."""
    names = draw(_DNS | _NAMES)
    nodes = [(name, draw(st.integers(0, 2))) for name in names]
    sent = draw(st.permutations(names))
    change = draw(st.sampled_from(["every", "missing", "twice", "unknown"]))
    if change == "missing":
        sent = sent[1:]
    elif change == "twice":
        sent = [*sent, sent[0]]
    elif change == "unknown":
        sent = [*sent, draw(_UNKNOWN)]
    percent = draw(st.sampled_from([30, 100]))
    pod = objects.pod("p", percent=percent)
    pod["metadata"]["uid"] = "uid-p"
    body = {"Pod": pod, "Nodes": None, "NodeNames": sent}
    spacing = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
    text = json.dumps(body, separators=spacing, ensure_ascii=draw(st.booleans()))
    return nodes, sent, percent, text.encode("utf-8", "surrogatepass")


def _decider(nodes: list[tuple[str, int]]) -> tuple[Decider, PolicyHolder]:
    sync = LedgerSync()
    sync.replace_nodes([node_record(name, gpus=gpus) for name, gpus in nodes])
    holder = PolicyHolder(sync, "default")
    return Decider(sync, holder), holder


def _answers(call: tuple[list[tuple[str, int]], list[str], int, bytes]) -> tuple[Any, ...]:
    """filter's arguments, verdict and prioritize's scores, as the process's helpers make
    them: the arguments read as `Service.filter_args` reads them. In the order of the
    nodes aside: with the C helper the names are the Chooser's own list, in its order,
    not the order sent, and filter passes them in its evaluation's order, which a
    kube-scheduler reads as a set (it adds an extender's scores by node name)."""
    nodes, _, _, raw = call
    decider, holder = _decider(nodes)
    every = holder.every_node.of(holder.current())
    args: wire.ExtenderArgs | None = None
    if every is not None:
        args = wire.ExtenderArgs.with_every_name(raw, every)
    if args is None:
        try:
            args = wire.ExtenderArgs.model_validate_json(raw)
        except ValueError as error:
            return (type(error),)
    names = args.names()
    verdict = decider.filter(args.pod, names)
    answer = wire.ranked_priorities_json(verdict.passed, decider.chosen(args.pod, verdict.passed))
    scores = {entry["Host"]: entry["Score"] for entry in json.loads(answer)}
    return sorted(names), _comparable(verdict), scores


def _comparable(verdict: Verdict) -> tuple[Any, ...]:
    """The verdict, the order of the nodes passed aside."""
    return (
        sorted(verdict.passed),
        verdict.failed,
        verdict.unresolvable,
        verdict.misfits,
        verdict.request,
        verdict.holding,
        verdict.problem,
    )


@settings(max_examples=200, deadline=None)
@given(_calls())
def test_filter_and_prioritize_answer_alike_with_and_without_the_c_helpers(
    call: tuple[list[tuple[str, int]], list[str], int, bytes],
) -> None:
    """For any node names (odd and hostile ones too) and any list filter is sent, a
    process with the C helpers and one without read the same arguments and give the same
    verdict and scores; a body neither can read fails alike."""
    c = built()
    with in_use(c.name_set, c.ranked_json):
        fast = _answers(call)
    with in_use(None, None):
        plain = _answers(call)
    assert fast == plain
    sent = call[1]
    if len(fast) > 1:
        assert fast[0] == sorted(sent)


@settings(max_examples=300, deadline=None)
@given(_DNS | _NAMES, st.data())
def test_prioritize_bytes_are_the_same_with_and_without_the_c_helper(
    names: list[str], data: st.DataObject
) -> None:
    """`ranked_priorities_json` on the same choices: byte for byte the same answer."""
    c = built()
    nodes = [(name, data.draw(st.integers(0, 2))) for name in names]
    decider, _ = _decider(nodes)
    pod = objects.pod("p", percent=data.draw(st.sampled_from([30, 100])))
    listed = data.draw(st.permutations(names))
    chosen = decider.chosen(pod, listed)
    with in_use(None, c.ranked_json):
        fast = wire.ranked_priorities_json(listed, chosen)
    with in_use(None, None):
        plain = wire.ranked_priorities_json(listed, chosen)
    assert fast == plain


def test_without_the_c_helpers_filter_keeps_no_set_and_parses() -> None:
    """The Python path builds nothing ahead: no set, not even the Chooser's list."""
    decider, holder = _decider([("n0", 1), ("n1", 1)])
    with in_use(None, None):
        assert holder.every_node.of(holder.current()) is None
        assert decider.every_node() is None
        assert holder.current()._every is None


def _helpers_in(env: dict[str, str]) -> dict[str, Any]:
    """`c_helpers` as a fresh process with `env` sees it."""
    show = (
        "import json; from gpuplace.extender import c_helpers as c;"
        " print(json.dumps([c.OFF, c.NAME_SET is not None, c.RANKED_JSON is not None]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", show],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    off, name_set, ranked = json.loads(done.stdout)
    return {"off": off, "name_set": name_set, "ranked": ranked}


def test_the_switch_turns_both_helpers_off() -> None:
    """`GPUPLACE_NO_EXTENSIONS=1` (any non-empty value, as aiohttp's): neither helper is
    used even where built; unset or empty: each is used where built."""
    base = {k: v for k, v in os.environ.items() if k != c_helpers.SWITCH}
    for value in ("1", "yes"):
        seen = _helpers_in({**base, c_helpers.SWITCH: value})
        assert seen == {"off": True, "name_set": False, "ranked": False}
    for env in (base, {**base, c_helpers.SWITCH: ""}):
        seen = _helpers_in(env)
        built_here = BUILT is not None
        assert seen == {"off": False, "name_set": built_here, "ranked": built_here}
