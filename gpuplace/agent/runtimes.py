"""Whether a node's container runtime passes CDI devices on: the DRA kubelet plugin's
precondition, decided from the Node's `status.nodeInfo.containerRuntimeVersion` (what the
kubelet reports: `containerd://1.7.24`, `cri-o://1.30.2`). Pure.

What a DRA plugin gives a container travels only as CDI device names in the CRI request,
and a runtime without CDI drops them without a word: the pod would run, with none of its
GPU and none of its limits. So DRA mode is refused unless the runtime is one that honours
them: containerd >= 1.7.2 (the first to read the CRI `CDIDevices` field; 1.7 only with
`enable_cdi = true` in its CRI configuration, the default from 2.0 on) or CRI-O >= 1.23
(CDI on by default). The version cannot show containerd 1.7's `enable_cdi`: docs/dra.md
says to set it, and `caveat` says so in the agent's log.
"""

from __future__ import annotations

import re

MINIMUM = {"containerd": (1, 7, 2), "cri-o": (1, 23, 0)}
"""The first release of each runtime that passes CDI devices from the CRI on."""
_VERSION = re.compile(r"v?([0-9]{1,4})\.([0-9]{1,4})(?:\.([0-9]{1,6}))?")


def parse(reported: str) -> tuple[str, tuple[int, int, int]] | None:
    """`containerd://1.7.24~ds1` → ("containerd", (1, 7, 24)); None when unreadable."""
    name, separator, version = reported.strip().partition("://")
    found = _VERSION.match(version)
    if not separator or found is None:
        return None
    major, minor, patch = found.groups()
    return name.lower(), (int(major), int(minor), int(patch or 0))


def _dotted(version: tuple[int, int, int]) -> str:
    return ".".join(str(part) for part in version)


def cdi_refusal(reported: str) -> str | None:
    """Why DRA mode is refused on a node whose runtime reports `reported`; None when the
    runtime passes CDI devices on."""
    shown = reported.strip()[:80] or "(none reported)"
    parsed = parse(reported)
    needs = ", ".join(f"{name} >= {_dotted(version)}" for name, version in MINIMUM.items())
    if parsed is None:
        return (
            f"the node's container runtime version {shown!r} cannot be read; DRA mode needs "
            f"a runtime that passes CDI devices on ({needs})"
        )
    name, version = parsed
    minimum = MINIMUM.get(name)
    if minimum is None:
        return (
            f"the node's container runtime {shown} is not one gpuplace knows to pass CDI "
            f"devices on; DRA mode needs {needs}"
        )
    if version < minimum:
        return (
            f"the node's container runtime {shown} drops CDI devices, so a DRA pod would run "
            f"without its GPU and its limits; DRA mode needs {name} >= {_dotted(minimum)} "
            "(or run the device plugin: --kubelet-plugin=device-plugin)"
        )
    return None


def caveat(reported: str) -> str | None:
    """What the version cannot show, for the log: containerd 1.x needs `enable_cdi`."""
    parsed = parse(reported)
    if parsed is not None and parsed[0] == "containerd" and parsed[1] < (2, 0, 0):
        return (
            "containerd 1.7 passes CDI devices on only with enable_cdi = true (and "
            'cdi_spec_dirs naming /var/run/cdi) in [plugins."io.containerd.grpc.v1.cri"]'
        )
    return None
