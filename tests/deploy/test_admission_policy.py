"""The ValidatingAdmissionPolicies of deploy/components/node-agent/admission-policy.yaml,
evaluated by cel-python the way kube-apiserver evaluates them (matchConditions, then the
variables in order, then each validation; `has` as strict as cel-go's, see tests.deploy.matching):
against every captured AdmissionReview as the API server sent it, the same pods mutated by
gpuplace's own webhook, a table of bypass attempts, random env lists, and for the
resources only a grant may ask for (issue 30) a table and random pods. An expression
that fails would refuse the request (failurePolicy Fail), so every evaluation must succeed.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.cluster import gpu_bypass, grammar, keys, mps_limits, nodes
from gpuplace.webhook import admission, mutating, reviews
from gpuplace.webhook.config import WebhookConfig
from gpuplace.webhook.inventory import FixedCapabilities
from tests.deploy import matching, rendering
from tests.webhook import helpers

pytest.importorskip("celpy", reason="cel-python (test extra) evaluates the CEL")

import celpy
from celpy import adapter, celtypes, evaluation

Obj = dict[str, Any]
BYPASS = "gpuplace-no-gpu-bypass"
OWN_NODE = "gpuplace-node-agent-own-node"
GRANT = "gpuplace-gpu-resources-need-a-grant"
SIDECAR = WebhookConfig().sidecar_user
AGENT = "system:serviceaccount:kube-system:gpuplace-node-agent"
NODE_NAME = "authentication.kubernetes.io/node-name"
FIXTURES = rendering.ROOT.parent / "shared" / "fixtures" / "admission"


def policy(name: str) -> Obj:
    # the DRA overlay holds every policy: the node-agent component's and the DRA one's
    return rendering.one(rendering.render(rendering.DRA), "ValidatingAdmissionPolicy", name)


@functools.cache
def _compiled(name: str) -> tuple[list[Any], list[tuple[str, Any]], list[tuple[str, Any]]]:
    environment = celpy.Environment(runner_class=matching.StrictRunner)

    def program(expression: str) -> Any:
        return environment.program(environment.compile(expression))

    spec = policy(name)["spec"]
    conditions = [program(c["expression"]) for c in spec.get("matchConditions", [])]
    variables = [(v["name"], program(v["expression"])) for v in spec.get("variables", [])]
    validations = [
        (v.get("message") or v["messageExpression"], program(v["expression"]))
        for v in spec["validations"]
    ]
    return conditions, variables, validations


def _evaluate(program: Any, activation: dict[str, Any], what: str) -> Any:
    try:
        return program.evaluate(activation)
    except evaluation.CELEvalError as error:
        raise AssertionError(f"{what} failed: {error}") from None


def refusals(name: str, request: Obj) -> list[str]:
    """The messages of the validations of policy `name` that refuse `request` (an
    AdmissionRequest dict); [] when it is allowed or the policy does not apply."""
    conditions, variables, validations = _compiled(name)
    activation: dict[str, Any] = {
        "object": adapter.json_to_cel(request.get("object")),
        "oldObject": adapter.json_to_cel(request.get("oldObject")),
        "request": adapter.json_to_cel(request),
    }
    for index, condition in enumerate(conditions):
        if not bool(_evaluate(condition, activation, f"matchCondition {index}")):
            return []
    values: dict[str, Any] = {}
    for variable, program in variables:
        activation["variables"] = celtypes.MapType(values)
        values[celtypes.StringType(variable)] = _evaluate(program, activation, variable)
    activation["variables"] = celtypes.MapType(values)
    refused = []
    for message, program in validations:
        value = _evaluate(program, activation, message)
        assert isinstance(value, celtypes.BoolType), f"{message} gave {value!r}"
        if not value:
            refused.append(message)
    return refused


def served(obj: Obj | None) -> Obj | None:
    """`obj` as the API server hands it to a policy: decoded into the Go types and
    encoded again, so a field that is `omitempty` and empty is not there. The one that
    matters here: an env entry's `value: ""` (what the real API server showed this
    policy, tests/realcluster/test_policies.py)."""
    if obj is None:
        return None
    found = copy.deepcopy(obj)
    spec = found.get("spec") or {}
    for field in ("containers", "initContainers", "ephemeralContainers"):
        for container in spec.get(field) or []:
            for entry in container.get("env") or []:
                if entry.get("value") == "":
                    del entry["value"]
    return found


def request(
    operation: str,
    obj: Obj | None,
    old: Obj | None = None,
    *,
    user: str = "alice",
    extra: dict[str, list[str]] | None = None,
) -> Obj:
    body: Obj = helpers.review(served(obj), operation=operation, old=served(old), user=user)[
        "request"
    ]
    body["userInfo"]["extra"] = extra or {}
    return body


@functools.cache
def deployed_reviewer() -> admission.Reviewer:
    """gpuplace's webhook as deploy/ runs it: with `--node-agent=true`."""
    args = rendering.container(
        rendering.one(rendering.render(rendering.NODE_AGENT), "Deployment", "gpuplace")["spec"][
            "template"
        ]["spec"],
        "gpuplace",
    )["args"]
    assert "--node-agent=true" in args
    capabilities = nodes.inventory(helpers.node_list()["items"]).capabilities()
    return admission.Reviewer(WebhookConfig(node_agent=True), FixedCapabilities(capabilities))


