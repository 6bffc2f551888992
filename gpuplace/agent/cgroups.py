"""Which pod a host process belongs to: its `/proc/<pid>/cgroup`, read under a proc root,
parsed for the kubelet's pod cgroup.

The kubelet puts every container of a pod under one cgroup named after the pod's UID, in
either of its cgroup drivers, on cgroup v1 (one line per hierarchy, `12:memory:/...`) or
v2 (one line, `0::/...`):

- systemd: `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/
  cri-containerd-<id>.scope` (`kubepods-pod<uid>.slice` for Guaranteed pods,
  `kubepods-besteffort-pod<uid>.slice`); the UID's dashes are written `_`. Under a
  kubelet `cgroupRoot` systemd prefixes every slice with its parents' names (kind and
  nvkind's `/kubelet`: `/kubelet.slice/kubelet-kubepods.slice/.../
  kubelet-kubepods-besteffort-pod<uid>.slice/...`); containerd may write the container's
  cgroup in its own `slice:prefix:name` form (`kubepods-pod<uid>.slice:cri-containerd:<id>`);
- cgroupfs: `/kubepods/burstable/pod<uid>/<id>` (`/kubepods/pod<uid>/<id>`,
  `/kubepods/besteffort/pod<uid>/<id>`).

Seen from inside a container with its own cgroup namespace, a path outside the agent's
own cgroup starts with `/..` segments (`0::/../../kubepods-besteffort-pod<uid>.slice/...`),
so the pod segment is looked for anywhere in the path. A process outside any pod (a
system service, the real capture's `0::/process_api/17aa...`) has no pod: None. Lines of
several hierarchies that name different pods name none (never a guess).

`pod_uid` never raises, whatever the text. Static pods: the cgroup carries the UID the
kubelet gave the static pod, which is its mirror pod's `kubernetes.io/config.mirror`
annotation, not the mirror's own UID (`gpuplace.agent.usage_sampling` maps both). I/O:
`Proc.pod_uid` reads one small file; everything else is pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_NAME = r"[0-9A-Za-z_.]+"
"""One dash-free part of a systemd unit name (a slice's name is its parents' joined by `-`)."""
_SYSTEMD = re.compile(
    rf"(?:{_NAME}-)*kubepods(?:-(?:burstable|besteffort))?-pod([0-9a-f_]{{36}})\.slice"
    rf"(?::[0-9A-Za-z_.-]+:[0-9A-Za-z_.-]+)?"
)
_CGROUPFS = re.compile(rf"pod({_UUID})")
_UID = re.compile(_UUID)
_CGROUPFS_PARENTS = frozenset({"kubepods", "burstable", "besteffort", ".."})
MAX_BYTES = 16384
"""The most of one cgroup file read: a process is in one cgroup per hierarchy (v1 has a
dozen lines of a few hundred bytes at most)."""


def _in_path(path: str) -> str | None:
    segments = path.split("/")
    for position, segment in enumerate(segments):
        systemd = _SYSTEMD.fullmatch(segment)
        if systemd is not None:
            uid = systemd.group(1).replace("_", "-")
            return uid if _UID.fullmatch(uid) else None
        cgroupfs = _CGROUPFS.fullmatch(segment)
        if cgroupfs is not None and position > 0 and segments[position - 1] in _CGROUPFS_PARENTS:
            return cgroupfs.group(1)
    return None


def pod_uid(text: str) -> str | None:
    """The pod UID the cgroup file `text` names, or None (not in a pod, malformed, or
    hierarchies that disagree). O(len(text))."""
    found: set[str] = set()
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        uid = _in_path(parts[2])
        if uid is not None:
            found.add(uid)
    return found.pop() if len(found) == 1 else None


@dataclass(frozen=True, slots=True)
class Proc:
    """A proc file system, `/proc` on a node (the host's only with hostPID: true); a temp
    directory in tests."""

    root: Path = Path("/proc")

    def pod_uid(self, pid: int | Literal["self"]) -> str | None:
        """The pod UID of process `pid` (`self`: the caller), or None: not in a pod, gone,
        or unreadable (a process that exited between NVML's list and this read)."""
        try:
            with (self.root / str(pid) / "cgroup").open("rb") as file:
                raw = file.read(MAX_BYTES)
        except OSError:
            return None
        return pod_uid(raw.decode("utf-8", errors="replace"))
