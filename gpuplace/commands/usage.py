"""`gpuplace usage --prometheus URL`: asked vs used, per pod, GPU and node.

Reads each managed pod's grant from its assignment annotations (the API: kubeconfig, as
`gpuplace explain`), and what it really used over the window from Prometheus: the node
agent's series (--metrics gpuplace) or NVIDIA dcgm-exporter's (--metrics dcgm). Prints
per pod per GPU asked vs used (peak and p95 of memory and SM utilisation), the totals
per GPU and node, then the pods that over-ask with the request to write instead.

Over-asking: on every GPU the pod holds, its memory peak stayed below --threshold of its
gpu-memory (suggested: peak x --headroom rounded up to the next GiB), or its p95 SM
utilisation below --threshold of its gpu-percent (suggested: p95 x --headroom rounded up
to the next 5%); judged only with --min-samples samples or more, and never from a whole
GPU's reading shared by several pods (dcgm-exporter on a shared GPU). See docs/usage.md.

Exit status: 0 report printed; 2 Prometheus or the API could not answer (the message
says why).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections.abc import Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any

import pydantic

from gpuplace import commands
from gpuplace.cluster import connecting, dra_claims, keys, kube
from gpuplace.usage import prometheus, report
from gpuplace.usage.gpu_loads import UsageUnavailable

_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d|w)?")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def duration(text: str) -> float:
    """`1h`, `30m`, `90s`, `2d`, `1h30m` or plain seconds, as seconds (at least 1)."""
    raw = text.strip()
    parts = _DURATION.findall(raw)
    if not raw or "".join(number + unit for number, unit in parts) != raw:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 1h, 30m or 90s")
    seconds = sum(float(number) * _UNIT[unit or "s"] for number, unit in parts)
    if seconds < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the window must be at least 1 s")
    return seconds


def moment(text: str) -> float:
    """An RFC 3339 time (`2026-11-24T09:00:00Z`) or POSIX seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an RFC 3339 time (2026-11-24T09:00:00Z) or POSIX seconds"
        ) from None


def ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number in (0, 1]")
    return value


def headroom(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number from 1 to 100")
    return value


def add_prometheus_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """The flags that say where GPU use is read (shared with `gpuplace explain`)."""
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        required=required,
        help="Prometheus' base URL (e.g. http://prometheus.monitoring:9090)"
        + ("" if required else ": adds an asked-vs-used section"),
    )
    parser.add_argument(
        "--metrics",
        choices=prometheus.METRICS,
        default="gpuplace",
        help="which series: the node agent's (gpuplace, per pod) or NVIDIA dcgm-exporter's "
        "(dcgm, per GPU: a shared GPU's use is not split between its pods) (default: %(default)s)",
    )
    parser.add_argument(
        "--window",
        type=duration,
        default=3600.0,
        metavar="DURATION",
        help="how far back to look: 1h, 30m, 2d, ... (default: 1h)",
    )
    parser.add_argument(
        "--at",
        type=moment,
        metavar="TIME",
        help="the window ends at this RFC 3339 time or POSIX seconds (default: now)",
    )
    parser.add_argument(
        "--step",
        type=duration,
        default=prometheus.STEP_SECONDS,
        metavar="DURATION",
        help="the scrape interval of the series: p95s and sample counts are taken over the "
        "de-duplicated series at this step (default: 15s)",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="file holding a bearer token for Prometheus (sent, never printed)",
    )
    parser.add_argument(
        "--prometheus-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds for each Prometheus query (default: %(default)s)",
    )
    parser.add_argument(
        "--threshold",
        type=ratio,
        default=report.Rule().threshold,
        help="a pod over-asks when its memory peak (or SM p95) stays below this share of its "
        "grant (default: %(default)s)",
    )
    parser.add_argument(
        "--headroom",
        type=headroom,
        default=report.Rule().headroom,
        help="suggested request = used x this, rounded up to a GiB or 5%% (default: %(default)s)",
    )
    parser.add_argument(
        "--min-samples",
        type=int,
        default=report.Rule().min_samples,
        metavar="N",
        help="pods with fewer samples in the window are not judged (default: %(default)s)",
    )


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """`--kubeconfig` and `--context`: the user's own credentials (this and `explain`)."""
    parser.add_argument(
        "--kubeconfig", type=Path, help="kubeconfig (default: $KUBECONFIG, ~/.kube/config)"
    )
    parser.add_argument("--context", help="kubeconfig context (default: its current one)")