def mutated(pod: Obj) -> Obj | None:
    """`pod` as gpuplace's real mutating webhook, as deployed, leaves it; None when it
    refuses it."""
    wire = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": request("CREATE", pod)}  # fmt: skip
    parsed = reviews.AdmissionReview.model_validate(wire).request
    decision = deployed_reviewer().mutate(parsed)
    if not decision.allowed:
        return None
    result: Obj = jsonpatch.apply_patch(pod, decision.ops) if decision.ops else pod
    return result


def share() -> Obj:
    pod = mutated(helpers.pod({keys.GPU_PERCENT: "25", keys.GPU_MEMORY: "2Gi"}))
    assert pod is not None
    return pod


def with_env(pod: Obj, *env: Obj, field: str = "containers") -> Obj:
    changed = copy.deepcopy(pod)
    containers = changed["spec"].setdefault(field, [])
    if not containers:
        containers.append({"name": "x", "image": "busybox:1.36"})
    containers[0].setdefault("env", []).extend(env)
    return changed


def with_mount(pod: Obj, path: str) -> Obj:
    changed = copy.deepcopy(pod)
    changed["spec"]["volumes"] = [{"name": "v", "emptyDir": {}}]
    changed["spec"]["containers"][0]["volumeMounts"] = [{"name": "v", "mountPath": path}]
    return changed


def annotated(pod: Obj, **annotations: str | None) -> Obj:
    changed = copy.deepcopy(pod)
    values = changed["metadata"].setdefault("annotations", {})
    for key, value in annotations.items():
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    return changed


# --- what gpuplace itself writes passes ------------------------------------------------------


def captured() -> list[tuple[str, Obj]]:
    files = sorted(FIXTURES.glob("*.json")) if FIXTURES.is_dir() else []
    return [(f.name, json.loads(f.read_text())["request"]["request"]) for f in files]


@pytest.mark.skipif(not captured(), reason=f"captured fixtures not found in {FIXTURES}")
@pytest.mark.parametrize(("name", "body"), captured(), ids=[n for n, _ in captured()])
def test_every_captured_request_is_allowed_as_sent_and_as_mutated(name: str, body: Obj) -> None:
    for judge in (BYPASS, GRANT):
        assert refusals(judge, body) == [], (judge, name)
        if body["operation"] == "CREATE":
            after = mutated(body["object"])
            if after is not None:  # what the webhook refuses is never stored
                assert refusals(judge, {**body, "object": after}) == [], (judge, name)


def test_the_deployed_webhook_writes_no_gpu_env_and_the_policy_allows_none() -> None:
    pod = share()
    env = pod["spec"]["containers"][0].get("env") or []
    assert [e for e in env if e["name"].startswith(("NVIDIA_", "CUDA_MPS_"))] == []
    assert refusals(BYPASS, request("CREATE", pod)) == []
    # the webhook without the agent would write them: the policy would refuse that pod
    spec = grammar.parse({keys.GPU_PERCENT: "25", keys.GPU_MEMORY: "2Gi"})
    assert spec is not None
    legacy = mutating.env_vars(spec)
    assert {e["name"] for e in legacy} == {
        mutating.VISIBLE_DEVICES_ENV,
        mps_limits.THREADS_ENV,
        mps_limits.MEMORY_ENV,
    }
    assert refusals(BYPASS, request("CREATE", with_env(pod, *legacy)))


