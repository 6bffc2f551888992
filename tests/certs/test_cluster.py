"""`gpuplace certs` against the local API as the certs CronJob's ServiceAccount (the RBAC
deploy/ ships enforced): Secrets, caBundle injection into the webhook configurations of
deploy/base, the publishing order that keeps the webhook reachable during a CA rotation,
conflicts and refusals."""

from __future__ import annotations

import base64
import copy
import io
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuplace import cli
from gpuplace.certs import bundles, checking, issuing, pairs, renewal
from gpuplace.cluster import certificates
from gpuplace.commands import certs as certs_command
from gpuplace.dev import localapi
from gpuplace.dev.localapi import MUTATING_WEBHOOKS as MUTATING
from gpuplace.dev.localapi import SECRETS
from gpuplace.dev.localapi import VALIDATING_WEBHOOKS as VALIDATING

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 3, 1, tzinfo=UTC)
NAMES = issuing.service_names("gpuplace-webhook", "gpuplace")
WRITES = ("POST", "PUT", "PATCH", "DELETE")


def webhook_manifests() -> list[dict[str, Any]]:
    text = (ROOT / "deploy" / "base" / "webhooks.yaml").read_text()
    return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture
def api() -> localapi.FakeApi:
    api = localapi.FakeApi(access=localapi.Access.shipped())
    for doc in webhook_manifests():
        api.create(doc)
    return api


@pytest.fixture
def server(api: localapi.FakeApi) -> Iterator[localapi.ThreadedServer]:
    with localapi.serve_in_thread(api) as server:
        yield server


@pytest.fixture
def kubeconfig(server: localapi.ThreadedServer, tmp_path: Path) -> str:
    return str(server.server.kubeconfig(tmp_path / "kubeconfig", localapi.CERTS))


def stored(
    server: localapi.ThreadedServer,
    resource: localapi.Resource,
    name: str,
    namespace: str | None = None,
) -> dict[str, Any] | None:
    """The object as the local API holds it now, or None."""

    def read() -> dict[str, Any] | None:
        try:
            return copy.deepcopy(server.api.get(resource, name, namespace))
        except localapi.ApiStatusError:
            return None

    return server.call(read)


def writes(server: localapi.ThreadedServer) -> list[tuple[str, str]]:
    """(method, path) of every write request, in order."""
    return server.call(lambda: [(c.method, c.path) for c in server.api.calls if c.method in WRITES])


def delete(server: localapi.ThreadedServer, resource: localapi.Resource) -> None:
    server.call(lambda: server.api.delete(resource, "gpuplace"))


def run(argv: list[str], now: datetime) -> tuple[int, str]:
    args = cli.build_parser().parse_args(argv)
    verbs = {
        "generate": certs_command.generate,
        "rotate": certs_command.rotate,
        "inject": certs_command.inject,
    }
    out = io.StringIO()
    code = verbs[args.certs_command](args, now, out)
    return code, out.getvalue()


def rotate_argv(kubeconfig: str, *extra: str) -> list[str]:
    return ["certs", "rotate", "--kubeconfig", kubeconfig, "--secret", "gpuplace-webhook-tls",
            "--inject", *extra]  # fmt: skip


def secret_data(server: localapi.ThreadedServer, name: str) -> dict[str, bytes]:
    secret = stored(server, SECRETS, name, "gpuplace")
    assert secret is not None, name
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def published(server: localapi.ThreadedServer, resource: localapi.Resource) -> list[bytes]:
    config = stored(server, resource, "gpuplace")
    assert config is not None
    return [base64.b64decode(w["clientConfig"]["caBundle"]) for w in config["webhooks"]]


