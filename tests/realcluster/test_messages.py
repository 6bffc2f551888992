"""What a user reads: each refusal as `kubectl apply -f pod.yaml` prints it, compared with
docs/annotations.md ("When something is wrong"); the warnings of accepted pods; the Event
and `gpuplace explain` of a pod that waits."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from typing import Any

import yaml

from tests.realcluster.conftest import Scope
from tests.realcluster.install import GPUPLACE
from tests.realcluster.kit import ROOT, Kubectl
from tests.realcluster.objects import gpu_node, pod, wait_bound

ANNOTATIONS_DOC = ROOT / "docs" / "annotations.md"


def section(title: str) -> str:
    text = ANNOTATIONS_DOC.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def documented_rows() -> dict[str, str]:
    """The refusal table: situation → message (blank situations continue the previous)."""
    rows: dict[str, str] = {}
    last = ""
    for line in section("When something is wrong").splitlines():
        match = re.fullmatch(r"\|\s*([^|]*?)\s*\|\s*`(.*)`\s*\|", line)
        if match is None:
            continue
        situation = match.group(1).strip() or last
        key, number = situation, 2
        while key in rows:
            key, number = f"{situation} {number}", number + 1
        rows[key] = match.group(2)
        last = situation
    return rows


def documented_warnings() -> list[str]:
    found = re.findall(r"^- `([^`]*)`", section("When something is wrong"), re.MULTILINE)
    return [warning for warning in found if "NVIDIA_VISIBLE_DEVICES" not in warning]


def normalised(text: str) -> str:
    """What differs with the cluster (figures, the models it has) made alike."""
    text = re.sub(r"the models present are: [^;)]*", "the models present are: MODELS", text)
    text = re.sub(r"of model \S+", "of model MODEL", text)
    return re.sub(r"\d+(Gi|Mi)?", "N", text)


def apply_file(kubectl: Kubectl, obj: Mapping[str, Any]) -> subprocess.CompletedProcess[str]:
    """`kubectl apply -f pod.yaml`, as the docs show it."""
    (kubectl.cwd / "pod.yaml").write_text(yaml.safe_dump(dict(obj)))
    return subprocess.run(
        [str(kubectl.binary), "--kubeconfig", str(kubectl.kubeconfig), "apply", "-f", "pod.yaml"],
        cwd=kubectl.cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_documented_refusal_is_what_kubectl_prints(scope: Scope, kubectl: Kubectl) -> None:
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=1))
    block = re.search(r"```text\n(.*?)\n```", section("When something is wrong"), re.DOTALL)
    assert block is not None
    done = apply_file(
        kubectl, pod("trainer", scope.namespace, {"gpuplace.io/gpu-percent": "fifty"})
    )
    assert done.returncode == 1
    assert done.stderr.strip() == block.group(1).strip()


def refusals(scope: Scope) -> dict[str, dict[str, Any]]:
    """A pod per documented situation that a user can cause."""
    ns, model = scope.namespace, scope.model

    def asking(extra: Mapping[str, str]) -> dict[str, Any]:
        return pod("trainer", ns, {"gpuplace.io/gpu-model": model, **extra})

    # naming the GPU container: a container of one's own that asks for a share is refused
    # (without the name, the one container carrying gpuplace resources would be the GPU's)
    two_containers = asking({"gpuplace.io/gpu-percent": "50", "gpuplace.io/container": "main"})
    side: dict[str, Any] = {"name": "side", "image": "localhost/busybox:local"}
    side["resources"] = {"limits": {"gpuplace.io/gpu-percent": "10"}}
    two_containers["spec"]["containers"].append(side)
    by_hand = asking({"gpuplace.io/gpu-percent": "50"})
    by_hand["spec"]["nodeName"] = scope.node("a")
    container = asking({"gpuplace.io/gpu-percent": "50", "gpuplace.io/container": "trainr"})
    container["spec"]["containers"][0]["name"] = "trainer"
    container["spec"]["containers"].append({"name": "sidecar", "image": "localhost/busybox:local"})
    return {
        "typo in a key": pod("trainer", ns, {"gpuplace.io/gpu-precent": "50"}),
        "bad value": asking({"gpuplace.io/gpu-memory": "lots"}),
        "contradiction": asking({"gpuplace.io/gpu-percent": "50", "gpuplace.io/gpu-count": "2"}),
        "missing partner": asking({"gpuplace.io/gpu-count": "1", "gpuplace.io/gang-name": "g"}),
        "no such container": container,
        "nothing could ever hold it": pod("trainer", ns, {"gpuplace.io/gpu-memory": "100Gi"}),
        "nothing could ever hold it 2": pod("trainer", ns, {"gpuplace.io/gpu-count": "16"}),
        "nothing could ever hold it 3": pod(
            "trainer", ns, {"gpuplace.io/gpu-percent": "50", "gpuplace.io/gpu-model": "Tesla-T4"}
        ),
        "nothing could ever hold it 4": asking(
            {"gpuplace.io/gpu-count": "2", "gpuplace.io/gpu-topology": "required"}
        ),
        "placed by hand": by_hand,
        "resources by hand": two_containers,
    }


def test_each_documented_refusal_is_what_kubectl_prints(scope: Scope, kubectl: Kubectl) -> None:
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=2))
    rows = documented_rows()
    made = refusals(scope)
    assert set(made) <= set(rows), sorted(set(made) - set(rows))
    wrong = {}
    for situation, obj in made.items():
        done = apply_file(kubectl, obj)
        documented = rows[situation].split("…")[0].rstrip(" (;")
        if done.returncode != 1 or normalised(documented) not in normalised(done.stderr):
            wrong[situation] = (rows[situation], done.stderr.strip())
    assert wrong == {}, "\n\n".join(
        f"{k}:\n  documented: {d}\n  printed: {p}" for k, (d, p) in wrong.items()
    )


def test_changing_a_request_later_is_refused_as_documented(scope: Scope, kubectl: Kubectl) -> None:
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=1))
    asks = {"gpuplace.io/gpu-percent": "50", "gpuplace.io/gpu-model": scope.model}
    kubectl.apply(pod("trainer", scope.namespace, asks))
    wait_bound(kubectl, scope.namespace, "trainer")
    done = kubectl.run(
        "-n",
        scope.namespace,
        "annotate",
        "pod",
        "trainer",
        "--overwrite",
        "gpuplace.io/gpu-percent=60",
        check=False,
    )
    documented = documented_rows()["changing a request later"]
    head, tail = documented.split("(…)")
    assert done.code == 1 and head in done.err and tail in done.err, done.err


def test_each_documented_warning_is_printed_on_apply(scope: Scope, kubectl: Kubectl) -> None:
    scope.add_nodes(gpu_node(scope.node("a"), model=scope.model, gpus=1))
    model = {"gpuplace.io/gpu-model": scope.model}
    volcano = pod("volcano", scope.namespace, {"gpuplace.io/gpu-percent": "20", **model})
    volcano["spec"]["schedulerName"] = "volcano"
    pods = [
        pod(
            "rounded",
            scope.namespace,
            {"gpuplace.io/gpu-percent": "20", "gpuplace.io/gpu-memory": "10G", **model},
        ),
        pod("memory-only", scope.namespace, {"gpuplace.io/gpu-memory": "8Gi", **model}),
        pod("no-memory", scope.namespace, {"gpuplace.io/gpu-percent": "20", **model}),
        pod(
            "topology",
            scope.namespace,
            {"gpuplace.io/gpu-count": "1", "gpuplace.io/gpu-topology": "required", **model},
        ),
        volcano,
    ]
    printed = "\n".join(apply_file(kubectl, obj).stderr for obj in pods)
    missing = [
        warning
        for warning in documented_warnings()
        if f"Warning: {warning}\n" not in printed + "\n"
    ]
    assert missing == [], printed


def test_a_pending_pod_says_why_in_its_event_and_in_explain(scope: Scope, kubectl: Kubectl) -> None:
    name = scope.node("a")
    scope.add_nodes(gpu_node(name, model=scope.model, gpus=2))
    model = {"gpuplace.io/gpu-model": scope.model}
    for first in ("first-0", "first-1"):
        kubectl.apply(pod(first, scope.namespace, {"gpuplace.io/gpu-percent": "60", **model}))
        wait_bound(kubectl, scope.namespace, first)
    # the node's totals have room (80% of 200%), no single GPU has: the sidecar says so
    kubectl.apply(pod("train", scope.namespace, {"gpuplace.io/gpu-percent": "50", **model}))
    event = kubectl.wait_event(scope.namespace, "train", "FailedGpuPlacement")
    head = f"0/1 nodes: 1 no GPU with enough share free (for 50% of one GPU of {scope.model})"
    assert event.startswith(head), event
    assert f"e.g. {name}: " in event and "40% free, needs 50%" in event, event
    assert event.endswith(f"Node by node: gpuplace explain {scope.namespace}/train"), event
    explained = subprocess.run(
        [GPUPLACE, "explain", f"{scope.namespace}/train", f"--kubeconfig={kubectl.kubeconfig}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert explained.startswith(f"Pod {scope.namespace}/train\n  Pending: no GPUs assigned yet.")
    rows = [line for line in explained.splitlines() if line.startswith(name + " ")]
    assert len(rows) == 1, explained
    row = rows[0]
    assert re.search(r"no GPU with enough share free\s+gpu \d: 40% free, needs 50%$", row), row
    assert scope.model in row and "40/40" in row, row