def test_the_policy_names_gpuplaces_keys_and_sidecar_as_the_code_does() -> None:
    spec = policy(BYPASS)["spec"]
    system = next(v for v in spec["variables"] if v["name"] == "system")["expression"]
    assert json.loads(system.replace("'", '"')) == list(keys.SYSTEM_ANNOTATIONS)
    assert SIDECAR in spec["validations"][-1]["expression"]


# --- bypass attempts are refused -------------------------------------------------------------


def _bypass_table() -> list[tuple[str, Obj, bool]]:
    """(case, AdmissionRequest, refused)."""
    plain = helpers.pod()
    running = annotated(share(), **{keys.ASSIGNED_GPUS: "0", keys.ASSIGNED_NODE: "h100-0"})
    all_gpus = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}
    no_gpu = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
    from_user = {
        "name": "NVIDIA_VISIBLE_DEVICES",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['mine']"}},
    }
    pipe = {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/nvidia-mps"}
    more = {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "100"}
    debug = with_env(running, all_gpus, field="ephemeralContainers")
    old_pod_with_env = with_env(plain, all_gpus)
    status = copy.deepcopy(old_pod_with_env)
    status["status"] = {"phase": "Running"}
    node = "system:node:h100-0"
    return [
        ("plain pod", request("CREATE", plain), False),
        ("a CPU pod that asks for no GPU", request("CREATE", with_env(plain, no_gpu)), False),
        ("NVIDIA_VISIBLE_DEVICES=all", request("CREATE", with_env(plain, all_gpus)), True),
        ("... in an init container", request("CREATE", with_env(plain, all_gpus,
                                                               field="initContainers")), True),
        ("... on a gpuplace pod", request("CREATE", with_env(share(), all_gpus)), True),
        ("read from a user annotation", request("CREATE", with_env(share(), from_user)), True),
        ("CUDA_MPS_PIPE_DIRECTORY", request("CREATE", with_env(share(), pipe)), True),
        ("MPS limit without gpuplace", request("CREATE", with_env(plain, more)), True),
        ("MPS limit on a gpuplace pod", request("CREATE", with_env(share(), more)), True),
        ("CUDA_VISIBLE_DEVICES is CUDA's own filter",
         request("CREATE", with_env(plain, {"name": "CUDA_VISIBLE_DEVICES", "value": "0"})),
         False),
        ("device-list volume mount",
         request("CREATE", with_mount(plain, "/var/run/nvidia-container-devices/all")), True),
        ("... through /run", request("CREATE", with_mount(plain,
                                                        "/run/nvidia-container-devices/GPU-1")),
         True),
        ("an ordinary mount", request("CREATE", with_mount(plain, "/data")), False),
        ("CDI annotation",
         request("CREATE", annotated(plain, **{"cdi.k8s.io/gpu": "nvidia.com/gpu=all"})), True),
        ("forged assignment", request("CREATE", annotated(share(), **{keys.ASSIGNED_GPUS: "0"})),
         True),
        ("the sidecar assigns", request("UPDATE", running, share(), user=SIDECAR), False),
        ("a user changes the GPUs",
         request("UPDATE", annotated(running, **{keys.ASSIGNED_GPUS: "1"}), running), True),
        ("a user removes the assignment",
         request("UPDATE", annotated(running, **{keys.ASSIGNED_NODE: None}), running), True),
        ("a user labels a running GPU pod",
         request("UPDATE", annotated(running, note="x"), running), False),
        ("debug container with the env", request("UPDATE", debug, running), True),
        ("debug container, env-free",
         request("UPDATE", with_env(running, {"name": "A", "value": "1"},
                                   field="ephemeralContainers"), running), False),
        ("a kubelet status write on a pod older than the policy",
         request("UPDATE", status, old_pod_with_env, user=node), False),
        ("the sidecar cannot set the env", request("CREATE", with_env(plain, all_gpus),
                                                   user=SIDECAR), True),
    ]  # fmt: skip


BYPASS_TABLE = _bypass_table()


@pytest.mark.parametrize(
    ("case", "body", "refused"), BYPASS_TABLE, ids=[case for case, _, _ in BYPASS_TABLE]
)
def test_bypass_attempts(case: str, body: Obj, refused: bool) -> None:
    found = refusals(BYPASS, body)
    assert bool(found) is refused, (case, found)
    assert len(found) <= 1, found  # each attempt is named by exactly one message


def test_an_existing_debug_container_is_not_judged_again() -> None:
    running = share()
    old = with_env(running, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                   field="ephemeralContainers")  # fmt: skip
    newer = annotated(old, note="x")
    assert refusals(BYPASS, request("UPDATE", newer, old)) == []


NAMES = st.sampled_from(
    [
        "NVIDIA_VISIBLE_DEVICES",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
        "CUDA_MPS_PIPE_DIRECTORY",
        "CUDA_MPS_LOG_DIRECTORY",
        "CUDA_VISIBLE_DEVICES",
        "PATH",
        "NVIDIA_DRIVER_CAPABILITIES",
    ]
)
FIELD_PATHS = st.sampled_from(
    [f"metadata.annotations['{keys.VISIBLE_DEVICES}']", "metadata.annotations['mine']"]
)
ENTRY = st.one_of(
    st.builds(
        lambda n, v: {"name": n, "value": v},
        NAMES,
        st.sampled_from(["all", "0", "50", "void", "none", "", "NONE"]),
    ),
    st.builds(
        lambda n, p: {"name": n, "valueFrom": {"fieldRef": {"fieldPath": p}}}, NAMES, FIELD_PATHS
    ),
)


def allowed_entry(entry: Obj) -> bool:
    """The rule, said in Python: `void`, `none` or empty ask the runtime for no GPU."""
    name: str = entry["name"]
    if name == "NVIDIA_VISIBLE_DEVICES":
        return entry.get("value") in ("void", "none", "")
    return not name.startswith("CUDA_MPS_")


@settings(deadline=None)  # CEL by cel-python: 100-300 ms an example on a busy host
@given(st.lists(ENTRY, max_size=5), st.booleans(), st.booleans())
def test_env_is_refused_exactly_when_it_names_gpus_or_mps(
    env: list[Obj], managed: bool, init: bool
) -> None:
    pod = with_env(helpers.pod(), *env, field="initContainers" if init else "containers")
    if managed:
        pod["metadata"]["labels"] = {keys.MANAGED: "true"}
    refused = bool(refusals(BYPASS, request("CREATE", pod)))
    assert refused is not all(allowed_entry(e) for e in env)


# --- `gpuplace preflight` judges existing pods as the policy judges their copies -------------


def refused_again(pod: Obj) -> bool:
    """Whether the policy refuses a CREATE of `pod` by a user for a reason that the
    creation of its replacement would meet again: all but the assignment annotations'
    rule (a replacement carries none)."""
    spec = policy(BYPASS)["spec"]
    again = {v["message"] for v in spec["validations"] if "message" in v}
    assert len(again) == len(spec["validations"]) - 1  # env, mount, CDI; not the assignment
    return bool(set(refusals(BYPASS, request("CREATE", pod))) & again)


CREATED_BY_USERS = [
    (case, body["object"])
    for case, body, _ in BYPASS_TABLE
    if body["operation"] == "CREATE" and body["userInfo"]["username"] != SIDECAR
]
"""The table's pods as a user creates them: what a controller creates again."""


@pytest.mark.parametrize(("case", "pod"), CREATED_BY_USERS, ids=[c for c, _ in CREATED_BY_USERS])
def test_preflight_names_what_the_policy_refuses_in_the_bypass_table(case: str, pod: Obj) -> None:
    # as a pod gpuplace's webhook did not mutate: on one it did, the GPU env the webhook
    # writes is not counted (the next test), whoever wrote it
    pod = copy.deepcopy(pod)
    pod["metadata"].get("labels", {}).pop(keys.MANAGED, None)
    assert bool(gpu_bypass.reasons(pod)) is refused_again(pod), (case, gpu_bypass.reasons(pod))


MOUNTS = st.sampled_from(
    [None, "/data", "/var/run/nvidia-container-devices/all", "/run/nvidia-container-devices/0"]
)


@settings(deadline=None, max_examples=60)  # CEL by cel-python: 100-300 ms an example
@given(st.lists(ENTRY, max_size=4), MOUNTS, st.booleans(), st.booleans())
def test_preflight_judges_a_pod_as_the_policy_judges_its_copy(
    env: list[Obj], mount: str | None, cdi: bool, init: bool
) -> None:
    pod = with_env(helpers.pod(), *env, field="initContainers" if init else "containers")
    if mount is not None:
        pod = with_mount(pod, mount)
    if cdi:
        pod = annotated(pod, **{"cdi.k8s.io/gpu": "nvidia.com/gpu=all"})
    existing = served(pod)  # as a list of the API answers it
    assert existing is not None
    assert bool(gpu_bypass.reasons(existing)) is refused_again(pod)


@pytest.mark.parametrize("node_agent", [False, True])
def test_preflight_leaves_the_gpu_env_gpuplaces_webhook_writes_alone(node_agent: bool) -> None:
    """A GPU pod mutated before the node agent carries the webhook's own GPU env, which
    the policy would refuse on the pod as stored; its replacement is mutated again (with
    --node-agent=true: no env), so preflight does not count it. `WEBHOOK_ENV` is what
    the webhook writes."""
    capabilities = nodes.inventory(helpers.node_list()["items"]).capabilities()
    reviewer = admission.Reviewer(
        WebhookConfig(node_agent=node_agent), FixedCapabilities(capabilities)
    )
    asked = helpers.pod({keys.GPU_PERCENT: "25", keys.GPU_MEMORY: "2Gi"})
    wire = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": request("CREATE", asked)}  # fmt: skip
    decision = reviewer.mutate(reviews.AdmissionReview.model_validate(wire).request)
    stored: Obj = jsonpatch.apply_patch(asked, decision.ops)
    written = {
        e["name"]: e.get("valueFrom") for e in stored["spec"]["containers"][0].get("env", [])
    }
    if node_agent:
        assert written == {}
    else:
        assert written == gpu_bypass.WEBHOOK_ENV
        assert refused_again(stored)  # as stored, the policy would refuse it
    assert gpu_bypass.reasons(stored) == []
    stored["spec"]["containers"][0].setdefault("env", []).append(
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}
    )
    assert gpu_bypass.reasons(stored) == ["container main sets NVIDIA_VISIBLE_DEVICES=all"]


