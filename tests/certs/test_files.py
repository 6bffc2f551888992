"""Certificate files: modes, atomic replacement, read back; `gpuplace certs` on files."""

from __future__ import annotations

import io
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpuplace import cli
from gpuplace.certs import bundles, checking, issuing, pairs, renewal
from gpuplace.certs import files as cert_files
from gpuplace.commands import certs as certs_command

NOW = datetime(2026, 3, 1, tzinfo=UTC)
SPEC = issuing.Spec(dns_names=issuing.service_names("gpuplace-webhook", "gpuplace"))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_are_written_0600_certificates_0644(tmp_path: Path) -> None:
    out = tmp_path / "tls"
    written = cert_files.write(out, renewal.issue((), SPEC, NOW))
    assert [p.name for p in written] == ["ca.key", "ca.crt", "ca-bundle.crt", "tls.key", "tls.crt"]
    assert mode(out) == 0o700
    assert mode(out / "ca.key") == 0o600
    assert mode(out / "tls.key") == 0o600
    assert mode(out / "tls.crt") == 0o644
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written)  # no temps


def test_rewrite_keeps_modes_and_reads_back(tmp_path: Path) -> None:
    first = renewal.issue((), SPEC, NOW)
    cert_files.write(tmp_path, first)
    (tmp_path / "tls.key").chmod(0o644)  # someone loosened it; the rewrite restores 0600
    second = renewal.issue(first.bundle, SPEC, NOW)
    cert_files.write(tmp_path, second)
    assert mode(tmp_path / "tls.key") == 0o600
    ca, serving, bundle = cert_files.read(tmp_path)
    assert ca is not None and serving is not None
    assert ca.cert == second.ca.cert and serving.cert == second.serving.cert
    assert bundle == second.bundle and len(bundle) == 2


def test_read_of_an_empty_directory_and_of_half_a_pair(tmp_path: Path) -> None:
    assert cert_files.read(tmp_path) == (None, None, ())
    cert_files.write(tmp_path, renewal.issue((), SPEC, NOW))
    (tmp_path / "tls.key").unlink()
    with pytest.raises(pairs.CertError, match="missing beside its pair"):
        cert_files.read(tmp_path)


def run(argv: list[str], now: datetime) -> tuple[int, str]:
    """Parse like `gpuplace ...` and run the certs verb on an injected clock."""
    args = cli.build_parser().parse_args(argv)
    body = {
        "generate": certs_command.generate,
        "rotate": certs_command.rotate,
        "check": certs_command.check,
    }[args.certs_command]
    out = io.StringIO()
    code = body(args, now, out)
    return code, out.getvalue()


def test_generate_rotate_check_on_files(tmp_path: Path) -> None:
    out = str(tmp_path / "tls")
    code, text = run(
        [
            "certs",
            "generate",
            "--out-dir",
            out,
            "--dns-name",
            "localhost",
            "--ip-address",
            "127.0.0.1",
        ],
        NOW,
    )
    assert code == 0
    assert "localhost" in text and "127.0.0.1" in text and "PRIVATE" not in text
    ca, serving, _ = cert_files.read(Path(out))
    assert ca is not None and serving is not None
    assert checking.covers(serving.cert, ["localhost"], [issuing.parse_ip("127.0.0.1")])

    with pytest.raises(pairs.CertError, match="already holds a CA"):
        run(["certs", "generate", "--out-dir", out], NOW)

    code, text = run(
        [
            "certs",
            "rotate",
            "--out-dir",
            out,
            "--dns-name",
            "localhost",
            "--ip-address",
            "127.0.0.1",
        ],
        NOW + timedelta(days=1),
    )
    assert code == 0 and "nothing to renew" in text and "wrote" not in text

    check = [
        "certs",
        "check",
        "--cert-file",
        f"{out}/tls.crt",
        "--key-file",
        f"{out}/tls.key",
        "--ca-file",
        f"{out}/ca-bundle.crt",
        "--service",
        "gpuplace-webhook",
    ]
    assert run(check, NOW + timedelta(days=1))[0] == certs_command.EXIT_OK
    assert run(check, NOW + timedelta(days=300))[0] == certs_command.EXIT_RENEWAL_DUE
    code, text = run(check, NOW + timedelta(days=400))
    assert code == certs_command.EXIT_FAILED and "expired" in text

    code, text = run(["certs", "rotate", "--out-dir", out], NOW + timedelta(days=300))
    assert code == 0 and "serving renewal was due" in text
    _, renewed, _ = cert_files.read(Path(out))
    assert renewed is not None and renewed.cert != serving.cert
    assert "localhost" not in checking.dns_names(renewed.cert)  # not asked for this time
    assert run(check, NOW + timedelta(days=300))[0] == certs_command.EXIT_OK


def test_generate_force_keeps_the_old_ca_trusted(tmp_path: Path) -> None:
    out = str(tmp_path)
    run(["certs", "generate", "--out-dir", out], NOW)
    old_ca, old_serving, _ = cert_files.read(tmp_path)
    assert old_ca is not None and old_serving is not None
    code, _ = run(["certs", "generate", "--out-dir", out, "--force"], NOW + timedelta(days=2))
    assert code == 0
    new_ca, _, bundle = cert_files.read(tmp_path)
    assert new_ca is not None and new_ca.cert != old_ca.cert
    assert set(bundle) == {old_ca.cert, new_ca.cert}
    # A replica still serving the old pair stays trusted.
    later = NOW + timedelta(days=2)
    assert checking.problems(old_serving.cert, bundle, later, SPEC.dns_names) == []


def test_destination_is_required_and_bad_flags_are_explained(tmp_path: Path) -> None:
    with pytest.raises(pairs.CertError, match="say where"):
        run(["certs", "rotate"], NOW)
    with pytest.raises(pairs.CertError, match="not an IP"):
        run(["certs", "generate", "--out-dir", str(tmp_path), "--ip-address", "300.1.1.1"], NOW)
    with pytest.raises(pairs.CertError, match="--days must be at least 1"):
        run(["certs", "generate", "--out-dir", str(tmp_path), "--days", "0"], NOW)


def test_cli_entry_prints_errors_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["certs", "rotate"]) == certs_command.EXIT_FAILED
    assert "say where" in capsys.readouterr().err
    assert cli.main(["certs", "generate", "--out-dir", str(tmp_path / "x")]) == 0
    written = bundles.parse((tmp_path / "x" / "ca-bundle.crt").read_bytes())
    assert len(written) == 1