def run_on_api(command: str, work: Coroutine[Any, Any, int]) -> int:
    """`asyncio.run(work)`, its exit status; a kubeconfig that cannot be used or an API
    error is one line on stderr and status 2 (this, `explain`, `queues`, `preflight`)."""
    try:
        return asyncio.run(work)
    except connecting.ConnectError as error:
        print(f"gpuplace {command}: {error}", file=sys.stderr)
    except kube.ApiError as error:
        print(
            f"gpuplace {command}: the API answered {error.status} {error.reason}: {error.message}",
            file=sys.stderr,
        )
    return 2


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "usage",
        help=commands.HELP["usage"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_prometheus_arguments(parser, required=True)
    parser.add_argument("--namespace", "-n", help="only this namespace's pods (default: all)")
    add_cluster_arguments(parser)
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.set_defaults(run=run)


def source_of(args: argparse.Namespace) -> prometheus.Source:
    """Where the flags say to read. Raises UsageUnavailable (e.g. a URL without a scheme),
    so that the command can refuse it before it connects to anything."""
    try:
        return prometheus.Source(
            url=args.prometheus,
            metrics=args.metrics,
            token_file=args.token_file,
            timeout_seconds=max(args.prometheus_timeout, 0.1),
            step_seconds=args.step,
        )
    except pydantic.ValidationError as error:
        raise UsageUnavailable(
            "; ".join(
                item["msg"].removeprefix("Value error, ")
                for item in error.errors(include_url=False)
            )
        ) from None


def rule_of(args: argparse.Namespace) -> report.Rule:
    return report.Rule(
        threshold=args.threshold, headroom=args.headroom, min_samples=max(args.min_samples, 1)
    )


async def read(
    args: argparse.Namespace, asked: list[report.Asked], *, namespace: str | None = None
) -> report.Report:
    """The report for `asked` from the Prometheus the flags name (only `namespace`'s pods
    when given). Raises UsageUnavailable."""
    async with prometheus.Reader(source_of(args)) as reader:
        usage = await reader.read(args.window, args.at)
    return report.build(usage, asked, rule_of(args), namespace=namespace)


def asked(pods: list[dict[str, Any]]) -> list[report.Asked]:
    """What each pod was granted, from its assignment annotations; a pod on the DRA path is
    left to the node agent's granted series (its claim's grant: a plan's annotations on it
    may name other GPUs than kube-scheduler allocated). O(pods)."""
    found = (report.asked_of(pod) for pod in pods if not dra_claims.named(pod))
    return [item for item in found if item is not None]


async def managed_pods(api: kube.Kube) -> list[dict[str, Any]]:
    """Every pod labelled gpuplace.io/managed=true, page by page."""
    return await api.list_all("pods", label_selector=f"{keys.MANAGED}=true")


def run(args: argparse.Namespace) -> int:
    try:
        source_of(args)  # a bad URL is refused before anything is connected
        return asyncio.run(_usage(args))
    except (UsageUnavailable, connecting.ConnectError) as error:
        print(f"gpuplace usage: {error}", file=sys.stderr)
        return 2
    except kube.ApiError as error:
        print(
            f"gpuplace usage: the API answered {error.status} {error.reason}: {error.message}",
            file=sys.stderr,
        )
        return 2


async def _usage(args: argparse.Namespace) -> int:
    client = await connecting.api_client(args.kubeconfig, context=args.context, in_cluster=False)
    api = kube.Kube(client)
    try:
        pods = await managed_pods(api)
    finally:
        await api.close()
    result = await read(args, asked(pods), namespace=args.namespace or None)
    print(result.as_json() if args.output == "json" else report.render(result))
    return 0
