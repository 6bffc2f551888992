"""Hostile input on every extender verb (issue 30, point 5 and its "must hold"): the
payloads kube-scheduler sent (../shared/fixtures/extender*, or the same shapes built
here when absent) mutated at random — a value of another type, null, a huge or negative
number, a long or unicode string, deep nesting, a key dropped, renamed or added — and
garbage bytes, sent to a running sidecar over HTTP. Every answer is 200 or 4xx, never a
5xx; each comes within a bound; a refusal changes nothing (ledger, holds, pending
preemptions); and the process does not grow beyond a bound over the run."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from tests.extender.conftest import Harness, harness

SHARED = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
VERBS = ("filter", "prioritize", "bind", "preempt")
ANSWER_WITHIN = 2.0
"""Seconds any one request may take (they take milliseconds)."""
GROWTH_MIB = 150
"""How much the process (the sidecar and its local API) may grow over one run."""


def _captured(verb: str) -> dict[str, Any] | None:
    folder = SHARED / ("extender-preempt" if verb == "preempt" else "extender")
    for path in sorted(folder.glob(f"*-{verb}-*.json")) if folder.is_dir() else []:
        request = json.loads(path.read_text())["request"]
        assert isinstance(request, dict)
        return request
    return None


def _built(verb: str) -> dict[str, Any]:
    """The captured payload's shape, for a checkout without ../shared."""
    pod = objects.pod("share-mutated", percent=50, memory="20Gi")
    pod["metadata"]["uid"] = "85c0a107-3645-4389-84b4-2e33b12c72ca"
    if verb == "bind":
        return {
            "PodName": "share-mutated",
            "PodNamespace": "default",
            "PodUID": pod["metadata"]["uid"],
            "Node": "gpu-a",
        }
    if verb == "preempt":
        pod["spec"]["priority"] = 1000
        victims = {"NumPDBViolations": 0, "Pods": [{"UID": "low-a"}]}
        return {"Pod": pod, "NodeNameToVictims": None, "NodeNameToMetaVictims": {"gpu-a": victims}}
    return {"Pod": pod, "NodeNames": ["gpu-a", "gpu-b"], "Nodes": None}


PAYLOADS = {verb: _captured(verb) or _built(verb) for verb in VERBS}


def _nested(depth: int) -> Any:
    value: Any = "deep"
    for level in range(depth):
        value = [value] if level % 2 else {"x": value}
    return value


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 10**40, -1, 0]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["", "\x00", "é" * 300, "𝔤𝔭𝔲" * 50, "x" * 20_000, "../../etc/passwd"]),
    st.just([]),
    st.just({}),
    st.lists(st.integers() | st.text(max_size=5) | st.none(), max_size=4),
    st.dictionaries(st.text(max_size=6), st.integers() | st.none(), max_size=3),
    st.integers(2, 300).map(_nested),
    st.integers(1_000, 20_000).map(lambda n: ["v"] * n),
)


def mutate(value: Any, draw: Callable[[Any], Any], depth: int = 0) -> Any:
    """`value` with one random change somewhere inside it (a copy)."""
    descend = isinstance(value, dict | list) and value and depth < 12 and draw(st.booleans())
    if descend and isinstance(value, dict):
        key = draw(st.sampled_from(sorted(value)))
        return {**value, key: mutate(value[key], draw, depth + 1)}
    if descend and isinstance(value, list):
        index = draw(st.integers(0, len(value) - 1))
        return [*value[:index], mutate(value[index], draw, depth + 1), *value[index + 1 :]]
    how = draw(st.sampled_from(["replace", "replace", "drop", "add", "case"]))
    if how == "replace" or not isinstance(value, dict) or not value:
        return draw(JUNK)
    changed = dict(value)
    key = draw(st.sampled_from(sorted(changed)))
    if how == "drop":
        del changed[key]
    elif how == "add":
        changed[draw(st.text(max_size=12))] = draw(JUNK)
    else:
        changed[key.swapcase()] = changed.pop(key)
    return changed


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def state(h: Harness) -> tuple[object, ...]:
    """What a refused request must leave as it was."""
    sync = h.sidecar.sync
    return (
        sync.ledger.generation,
        sync.ledger.snapshot(),
        tuple(h.sidecar.preempter.pending),
        sync.pods_version,
    )