def without_ca_bundle(config: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(config)
    config.pop("metadata")
    for webhook in config["webhooks"]:
        webhook["clientConfig"].pop("caBundle", None)
    return config


def test_first_run_creates_secrets_and_injects_the_bundle(
    server: localapi.ThreadedServer, kubeconfig: str
) -> None:
    code, text = run(rotate_argv(kubeconfig), NOW)
    assert code == 0, text
    assert "no CA yet" in text and "PRIVATE" not in text

    serving_secret = stored(server, SECRETS, "gpuplace-webhook-tls", "gpuplace")
    assert serving_secret is not None and serving_secret["type"] == "kubernetes.io/tls"
    serving = secret_data(server, "gpuplace-webhook-tls")
    ca = secret_data(server, "gpuplace-ca")
    pair = pairs.load(serving["tls.crt"], serving["tls.key"])
    assert pairs.load(ca["ca.crt"], ca["ca.key"])  # the CA key lives only in gpuplace-ca
    assert "ca.key" not in serving

    for key in (MUTATING, VALIDATING):
        for bundle_pem in published(server, key):
            assert bundle_pem == ca["ca-bundle.crt"] == serving["ca.crt"]
            checking.verify(pair, bundles.parse(bundle_pem), NOW, NAMES)
    # Nothing but caBundle changed in the webhook configurations of deploy/base.
    originals = {d["kind"]: d for d in webhook_manifests()}
    for key in (MUTATING, VALIDATING):
        current = stored(server, key, "gpuplace")
        assert current is not None
        assert without_ca_bundle(current) == without_ca_bundle(
            {**originals[key.kind], "metadata": {}}
        )


def test_second_run_writes_nothing(server: localapi.ThreadedServer, kubeconfig: str) -> None:
    run(rotate_argv(kubeconfig), NOW)
    count = len(writes(server))
    code, text = run(rotate_argv(kubeconfig), NOW + timedelta(days=1))
    assert code == 0 and "nothing to renew" in text
    assert len(writes(server)) == count


def test_serving_renewal_replaces_only_the_serving_secret(
    server: localapi.ThreadedServer, kubeconfig: str
) -> None:
    run(rotate_argv(kubeconfig), NOW)
    before = secret_data(server, "gpuplace-webhook-tls")
    count = len(writes(server))
    code, text = run(rotate_argv(kubeconfig), NOW + timedelta(days=250))
    assert code == 0 and "serving renewal was due" in text
    assert writes(server)[count:] == [
        ("PUT", "/api/v1/namespaces/gpuplace/secrets/gpuplace-webhook-tls")
    ]
    after = secret_data(server, "gpuplace-webhook-tls")
    assert after["tls.crt"] != before["tls.crt"] and after["ca.crt"] == before["ca.crt"]


def test_ca_rotation_publishes_the_bundle_before_the_serving_pair(
    server: localapi.ThreadedServer, kubeconfig: str
) -> None:
    run(rotate_argv(kubeconfig), NOW)
    run(rotate_argv(kubeconfig), NOW + timedelta(days=1000))  # a serving renewal
    old_serving = secret_data(server, "gpuplace-webhook-tls")
    count = len(writes(server))
    when = NOW + timedelta(days=1300)  # past 2/3 of the 5-year CA
    code, text = run(rotate_argv(kubeconfig), when)
    assert code == 0 and "CA renewal was due" in text
    assert writes(server)[count:] == [
        ("PUT", "/api/v1/namespaces/gpuplace/secrets/gpuplace-ca"),
        ("PATCH", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/gpuplace"),
        ("PATCH", "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/gpuplace"),
        ("PUT", "/api/v1/namespaces/gpuplace/secrets/gpuplace-webhook-tls"),
    ]
    bundle = bundles.parse(published(server, MUTATING)[0])
    assert len(bundle) == 2
    new_serving = secret_data(server, "gpuplace-webhook-tls")
    for serving in (old_serving, new_serving):  # both replicas' pairs are trusted
        pair = pairs.load(serving["tls.crt"], serving["tls.key"])
        checking.verify(pair, bundle, when, NAMES)


def test_a_racing_writer_is_retried(server: localapi.ThreadedServer, kubeconfig: str) -> None:
    raced: list[str] = []

    def race() -> None:  # someone else writes between our GET and PATCH
        raced.append("mutating")
        server.api.patch(MUTATING, "gpuplace", {"metadata": {"labels": {"raced": "yes"}}})

    server.call(lambda: server.api.before("PATCH", "/mutatingwebhookconfigurations/", race))
    code, _ = run(rotate_argv(kubeconfig), NOW)
    assert code == 0 and raced
    patches = [p for m, p in writes(server) if m == "PATCH" and "mutating" in p]
    assert len(patches) == 2  # the 409 and the retry
    assert published(server, MUTATING)[0] == secret_data(server, "gpuplace-ca")["ca-bundle.crt"]


def test_missing_webhook_configuration_stops_before_the_serving_secret(
    server: localapi.ThreadedServer, kubeconfig: str, capsys: pytest.CaptureFixture[str]
) -> None:
    delete(server, VALIDATING)
    assert cli.main(rotate_argv(kubeconfig)) == certs_command.EXIT_FAILED
    assert "ValidatingWebhookConfiguration gpuplace not found" in capsys.readouterr().err
    assert stored(server, SECRETS, "gpuplace-webhook-tls", "gpuplace") is None


def test_unusable_secret_is_never_overwritten(
    server: localapi.ThreadedServer, kubeconfig: str
) -> None:
    junk = base64.b64encode(b"junk").decode()
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "gpuplace-ca", "namespace": "gpuplace"},
        "type": "Opaque",
        "data": {"ca.crt": junk, "ca.key": junk},
    }
    server.call(lambda: server.api.create(secret))
    with pytest.raises(certificates.StoreError, match="Secret gpuplace/gpuplace-ca"):
        run(rotate_argv(kubeconfig), NOW)
    assert writes(server) == []


def test_dry_run_writes_nothing(server: localapi.ThreadedServer, kubeconfig: str) -> None:
    code, text = run(rotate_argv(kubeconfig, "--dry-run"), NOW)
    assert code == 0 and "no CA yet" in text
    assert writes(server) == []


