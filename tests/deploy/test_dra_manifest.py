"""deploy/components/dra as rendered in overlays/self-managed-dra: the DRA DaemonSet is the
device-plugin one but for what DRA needs (its ServiceAccount, the kubelet's DRA directories
and the CDI directory, `--kubelet-plugin=dra`, DRA nodes only), the device-plugin DaemonSet
keeps off DRA nodes, the sidecar taints silent agents' devices; and the policies that hold
the DRA agent to its own node's slice and the sidecar to its silence taint, evaluated by
cel-python as kube-apiserver does (the real server judges them in
tests/realcluster/test_dra.py)."""

from __future__ import annotations

import copy

import pytest

from gpuplace.cluster import dra, keys
from gpuplace.wiring.agent_settings import AgentSettings
from gpuplace.wiring.settings import Settings
from tests.deploy import rendering
from tests.deploy.rendering import Obj, container, one, render
from tests.deploy.test_admission_policy import (
    NODE_NAME,
    OWN_NODE,
    node,
    node_update,
    refusals,
    request,
)

DRA_AGENT = "system:serviceaccount:kube-system:gpuplace-node-agent-dra"
SIDECAR = "system:serviceaccount:gpuplace:gpuplace"
OWN_SLICES = "gpuplace-node-agent-own-slices"
SILENCE_ONLY = "gpuplace-silence-taints-only"


def objects() -> list[Obj]:
    return render(rendering.DRA)


def daemonsets() -> tuple[Obj, Obj]:
    found = objects()
    return one(found, "DaemonSet", "gpuplace-node-agent"), one(
        found, "DaemonSet", "gpuplace-node-agent-dra"
    )


def test_the_dra_daemonset_is_the_device_plugin_one_but_for_dra() -> None:
    plugin, dra_set = daemonsets()
    spec, dra_spec = plugin["spec"]["template"]["spec"], dra_set["spec"]["template"]["spec"]
    assert dra_spec["serviceAccountName"] == "gpuplace-node-agent-dra"
    assert dra_spec["nodeSelector"] == {keys.NODE_ENABLED: "true", keys.NODE_DRA: "true"}
    box, dra_box = container(spec, "node-agent"), container(dra_spec, "node-agent")
    assert dra_box["args"] == [
        "node-agent", "--kubelet-plugin=dra", *[a for a in box["args"] if a != "node-agent"]
    ]  # fmt: skip
    for field in ("image", "env", "ports", "startupProbe", "livenessProbe", "readinessProbe",
                  "resources", "securityContext"):  # fmt: skip
        assert dra_box[field] == box[field], field
    for field in ("priorityClassName", "hostPID", "tolerations", "securityContext",
                  "enableServiceLinks", "terminationGracePeriodSeconds"):  # fmt: skip
        assert dra_spec[field] == spec[field], field
    assert dra_set["spec"]["updateStrategy"] == plugin["spec"]["updateStrategy"]
    mounts = {m["name"]: m["mountPath"] for m in dra_box["volumeMounts"]}
    plain = {m["name"]: m["mountPath"] for m in box["volumeMounts"]}
    assert mounts == {
        **{k: v for k, v in plain.items() if k != "device-plugins"},
        "plugins-registry": "/var/lib/kubelet/plugins_registry",
        "plugin": f"/var/lib/kubelet/plugins/{dra.DRIVER}",
        "cdi": "/var/run/cdi",
    }
    # the directories are the agent's defaults (the DaemonSet names none)
    defaults = AgentSettings.model_fields
    assert str(defaults["kubelet_registry_dir"].default) == mounts["plugins-registry"]
    assert f"{defaults['kubelet_plugins_dir'].default}/{dra.DRIVER}" == mounts["plugin"]
    assert str(defaults["cdi_dir"].default) == mounts["cdi"]
    volumes = {v["name"]: v["hostPath"]["path"] for v in dra_spec["volumes"] if "hostPath" in v}
    assert {volumes[name] for name in ("plugins-registry", "plugin", "cdi")} == {
        mounts["plugins-registry"], mounts["plugin"], mounts["cdi"]
    }  # fmt: skip


def test_a_node_is_on_one_path() -> None:
    plugin, dra_set = daemonsets()
    terms = plugin["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {"matchExpressions": [{"key": keys.NODE_DRA, "operator": "NotIn", "values": ["true"]}]}
    ]
    assert dra_set["spec"]["template"]["spec"]["nodeSelector"]["gpuplace.io/dra"] == "true"
    # without the component the device-plugin DaemonSet has no such affinity
    alone = one(render(rendering.NODE_AGENT), "DaemonSet", "gpuplace-node-agent")
    assert "affinity" not in alone["spec"]["template"]["spec"]


def test_the_sidecar_taints_silent_agents_and_writes_claims_with_the_component_only() -> None:
    def args(tree: str) -> list[str]:
        deployment = one(render(tree), "Deployment", "gpuplace")
        return list(container(deployment["spec"]["template"]["spec"], "gpuplace")["args"])

    assert "--dra-silence-taints=true" in args(rendering.DRA)
    assert "--dra-claims=fallback" in args(rendering.DRA)
    assert not any("dra" in arg for arg in args(rendering.NODE_AGENT))
    # what the flag says is a value `gpuplace serve` takes
    settings = Settings.model_validate({"dra_claims": "fallback"})
    assert settings.dra_claims == "fallback"


def test_the_device_class_is_shipped_once() -> None:
    found = one(objects(), "DeviceClass", dra.DEVICE_CLASS)
    assert found["spec"]["extendedResourceName"] == dra.EXTENDED_RESOURCE


