"""The committed DRA protobuf modules are exactly what protoc makes of the .proto files, and
those are the kubelet's own (v1.36.2, the kit's copies), with the wire names it dials."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuplace.agent.draplugin import dra_pb2, dra_pb2_grpc, health_pb2, registration_pb2

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path("gpuplace", "agent", "draplugin")
PROTOS = {
    "dra.proto": "dra-v1-api.proto",
    "registration.proto": "pluginregistration-v1-api.proto",
    "health.proto": "dra-health-v1alpha1-api.proto",
}
"""Our file → the kit's copy of the kubelet's (../shared/k8s/reference/protos)."""
KIT_PROTOS = ROOT.parent / "shared" / "k8s" / "reference" / "protos"


def generated_names(proto: str) -> list[str]:
    stem = proto.removesuffix(".proto")
    return [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py", f"{stem}_pb2_grpc.pyi"]


def test_regenerating_gives_the_committed_files(tmp_path: Path) -> None:
    (tmp_path / PACKAGE).mkdir(parents=True)
    for proto in PROTOS:
        shutil.copy(ROOT / PACKAGE / proto, tmp_path / PACKAGE / proto)
    binaries = Path(sys.executable).parent
    if not (binaries / "protoc-gen-mypy").exists():
        pytest.fail("mypy-protobuf (the test extra) is not installed beside this Python")
    env = {**os.environ, "PATH": f"{binaries}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--python_out=.",
            "--grpc_python_out=.",
            "--mypy_out=.",
            "--mypy_grpc_out=.",
            *(str(PACKAGE / proto) for proto in PROTOS),
        ],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
    )
    for proto in PROTOS:
        for name in generated_names(proto):
            fresh = (tmp_path / PACKAGE / name).read_text()
            committed = (ROOT / PACKAGE / name).read_text()
            assert fresh == committed, f"{PACKAGE / name} is stale: regenerate it (see __init__)"


def test_the_protos_are_the_kubelets_own() -> None:
    if not KIT_PROTOS.is_dir():
        pytest.skip(f"{KIT_PROTOS} absent (../shared beside the checkout)")
    for ours, theirs in PROTOS.items():
        assert (ROOT / PACKAGE / ours).read_bytes() == (KIT_PROTOS / theirs).read_bytes(), ours


def test_the_wire_names_are_the_kubelets() -> None:
    """The services the kubelet dials and the fields NodePrepareResources carries."""
    service = dra_pb2.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert service.full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert [method.name for method in service.methods] == [
        "NodePrepareResources",
        "NodeUnprepareResources",
    ]
    registration = registration_pb2.DESCRIPTOR.services_by_name["Registration"]
    assert registration.full_name == "pluginregistration.Registration"
    assert [method.name for method in registration.methods] == [
        "GetInfo",
        "NotifyRegistrationStatus",
    ]
    health = health_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert health.full_name == "v1alpha1.DRAResourceHealth"
    device = dra_pb2.Device.DESCRIPTOR
    assert {field.name: field.number for field in device.fields} == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    }
    claim = dra_pb2.Claim.DESCRIPTOR
    assert {field.name: field.number for field in claim.fields} == {
        "namespace": 1,
        "uid": 2,
        "name": 3,
    }
    assert hasattr(dra_pb2_grpc, "add_DRAPluginServicer_to_server")