def test_the_binding_spares_only_the_nodes_own_machinery() -> None:
    objects = rendering.render(rendering.NODE_AGENT)
    binding = rendering.one(objects, "ValidatingAdmissionPolicyBinding", BYPASS)
    assert binding["spec"]["policyName"] == BYPASS
    assert binding["spec"]["validationActions"] == ["Deny"]
    selector = binding["spec"]["matchResources"]["namespaceSelector"]
    for labels, judged in (
        ({"kubernetes.io/metadata.name": "team-a"}, True),
        ({"kubernetes.io/metadata.name": "gpuplace"}, True),
        ({"kubernetes.io/metadata.name": "default", "gpuplace.io/gpu-system": "false"}, True),
        ({"kubernetes.io/metadata.name": "kube-system"}, False),
        ({"kubernetes.io/metadata.name": "gpu-operator", "gpuplace.io/gpu-system": "true"}, False),
    ):
        assert rendering.selects(selector, labels) is judged, labels
        # `gpuplace preflight` spares the namespaces the binding spares
        name = labels["kubernetes.io/metadata.name"]
        assert gpu_bypass.judged(name, labels) is judged, labels
    assert keys.GPU_SYSTEM in {e["key"] for e in selector["matchExpressions"]}
    assert policy(BYPASS)["spec"]["failurePolicy"] == "Fail"
    own = rendering.one(objects, "ValidatingAdmissionPolicyBinding", OWN_NODE)
    assert own["spec"] == {"policyName": OWN_NODE, "validationActions": ["Deny"]}