def test_generate_refuses_an_existing_ca_unless_forced(
    server: localapi.ThreadedServer, kubeconfig: str
) -> None:
    generate = ["certs", "generate", "--kubeconfig", kubeconfig, "--secret",
                "gpuplace-webhook-tls", "--inject"]  # fmt: skip
    assert run(generate, NOW)[0] == 0
    first_ca = secret_data(server, "gpuplace-ca")["ca.crt"]
    with pytest.raises(pairs.CertError, match="already holds a CA"):
        run(generate, NOW)
    assert run([*generate, "--force"], NOW + timedelta(days=1))[0] == 0
    bundle = bundles.parse(published(server, VALIDATING)[0])
    assert pairs.load_cert(first_ca) in bundle and len(bundle) == 2


def test_generate_to_secret_and_files_at_once(
    server: localapi.ThreadedServer, kubeconfig: str, tmp_path: Path
) -> None:
    argv = ["certs", "generate", "--kubeconfig", kubeconfig, "--secret", "gpuplace-webhook-tls",
            "--out-dir", str(tmp_path / "tls")]  # fmt: skip
    assert run(argv, NOW)[0] == 0
    assert (tmp_path / "tls" / "tls.crt").read_bytes() == secret_data(
        server, "gpuplace-webhook-tls"
    )["tls.crt"]
    # Without --inject the webhook configurations are left alone.
    assert all(m != "PATCH" for m, _ in writes(server))


def test_inject_verb_merges_a_given_bundle(
    server: localapi.ThreadedServer, kubeconfig: str, tmp_path: Path
) -> None:
    run(rotate_argv(kubeconfig), NOW)
    cluster_ca = pairs.load_cert(secret_data(server, "gpuplace-ca")["ca.crt"])
    other = renewal.issue((), issuing.Spec(dns_names=NAMES), NOW)
    ca_file = tmp_path / "extra.crt"
    ca_file.write_bytes(other.ca.cert_pem())
    code, text = run(
        ["certs", "inject", "--kubeconfig", kubeconfig, "--ca-file", str(ca_file)], NOW
    )
    assert code == 0 and "caBundle patched into" in text
    for key in (MUTATING, VALIDATING):
        assert set(bundles.parse(published(server, key)[0])) == {cluster_ca, other.ca.cert}
    code, text = run(
        ["certs", "inject", "--kubeconfig", kubeconfig, "--ca-file", str(ca_file)], NOW
    )
    assert "already current" in text


async def test_module_against_the_local_api_directly(api: localapi.FakeApi) -> None:
    """certs_k8s with an ApiClient built by hand (no kubeconfig)."""
    from kubernetes_asyncio import client

    async with (
        localapi.serve(api) as server,
        client.ApiClient(server.configuration(localapi.CERTS)) as kube,
    ):
        target = certificates.Target()
        outcome = await certificates.rotate(
            kube, target, issuing.Spec(dns_names=NAMES), NOW, inject_bundle=True
        )
        assert outcome.injected == [
            "MutatingWebhookConfiguration/gpuplace",
            "ValidatingWebhookConfiguration/gpuplace",
        ]
        stored = await certificates.read(kube, target)
        assert stored.ca is not None and stored.ca.cert == outcome.material.ca.cert
        assert await certificates.published_bundle(kube, target) == outcome.material.bundle


def test_files_mode_with_inject_publishes_the_bundle_first(
    server: localapi.ThreadedServer, kubeconfig: str, tmp_path: Path
) -> None:
    """`serve` outside the cluster (a laptop behind a tunnel): files, plus the caBundle."""
    out = tmp_path / "tls"
    argv = ["certs", "rotate", "--kubeconfig", kubeconfig, "--out-dir", str(out), "--inject"]
    code, text = run(argv, NOW)
    assert code == 0 and "caBundle patched into" in text
    assert published(server, MUTATING)[0] == (out / "ca-bundle.crt").read_bytes()
    assert stored(server, SECRETS, "gpuplace-webhook-tls", "gpuplace") is None  # files only

    delete(server, VALIDATING)  # a failed publish leaves the files as they were
    before = (out / "tls.crt").read_bytes()
    with pytest.raises(certificates.StoreError):
        run(argv, NOW + timedelta(days=250))  # a serving renewal is due by then
    assert (out / "tls.crt").read_bytes() == before


def test_unreachable_api_server_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as probe:  # a port on 127.0.0.1 nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nobody = localapi.Server(localapi.FakeApi(), f"http://127.0.0.1:{port}")
    path = nobody.kubeconfig(tmp_path / "kubeconfig")
    assert cli.main(rotate_argv(str(path))) == certs_command.EXIT_FAILED
    err = capsys.readouterr().err
    assert err.startswith("gpuplace certs: ") and "Traceback" not in err
