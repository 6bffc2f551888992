"""One module per `gpuplace` sub-command, and their index.

`HELP` names every command with its one-line help, so that `gpuplace --help` lists them
without importing one: the CLI imports only the module of the command it runs (`serve`
never loads the demo). A command's module is its name with `_` for `-`
(`node-agent` → `node_agent`) and exposes `register(subparsers)`, which adds the
command's parser with `help=HELP[name]`. An index entry whose module is not installed
(the image leaves out `demo`) is not offered.
"""

from __future__ import annotations

import importlib.util
import sys

HELP = {
    "certs": "generate, renew and publish the webhook's TLS certificates",
    "demo": "run gpuplace end to end on a bundled cluster, no Kubernetes needed",
    "explain": "why a pod is on its node, or why it is pending, node by node",
    "node-agent": "run the node agent: GPU discovery and heartbeat, MPS daemons, ops endpoints",
    "preflight": "namespaces whose pods the node agent's admission policy would refuse (GPU stack)",
    "queues": "every GpuQueue's quota, use, borrowing, lending, waiting workloads and fair share",
    "serve": "run the admission webhook, the scheduler extender and the ops endpoints",
    "simulate": "replay a GPU cluster trace (openb format) and print allocation figures",
    "usage": "asked vs used per pod, GPU and node from Prometheus; names the pods that over-ask",
}


def module_name(command: str) -> str:
    """The module that implements `command`: `gpuplace.commands.node_agent` for node-agent."""
    return f"{__name__}.{command.replace('-', '_')}"


def installed() -> list[str]:
    """The commands of `HELP` whose module is installed, in alphabetical order."""
    return [name for name in sorted(HELP) if importlib.util.find_spec(module_name(name))]


def lacks(module: str, command: str, extra: str) -> bool:
    """True, after one line on stderr that says what to install, when the optional
    dependency `module` (of the package extra `extra`) is not installed."""
    if importlib.util.find_spec(module) is not None:
        return False
    print(
        f"gpuplace {command}: needs {module}, which is not installed: "
        f"pip install 'gpuplace[{extra}]'",
        file=sys.stderr,
    )
    return True
