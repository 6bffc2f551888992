"""Webhook certificates in the cluster: the two Secrets and the `caBundle` of both webhook
configurations, through kubernetes-asyncio.

Layout (the Deployment mounts only the serving Secret; the CA key never reaches it):
- CA Secret (`Opaque`): `ca.crt`, `ca.key`, `ca-bundle.crt` (every CA still trusted).
- serving Secret (`kubernetes.io/tls`): `tls.crt`, `tls.key`, `ca.crt` (the bundle).

Writes are optimistic (resourceVersion preconditions; a 409 means someone else wrote first
and the caller re-reads). `rotate` publishes in the one order that never breaks a call
from the API server: CA Secret, then caBundle, then the serving Secret. Never logs
certificate or key bytes.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography import x509
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpuplace.certs import bundles, issuing, pairs, renewal

log = logging.getLogger(__name__)

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CA_BUNDLE = "ca-bundle.crt"
TLS_CERT = "tls.crt"
TLS_KEY = "tls.key"
LABELS = {"app.kubernetes.io/name": "gpuplace", "app.kubernetes.io/managed-by": "gpuplace-certs"}
CONFLICT_RETRIES = 5
DEFAULT_SECRET = "gpuplace-webhook-tls"


class StoreError(RuntimeError):
    """The cluster refused or lacks something; the message says what and where."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where the material lives. Names default to the ones `deploy/` uses."""

    namespace: str = "gpuplace"
    secret: str = DEFAULT_SECRET
    ca_secret: str = "gpuplace-ca"
    mutating: str = "gpuplace"
    validating: str = "gpuplace"


