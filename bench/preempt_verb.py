"""The preempt verb's synchronous work per call: what holds the event loop the other verbs
and `/readyz` share.

Two shapes of call, timed in the parts `gpuplace.extender.app` runs them in: decoding
the body (`PreemptionArgs.model_validate_json`, one stretch), the answer
(`Preempter.answering`, whose steps the extender runs in slices of ~5 ms with a turn of
the event loop between them: `longest_step_seconds` is the longest step, its first
included, which also reads the call's snapshot) and its encoding (one stretch).

- `victims`: issue 30's hostile call, one 8-GPU node whose GPUs are held by 8 whole-GPU
  pods of priority 0, and a whole-GPU preemptor offered one of them plus N more UIDs
  that hold no GPU there (10,000, 20,000, 100,000). With the default
  `--preempt-max-victims` (1,000) such a node is left out unread; with the limit lifted
  (`limit: off`) the answer is worked out, linear in N (it took 0.65 s / 2.7 s / ~67 s
  before issue 30, a list scanned per victim);
- `nodes`: kube-scheduler's widest real call, `--preempt-max-nodes` nodes (1,000) of
  8 GPUs, each GPU held by a 50% and a 40% pod of priority 0, a 70% preemptor offered
  the two pods of one GPU per node (its pick on node totals), so every node runs the
  search.

    .venv/bin/python -m bench.preempt_verb [--victims 10000,20000,100000] [--nodes 1000]
        [--repeat 3]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.gang_preempt_plan import bound
from gpuplace.cluster import pods
from gpuplace.cluster.nodes import NodeRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev.localapi import objects
from gpuplace.extender.preempt_verb import Preempter
from gpuplace.extender.preempt_wire import PreemptionArgs, PreemptionResult
from gpuplace.placement.requests import WHOLE
from gpuplace.wiring.settings import SidecarSettings
from tests.placement.clusters import node

GPUS = 8
DEFAULTS = SidecarSettings()


def _body(percent: int | None, offered: dict[str, list[str]]) -> bytes:
    pod = objects.pod("high", percent=percent, count=None if percent else 1)
    pod["metadata"]["uid"] = "high"
    pod["spec"]["priority"] = 100
    return json.dumps(
        {
            "Pod": pod,
            "NodeNameToVictims": None,
            "NodeNameToMetaVictims": {
                name: {"Pods": [{"UID": uid} for uid in uids], "NumPDBViolations": 0}
                for name, uids in offered.items()
            },
        }
    ).encode()


def _timed(run: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def _stepped(preempter: Preempter, args: PreemptionArgs) -> tuple[PreemptionResult, float]:
    """The answer, and the longest of its steps (what runs between two pauses)."""
    steps, longest = preempter.answering(args), 0.0
    while True:
        started = time.perf_counter()
        try:
            next(steps)
        except StopIteration as done:
            return done.value, max(longest, time.perf_counter() - started)
        longest = max(longest, time.perf_counter() - started)


def _call(preempter: Preempter, body: bytes, repeat: int) -> dict[str, Any]:
    decode_s, args = _timed(lambda: PreemptionArgs.model_validate_json(body), repeat)
    answer_s, (result, longest) = _timed(lambda: _stepped(preempter, args), repeat)
    encode_s, _ = _timed(result.dump, repeat)
    return {
        "body_kib": len(body) // 1024,
        "decode_seconds": round(decode_s, 4),
        "answer_seconds": round(answer_s, 4),
        "longest_step_seconds": round(longest, 4),
        "encode_seconds": round(encode_s, 4),
        "answered_nodes": len(result.nodes),
        "answered_victims": sum(len(uids) for uids, _ in result.nodes.values()),
    }


def victims_case(count: int, limit: int | None, repeat: int) -> dict[str, Any]:
    sync = LedgerSync()
    sync.put_node(NodeRecord("gpu-0", "gpu-0", True, node("gpu-0", GPUS)))
    for g in range(GPUS):
        bound(sync, f"p{g}", "gpu-0", g, WHOLE)
    offered = ["p0", *(f"no-gpu-{i:06d}" for i in range(count))]
    preempter = Preempter(
        sync,
        pods.Reader().request,
        max_victims=limit if limit is not None else count + 1,
        max_nodes=DEFAULTS.preempt_max_nodes,
    )
    case = {"victims": count, "limit": limit if limit is not None else "off"}
    return case | _call(preempter, _body(None, {"gpu-0": offered}), repeat)


def nodes_case(count: int, repeat: int) -> dict[str, Any]:
    sync = LedgerSync()
    offered: dict[str, list[str]] = {}
    for n in range(count):
        name = f"gpu-{n:05d}"
        sync.put_node(NodeRecord(name, name, True, node(name, GPUS)))
        for g in range(GPUS):
            bound(sync, f"{name}-{g}-50", name, g, 500)
            bound(sync, f"{name}-{g}-40", name, g, 400)
        offered[name] = [f"{name}-{n % GPUS}-50", f"{name}-{(n + 1) % GPUS}-40"]
    preempter = Preempter(
        sync,
        pods.Reader().request,
        max_victims=DEFAULTS.preempt_max_victims,
        max_nodes=DEFAULTS.preempt_max_nodes,
    )
    return {"nodes": count, "pods": len(sync.pods)} | _call(preempter, _body(70, offered), repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--victims", default="10000,20000,100000")
    parser.add_argument("--nodes", default=str(DEFAULTS.preempt_max_nodes))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    counts = [int(n) for n in args.victims.split(",") if n]
    cases = [
        victims_case(n, limit, args.repeat)
        for n in counts
        for limit in (DEFAULTS.preempt_max_victims, None)
    ]
    cases += [nodes_case(int(n), args.repeat) for n in args.nodes.split(",") if n]
    print(json.dumps({"benchmark": "preempt_verb", "cases": cases}, indent=2))


if __name__ == "__main__":
    main()
