"""A process's pod from its /proc/<pid>/cgroup: both kubelet cgroup drivers, cgroup v1 and
v2, QoS classes, paths seen from inside a cgroup namespace; the real capture's process
outside any pod; garbage never raises."""

from __future__ import annotations

import tempfile
import uuid as uuidlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuplace.agent import cgroups
from tests.agent.kubelet import gpu_fixture

UID = "0f9a3c2e-5b1d-4e7a-9c3f-2a6b8d1e4f70"
SYSTEMD_UID = UID.replace("-", "_")
CID = "4b2f" * 16


def test_the_real_mps_clients_are_in_no_pod() -> None:
    """shared/fixtures/gpu/mps-control.txt: the captured clients' cgroup, as it is."""
    text = (gpu_fixture("mps-control.txt")).read_text()
    sections = text.split("== /proc/")[1:]
    assert len(sections) == 2
    for section in sections:
        header, _, body = section.partition("\n")
        assert header.endswith("/cgroup")
        assert body.strip().startswith("0::/process_api/")
        assert cgroups.pod_uid(body) is None


@pytest.mark.parametrize(
    "text",
    [
        # cgroup v2, systemd driver, each QoS class
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice"
        f"/cri-containerd-{CID}.scope\n",
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SYSTEMD_UID}"
        f".slice/cri-containerd-{CID}.scope\n",
        f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope\n",
        # CRI-O and Docker scopes
        f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/crio-{CID}.scope\n",
        f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/docker-{CID}.scope\n",
        # cgroup v2, cgroupfs driver
        f"0::/kubepods/burstable/pod{UID}/{CID}\n",
        f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
        f"0::/kubepods/pod{UID}/{CID}\n",
        # seen from inside another container's cgroup namespace
        f"0::/../../kubepods-besteffort-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope\n",
        f"0::/../../../besteffort/pod{UID}/{CID}\n",
        # cgroup v1: one line per hierarchy, all naming the same pod
        f"12:memory:/kubepods/burstable/pod{UID}/{CID}\n"
        f"11:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}\n"
        f"1:name=systemd:/kubepods/burstable/pod{UID}/{CID}\n",
        f"12:pids:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}"
        f".slice/cri-containerd-{CID}.scope\n0::/\n",
        # the pod's sandbox (pause) or a process in the pod cgroup itself
        f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice\n",
        # kind / nvkind: the kubelet's cgroupRoot is /kubelet, systemd prefixes every slice
        f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice"
        f"/kubelet-kubepods-besteffort-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope\n",
        f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{SYSTEMD_UID}.slice"
        f"/cri-containerd-{CID}.scope\n",
        f"0::/a.slice/a-b.slice/a-b-kubepods.slice/a-b-kubepods-burstable.slice"
        f"/a-b-kubepods-burstable-pod{SYSTEMD_UID}.slice/crio-{CID}.scope\n",
        # containerd's systemd cgroup path (slice:prefix:name)
        f"0::/kubepods-burstable-pod{SYSTEMD_UID}.slice:cri-containerd:{CID}\n",
        f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice:cri-containerd:{CID}\n",
    ],
)
def test_every_kubepods_layout_names_its_pod(text: str) -> None:
    assert cgroups.pod_uid(text) == UID


OTHER = "9d8c7b6a-5f4e-4d3c-8b2a-1f0e9d8c7b6a"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0::/\n",
        "0::/process_api/17aa28515a5cbf055b6370f4142072ec\n",  # the capture's
        "0::/system.slice/containerd.service\n",
        "0::/user.slice/user-1000.slice/session-3.scope\n",
        f"0::/docker/{CID}\n",
        # a pod segment outside kubepods is not the kubelet's
        f"0::/somewhere/pod{UID}/{CID}\n",
        # not a UUID
        "0::/kubepods/burstable/podnot-a-uid/x\n",
        "0::/kubepods.slice/kubepods-pod0f9a3c2e_5b1d.slice/x.scope\n",
        f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID.upper()}.slice/x.scope\n",
        # v1 hierarchies that disagree name no pod
        f"12:memory:/kubepods/pod{UID}/{CID}\n11:cpu:/kubepods/pod{OTHER}/{CID}\n",
        "garbage\n\x00\xff:::\n",
        # a prefix that is not a slice name's, or a suffix that is not slice:prefix:name
        f"0::/x/-kubepods-pod{SYSTEMD_UID}.slice/x.scope\n",
        f"0::/x/a--kubepods-pod{SYSTEMD_UID}.slice/x.scope\n",
        f"0::/x/a b-kubepods-pod{SYSTEMD_UID}.slice/x.scope\n",
        f"0::/x/akubepods-pod{SYSTEMD_UID}.slice/x.scope\n",
        f"0::/x/kubepods-pod{SYSTEMD_UID}.slice:\n",
        f"0::/x/kubepods-pod{SYSTEMD_UID}.slice:cri-containerd\n",
        f"0::/x/kubepods-pod{SYSTEMD_UID}.slice:cri-containerd:\n",
        f"0::/x/kubepods-pod{SYSTEMD_UID}.slice:a:b:c\n",
        f"0::/x/kubepods-pod{SYSTEMD_UID}.slicex\n",
    ],
)
def test_anything_else_names_no_pod(text: str) -> None:
    assert cgroups.pod_uid(text) is None