@dataclass(frozen=True, slots=True)
class Stored:
    """What the cluster holds now; a missing Secret gives None pairs and an empty bundle."""

    ca: pairs.Pair | None
    serving: pairs.Pair | None
    bundle: tuple[x509.Certificate, ...]
    ca_version: str | None
    serving_version: str | None
    serving_bundle: bytes = b""
    """The `ca.crt` of the serving Secret as stored (kept equal to the bundle)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


async def _read_secret(core: Any, namespace: str, name: str) -> tuple[dict[str, bytes], str] | None:
    try:
        secret = await core.read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise StoreError(f"reading Secret {namespace}/{name}: HTTP {exc.status}") from None
    data = {key: _unb64(value) for key, value in (secret.data or {}).items()}
    return data, str(secret.metadata.resource_version)


async def read(api: client.ApiClient, target: Target) -> Stored:
    """Both Secrets, parsed. A Secret that exists but holds unusable material is an error
    (it is never silently replaced: someone may have put it there on purpose)."""
    core = client.CoreV1Api(api)
    ca_secret = await _read_secret(core, target.namespace, target.ca_secret)
    serving_secret = await _read_secret(core, target.namespace, target.secret)
    ca = serving = None
    bundle: tuple[x509.Certificate, ...] = ()
    where = f"{target.namespace}/{target.ca_secret}"
    if ca_secret is not None:
        data = ca_secret[0]
        try:
            ca = pairs.load(data.get(CA_CERT, b""), data.get(CA_KEY, b""))
            bundle = bundles.parse(data.get(CA_BUNDLE, b""))
        except pairs.CertError as exc:
            raise StoreError(f"Secret {where}: {exc}") from None
    if serving_secret is not None:
        data = serving_secret[0]
        try:
            serving = pairs.load(data.get(TLS_CERT, b""), data.get(TLS_KEY, b""))
        except pairs.CertError as exc:
            where = f"{target.namespace}/{target.secret}"
            raise StoreError(f"Secret {where}: {exc}") from None
    return Stored(
        ca=ca,
        serving=serving,
        bundle=bundle,
        ca_version=None if ca_secret is None else ca_secret[1],
        serving_version=None if serving_secret is None else serving_secret[1],
        serving_bundle=b"" if serving_secret is None else serving_secret[0].get(CA_CERT, b""),
    )


async def _write_secret(
    core: Any,
    namespace: str,
    name: str,
    *,
    kind: str,
    data: dict[str, bytes],
    version: str | None,
) -> None:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": LABELS}
    if version is not None:
        metadata["resourceVersion"] = version
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": kind,
        "data": {key: _b64(value) for key, value in data.items()},
    }
    try:
        if version is None:
            await core.create_namespaced_secret(namespace, body)
        else:
            await core.replace_namespaced_secret(name, namespace, body)
    except ApiException as exc:
        if exc.status == 409:
            raise StoreError(
                f"Secret {namespace}/{name} changed while gpuplace was writing it; run again"
            ) from None
        raise StoreError(f"writing Secret {namespace}/{name}: HTTP {exc.status}") from None
    log.info("secret written", extra={"secret": f"{namespace}/{name}"})


async def write_ca(
    api: client.ApiClient, target: Target, material: renewal.Material, version: str | None
) -> None:
    await _write_secret(
        client.CoreV1Api(api),
        target.namespace,
        target.ca_secret,
        kind="Opaque",
        data={
            CA_CERT: material.ca.cert_pem(),
            CA_KEY: material.ca.key_pem(),
            CA_BUNDLE: material.bundle_pem(),
        },
        version=version,
    )


async def write_serving(
    api: client.ApiClient, target: Target, material: renewal.Material, version: str | None
) -> None:
    await _write_secret(
        client.CoreV1Api(api),
        target.namespace,
        target.secret,
        kind="kubernetes.io/tls",
        data={
            TLS_CERT: material.serving.cert_pem(),
            TLS_KEY: material.serving.key_pem(),
            CA_CERT: material.bundle_pem(),
        },
        version=version,
    )


def _configs(api: client.ApiClient, target: Target) -> list[tuple[str, str, Any, Any]]:
    adm = client.AdmissionregistrationV1Api(api)
    return [
        (
            "MutatingWebhookConfiguration",
            target.mutating,
            adm.read_mutating_webhook_configuration,
            adm.patch_mutating_webhook_configuration,
        ),
        (
            "ValidatingWebhookConfiguration",
            target.validating,
            adm.read_validating_webhook_configuration,
            adm.patch_validating_webhook_configuration,
        ),
    ]


async def published_bundle(api: client.ApiClient, target: Target) -> tuple[x509.Certificate, ...]:
    """Every CA in the caBundle of any webhook of both configurations (missing ones: none)."""
    found: list[x509.Certificate] = []
    for kind, name, read_config, _ in _configs(api, target):
        try:
            config = await read_config(name)
        except ApiException as exc:
            if exc.status == 404:
                continue
            raise StoreError(f"reading {kind} {name}: HTTP {exc.status}") from None
        for webhook in config.webhooks or []:
            try:
                found += bundles.parse(_unb64(webhook.client_config.ca_bundle))
            except (pairs.CertError, ValueError):
                log.warning("unreadable caBundle replaced", extra={"config": name})
    return bundles.merge(found)


async def inject(api: client.ApiClient, target: Target, bundle_pem: bytes) -> list[str]:
    """Set `caBundle` of every webhook in both configurations to `bundle_pem`.

    Returns the configurations that changed. A missing configuration is a `StoreError`
    (apply the manifests first). Conflicting writers are retried from a fresh read.
    """
    wanted = _b64(bundle_pem)
    changed: list[str] = []
    for kind, name, read_config, patch_config in _configs(api, target):
        for _attempt in range(CONFLICT_RETRIES):
            try:
                config = await read_config(name)
            except ApiException as exc:
                if exc.status == 404:
                    raise StoreError(
                        f"{kind} {name} not found: apply the manifests in deploy/ first"
                    ) from None
                raise StoreError(f"reading {kind} {name}: HTTP {exc.status}") from None
            webhooks = config.webhooks or []
            stale = [w.name for w in webhooks if w.client_config.ca_bundle != wanted]
            if not stale:
                break
            body = {
                "metadata": {"resourceVersion": config.metadata.resource_version},
                "webhooks": [{"name": w, "clientConfig": {"caBundle": wanted}} for w in stale],
            }
            try:
                await patch_config(name, body)  # a dict body is sent as a strategic merge patch
            except ApiException as exc:
                if exc.status == 409:
                    continue
                raise StoreError(f"patching {kind} {name}: HTTP {exc.status}") from None
            changed.append(f"{kind}/{name}")
            log.info("caBundle injected", extra={"config": f"{kind}/{name}"})
            break
        else:
            raise StoreError(f"{kind} {name} kept changing; gave up after {CONFLICT_RETRIES}")
    return changed


@dataclass(frozen=True, slots=True)
class Outcome:
    plan: renewal.Plan
    material: renewal.Material
    injected: list[str]


async def rotate(
    api: client.ApiClient,
    target: Target,
    spec: issuing.Spec,
    now: datetime,
    *,
    inject_bundle: bool,
    force_new_ca: bool = False,
    dry_run: bool = False,
) -> Outcome:
    """Create, renew or keep the webhook's certificates, then publish them in a safe order.

    `force_new_ca` issues a new CA and serving pair whatever their age (`certs generate`);
    the old CAs stay in the bundle until they expire either way.
    """
    stored = await read(api, target)
    published = await published_bundle(api, target) if inject_bundle else ()
    known = bundles.merge(stored.bundle, published)
    if force_new_ca:
        plan = renewal.Plan(True, True, ("a new CA was asked for",))
        material = renewal.issue(
            bundles.merge(known, () if stored.ca is None else (stored.ca.cert,)), spec, now
        )
    else:
        plan, material = renewal.rotate(stored.ca, stored.serving, known, spec, now)
    if dry_run:
        return Outcome(plan=plan, material=material, injected=[])
    if plan.new_ca or bundles.encode(stored.bundle) != material.bundle_pem():
        await write_ca(api, target, material, stored.ca_version)
    injected = await inject(api, target, material.bundle_pem()) if inject_bundle else []
    if plan.new_serving or stored.serving_bundle != material.bundle_pem():
        await write_serving(api, target, material, stored.serving_version)
    return Outcome(plan=plan, material=material, injected=injected)
