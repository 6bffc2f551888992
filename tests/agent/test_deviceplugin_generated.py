"""The committed protobuf modules are exactly what protoc makes of `api.proto` today."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuplace.agent.deviceplugin import api_pb2, api_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path("gpuplace", "agent", "deviceplugin")
GENERATED = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py", "api_pb2_grpc.pyi")


def test_regenerating_gives_the_committed_files(tmp_path: Path) -> None:
    (tmp_path / PACKAGE).mkdir(parents=True)
    shutil.copy(ROOT / PACKAGE / "api.proto", tmp_path / PACKAGE / "api.proto")
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
            str(PACKAGE / "api.proto"),
        ],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / PACKAGE / name).read_text()
        committed = (ROOT / PACKAGE / name).read_text()
        assert fresh == committed, f"{PACKAGE / name} is stale: regenerate it (see api.proto)"


def test_the_wire_names_are_the_kubelets() -> None:
    """The gRPC method paths and field numbers the kubelet speaks (package v1beta1)."""
    service = api_pb2.DESCRIPTOR.services_by_name["DevicePlugin"]
    assert service.full_name == "v1beta1.DevicePlugin"
    assert [method.name for method in service.methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    assert api_pb2.DESCRIPTOR.services_by_name["Registration"].full_name == "v1beta1.Registration"
    response = api_pb2.ContainerAllocateResponse.DESCRIPTOR
    assert {field.name: field.number for field in response.fields} == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }
    request = api_pb2.ContainerPreferredAllocationRequest.DESCRIPTOR
    assert {field.name: field.number for field in request.fields} == {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    }
    assert hasattr(api_pb2_grpc, "add_DevicePluginServicer_to_server")
