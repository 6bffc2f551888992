"""gpuplace installed as a platform engineer installs it (issue 44): the image built from the
shipped Dockerfile, the shipped Deployment, CronJob and DaemonSet running from it on the
kit's kubelet node (`tests/realcluster/pods.py`), the certificate renewed under a running
webhook, and an upgrade while GPU pods are being created.

The tests share one installation (`in_pods`, which takes the session's cluster over: they
run last, `sessions.TAKES_OVER`) and run in this file's order: the upgrade is last.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from prometheus_client.parser import text_string_to_metric_families

from bench import image_install
from gpuplace.certs import issuing, pairs
from tests.deploy import test_install_sequence as install_sequence
from tests.realcluster import image, kit, pods
from tests.realcluster.conftest import Scope, kubelet_node_reading
from tests.realcluster.image import Built
from tests.realcluster.install import AGENT_NAMESPACE, LEASE, NAMESPACE, play
from tests.realcluster.kit import ROOT, Cluster, Kubectl
from tests.realcluster.objects import (
    REAL_NODE_GPUS,
    REAL_NODE_MODEL,
    bound,
    gpu_node,
    grant,
    pod,
)
from tests.realcluster.pods import InPods, ready
from tests.realcluster.sessions import HOST_PROCESSES, unusable
from tests.realcluster.test_node_agent import DEVICES, environment, gpu_env, inside, start

pytestmark = pytest.mark.timeout(1500)
"""The first test builds the image (minutes on a cold cache) and installs it."""

SERVICE_NAME = "gpuplace-webhook.gpuplace.svc"
UID = 65532
NO_KUBELET = {"key": "gpuplace.io/realcluster-no-kubelet", "value": "true", "effect": "NoSchedule"}
"""On these tests' fake GPU nodes: no kubelet would start the pods of the Deployment (its
surge pod prefers another node) or of the DaemonSet (it follows gpuplace.io/enabled), so
only the tests' own pods, which tolerate it, go there."""
TOLERATE = [{"key": NO_KUBELET["key"], "operator": "Exists", "effect": "NoSchedule"}]
STREAM_MAX = 300
"""Pods the upgrade's stream creates at most, one about every 0.3 s (the fake nodes hold
320 of its 10 % shares)."""


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    if not kit.KIT.is_dir():
        pytest.skip(f"real-cluster tier: {kit.KIT} absent (../shared beside the checkout)")
    return image.build(tmp_path_factory.mktemp("image"))