# --- the node agent changes its own Node's gpuplace annotations only -------------------------


def node(name: str = "h100-0", **annotations: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, keys.NODE_ENABLED: "true"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", **annotations},
        },
        "spec": {"podCIDR": "10.0.0.0/24"},
    }


def node_update(new: Obj, old: Obj, *, user: str = AGENT, on: str | None = "h100-0") -> Obj:
    body = request("UPDATE", new, old, user=user, extra={NODE_NAME: [on]} if on else {})
    body["kind"] = {"group": "", "version": "v1", "kind": "Node"}
    body["resource"] = {"group": "", "version": "v1", "resource": "nodes"}
    return body


def test_the_agent_patches_its_own_nodes_gpuplace_annotations() -> None:
    old = node(**{keys.NODE_GPUS: "[]"})
    new = node(**{keys.NODE_GPUS: '[{"index": 0}]', "gpuplace.io/agent-heartbeat": "now"})
    assert refusals(OWN_NODE, node_update(new, old)) == []
    assert refusals(OWN_NODE, node_update(old, new)) == []  # and may remove them


@pytest.mark.parametrize(
    "case",
    ["another node", "no node in the token", "a label", "a foreign annotation", "the spec",
     "removes a foreign annotation"],
)  # fmt: skip
def test_the_agent_may_not_touch_anything_else(case: str) -> None:
    old = node()
    new = copy.deepcopy(old)
    on: str | None = "h100-0"
    if case == "another node":
        on = "h100-1"
    elif case == "no node in the token":
        on = None
    elif case == "a label":
        new["metadata"]["labels"]["nvidia.com/gpu.count"] = "8"
    elif case == "a foreign annotation":
        new["metadata"]["annotations"]["other.io/x"] = "1"
    elif case == "the spec":
        new["spec"]["unschedulable"] = True
    else:
        del new["metadata"]["annotations"]["node.alpha.kubernetes.io/ttl"]
    assert len(refusals(OWN_NODE, node_update(new, old, on=on))) == 1, case


