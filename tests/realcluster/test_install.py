"""README "Installing into a cluster", played on a real API server: the three kubectl lines
of step 3 on the shipped overlay, certificates as step 4 offers, and gpuplace running
with the shipped identities and nothing refused to it."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from tests.realcluster.install import NAMESPACE, Installation


def test_server_dry_run_stores_nothing_then_apply_creates_everything(
    gpuplace: Installation,
) -> None:
    assert gpuplace.steps["namespace"].out.strip() == "namespace/gpuplace created"
    dry_run = gpuplace.steps["dry-run"].out.splitlines()
    assert dry_run and all(line.endswith("(server dry run)") for line in dry_run), dry_run
    assert gpuplace.stored_after_dry_run == []
    applied = gpuplace.steps["apply"].out.splitlines()
    # every object of the overlay, the namespace included (it gets its labels now)
    assert len(applied) == len(gpuplace.rendered), applied
    assert "namespace/gpuplace configured" in applied
    labels = gpuplace.kubectl.json("get", "namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def test_certs_rotate_injects_the_ca_into_both_webhooks(gpuplace: Installation) -> None:
    out = gpuplace.steps["certs"].out
    assert "caBundle patched into MutatingWebhookConfiguration/gpuplace" in out
    assert "caBundle patched into ValidatingWebhookConfiguration/gpuplace" in out
    for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        hook = gpuplace.kubectl.json("get", kind, "gpuplace")["webhooks"][0]
        assert hook["clientConfig"]["caBundle"]
        assert hook["clientConfig"]["url"].startswith(
            f"https://127.0.0.1:{gpuplace.ports.webhook}/"
        )
    secret = gpuplace.kubectl.json("-n", NAMESPACE, "get", "secret", "gpuplace-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls"


def test_serve_and_scheduler_run_as_their_own_service_accounts(gpuplace: Installation) -> None:
    serve_config = next(arg for arg in gpuplace.serve.argv if arg.startswith("--kubeconfig="))
    whoami = gpuplace.kubectl.as_user(Path(serve_config.split("=", 1)[1])).json("auth", "whoami")
    assert whoami["status"]["userInfo"]["username"] == "system:serviceaccount:gpuplace:gpuplace"
    lease = gpuplace.kubectl.json("-n", NAMESPACE, "get", "lease", "gpuplace-scheduler")
    assert lease["spec"]["holderIdentity"]
    # the gang controller follows the scheduler's Lease (read every 2 s): this replica leads
    deadline = time.monotonic() + 30
    while "gpuplace_gang_controller_leading 1.0" not in (metrics := scrape(gpuplace)):
        assert time.monotonic() < deadline, "the gang controller never led"
        time.sleep(0.5)
    refused = [
        line
        for line in metrics.splitlines()
        if line.startswith("gpuplace_api_refusals_total") and not line.endswith(" 0.0")
    ]
    assert refused == [], "the shipped RBAC refused gpuplace a call"


def test_api_priority_and_fairness_gives_gpuplace_the_schedulers_levels(
    gpuplace: Installation,
) -> None:
    """The shipped FlowSchemas (deploy/base/flowcontrol.yaml) put both identities'
    requests at `workload-high` and their Lease traffic at `leader-election`, as Kubernetes
    does for its own kube-scheduler: kube-apiserver says in each answer's
    X-Kubernetes-PF-* headers which FlowSchema and priority level it used."""
    uids = {
        kind: {
            item["metadata"]["uid"]: item["metadata"]["name"]
            for item in gpuplace.kubectl.json("get", kind)["items"]
        }
        for kind in ("flowschemas", "prioritylevelconfigurations")
    }
    serve = Path(
        next(arg for arg in gpuplace.serve.argv if arg.startswith("--kubeconfig=")).split("=", 1)[1]
    )
    scheduler = gpuplace.workdir / "gpuplace-scheduler.kubeconfig"
    lease = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/gpuplace-scheduler"
    seen = {}
    for who, kubeconfig in (("serve", serve), ("scheduler", scheduler)):
        for what, path in (("pods", "/api/v1/pods?limit=1"), ("lease", lease)):
            status, answered, _ = gpuplace.cluster.request_as(kubeconfig, "GET", path)
            assert status == 200, (who, what, status)
            headers = {name.lower(): value for name, value in answered.items()}
            seen[who, what] = (
                uids["flowschemas"].get(headers.get("x-kubernetes-pf-flowschema-uid", "")),
                uids["prioritylevelconfigurations"].get(
                    headers.get("x-kubernetes-pf-prioritylevel-uid", "")
                ),
            )
    assert seen == {
        ("serve", "pods"): ("gpuplace", "workload-high"),
        ("serve", "lease"): ("gpuplace-leader-election", "leader-election"),
        ("scheduler", "pods"): ("gpuplace", "workload-high"),
        ("scheduler", "lease"): ("gpuplace-leader-election", "leader-election"),
    }


def scrape(gpuplace: Installation) -> str:
    url = f"http://127.0.0.1:{gpuplace.ports.metrics}/metrics"
    with urllib.request.urlopen(url, timeout=5) as answer:
        return str(answer.read().decode())