@pytest.fixture(scope="module")
def in_pods(
    cluster: Cluster,
    built: Built,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[InPods]:
    kubelet_node_reading(cluster)
    if cluster.env.get("K8S_DEVICE_PLUGIN_DIR") != "/var/lib/kubelet/device-plugins":
        unusable("the node's device-plugin directory is not the DaemonSet's hostPath")
    retiring = request.config.stash.get(HOST_PROCESSES, [])
    with pods.installed(
        cluster, tmp_path_factory.mktemp("pods"), built, retiring=retiring
    ) as found:
        yield found


@pytest.fixture
def kubectl(in_pods: InPods, tmp_path: Path) -> Kubectl:
    """Admin kubectl in the test's tmp dir; overrides conftest's, which would start the
    host-process installation, so that conftest's `scope` works on this one."""
    return Kubectl(in_pods.kubectl.binary, in_pods.kubectl.kubeconfig, tmp_path)


# ---- point 1: the image


def pins() -> dict[str, str]:
    found = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            found[re.sub(r"[-_.]+", "-", name.strip()).lower()] = version.strip()
    return found


def test_the_image_is_the_shipped_dockerfile_with_no_build_tools(built: Built) -> None:
    report = built.report
    assert report["dockerfile"] == str(ROOT / "Dockerfile")
    # the base: Debian bookworm's Python 3.11, as python:3.11.x-slim-bookworm
    assert report["base"]["python"].startswith("3.11."), report["base"]
    checks = report["checks"]
    assert checks["compilers"] == []
    assert not checks["pip_in_gpuplace_venv"]
    assert checks["dev_tools_in_gpuplace_venv"] == []
    assert not checks["development_room"] and not checks["source_tree"]
    assert sorted(name.split(".")[0] for name in checks["c_helpers"]) == [
        "_node_names",
        "_priorities",
    ]
    assert report["problems"] == []
    debian = report["packages"]["debian"]
    assert {"python3.11", "ca-certificates", "tzdata"} <= set(debian)
    assert not {"gcc", "gcc-12", "cpp", "binutils", "make", "libc6-dev"} & set(debian)
    venv = report["packages"]["gpuplace_venv"]
    assert venv.pop("gpuplace") == image.VERSION
    pinned = pins()
    assert {name: (version, pinned.get(name)) for name, version in venv.items()} == {
        name: (version, version) for name, version in venv.items()
    }, "the venv holds a version constraints.txt does not pin"
    assert report["user"] == f"{UID}:{UID}" and report["entrypoint"] == ["gpuplace"]
    assert report["exposed_ports"] == ["8443/tcp", "9090/tcp"]
    assert report["size_bytes"] > report["base"]["size_bytes"] > 0
    assert {"build", "total"} <= set(report["seconds"])
    assert built.archive.stat().st_size == report["archive"]["bytes"]


# ---- point 2: the shipped Deployment


def contains(live: Any, shipped: Any) -> bool:
    """`shipped` is in `live`: every key it sets has its value there (the API server adds
    defaults: probe thresholds, the ports' protocol, ...)."""
    if isinstance(shipped, Mapping):
        return isinstance(live, Mapping) and all(
            key in live and contains(live[key], value) for key, value in shipped.items()
        )
    if isinstance(shipped, list):
        return (
            isinstance(live, list)
            and len(live) == len(shipped)
            and all(contains(a, b) for a, b in zip(live, shipped, strict=True))
        )
    return bool(live == shipped)


@dataclass(frozen=True)
class Process:
    """A container's main process as the host's /proc shows it."""

    pid: int
    argv: list[str]
    uid: int
    no_new_privs: bool
    effective_caps: int
    root_read_only: bool


def processes_of(pod_uid: str) -> list[Process]:
    """The processes of a pod's containers (cgroupfs: .../pod<UID>/<container>), the pause
    process left out."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if f"pod{pod_uid}" not in (entry / "cgroup").read_text():
                continue
            argv = (entry / "cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
            if argv[0] == "/pause":
                continue
            status = dict(
                line.split(":", 1) for line in (entry / "status").read_text().splitlines()
            )
            root = next(
                line.split()
                for line in (entry / "mountinfo").read_text().splitlines()
                if line.split()[4] == "/"
            )
            found.append(
                Process(
                    int(entry.name),
                    argv,
                    int(status["Uid"].split()[1]),
                    status.get("NoNewPrivs", "").strip() == "1",
                    int(status["CapEff"].strip(), 16),
                    "ro" in root[5].split(","),
                )
            )
    return found


def pod_ip(obj: Mapping[str, Any]) -> str:
    return str(obj["status"]["podIP"])


def scrape(address: str, port: int = 9090) -> str:
    with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


def value(metrics: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels`."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def leader(in_pods: InPods) -> str:
    holder = in_pods.kubectl.json("-n", NAMESPACE, "get", "lease", LEASE)["spec"]
    return str(holder.get("holderIdentity") or "")


def test_the_shipped_deployment_runs_from_the_image(in_pods: InPods) -> None:
    running = in_pods.pods()
    assert len(running) == 2 and all(ready(obj) for obj in running), running
    shipped = in_pods.shipped("Deployment", "gpuplace")["spec"]["template"]["spec"]
    images = {"gpuplace": in_pods.built.tag, "kube-scheduler": in_pods.scheduler_image}
    for obj in running:
        spec = obj["spec"]
        assert contains(spec["securityContext"], shipped["securityContext"])
        assert [box["name"] for box in spec["containers"]] == ["kube-scheduler", "gpuplace"]
        for box, want in zip(spec["containers"], shipped["containers"], strict=True):
            for key in ("command", "args", "ports", "resources", "securityContext"):
                assert contains(box.get(key), want.get(key)), (box["name"], key)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert contains(box[probe], want[probe]), (box["name"], probe)
            assert box["image"] == images[box["name"]]
        statuses = obj["status"]["containerStatuses"]
        assert all(s["ready"] and s["restartCount"] == 0 for s in statuses), statuses
        # what the kernel says of each container's process
        seen = {
            ("kube-scheduler" if "kube-scheduler" in p.argv[0] else "gpuplace"): p
            for p in processes_of(obj["metadata"]["uid"])
        }
        assert set(seen) == {"kube-scheduler", "gpuplace"}, seen
        assert seen["gpuplace"].argv[1:3] == ["/opt/gpuplace/bin/gpuplace", "serve"]
        for process in seen.values():
            assert process.uid == UID, process
            assert process.root_read_only, process
            assert process.no_new_privs and process.effective_caps == 0, process
    # one replica leads: its kube-scheduler holds the Lease, its gang controller leads
    holder = leader(in_pods)
    names = [obj["metadata"]["name"] for obj in running]
    assert [name for name in names if holder.startswith(name + "_")] != [], (holder, names)
    leading = {
        obj["metadata"]["name"]: value(scrape(pod_ip(obj)), "gpuplace_gang_controller_leading")
        for obj in running
    }
    deadline = time.monotonic() + 60
    while sorted(leading.values()) != [0.0, 1.0]:
        assert time.monotonic() < deadline, leading
        time.sleep(1)
        leading = {
            obj["metadata"]["name"]: value(scrape(pod_ip(obj)), "gpuplace_gang_controller_leading")
            for obj in running
        }
    assert holder.startswith(max(leading, key=lambda name: leading[name]) + "_")
    # the webhook is called at the Service (the tier's stand-ins route it), with a caBundle
    for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        hook = in_pods.kubectl.json("get", kind, "gpuplace")["webhooks"][0]["clientConfig"]
        assert hook["service"]["name"] == "gpuplace-webhook" and hook["caBundle"]


def audit_lines(kubectl: Kubectl) -> list[dict[str, Any]]:
    """The webhook's audit lines in `kubectl logs` of every gpuplace pod."""
    args = ("-n", NAMESPACE, "logs", "-l", pods.SELECTOR, "-c", "gpuplace", "--tail=-1")
    out = kubectl.run(*args).out
    lines = []
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            item = json.loads(line)
            if isinstance(item, dict) and "endpoint" in item and "decision" in item:
                lines.append(item)
    return lines


def test_a_share_is_admitted_and_placed_by_the_pods(
    in_pods: InPods, kubectl: Kubectl, scope: Scope
) -> None:
    node = scope.node("gpu")
    scope.add_nodes(gpu_node(node, model=scope.model, gpus=2, taints=[NO_KUBELET]))
    asks = {
        "gpuplace.io/gpu-percent": "50",
        "gpuplace.io/gpu-memory": "10Gi",
        "gpuplace.io/gpu-model": scope.model,
    }
    share = pod("share", scope.namespace, asks, tolerations=TOLERATE)
    (kubectl.cwd / "pod.yaml").write_text(yaml.safe_dump(share))
    applied = kubectl.run("apply", "-f", "pod.yaml")
    assert applied.out.strip() == "pod/share created", applied
    placed = kit_wait_bound(kubectl, scope.namespace, "share")
    assert placed["spec"]["schedulerName"] == "gpuplace"
    assert placed["spec"]["nodeName"] == node and grant(placed)["node"] == node
    assert grant(placed)["milli"] == "500"
    # the webhook's audit lines, in `kubectl logs`, from the pods that served the reviews
    seen = [
        line
        for line in audit_lines(kubectl)
        if line["namespace"] == scope.namespace and line["name"] == "share"
    ]
    assert {line["endpoint"] for line in seen} >= {"mutate", "validate"}, seen
    assert all(line["decision"] == "allowed" for line in seen), seen
    # the extender of the leading replica bound it: its kube-scheduler called its sidecar
    holder = leader(in_pods)
    (lead,) = [obj for obj in in_pods.pods() if holder.startswith(obj["metadata"]["name"] + "_")]
    metrics = scrape(pod_ip(lead))
    for verb in ("filter", "bind"):
        assert value(metrics, EXTENDER, verb=verb, result="ok") >= 1, verb


EXTENDER = "gpuplace_extender_request_duration_seconds_count"


def kit_wait_bound(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    found = kubectl.wait_object(
        "pods", name, bound, namespace=namespace, timeout=120, what=f"{namespace}/{name} bound"
    )
    assert found is not None
    return found


# ---- point 4: the node agent's DaemonSet


def test_the_node_agent_daemonset_serves_the_kubelet_and_a_pod_gets_its_grant(
    in_pods: InPods, kubectl: Kubectl, scope: Scope
) -> None:
    # the DaemonSet also runs on every fake GPU node (opted in too; no kubelet starts it)
    (agent,) = [
        obj
        for obj in in_pods.pods(pods.AGENT_SELECTOR, AGENT_NAMESPACE)
        if obj["spec"].get("nodeName") == in_pods.node
    ]
    assert ready(agent) and agent["spec"]["nodeName"] == in_pods.node
    box = agent["spec"]["containers"][0]
    assert box["image"] == in_pods.built.tag
    shipped = in_pods.shipped("DaemonSet", "gpuplace-node-agent")["spec"]["template"]["spec"]
    assert contains(box["securityContext"], shipped["containers"][0]["securityContext"])
    assert box["args"] == shipped["containers"][0]["args"]
    (process,) = [
        p
        for p in processes_of(agent["metadata"]["uid"])
        if p.argv[1:3] == ["/opt/gpuplace/bin/gpuplace", "node-agent"]
    ]
    assert process.uid == 0 and process.root_read_only and process.no_new_privs
    setgid, setuid = 1 << 6, 1 << 7  # capability numbers 6 and 7
    assert process.effective_caps == setgid | setuid, hex(process.effective_caps)
    # registered with the kubelet, its GPUs published on the Node
    node = kubectl.json("get", "node", in_pods.node)
    assert node["status"]["capacity"]["gpuplace.io/gpu"] == str(100 * REAL_NODE_GPUS)
    published = json.loads(node["metadata"]["annotations"]["gpuplace.io/gpus"])
    assert [gpu["uuid"] for gpu in published] == in_pods.uuids
    assert value(scrape(pod_ip(agent)), "gpuplace_agent_plugin_registered") == 1
    # a whole GPU, granted by the sidecar, handed over by the agent's Allocate
    asks = {"gpuplace.io/gpu-count": "1", "gpuplace.io/gpu-model": REAL_NODE_MODEL}
    whole = pod(
        "whole", scope.namespace, asks, node_selector={"kubernetes.io/hostname": in_pods.node}
    )
    running = start(kubectl, whole)
    granted = grant(running)
    assert granted["node"] == in_pods.node and granted["uuids"] in in_pods.uuids
    assert gpu_env(environment(kubectl, running)) == {"NVIDIA_VISIBLE_DEVICES": DEVICES}
    assert inside(kubectl, running, "ls", DEVICES).split() == [granted["uuids"]]


def test_the_install_is_timed_as_the_bench_reports_it(in_pods: InPods) -> None:
    """`bench/image_install.py`'s figures, from this installation (README's install times)."""
    figures = image_install.measure(in_pods)
    assert figures["image"]["size_mib"] > figures["image"]["base_size_mib"] > 0
    steps = figures["install_seconds"]
    assert {"import", "apply", "certs", "rollout", "node-agent", "install"} <= set(steps)
    assert 0 < steps["apply"] + steps["certs"] + steps["rollout"] <= steps["install"]


# ---- point 3: the certificate CronJob under a running webhook


def secret_pair(kubectl: Kubectl, name: str) -> dict[str, bytes]:
    data = kubectl.json("-n", NAMESPACE, "get", "secret", name)["data"]
    return {key: base64.b64decode(value) for key, value in data.items()}


def fingerprint(pem_or_der: bytes) -> str:
    der = (
        x509.load_pem_x509_certificate(pem_or_der).public_bytes(serialization.Encoding.DER)
        if pem_or_der.lstrip().startswith(b"-----")
        else pem_or_der
    )
    return hashlib.sha256(der).hexdigest()


def served(address: str) -> str:
    """The fingerprint of the certificate a webhook serves on address:8443 (as kube-apiserver
    asks: SNI the Service's name)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection((address, 8443), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=SERVICE_NAME) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return fingerprint(der)


def aged_serving(ca: pairs.Pair, age: timedelta) -> pairs.Pair:
    """A serving pair for the Service, signed by `ca`'s key as if issued `age` ago (what the
    CronJob finds once that much time has passed): `ca`'s certificate re-signed with the
    same key, subject and key identifier but an earlier notBefore, so that the pair chains
    to the CA in caBundle."""
    then = datetime.now(UTC) - age
    builder = (
        x509.CertificateBuilder()
        .subject_name(ca.cert.subject)
        .issuer_name(ca.cert.subject)
        .public_key(ca.key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(then - timedelta(hours=1))
        .not_valid_after(ca.cert.not_valid_after_utc)
    )
    for extension in ca.cert.extensions:
        builder = builder.add_extension(extension.value, extension.critical)
    backdated = pairs.Pair(cert=builder.sign(ca.key, hashes.SHA256()), key=ca.key)
    spec = issuing.Spec(dns_names=issuing.service_names("gpuplace-webhook", NAMESPACE))
    return issuing.new_serving(backdated, spec, then)


def serving_state(in_pods: InPods) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Per gpuplace pod: the certificate it serves and its containers' IDs."""
    return {
        obj["metadata"]["name"]: (
            served(pod_ip(obj)),
            tuple(s["containerID"] for s in obj["status"]["containerStatuses"]),
        )
        for obj in in_pods.pods()
    }


def test_the_certificate_cronjob_renews_and_the_running_webhook_serves_it(
    in_pods: InPods, kubectl: Kubectl
) -> None:
    before = serving_state(in_pods)
    original = fingerprint(secret_pair(kubectl, "gpuplace-webhook-tls")["tls.crt"])
    assert {cert for cert, _ in before.values()} == {original}, before
    reloads = {name: value(scrape_pod(in_pods, name), RELOADS) for name in before}
    # months later: the serving pair is past 2/3 of its year
    ca_secret = secret_pair(kubectl, "gpuplace-ca")
    ca = pairs.load(ca_secret["ca.crt"], ca_secret["ca.key"])
    aged = aged_serving(ca, timedelta(days=300))
    secret = kubectl.json("-n", NAMESPACE, "get", "secret", "gpuplace-webhook-tls")
    secret["data"]["tls.crt"] = base64.b64encode(aged.cert_pem()).decode()
    secret["data"]["tls.key"] = base64.b64encode(aged.key_pem()).decode()
    kubectl.run("replace", "-f", "-", input=json.dumps(secret))
    # the CronJob, run once by hand
    job = "gpuplace-certs-renew"
    by_hand = f"kubectl -n gpuplace create job {job} --from=cronjob/gpuplace-certs"
    play(kubectl, by_hand, kubectl.cwd)
    play(
        kubectl,
        f"kubectl -n gpuplace wait --for=condition=complete job/{job} --timeout=5m",
        kubectl.cwd,
        timeout=330,
    )
    said = kubectl.run("-n", NAMESPACE, "logs", f"job/{job}").out
    assert "serving renewal was due" in said, said
    (ran,) = kubectl.json("-n", NAMESPACE, "get", "pods", "-l", f"job-name={job}")["items"]
    assert ran["spec"]["containers"][0]["image"] == in_pods.built.tag
    assert ran["status"]["phase"] == "Succeeded"
    renewed = fingerprint(secret_pair(kubectl, "gpuplace-webhook-tls")["tls.crt"])
    assert renewed not in {original, fingerprint(aged.cert_pem())}
    # the kubelet swaps the mounted files; serve reloads them: same containers, new pair
    deadline = time.monotonic() + 240
    after = serving_state(in_pods)
    while {cert for cert, _ in after.values()} != {renewed}:
        assert time.monotonic() < deadline, (after, renewed)
        time.sleep(2)
        after = serving_state(in_pods)
    assert {name: ids for name, (_, ids) in after.items()} == {
        name: ids for name, (_, ids) in before.items()
    }, "a gpuplace container was restarted"
    for name in before:
        assert value(scrape_pod(in_pods, name), RELOADS) > reloads[name]
    # kube-apiserver still trusts it (the CA and caBundle are unchanged)
    probe = pod(
        "probe",
        "default",
        {"gpuplace.io/gpu-count": "1", "gpuplace.io/gpu-model": REAL_NODE_MODEL},
    )
    kubectl.run("create", "--dry-run=server", "-f", "-", input=json.dumps(probe))


RELOADS = "gpuplace_webhook_certificate_reloads_total"


def scrape_pod(in_pods: InPods, name: str) -> str:
    (obj,) = [item for item in in_pods.pods() if item["metadata"]["name"] == name]
    return scrape(pod_ip(obj))


# ---- point 5: an upgrade under a stream of GPU pods


@dataclass
class Created:
    name: str
    status: int
    at: float
    """When the request was sent (time.monotonic)."""
    seconds: float
    body: str


def stream(
    cluster: Cluster, kubeconfig: Path, namespace: str, model: str, stop: threading.Event
) -> list[Created]:
    """GPU pods created one after another (POST, as kubectl does) until `stop` is set."""
    made: list[Created] = []
    path = f"/api/v1/namespaces/{namespace}/pods"
    asks = {"gpuplace.io/gpu-percent": "10", "gpuplace.io/gpu-model": model}
    while not stop.is_set() and len(made) < STREAM_MAX:
        name = f"stream-{len(made):03d}"
        started = time.monotonic()
        status, _, body = cluster.request_as(
            kubeconfig,
            "POST",
            path,
            pod(name, namespace, asks, tolerations=TOLERATE),
            content_type="application/json",
        )
        made.append(Created(name, status, started, time.monotonic() - started, body))
        time.sleep(0.3)
    return made


def test_an_upgrade_rolls_the_deployment_while_gpu_pods_are_created(
    in_pods: InPods, kubectl: Kubectl, scope: Scope, request: pytest.FixtureRequest
) -> None:
    scope.add_nodes(
        *(
            gpu_node(scope.node(f"gpu{i}"), model=scope.model, gpus=8, taints=[NO_KUBELET])
            for i in range(4)
        )
    )
    kubectl.run("-n", scope.namespace, "create", "serviceaccount", "streamer")
    kubectl.run(
        "-n", scope.namespace, "create", "rolebinding", "streamer", "--clusterrole=edit",
        f"--serviceaccount={scope.namespace}:streamer",
    )  # fmt: skip
    kubeconfig = in_pods.sa_kubeconfig(scope.namespace, "streamer")
    old = {obj["metadata"]["name"] for obj in in_pods.pods()}
    image.tag(in_pods.cluster, in_pods.built.tag, image.UPGRADE_TAG)
    pods.overlay(in_pods.workdir, image.UPGRADE_TAG, in_pods.scheduler_image, in_pods.replay)
    stop = threading.Event()
    made: list[Created] = []
    streaming = threading.Thread(
        target=lambda: made.extend(
            stream(in_pods.cluster, kubeconfig, scope.namespace, scope.model, stop)
        )
    )
    streaming.start()
    try:
        time.sleep(2)
        # the upgrade: the same three lines of step 3, then step 5's wait
        for line in install_sequence.documented():
            play(kubectl, line, in_pods.overlay)
        play(kubectl, pods.ROLLOUT_STEP[0], in_pods.overlay, timeout=pods.TIMEOUT)
        new = {obj["metadata"]["name"] for obj in in_pods.pods()}
        assert new and not new & old, (old, new)
        # the new replica takes the Lease
        deadline = time.monotonic() + 120
        while not any(leader(in_pods).startswith(name + "_") for name in new):
            assert time.monotonic() < deadline, (leader(in_pods), new)
            time.sleep(1)
        led = time.monotonic()
        time.sleep(3)  # a few creates against the new replicas alone
    finally:
        stop.set()
        streaming.join(timeout=60)
        # one request for all of them at the end (kubectl deletes pods one at a time)
        scope_pods = f"/api/v1/namespaces/{scope.namespace}/pods"
        request.addfinalizer(lambda: in_pods.cluster.request_as(kubeconfig, "DELETE", scope_pods))
    assert made and made[-1].at > led, "the stream ended before the new replica led"
    assert len(made) >= 20, f"only {len(made)} pods created during the rollout"
    timeouts = webhook_timeouts(kubectl)
    refused = [c for c in made if c.status != 201]
    assert refused == [], refused[:3]
    slow = [(c.name, round(c.seconds, 2)) for c in made if c.seconds >= max(timeouts)]
    assert slow == [], f"creates slower than the webhooks' timeout {max(timeouts)} s: {slow}"
    # every pod mutated, placed, granted once; no GPU holds more than it has
    names = {c.name for c in made}
    seen = kubectl.watch(
        ["pods", "-n", scope.namespace],
        lambda pods_seen: (
            pods_seen if sum(1 for o in pods_seen.values() if bound(o)) == len(names) else None
        ),
        timeout=180,
        what=f"all {len(names)} streamed pods bound with their grants",
    )
    placed = {key.split("/", 1)[1]: obj for key, obj in seen.items()}
    assert set(placed) == names
    assert {obj["spec"]["schedulerName"] for obj in placed.values()} == {"gpuplace"}
    per_gpu: dict[tuple[str, str], int] = {}
    for obj in placed.values():
        granted = grant(obj)
        assert granted["milli"] == "100" and "," not in granted["gpus"], granted
        gpu = (granted["node"], granted["gpus"])
        per_gpu[gpu] = per_gpu.get(gpu, 0) + int(granted["milli"])
    assert max(per_gpu.values()) <= 1000, per_gpu
    # each new replica's ledger (rebuilt from the API) holds exactly these grants
    want = (float(sum(per_gpu.values())), float(len(names)))
    deadline = time.monotonic() + 60
    while (ledgers := ledger_totals(in_pods)) != {name: want for name in new}:
        assert time.monotonic() < deadline, (ledgers, want)
        time.sleep(1)


def ledger_totals(in_pods: InPods) -> dict[str, tuple[float, float]]:
    """Per gpuplace pod: the milli-GPUs its ledger holds and its count of confirmed grants."""
    totals = {}
    for obj in in_pods.pods():
        metrics = scrape(pod_ip(obj))
        totals[obj["metadata"]["name"]] = (
            value(metrics, "gpuplace_ledger_allocated_milligpus"),
            value(metrics, "gpuplace_ledger_grants", state="confirmed"),
        )
    return totals


def webhook_timeouts(kubectl: Kubectl) -> list[int]:
    return [
        int(kubectl.json("get", kind, "gpuplace")["webhooks"][0]["timeoutSeconds"])
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration")
    ]