async def seeded(h: Harness) -> None:
    """The payloads' nodes, and the captured preemption's victims bound there, so that
    a refusal has a ledger to leave alone."""
    await asyncio.wait_for(h.sidecar.sync.ready.wait(), 5)
    victims = PAYLOADS["preempt"]["NodeNameToMetaVictims"]
    for i, (node, offered) in enumerate(victims.items()):
        for j, pod in enumerate(offered["Pods"]):
            low = h.api.create(objects.pod(f"low-{i}-{j}", percent=30), uid=pod["UID"])
            assert await h.bind(low, node) == ""
    total = sum(len(offered["Pods"]) for offered in victims.values())
    await h.synced(lambda: sum(r.bound for r in h.sidecar.sync.pods.values()) == total)


def nodes_named() -> set[str]:
    names = set(PAYLOADS["filter"]["NodeNames"]) | set(PAYLOADS["prioritize"]["NodeNames"])
    return names | set(PAYLOADS["preempt"]["NodeNameToMetaVictims"]) | {PAYLOADS["bind"]["Node"]}


async def send(h: Harness, verb: str, body: bytes) -> tuple[int, float]:
    started = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    async with h.session.post(f"{h.url}/{verb}", data=body, headers=headers) as response:
        await response.read()
        return response.status, time.perf_counter() - started


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_mutated_payloads_get_200_or_4xx_and_a_refusal_changes_nothing(
    data: st.DataObject,
) -> None:
    async def run() -> None:
        async with localapi.serve(localapi.FakeApi(access=localapi.Access.shipped())) as server:
            for name in sorted(nodes_named()):
                server.api.create(objects.node(name, gpus=1))
            async with harness(server) as h:
                await seeded(h)
                grown_from = rss_mib()
                for verb in VERBS:
                    for _ in range(10):
                        mutated = mutate(copy.deepcopy(PAYLOADS[verb]), data.draw)
                        body = json.dumps(mutated).encode()
                        before = state(h)
                        status, took = await send(h, verb, body)
                        assert status == 200 or 400 <= status < 500, (verb, status, body[:300])
                        assert took < ANSWER_WITHIN, (verb, took, body[:300])
                        if status != 200:
                            assert state(h) == before, (verb, body[:300])
                    garbage = data.draw(st.binary(max_size=200))
                    before = state(h)
                    status, took = await send(h, verb, garbage)
                    assert status == 400 and took < ANSWER_WITHIN, (verb, status, garbage)
                    assert state(h) == before
                assert rss_mib() - grown_from < GROWTH_MIB

    asyncio.run(run())


@pytest.mark.parametrize(
    ("verb", "body", "where"),
    [
        # issue 30, point 5: each of these was a 500
        (
            "filter",
            {"Pod": {"metadata": {"name": "x"}}, "Nodes": {"items": [{"metadata": 5}]}},
            "Nodes.items.0: metadata: Input should be an object",
        ),
        ("preempt", {"Pod": {"metadata": "x", "spec": 5}}, "Pod: metadata: Input should be"),
        (
            "preempt",
            {
                "Pod": {"metadata": {"name": "p"}},
                "NodeNameToMetaVictims": None,
                "NodeNameToVictims": {"n": {"Pods": [{"metadata": 5}]}},
            },
            "NodeNameToVictims.n.Pods.0: metadata: Input should be an object",
        ),
        # and the parts read of the pod, by type
        ("filter", {"Pod": {"metadata": {"name": 5}}, "NodeNames": []}, "metadata.name"),
        (
            "prioritize",
            {"Pod": {"metadata": {"name": "p", "annotations": {"a": 1}}}, "NodeNames": []},
            "metadata.annotations.a",
        ),
        (
            "preempt",
            {"Pod": {"metadata": {"name": "p"}, "spec": {"priority": "5"}}},
            "spec.priority",
        ),
        (
            "preempt",
            {"Pod": {"metadata": {"name": "p"}, "spec": {"priority": 2**31}}},
            "spec.priority: Input should be less than 2147483648",
        ),
        (
            "filter",
            {
                "Pod": {"metadata": {"name": "p"}, "spec": {"containers": [{"resources": 3}]}},
                "NodeNames": [],
            },
            "spec.containers.0.resources",
        ),
        (
            "preempt",
            {
                "Pod": {"metadata": {"name": "p"}},
                "NodeNameToMetaVictims": {"n": {"Pods": [], "NumPDBViolations": -1}},
            },
            "NumPDBViolations",
        ),
        ("bind", {"PodName": 5, "PodNamespace": "d", "PodUID": "u", "Node": "n"}, "PodName"),
    ],
)
async def test_malformed_shapes_get_400_naming_the_part(
    server: localapi.Server, verb: str, body: dict[str, Any], where: str
) -> None:
    async with harness(server) as h:
        status, answer = await h.post(verb, body)
    assert status == 400, answer
    assert answer["Error"].startswith(f"not a kube-scheduler {verb} request: "), answer
    assert where in answer["Error"], answer