QOS = st.sampled_from(["", "burstable", "besteffort"])
RUNTIME = st.sampled_from(["cri-containerd", "crio", "docker"])
ROOT = st.lists(
    st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.", min_size=1),
    max_size=3,
).filter(lambda names: all(name not in (".", "..") for name in names))
"""The kubelet's cgroupRoot as systemd nests it (`/kubelet` on kind: `kubelet.slice/
kubelet-kubepods.slice/...`): each name a slice name's segment."""


@given(
    st.uuids(),
    QOS,
    RUNTIME,
    st.tuples(st.booleans(), st.booleans(), st.booleans()),
    st.tuples(st.integers(0, 3), ROOT),
)
def test_any_well_formed_path_round_trips_its_uid(
    uid: uuidlib.UUID,
    qos: str,
    runtime: str,
    driver_v1_colons: tuple[bool, bool, bool],
    up_and_root: tuple[int, list[str]],
) -> None:
    """Either driver (systemd or cgroupfs), v1 or v2, any QoS class and runtime, under any
    cgroupRoot, systemd's scope or containerd's `slice:prefix:name`, seen from any depth
    of a cgroup namespace."""
    systemd, v1, colons = driver_v1_colons
    up, root = up_and_root
    text_uid = str(uid)
    if systemd:
        prefix = "".join(f"{name}-" for name in root)
        parents = [f"{'-'.join(root[: n + 1])}.slice" for n in range(len(root))]
        tier = f"{prefix}kubepods-{qos}" if qos else f"{prefix}kubepods"
        parts = [*parents, f"{prefix}kubepods.slice"] + ([f"{tier}.slice"] if qos else [])
        pod_slice = f"{tier}-pod{text_uid.replace('-', '_')}.slice"
        if colons:
            parts += [f"{pod_slice}:{runtime}:{CID}"]
        else:
            parts += [pod_slice, f"{runtime}-{CID}.scope"]
    else:
        parts = [*root, "kubepods"] + ([qos] if qos else []) + [f"pod{text_uid}", CID]
    if up:  # a cgroup namespace cuts the leading segments off and climbs instead
        parts = [".."] * up + parts[min(up, len(parts) - 2) :]
    path = "/" + "/".join(parts)
    text = f"12:memory:{path}\n3:cpu,cpuacct:{path}\n" if v1 else f"0::{path}\n"
    assert cgroups.pod_uid(text) == text_uid


@given(st.text(max_size=400))
def test_garbage_never_raises(text: str) -> None:
    found = cgroups.pod_uid(text)
    assert found is None or len(found) == 36


@given(st.binary(max_size=cgroups.MAX_BYTES + 100))
def test_a_cgroup_file_of_any_bytes_never_raises(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "7").mkdir()
        (Path(root) / "7" / "cgroup").write_bytes(raw)
        found = cgroups.Proc(Path(root)).pod_uid(7)
    assert found is None or found in raw.decode(errors="replace").replace("_", "-")


def test_proc_reads_under_its_root_and_a_gone_process_has_no_pod(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(f"0::/kubepods/pod{UID}/{CID}\n")
    proc = cgroups.Proc(tmp_path)
    assert proc.pod_uid(42) == UID
    assert proc.pod_uid(43) is None  # exited between NVML's list and the read
    (tmp_path / "44").mkdir()
    (tmp_path / "44" / "cgroup").mkdir()  # unreadable as a file
    assert proc.pod_uid(44) is None
