"""deploy/ as `kustomize build` renders it: every Kubernetes object validates against the
schemas (kubernetes-validate, strict, the cluster's version and the newest shipped), and the
properties the design relies on hold in the rendered objects."""

from __future__ import annotations

import re
import tomllib
from collections import Counter
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as validate_utils

from gpuplace import cli
from gpuplace.certs import issuing
from gpuplace.cluster import certificates, keys
from tests.deploy import rendering
from tests.deploy.rendering import Obj, container, named, one, render
from tests.docs import clitree

ROOT = rendering.ROOT
_VERSION_FILE = ROOT.parent / "shared" / "fixtures" / "k8s-version.txt"
K8S_VERSION = (
    _VERSION_FILE.read_text().split()[-1]
    if _VERSION_FILE.exists()
    else "v1.36.2"  # the version the captured fixtures came from, when ../shared is absent
)
NAMESPACE = "gpuplace"
NODE_AGENT_PREFIX = "gpuplace-node-agent"
SERVICE = "gpuplace-webhook"
SIDECAR_SA = "gpuplace"
SCHEDULER_SA = "gpuplace-scheduler"
NOT_KUBERNETES = {"cert-manager.io/v1"}  # CRDs the schemas do not ship; see test_cert_manager


def versions() -> list[str]:
    """The cluster's version (fixtures/k8s-version.txt) and the newest schema shipped."""
    cluster = K8S_VERSION.lstrip("v")
    newest = validate_utils.latest_version()
    assert tuple(map(int, newest.split(".")[:2])) >= (1, 30)
    return sorted({cluster, newest})


@pytest.mark.parametrize("tree", rendering.TREES)
@pytest.mark.parametrize("version", versions())
def test_every_object_validates_strictly(tree: str, version: str) -> None:
    objects = render(tree)
    assert objects
    checked = 0
    for obj in objects:
        if obj["apiVersion"] in NOT_KUBERNETES:
            continue
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{tree}: {where} invalid for {version}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{tree}: {where}: no schema for {obj['apiVersion']} in {version}")
        checked += 1
    assert checked >= 20


def test_the_validator_refuses_what_the_api_server_would() -> None:
    """The check above can fail: a misspelt field is refused."""
    deployment = one(render("base"), "Deployment", "gpuplace")
    spec = deployment["spec"]["template"]["spec"]
    container(spec, "gpuplace")["securityContext"]["readOnlyRootFS"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION.lstrip("v"), strict=True)


@pytest.mark.parametrize("tree", rendering.TREES)
def test_names_are_unique_and_namespaced_objects_live_in_gpuplace(tree: str) -> None:
    objects = render(tree)
    ids = Counter(
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects
    )
    assert [i for i, n in ids.items() if n > 1] == []
    cluster_scoped = {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "CustomResourceDefinition",
        "FlowSchema",
        "DeviceClass",
    }
    for obj in objects:
        ns = obj["metadata"].get("namespace")
        if obj["kind"] in cluster_scoped:
            assert ns is None, obj["metadata"]["name"]
        elif (obj["kind"], obj["metadata"]["name"]) == (
            "RoleBinding",
            "gpuplace-scheduler-authentication-reader",
        ):
            assert ns == "kube-system"  # reads the client CA ConfigMap there
        elif obj["metadata"]["name"].startswith(NODE_AGENT_PREFIX):
            assert ns == "kube-system"  # a node daemon: see test_node_agent_manifest.py
        else:
            assert ns == NAMESPACE, f"{obj['kind']}/{obj['metadata']['name']}"


def test_overlays_hold_the_base_and_only_add() -> None:
    base = {(o["kind"], o["metadata"]["name"]) for o in render("base")}
    for overlay in rendering.OVERLAYS:
        assert base <= {(o["kind"], o["metadata"]["name"]) for o in render(f"overlays/{overlay}")}


# --- the Deployment ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployment() -> Obj:
    return one(render("overlays/self-managed"), "Deployment", "gpuplace")


