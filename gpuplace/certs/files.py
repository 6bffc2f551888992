"""Webhook certificates as files: the layout `gpuplace serve --cert-file/--key-file` reads.

Files in one directory: `ca.crt`, `ca.key`, `ca-bundle.crt`, `tls.crt`, `tls.key`. Keys are
written 0600 and certificates 0644, each through a temporary file and a rename, so a
reader (the server's reload) sees either the old or the new file, never half of one; the
key is renamed into place before the certificate, and the server checks that the two match
(`gpuplace.certs.pairs.load`) before it swaps them in. Never logs key bytes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from cryptography import x509

from gpuplace.certs import bundles, pairs, renewal

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CA_BUNDLE = "ca-bundle.crt"
TLS_CERT = "tls.crt"
TLS_KEY = "tls.key"
KEY_MODE = 0o600
CERT_MODE = 0o644
DIR_MODE = 0o700


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace `path` with `data`; the file has `mode` from its first byte on."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write(directory: Path, material: renewal.Material) -> list[Path]:
    """Write all five files (CA first, serving key before serving certificate)."""
    if not directory.exists():
        directory.mkdir(mode=DIR_MODE, parents=True)
    plan = [
        (CA_KEY, material.ca.key_pem(), KEY_MODE),
        (CA_CERT, material.ca.cert_pem(), CERT_MODE),
        (CA_BUNDLE, material.bundle_pem(), CERT_MODE),
        (TLS_KEY, material.serving.key_pem(), KEY_MODE),
        (TLS_CERT, material.serving.cert_pem(), CERT_MODE),
    ]
    written = []
    for name, data, mode in plan:
        path = directory / name
        write_atomic(path, data, mode)
        written.append(path)
    return written


def read(
    directory: Path,
) -> tuple[pairs.Pair | None, pairs.Pair | None, tuple[x509.Certificate, ...]]:
    """CA pair, serving pair and bundle from `directory`; a missing pair gives None.

    `CertError` when a file is there but unusable (it is never silently replaced)."""

    def pair(cert: str, key: str) -> pairs.Pair | None:
        cert_path, key_path = directory / cert, directory / key
        if not cert_path.exists() and not key_path.exists():
            return None
        try:
            return pairs.load(cert_path.read_bytes(), key_path.read_bytes())
        except FileNotFoundError as exc:
            raise pairs.CertError(f"{exc.filename} is missing beside its pair") from None
        except pairs.CertError as exc:
            raise pairs.CertError(f"{cert_path}: {exc}") from None

    ca = pair(CA_CERT, CA_KEY)
    serving = pair(TLS_CERT, TLS_KEY)
    bundle_path = directory / CA_BUNDLE
    bundle = bundles.parse(bundle_path.read_bytes()) if bundle_path.exists() else ()
    return ca, serving, bundle
