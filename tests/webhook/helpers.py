"""Test helpers shared by the webhook and serve tests: throwaway TLS files, a node
inventory in `kubectl get nodes -o json` shape, the captured admission fixtures, and
review bodies."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import uuid
from pathlib import Path
from typing import Any

import kubernetes_validate
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from packaging.version import Version

from gpuplace.cluster import keys

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
ADMISSION_FIXTURES = SHARED / "fixtures" / "admission"
K8S_VERSION_FILE = SHARED / "fixtures" / "k8s-version.txt"
NO_FIXTURES = f"captured admission fixtures not found at {ADMISSION_FIXTURES} (../shared)"


def write_certificate(
    directory: Path, name: str = "tls", serial: int | None = None
) -> tuple[Path, Path]:
    """A self-signed ECDSA certificate for 127.0.0.1/localhost; returns (cert, key) paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuplace-test")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(serial if serial is not None else x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def node(
    name: str,
    *,
    gpus: int = 0,
    model: str = "",
    memory_mib: int = 0,
    enabled: bool = True,
    nvlink: list[int] | None = None,
) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name}
    annotations: dict[str, str] = {}
    if enabled:
        labels[keys.NODE_ENABLED] = "true"
    if gpus:
        labels[keys.GFD_COUNT] = str(gpus)
        labels[keys.GFD_PRODUCT] = model
        labels[keys.GFD_MEMORY] = str(memory_mib)
    if nvlink is not None:
        annotations[keys.NODE_GPUS] = json.dumps(
            [{"index": index, "nvlink": domain} for index, domain in enumerate(nvlink)]
        )
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"}},
    }


def node_list() -> dict[str, Any]:
    """A small cluster: 8×A100-80GB on NVLink, 2×L4-24GB, a CPU node, a node not opted in."""
    return {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            node("a100-0", gpus=8, model="NVIDIA-A100-SXM4-80GB", memory_mib=81920, nvlink=[0] * 8),
            node("l4-0", gpus=2, model="NVIDIA-L4", memory_mib=24576),
            node("cpu-0"),
            node("t4-off", gpus=4, model="Tesla-T4", memory_mib=16384, enabled=False),
        ],
    }


def fixture_files(pattern: str = "*.json") -> list[Path]:
    return sorted(ADMISSION_FIXTURES.glob(pattern)) if ADMISSION_FIXTURES.is_dir() else []


def fixture_request(path: Path) -> dict[str, Any]:
    """The AdmissionReview exactly as the API server sent it."""
    request: dict[str, Any] = json.loads(path.read_text())["request"]
    return request


def schema_version() -> str:
    """Newest Pod schema kubernetes-validate ships that is not newer than the cluster's."""
    versions: list[str] = sorted(
        {str(v) for v in kubernetes_validate.utils.all_versions()}, key=Version
    )
    if K8S_VERSION_FILE.is_file():
        found = re.search(r"v?(\d+\.\d+(?:\.\d+)?)", K8S_VERSION_FILE.read_text())
        if found is None:
            return versions[-1]
        cluster = Version(found.group(1))
        fitting = [v for v in versions if Version(v).release[:2] <= cluster.release[:2]]
        if fitting:
            return fitting[-1]
    return versions[-1]


def review(
    obj: dict[str, Any] | None,
    *,
    operation: str = "CREATE",
    old: dict[str, Any] | None = None,
    user: str = "alice",
    dry_run: bool = False,
    uid: str | None = None,
) -> dict[str, Any]:
    meta = (obj or old or {}).get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid or str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "name": str(meta.get("name", "")),
            "namespace": str(meta.get("namespace", "default")),
            "operation": operation,
            "userInfo": {"username": user, "groups": ["system:authenticated"]},
            "object": obj,
            "oldObject": old,
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def pod(
    annotations: dict[str, str] | None = None,
    *,
    containers: list[dict[str, Any]] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A pod as the API server sends it to admission (defaults applied)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "p",
            "namespace": "default",
            "annotations": dict(annotations or {}),
        },
        "spec": {
            "containers": containers
            if containers is not None
            else [
                {
                    "name": "main",
                    "image": "busybox:1.36",
                    "imagePullPolicy": "IfNotPresent",
                    "resources": {},
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File",
                }
            ],
            "dnsPolicy": "ClusterFirst",
            "restartPolicy": "Always",
            "schedulerName": "default-scheduler",
            "securityContext": {},
            "terminationGracePeriodSeconds": 30,
            **spec,
        },
        "status": {},
    }