def test_other_users_are_not_judged_by_the_agents_policy() -> None:
    old = node()
    new = node(**{"other.io/x": "1"})
    assert refusals(OWN_NODE, node_update(new, old, user="system:node:h100-0", on=None)) == []


# --- a gpuplace.io/ resource only through gpuplace's webhook (issue 30) ---------------------

MIRROR = "kubernetes.io/config.mirror"


def asking(
    resource: str = keys.RESOURCE_GPU,
    *,
    namespace: str = "team-a",
    annotations: dict[str, str] | None = None,
    field: str = "containers",
) -> Obj:
    """A pod whose first container (or an init container) asks for `resource` itself."""
    pod = helpers.pod(annotations)
    pod["metadata"]["namespace"] = namespace
    container = {"name": "gpu", "image": "cuda:12",
                 "resources": {"limits": {resource: "1"}, "requests": {resource: "1"}}}  # fmt: skip
    if field == "containers":
        pod["spec"]["containers"][0] = container
    else:
        pod["spec"]["initContainers"] = [container]
    return pod


def webhook_namespaces_skipped() -> list[str]:
    """The namespaces deploy/base/webhooks.yaml keeps from both webhooks."""
    skipped = set()
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for hook in rendering.one(rendering.render(rendering.NODE_AGENT), kind, "gpuplace")[
            "webhooks"
        ]:
            (expression,) = hook["namespaceSelector"]["matchExpressions"]
            assert expression["key"] == "kubernetes.io/metadata.name"
            assert expression["operator"] == "NotIn"
            skipped.add(tuple(expression["values"]))
    (values,) = skipped
    return list(values)


def _grant_table() -> list[tuple[str, Obj, bool]]:
    """(case, AdmissionRequest, refused)."""
    gpu = mutated(helpers.pod({keys.GPU_COUNT: "1"}))
    assert gpu is not None and keys.RESOURCE_GPU in str(gpu)
    annotated_raw = asking(annotations={keys.GPU_COUNT: "1"})
    mirror = asking(namespace="kube-system", annotations={MIRROR: "abc"})
    return [
        ("a plain pod", request("CREATE", helpers.pod()), False),
        ("a gpuplace pod as the webhook leaves it", request("CREATE", gpu), False),
        ("a gpuplace share as the webhook leaves it", request("CREATE", share()), False),
        ("gpuplace.io/gpu without annotations", request("CREATE", asking()), True),
        ("... in an init container",
         request("CREATE", asking(field="initContainers")), True),
        ("... gpu-percent", request("CREATE", asking(keys.RESOURCE_PERCENT)), True),
        ("... gpu-memory", request("CREATE", asking(keys.RESOURCE_MEMORY)), True),
        ("... in kube-system (the webhook does not see it)",
         request("CREATE", asking(namespace="kube-system")), True),
        ("... in gpuplace's own namespace",
         request("CREATE", asking(namespace="gpuplace")), True),
        ("... with annotations where the webhook does not look",
         request("CREATE", asking(namespace="gpuplace", annotations={keys.GPU_COUNT: "1"})),
         True),
        ("annotations and the resource: the validating webhook judges it",
         request("CREATE", annotated_raw), False),
        ("a static pod's mirror (the agent must see it)",
         request("CREATE", mirror, user="system:node:gpu-node-1"), False),
        ("nvidia.com/gpu is not gpuplace's",
         request("CREATE", asking("nvidia.com/gpu", namespace="kube-system")), False),
        ("the sidecar cannot either", request("CREATE", asking(), user=SIDECAR), True),
    ]  # fmt: skip


