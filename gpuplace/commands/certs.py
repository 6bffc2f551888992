"""`gpuplace certs`: the webhook's CA and serving certificate, to files and/or Secrets,
renewed before expiry, with the CA bundle patched into both webhook configurations.

    gpuplace certs generate --out-dir ./tls                  # a laptop, `serve` beside it
    gpuplace certs rotate --secret gpuplace-webhook-tls --inject   # install or renew, idempotent
    gpuplace certs inject --ca-file ./tls/ca-bundle.crt      # only the caBundle
    gpuplace certs check --cert-file tls.crt --key-file tls.key --ca-file ca-bundle.crt

Owns argument parsing and printing; the decisions are in `gpuplace/certs/`, the cluster calls in
`gpuplace.cluster.certificates`, the files in `gpuplace.certs.files`. Prints what it did and why,
never key material.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

import aiohttp
from cryptography import x509
from kubernetes_asyncio import client, config

from gpuplace import commands
from gpuplace.certs import bundles, checking, issuing, pairs, renewal
from gpuplace.certs import files as cert_files
from gpuplace.cluster import certificates

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_RENEWAL_DUE = 3


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "certs",
        help=commands.HELP["certs"],
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    verbs = parser.add_subparsers(dest="certs_command", required=True, metavar="VERB")

    generate_parser = verbs.add_parser(
        "generate",
        help="a new CA and serving certificate (old CAs stay trusted until they expire)",
    )
    _add_names(generate_parser)
    _add_destinations(generate_parser)
    generate_parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing CA (otherwise generate refuses: use rotate to renew)",
    )
    generate_parser.set_defaults(run=_entry(generate))

    rotate_parser = verbs.add_parser(
        "rotate",
        help="create what is missing, renew what is due (2/3 of its lifetime), else nothing",
    )
    _add_names(rotate_parser)
    _add_destinations(rotate_parser)
    rotate_parser.add_argument("--dry-run", action="store_true", help="print the decision only")
    rotate_parser.set_defaults(run=_entry(rotate))

    inject_parser = verbs.add_parser(
        "inject", help="patch caBundle into both webhook configurations"
    )
    inject_parser.add_argument(
        "--ca-file",
        type=Path,
        help="PEM bundle to trust (default: the bundle in the CA Secret)",
    )
    _add_cluster(inject_parser)
    inject_parser.set_defaults(run=_entry(inject))

    check_parser = verbs.add_parser(
        "check",
        help="is a serving pair usable: valid, matching, chained, right names (exit 0/1/3)",
    )
    check_parser.add_argument("--cert-file", type=Path, default=Path("/etc/gpuplace/tls/tls.crt"))
    check_parser.add_argument("--key-file", type=Path, default=Path("/etc/gpuplace/tls/tls.key"))
    check_parser.add_argument(
        "--ca-file",
        type=Path,
        help="trusted CA bundle (default: ca.crt beside --cert-file)",
    )
    check_parser.add_argument("--service", help="also require the SANs of this Service")
    check_parser.add_argument("--namespace", default="gpuplace")
    check_parser.add_argument("--dns-name", action="append", default=[], metavar="NAME")
    check_parser.add_argument(
        "--renew-fraction", type=float, default=issuing.RENEW_FRACTION, metavar="F"
    )
    check_parser.set_defaults(run=_entry(check))


def _add_names(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("what to issue")
    group.add_argument("--service", default="gpuplace-webhook", help="webhook Service name")
    group.add_argument("--namespace", default="gpuplace", help="its namespace (and Secrets')")
    group.add_argument(
        "--dns-name", action="append", default=[], metavar="NAME", help="extra SAN (repeat)"
    )
    group.add_argument(
        "--ip-address", action="append", default=[], metavar="IP", help="IP SAN (repeat)"
    )
    group.add_argument("--key-type", choices=pairs.KEY_TYPES, default="ecdsa-p256")
    group.add_argument("--ca-days", type=int, default=issuing.CA_VALIDITY.days)
    group.add_argument("--days", type=int, default=issuing.SERVING_VALIDITY.days)
    group.add_argument(
        "--renew-fraction",
        type=float,
        default=issuing.RENEW_FRACTION,
        metavar="F",
        help="renew once this fraction of a lifetime has passed (default 2/3)",
    )


def _add_cluster(parser: argparse.ArgumentParser, *, namespace: bool = True) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument("--kubeconfig", help="default: in-cluster, else ~/.kube/config")
    group.add_argument("--context", help="kubeconfig context")
    if namespace:
        group.add_argument("--namespace", default="gpuplace", help="namespace of the Secrets")
    group.add_argument(
        "--ca-secret", default="gpuplace-ca", help="Secret holding the CA and its key"
    )
    group.add_argument("--mutating-webhook", default="gpuplace", metavar="NAME")
    group.add_argument("--validating-webhook", default="gpuplace", metavar="NAME")


def _add_destinations(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("where (files and/or cluster)")
    group.add_argument("--out-dir", type=Path, help="write ca.crt, ca.key, tls.crt, tls.key here")
    group.add_argument(
        "--secret",
        metavar="NAME",
        help="serving Secret (kubernetes.io/tls) in --namespace, e.g. gpuplace-webhook-tls",
    )
    group.add_argument(
        "--inject", action="store_true", help="patch caBundle into both webhook configurations"
    )
    _add_cluster(parser, namespace=False)


def _entry(
    body: Callable[[argparse.Namespace, datetime, TextIO], int],
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return body(args, datetime.now(UTC), sys.stdout)
        except (pairs.CertError, certificates.StoreError, config.ConfigException) as exc:
            print(f"gpuplace certs: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except (OSError, aiohttp.ClientError) as exc:  # a file, or the API server unreachable
            print(f"gpuplace certs: {type(exc).__name__}: {exc}", file=sys.stderr)
            return EXIT_FAILED

    return run


def spec_from(args: argparse.Namespace) -> issuing.Spec:
    for flag, days in (("--ca-days", args.ca_days), ("--days", args.days)):
        if days < 1:
            raise pairs.CertError(f"{flag} must be at least 1")
    return issuing.Spec(
        dns_names=issuing.service_names(args.service, args.namespace, args.dns_name),
        ip_addresses=tuple(issuing.parse_ip(ip) for ip in args.ip_address),
        key_type=args.key_type,
        ca_validity=timedelta(days=args.ca_days),
        serving_validity=timedelta(days=args.days),
        renew_fraction=args.renew_fraction,
    )


def target_from(args: argparse.Namespace) -> certificates.Target:
    return certificates.Target(
        namespace=args.namespace,
        secret=getattr(args, "secret", None) or certificates.DEFAULT_SECRET,
        ca_secret=args.ca_secret,
        mutating=args.mutating_webhook,
        validating=args.validating_webhook,
    )


async def api_client(kubeconfig: str | None, context: str | None) -> client.ApiClient:
    """In-cluster credentials when running in a pod (and no --kubeconfig), else kubeconfig."""
    configuration = client.Configuration()
    if kubeconfig is None and context is None:
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            return client.ApiClient(configuration)
        except config.ConfigException:
            pass
    await config.load_kube_config(
        config_file=kubeconfig, context=context, client_configuration=configuration
    )
    return client.ApiClient(configuration)


def _require_destination(args: argparse.Namespace) -> None:
    if not (args.out_dir or args.secret):
        raise pairs.CertError("say where: --out-dir DIR and/or --secret NAME")


def generate(args: argparse.Namespace, now: datetime, out: TextIO) -> int:
    _require_destination(args)
    spec = spec_from(args)
    if args.secret:
        return asyncio.run(_in_cluster(args, spec, now, out, force_new_ca=True))
    ca, _serving, bundle = cert_files.read(args.out_dir)
    if ca is not None and not args.force:
        raise pairs.CertError(
            f"{args.out_dir} already holds a CA: `gpuplace certs rotate` renews it, "
            "--force replaces it"
        )
    old = () if ca is None else (ca.cert,)
    material = renewal.issue(bundles.merge(bundle, old), spec, now)
    plan = renewal.Plan(True, True, ("a new CA was asked for",))
    return asyncio.run(_publish_files(args, plan, material, spec=spec, now=now, out=out))


def rotate(args: argparse.Namespace, now: datetime, out: TextIO) -> int:
    _require_destination(args)
    spec = spec_from(args)
    if args.secret:
        return asyncio.run(_in_cluster(args, spec, now, out, force_new_ca=False))
    ca, serving, bundle = cert_files.read(args.out_dir)
    plan, material = renewal.rotate(ca, serving, bundle, spec, now)
    if args.dry_run:
        _report(plan, material, spec, out)
        return EXIT_OK
    unchanged = plan.nothing and bundles.encode(bundle) == material.bundle_pem()
    if unchanged and not args.inject:
        _report(plan, material, spec, out)
        return EXIT_OK
    return asyncio.run(
        _publish_files(args, plan, material, spec=spec, now=now, out=out, write=not unchanged)
    )


async def _publish_files(
    args: argparse.Namespace,
    plan: renewal.Plan,
    material: renewal.Material,
    *,
    spec: issuing.Spec,
    now: datetime,
    out: TextIO,
    write: bool = True,
) -> int:
    """Files mode: the bundle goes to the API server (with --inject) before any file is
    replaced, so a server that reloads the new pair is already trusted."""
    _report(plan, material, spec, out)
    if args.inject:
        async with await api_client(args.kubeconfig, args.context) as api:
            target = target_from(args)
            published = await certificates.published_bundle(api, target)
            trusted = bundles.combine(now, published, material.bundle)
            changed = await certificates.inject(api, target, bundles.encode(trusted))
        _print_injected(changed, out)
    if write:
        _write_files(args.out_dir, material, out)
    return EXIT_OK


async def _in_cluster(
    args: argparse.Namespace,
    spec: issuing.Spec,
    now: datetime,
    out: TextIO,
    *,
    force_new_ca: bool,
) -> int:
    target = target_from(args)
    dry_run = bool(getattr(args, "dry_run", False))
    async with await api_client(args.kubeconfig, args.context) as api:
        if force_new_ca and not args.force:
            stored = await certificates.read(api, target)
            if stored.ca is not None:
                raise pairs.CertError(
                    f"Secret {target.namespace}/{target.ca_secret} already holds a CA: "
                    "`gpuplace certs rotate` renews it, --force replaces it"
                )
        outcome = await certificates.rotate(
            api,
            target,
            spec,
            now,
            inject_bundle=args.inject,
            force_new_ca=force_new_ca,
            dry_run=dry_run,
        )
    _report(outcome.plan, outcome.material, spec, out)
    _print_injected(outcome.injected, out)
    if args.out_dir and not dry_run:
        _write_files(args.out_dir, outcome.material, out)
    return EXIT_OK


def _print_injected(changed: list[str], out: TextIO) -> None:
    for name in changed:
        print(f"caBundle patched into {name}", file=out)


def inject(args: argparse.Namespace, now: datetime, out: TextIO) -> int:
    return asyncio.run(_inject_async(args, now, out))


async def _inject_async(args: argparse.Namespace, now: datetime, out: TextIO) -> int:
    target = target_from(args)
    async with await api_client(args.kubeconfig, args.context) as api:
        if args.ca_file is not None:
            given = bundles.parse(args.ca_file.read_bytes())
        else:
            stored = await certificates.read(api, target)
            if stored.ca is None:
                raise pairs.CertError(
                    f"Secret {target.namespace}/{target.ca_secret} not found; pass --ca-file"
                )
            given = bundles.merge(stored.bundle, (stored.ca.cert,))
        trusted = bundles.combine(now, await certificates.published_bundle(api, target), given)
        if not trusted:
            raise pairs.CertError("no unexpired CA certificate to inject")
        changed = await certificates.inject(api, target, bundles.encode(trusted))
    for cert in trusted:
        print(f"trusted: {_describe(cert)}", file=out)
    print(
        "caBundle patched into " + ", ".join(changed) if changed else "caBundle already current",
        file=out,
    )
    return EXIT_OK


def check(args: argparse.Namespace, now: datetime, out: TextIO) -> int:
    ca_file = args.ca_file or args.cert_file.with_name("ca.crt")
    try:
        pair = pairs.load(args.cert_file.read_bytes(), args.key_file.read_bytes())
        bundle = bundles.parse(ca_file.read_bytes())
    except OSError as exc:
        raise pairs.CertError(f"cannot read {exc.filename}: {exc.strerror}") from None
    names = list(args.dns_name)
    if args.service:
        names = list(issuing.service_names(args.service, args.namespace, names))
    print(f"certificate: {_describe(pair.cert)}", file=out)
    print(f"DNS names: {', '.join(checking.dns_names(pair.cert)) or '-'}", file=out)
    found = checking.problems(pair.cert, bundle, now, names)
    if found:
        for problem in found:
            print(f"problem: {problem}", file=out)
        return EXIT_FAILED
    when = renewal.renew_at(pair.cert, args.renew_fraction)
    if now >= when:
        print(f"usable, but renewal was due at {when:%Y-%m-%d %H:%M} UTC", file=out)
        return EXIT_RENEWAL_DUE
    print(f"usable; renewal due at {when:%Y-%m-%d %H:%M} UTC", file=out)
    return EXIT_OK


def _describe(cert: x509.Certificate) -> str:
    return (
        f"{cert.subject.rfc4514_string()} valid {cert.not_valid_before_utc:%Y-%m-%d} "
        f"to {cert.not_valid_after_utc:%Y-%m-%d}"
    )


def _report(
    plan: renewal.Plan, material: renewal.Material, spec: issuing.Spec, out: TextIO
) -> None:
    if plan.nothing:
        print("nothing to renew", file=out)
    for reason in plan.reasons:
        print(f"renewing: {reason}", file=out)
    print(f"CA: {_describe(material.ca.cert)}", file=out)
    print(f"serving: {_describe(material.serving.cert)}", file=out)
    print(f"  names: {', '.join(checking.dns_names(material.serving.cert))}", file=out)
    ips = checking.ip_addresses(material.serving.cert)
    if ips:
        print(f"  IPs: {', '.join(str(ip) for ip in ips)}", file=out)
    when = renewal.renew_at(material.serving.cert, spec.renew_fraction)
    print(f"  renewal due: {when:%Y-%m-%d} UTC", file=out)
    print(f"bundle: {len(material.bundle)} CA(s)", file=out)


def _write_files(directory: Path, material: renewal.Material, out: TextIO) -> None:
    for path in cert_files.write(directory, material):
        print(f"wrote {path}", file=out)