def test_deployment_is_highly_available(deployment: Obj) -> None:
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert pod["priorityClassName"] == "system-cluster-critical"
    terms = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    term = terms[0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert rendering.selects(term["labelSelector"], spec["template"]["metadata"]["labels"])
    assert rendering.selects(spec["selector"], spec["template"]["metadata"]["labels"])


def test_kube_scheduler_is_the_stock_image_of_the_cluster_version(deployment: Obj) -> None:
    scheduler = container(deployment["spec"]["template"]["spec"], "kube-scheduler")
    assert scheduler["image"] == f"registry.k8s.io/kube-scheduler:{K8S_VERSION}"
    assert scheduler["command"][0] == "/usr/local/bin/kube-scheduler"
    assert "--config=/etc/gpuplace/scheduler/config.yaml" in scheduler["command"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert scheduler[probe]["httpGet"]["scheme"] == "HTTPS"
        assert scheduler[probe]["httpGet"]["port"] == "scheduler"
    assert scheduler["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert scheduler["livenessProbe"]["httpGet"]["path"] == "/livez"


def test_gpuplace_container_runs_serve_with_the_contract_flags(deployment: Obj) -> None:
    sidecar = container(deployment["spec"]["template"]["spec"], "gpuplace")
    args = sidecar["args"]
    assert args[0] == "serve"
    for flag in (
        "--webhook-port=8443",
        "--extender-address=127.0.0.1",
        "--extender-port=8888",
        "--metrics-port=9090",
        "--cert-file=/etc/gpuplace/tls/tls.crt",
        "--key-file=/etc/gpuplace/tls/tls.key",
        "--scheduler-name=gpuplace",
        f"--sidecar-user=system:serviceaccount:{NAMESPACE}:{SIDECAR_SA}",
    ):
        assert flag in args
    # Every flag is one `gpuplace serve` really accepts (no drift from the CLI).
    parsed = cli.build_parser().parse_args(args)
    assert parsed.command == "serve"
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"webhook": 8443, "metrics": 9090}  # the extender stays on loopback
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


def test_gpuplace_image_is_this_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for tree in rendering.TREES:
        for name, spec in rendering.pod_specs(render(tree)).items():
            for c in spec["containers"]:
                if not c["image"].startswith("registry.k8s.io/"):
                    assert c["image"] == f"gpuplace:{version}", (tree, name)


@pytest.mark.parametrize("tree", rendering.TREES)
def test_every_container_is_locked_down_and_sized(tree: str) -> None:
    specs = rendering.pod_specs(render(tree))
    assert specs
    for workload, spec in specs.items():
        pod_security = spec["securityContext"]
        assert pod_security["runAsNonRoot"] is True
        assert pod_security["runAsUser"] > 0
        assert pod_security["seccompProfile"]["type"] == "RuntimeDefault"
        for c in spec["containers"]:
            where = f"{workload}/{c['name']}"
            security = c["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in security["capabilities"], where
            for bound in ("requests", "limits"):
                assert set(c["resources"][bound]) >= {"cpu", "memory"}, where


def test_each_container_holds_only_its_own_identity(deployment: Obj) -> None:
    objects = render("overlays/self-managed")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == SIDECAR_SA
    assert pod["automountServiceAccountToken"] is False
    volumes: dict[str, Obj] = {v["name"]: v for v in pod["volumes"]}
    token_path = "/var/run/secrets/kubernetes.io/serviceaccount"

    def token_volume(name: str) -> Obj:
        mounts = [m for m in container(pod, name)["volumeMounts"] if m["mountPath"] == token_path]
        assert len(mounts) == 1 and mounts[0]["readOnly"] is True
        return volumes[mounts[0]["name"]]

    sidecar_token = token_volume("gpuplace")
    sources = [next(iter(s)) for s in sidecar_token["projected"]["sources"]]
    assert sources == ["serviceAccountToken", "configMap", "downwardAPI"]
    scheduler_token = token_volume("kube-scheduler")
    secret = named(objects, "Secret")[scheduler_token["secret"]["secretName"]]
    assert secret["type"] == "kubernetes.io/service-account-token"
    assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == SCHEDULER_SA
    for sa in (SIDECAR_SA, SCHEDULER_SA):
        assert named(objects, "ServiceAccount")[sa]["automountServiceAccountToken"] is False


def test_tls_secret_is_the_one_the_certificates_are_written_to(deployment: Obj) -> None:
    pod = deployment["spec"]["template"]["spec"]
    mount = next(
        m
        for m in container(pod, "gpuplace")["volumeMounts"]
        if m["mountPath"] == "/etc/gpuplace/tls"
    )
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == certificates.DEFAULT_SECRET
    assert all("gpuplace-ca" not in str(v) for v in pod["volumes"])  # never the CA key
    cron = one(render("overlays/self-managed"), "CronJob", "gpuplace-certs")
    args = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["certs", "rotate"]
    assert f"--secret={certificates.DEFAULT_SECRET}" in args and "--inject" in args
    assert f"--service={SERVICE}" in args and f"--namespace={NAMESPACE}" in args
    parsed = cli.build_parser().parse_args(args)
    assert parsed.ca_secret == certificates.Target.__dataclass_fields__["ca_secret"].default


def test_critical_pods_are_admitted_by_a_scoped_quota(deployment: Obj) -> None:
    quota = one(render("base"), "ResourceQuota", "gpuplace-critical-pods")
    expr = quota["spec"]["scopeSelector"]["matchExpressions"][0]
    assert expr["scopeName"] == "PriorityClass"
    assert deployment["spec"]["template"]["spec"]["priorityClassName"] in expr["values"]
    assert int(quota["spec"]["hard"]["pods"]) > deployment["spec"]["replicas"] + 1


def test_namespace_enforces_restricted_pod_security() -> None:
    ns = one(render("base"), "Namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# --- Service, PDB, NetworkPolicy -------------------------------------------------------------


def test_service_reaches_the_webhook_port(deployment: Obj) -> None:
    service = one(render("base"), "Service", SERVICE)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert rendering.selects({"matchLabels": service["spec"]["selector"]}, labels)
    (port,) = service["spec"]["ports"]
    assert port["port"] == 443 and port["targetPort"] == "webhook"


def test_pdb_keeps_one_replica(deployment: Obj) -> None:
    pdb = one(render("base"), "PodDisruptionBudget")
    assert rendering.selects(
        pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"]
    )
    assert 1 <= pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def test_network_policy(deployment: Obj) -> None:
    policy = one(render("base"), "NetworkPolicy", "gpuplace")
    spec = policy["spec"]
    assert rendering.selects(
        spec["podSelector"], deployment["spec"]["template"]["metadata"]["labels"]
    )
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    webhook, metrics = spec["ingress"]
    assert "from" not in webhook and [p["port"] for p in webhook["ports"]] == [8443]
    assert [p["port"] for p in metrics["ports"]] == [9090, 10259]
    (source,) = metrics["from"]
    assert source["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }
    api, dns = spec["egress"]
    assert sorted(p["port"] for p in api["ports"]) == [443, 6443]
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}


def test_the_documented_prometheus_egress_widens_the_policy_for_load_aware(
    deployment: Obj,
) -> None:
    """docs/deploy.md's second NetworkPolicy (issue 46): valid as the API server reads it,
    it selects the pods the shipped policy locks down and opens egress to the port of
    `--usage-prometheus`'s example in `serve --help`."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = text[text.index("<!-- prometheus-egress") :]
    block = block[block.index("```yaml") + len("```yaml") : block.index("```\n", 10)]
    policy = yaml.safe_load(block)
    kubernetes_validate.validate(policy, K8S_VERSION.lstrip("v"), strict=True)
    assert policy["kind"] == "NetworkPolicy" and policy["metadata"]["namespace"] == NAMESPACE
    shipped = one(render("base"), "NetworkPolicy", "gpuplace")
    assert policy["spec"]["podSelector"] == shipped["spec"]["podSelector"]
    assert rendering.selects(
        policy["spec"]["podSelector"], deployment["spec"]["template"]["metadata"]["labels"]
    )
    assert policy["spec"]["policyTypes"] == ["Egress"]
    (flag,) = [
        a
        for a in clitree.options(clitree.parser_of("serve"))
        if "--usage-prometheus" in a.option_strings
    ]
    example = re.search(r"e\.g\. http://[\w.-]+:(\d+)", flag.help or "")
    assert example, flag.help
    port = int(example.group(1))
    assert [p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]] == [port]


# --- the webhook configurations ------------------------------------------------------------


@pytest.fixture(scope="module")
def webhooks() -> dict[str, Obj]:
    objects = render("base")
    mutating = one(objects, "MutatingWebhookConfiguration")["webhooks"]
    validating = one(objects, "ValidatingWebhookConfiguration")["webhooks"]
    assert len(mutating) == len(validating) == 1
    return {"mutate": mutating[0], "validate": validating[0]}


def test_failure_policies_and_timing(webhooks: dict[str, Obj]) -> None:
    mutate, validate = webhooks["mutate"], webhooks["validate"]
    assert mutate["failurePolicy"] == "Ignore"  # fails open
    assert validate["failurePolicy"] == "Fail"  # fails closed, for GPU pods only
    assert mutate["reinvocationPolicy"] == "IfNeeded"
    for hook in (mutate, validate):
        assert hook["sideEffects"] == "NoneOnDryRun"
        assert hook["admissionReviewVersions"] == ["v1"]
        assert 1 <= hook["timeoutSeconds"] <= 5
        assert "caBundle" not in hook["clientConfig"]  # injected, never committed


def test_webhooks_call_the_service(webhooks: dict[str, Obj]) -> None:
    for path, hook in webhooks.items():
        assert hook["clientConfig"]["service"] == {
            "name": SERVICE,
            "namespace": NAMESPACE,
            "path": f"/{path}",
            "port": 443,
        }
        assert hook["name"].endswith(".gpuplace.io")


def test_webhooks_see_pods_outside_system_namespaces(webhooks: dict[str, Obj]) -> None:
    # What each webhook must see (test_match_conditions.py says why, case by case).
    scope = {
        "mutate": (["CREATE"], ["pods"]),
        "validate": (["CREATE", "UPDATE"], ["pods", "pods/status"]),
    }
    for path, hook in webhooks.items():
        operations, resources = scope[path]
        assert hook["rules"] == [
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "operations": operations,
                "resources": resources,
                "scope": "Namespaced",
            }
        ]
        selector = hook["namespaceSelector"]
        for ns, sent in (("kube-system", False), (NAMESPACE, False), ("team-a", True)):
            labels = {"kubernetes.io/metadata.name": ns}
            assert rendering.selects(selector, labels) is sent, ns
        # The CEL conditions name our annotation prefix, spelled once in gpuplace.cluster.keys.
        for condition in hook["matchConditions"]:
            assert re.findall(r"startsWith\('([^']*)'\)", condition["expression"]) != []
            assert set(re.findall(r"startsWith\('([^']*)'\)", condition["expression"])) == {
                keys.PREFIX
            }


def test_certificate_names_match_the_service() -> None:
    service = one(render("base"), "Service", SERVICE)
    names = issuing.service_names(service["metadata"]["name"], service["metadata"]["namespace"])
    assert names == (f"{SERVICE}.{NAMESPACE}.svc", f"{SERVICE}.{NAMESPACE}.svc.cluster.local")
    parsed = cli.build_parser().parse_args(["certs", "rotate", "--secret", "x"])
    assert (parsed.service, parsed.namespace) == (SERVICE, NAMESPACE)


def test_deploy_tree_has_no_stray_files() -> None:
    """Every YAML file under deploy/ is used by a kustomization (none silently ignored)."""
    used: set[Path] = set()
    for kustomization in rendering.DEPLOY.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        here = kustomization.parent
        used.add(kustomization)
        for entry in spec.get("resources", []):
            used.add((here / entry).resolve())
        for patch in spec.get("patches", []):
            if "path" in patch:
                used.add((here / patch["path"]).resolve())
        for generator in spec.get("configMapGenerator", []):
            for file in generator.get("files", []):
                used.add((here / file.split("=")[-1]).resolve())
    files = {p.resolve() for p in rendering.DEPLOY.rglob("*.yaml")}
    assert files - {p.resolve() for p in used} == set()


def test_secret_files_are_group_readable_only(deployment: Obj) -> None:
    """YAML's 0440 is octal only to a YAML 1.1 reader; the rendered value must be 0o440."""
    modes = [
        (v.get("secret") or v.get("projected"))["defaultMode"]
        for v in deployment["spec"]["template"]["spec"]["volumes"]
        if "secret" in v or "projected" in v
    ]
    assert modes and set(modes) == {0o440}


@pytest.mark.parametrize("tree", rendering.TREES)
def test_flow_schemas_give_both_identities_the_schedulers_priority_levels(tree: str) -> None:
    """API Priority and Fairness: the two identities the overlay creates, at the
    suggested levels Kubernetes gives its own scheduler (the real API server's answer
    headers are checked on the real-cluster tier, tests/realcluster/test_install.py)."""
    objects = render(tree)
    accounts = {
        (obj["metadata"]["namespace"], obj["metadata"]["name"])
        for obj in objects
        if obj["kind"] == "ServiceAccount" and obj["metadata"]["namespace"] == NAMESPACE
    }
    schemas = named(objects, "FlowSchema")
    assert set(schemas) == {"gpuplace", "gpuplace-leader-election"}
    for schema in schemas.values():
        subjects = {
            (s["serviceAccount"]["namespace"], s["serviceAccount"]["name"])
            for rule in schema["spec"]["rules"]
            for s in rule["subjects"]
        }
        assert subjects == {(NAMESPACE, "gpuplace"), (NAMESPACE, "gpuplace-scheduler")}
        assert subjects <= accounts
    everything, lease = schemas["gpuplace"]["spec"], schemas["gpuplace-leader-election"]["spec"]
    assert everything["priorityLevelConfiguration"]["name"] == "workload-high"
    assert lease["priorityLevelConfiguration"]["name"] == "leader-election"
    # the Lease rule is matched first, and before the suggested `service-accounts` (9000)
    assert lease["matchingPrecedence"] < everything["matchingPrecedence"] < 9000
    config = yaml.safe_load(
        (rendering.ROOT / "deploy" / "base" / "kube-scheduler-config.yaml").read_text()
    )
    (rule,) = lease["rules"][0]["resourceRules"]
    assert rule["namespaces"] == [config["leaderElection"]["resourceNamespace"]]
    assert rule["resources"] == [config["leaderElection"]["resourceLock"]]