# --- the policies -----------------------------------------------------------------------


def slice_of(node_name: str, driver: str = dra.DRIVER) -> Obj:
    body = dra.resource_slice(node_name, "u", [dra.GpuDevice(0, "GPU-0", 81559)])
    body["spec"]["driver"] = driver
    return body


def slice_request(
    operation: str, new: Obj | None, old: Obj | None = None, *, user: str, on: str | None
) -> Obj:
    body = request(operation, new, old, user=user, extra={NODE_NAME: [on]} if on else {})
    body["kind"] = {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceSlice"}
    body["resource"] = {"group": "resource.k8s.io", "version": "v1", "resource": "resourceslices"}
    return body


WHOSE = "the gpuplace DRA node agent may write only the ResourceSlice of the Node it runs on"
DRIVER = "the gpuplace DRA node agent may write only ResourceSlices of driver gpu.gpuplace.io"


@pytest.mark.parametrize(
    ("operation", "new", "old", "on", "refused"),
    [
        ("CREATE", slice_of("h100-0"), None, "h100-0", []),
        ("UPDATE", slice_of("h100-0"), slice_of("h100-0"), "h100-0", []),
        ("DELETE", None, slice_of("h100-0"), "h100-0", []),
        ("CREATE", slice_of("h100-1"), None, "h100-0", [WHOSE]),
        ("CREATE", slice_of("h100-0"), None, None, [WHOSE]),
        ("UPDATE", slice_of("h100-0"), slice_of("h100-1"), "h100-0", [WHOSE]),  # taking another's
        ("DELETE", None, slice_of("h100-1"), "h100-0", [WHOSE]),
        ("CREATE", slice_of("h100-0", "gpu.nvidia.com"), None, "h100-0", [DRIVER]),
        ("DELETE", None, slice_of("h100-0", "gpu.nvidia.com"), "h100-0", [DRIVER]),
    ],
)
def test_the_dra_agent_writes_only_its_own_nodes_slice(
    operation: str, new: Obj | None, old: Obj | None, on: str | None, refused: list[str]
) -> None:
    asked = slice_request(operation, new, old, user=DRA_AGENT, on=on)
    assert refusals(OWN_SLICES, asked) == refused
    # nobody else is judged by it (the kubelet wipes a gone plugin's slices)
    other = slice_request(operation, new, old, user="system:node:h100-0", on=None)
    assert refusals(OWN_SLICES, other) == []


def test_the_dra_agent_patches_its_nodes_annotations_like_the_other_agent() -> None:
    old, new = node(), node(**{"gpuplace.io/agent-heartbeat": "now"})
    assert refusals(OWN_NODE, node_update(new, old, user=DRA_AGENT)) == []
    assert refusals(OWN_NODE, node_update(new, old, user=DRA_AGENT, on="h100-1")) == [
        "the gpuplace node agent may change only the Node it runs on"
    ]


SILENCE = (
    "gpuplace's sidecar may only add the taint gpu.gpuplace.io/agent-silent to the devices "
    "of a gpu.gpuplace.io ResourceSlice"
)


def stored() -> Obj:
    body = dra.resource_slice(
        "h100-0",
        "u",
        [dra.GpuDevice(0, "GPU-0", 81559), dra.GpuDevice(1, "GPU-1", 81559, healthy=False)],
    )
    body["metadata"]["resourceVersion"] = "7"
    return body


def changed(how: str) -> Obj:
    new = stored()
    devices = new["spec"]["devices"]
    if how == "an attribute":
        devices[0]["attributes"]["model"] = {"string": "forged"}
    elif how == "a capacity":
        devices[0]["capacity"]["compute"]["value"] = "2000"
    elif how == "a device removed":
        del devices[1]
    elif how == "the node":
        new["spec"]["nodeName"] = "h100-9"
    elif how == "the unhealthy taint dropped":
        del devices[1]["taints"]
    elif how == "another taint added":
        devices[0]["taints"] = [{"key": "example.com/x", "effect": "NoExecute"}]
    elif how == "the sharing switch":
        devices[0]["allowMultipleAllocations"] = False
    return new


def test_the_sidecar_may_add_its_silence_taint() -> None:
    old = stored()
    new = dra.with_silence(old, "2026-12-01T15:00:00Z")
    assert refusals(SILENCE_ONLY, slice_request("UPDATE", new, old, user=SIDECAR, on=None)) == []


@pytest.mark.parametrize(
    "how",
    ["an attribute", "a capacity", "a device removed", "the node", "the unhealthy taint dropped",
     "another taint added", "the sharing switch"],
)  # fmt: skip
def test_the_sidecar_may_change_nothing_else(how: str) -> None:
    old = stored()
    new = dra.with_silence(changed(how), "2026-12-01T15:00:00Z")
    assert refusals(SILENCE_ONLY, slice_request("UPDATE", new, old, user=SIDECAR, on=None)) == [
        SILENCE
    ], how
    # the agent's own writes are not the sidecar's policy's
    assert (
        refusals(SILENCE_ONLY, slice_request("UPDATE", new, old, user=DRA_AGENT, on="h100-0")) == []
    )


def test_a_slice_of_another_driver_is_not_the_sidecars() -> None:
    old = copy.deepcopy(stored())
    old["spec"]["driver"] = "gpu.nvidia.com"
    new = dra.with_silence(old, "t")
    assert refusals(SILENCE_ONLY, slice_request("UPDATE", new, old, user=SIDECAR, on=None)) == [
        SILENCE
    ]