GRANT_TABLE = _grant_table()


@pytest.mark.parametrize(
    ("case", "body", "refused"), GRANT_TABLE, ids=[case for case, _, _ in GRANT_TABLE]
)
def test_a_gpuplace_resource_only_through_the_webhook(case: str, body: Obj, refused: bool) -> None:
    found = refusals(GRANT, body)
    assert bool(found) is refused, (case, found)
    if refused:
        (message,) = found
        assert "gpu" in message.lower()


def test_the_grant_policy_names_gpuplaces_keys_and_the_webhooks_namespaces() -> None:
    variables = {v["name"]: v["expression"] for v in policy(GRANT)["spec"]["variables"]}
    listed = variables["requested"].split("[", 1)[1].split("]", 1)[0]
    assert json.loads("[" + listed.replace("'", '"') + "]") == list(keys.USER_ANNOTATIONS)
    unseen = variables["unseen"].split("[", 1)[1].split("]", 1)[0]
    assert json.loads("[" + unseen.replace("'", '"') + "]") == webhook_namespaces_skipped()
    objects = rendering.render(rendering.NODE_AGENT)
    binding = rendering.one(objects, "ValidatingAdmissionPolicyBinding", GRANT)
    # every namespace, kube-system and gpu-system ones included
    assert binding["spec"] == {"policyName": GRANT, "validationActions": ["Deny"]}
    assert policy(GRANT)["spec"]["failurePolicy"] == "Fail"
    # a container's resources are set once: CREATE is judged, nothing else is sent
    (rule,) = policy(GRANT)["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["operations"], rule["resources"]) == (["CREATE"], ["pods"])


RESOURCES = st.dictionaries(
    st.sampled_from(
        [
            keys.RESOURCE_GPU,
            keys.RESOURCE_PERCENT,
            keys.RESOURCE_MEMORY,
            "nvidia.com/gpu",
            "cpu",
            "memory",
        ]
    ),
    st.sampled_from(["1", "100m", "2"]),
    max_size=3,
)
CONTAINERS = st.lists(
    st.builds(
        lambda n, requests, limits: {
            "name": f"c{n}",
            "image": "x",
            "resources": {
                **({"requests": requests} if requests is not None else {}),
                **({"limits": limits} if limits is not None else {}),
            },
        },
        st.integers(0, 99),
        st.none() | RESOURCES,
        st.none() | RESOURCES,
    ),
    min_size=1,
    max_size=3,
    unique_by=lambda c: str(c["name"]),
)


@settings(deadline=None)
@given(
    CONTAINERS,
    st.none() | CONTAINERS,
    st.dictionaries(
        st.sampled_from([*keys.USER_ANNOTATIONS, MIRROR, "other.io/x", keys.ASSIGNED_GPUS]),
        st.just("1"),
        max_size=2,
    ),
    st.sampled_from(["team-a", "default", "kube-system", "gpuplace", "gpu-operator"]),
)
def test_refused_exactly_when_a_resource_is_asked_for_outside_the_webhooks_reach(
    containers: list[Obj], init: list[Obj] | None, annotations: dict[str, str], namespace: str
) -> None:
    pod = helpers.pod(annotations, containers=containers)
    pod["metadata"]["namespace"] = namespace
    if init is not None:
        pod["spec"]["initContainers"] = [{**c, "name": "i" + c["name"]} for c in init]
    asks = any(
        name.startswith(keys.PREFIX)
        for container in containers + (init or [])
        for part in ("requests", "limits")
        for name in container["resources"].get(part, {})
    )
    through_webhook = any(
        key in annotations for key in keys.USER_ANNOTATIONS
    ) and namespace not in ("kube-system", "gpuplace")
    refused = bool(refusals(GRANT, request("CREATE", pod)))
    assert refused is (asks and not through_webhook and MIRROR not in annotations)
