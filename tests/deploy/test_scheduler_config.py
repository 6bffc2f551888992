"""The KubeSchedulerConfiguration (not a Kubernetes object, so no schema in
kubernetes-validate): its fields are exactly those kube-scheduler decodes (it decodes
strictly and refuses unknown fields), and its `extenders:` entry is the process contract's.

The field names are the JSON tags of k8s.io/kube-scheduler/config/v1 (KubeSchedulerConfiguration,
KubeSchedulerProfile, Extender, ExtenderManagedResource) and of
k8s.io/component-base/config/v1alpha1 (LeaderElectionConfiguration,
ClientConnectionConfiguration, DebuggingConfiguration), as of Kubernetes 1.36.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from gpuplace.cluster import keys
from tests.deploy.rendering import Obj, container, one, render

TOP = {
    "apiVersion",
    "kind",
    "parallelism",
    "leaderElection",
    "clientConnection",
    "enableProfiling",
    "enableContentionProfiling",
    "percentageOfNodesToScore",
    "percentageOfPlacementsToScore",
    "podInitialBackoffSeconds",
    "podMaxBackoffSeconds",
    "profiles",
    "extenders",
    "delayCacheUntilActive",
}
LEADER_ELECTION = {
    "leaderElect",
    "leaseDuration",
    "renewDeadline",
    "retryPeriod",
    "resourceLock",
    "resourceName",
    "resourceNamespace",
}
CLIENT_CONNECTION = {"kubeconfig", "acceptContentTypes", "contentType", "qps", "burst"}
PROFILE = {
    "schedulerName",
    "percentageOfNodesToScore",
    "percentageOfPlacementsToScore",
    "plugins",
    "pluginConfig",
}
EXTENDER = {
    "urlPrefix",
    "filterVerb",
    "preemptVerb",
    "prioritizeVerb",
    "weight",
    "bindVerb",
    "enableHTTPS",
    "tlsConfig",
    "httpTimeout",
    "nodeCacheCapable",
    "managedResources",
    "ignorable",
}
MANAGED_RESOURCE = {"name", "ignoredByScheduler"}
GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")


@pytest.fixture(scope="module")
def objects() -> list[Obj]:
    return render("base")


@pytest.fixture(scope="module")
def config_map(objects: list[Obj]) -> Obj:
    maps = [o for o in objects if o["kind"] == "ConfigMap"]
    assert len(maps) == 1
    return maps[0]


@pytest.fixture(scope="module")
def config(config_map: Obj) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(config_map["data"]["config.yaml"])
    return loaded


def test_fields_are_all_known_to_kube_scheduler(config: dict[str, Any]) -> None:
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert set(config) <= TOP
    assert set(config["leaderElection"]) <= LEADER_ELECTION
    assert set(config["clientConnection"]) <= CLIENT_CONNECTION
    for profile in config["profiles"]:
        assert set(profile) <= PROFILE
    for extender in config["extenders"]:
        assert set(extender) <= EXTENDER
        for resource in extender["managedResources"]:
            assert set(resource) <= MANAGED_RESOURCE


def test_extender_entry_is_the_contract(config: dict[str, Any]) -> None:
    (extender,) = config["extenders"]
    assert extender == {
        "urlPrefix": "http://127.0.0.1:8888",
        "filterVerb": "filter",
        "bindVerb": "bind",
        "preemptVerb": "preempt",
        "weight": 100000,
        "enableHTTPS": False,
        "nodeCacheCapable": True,
        "managedResources": [
            {"name": keys.RESOURCE_PERCENT, "ignoredByScheduler": False},
            {"name": keys.RESOURCE_MEMORY, "ignoredByScheduler": False},
        ],
        "ignorable": False,
        "httpTimeout": "5s",
    }
    assert GO_DURATION.match(extender["httpTimeout"])
    assert isinstance(extender["weight"], int) and extender["weight"] > 0
    assert config["percentageOfNodesToScore"] == 100


def test_profile_and_leader_election(config: dict[str, Any], objects: list[Obj]) -> None:
    assert config["profiles"] == [{"schedulerName": "gpuplace"}]
    election = config["leaderElection"]
    assert election["leaderElect"] is True
    assert election["resourceLock"] == "leases"
    assert election["resourceNamespace"] == "gpuplace"
    pod = one(objects, "Deployment", "gpuplace")["spec"]["template"]["spec"]
    assert "--scheduler-name=gpuplace" in container(pod, "gpuplace")["args"]


def test_extender_address_is_where_the_sidecar_listens(
    config: dict[str, Any], objects: list[Obj]
) -> None:
    pod = one(objects, "Deployment", "gpuplace")["spec"]["template"]["spec"]
    args = dict(a.split("=", 1) for a in container(pod, "gpuplace")["args"] if "=" in a)
    prefix = f"http://{args['--extender-address']}:{args['--extender-port']}"
    assert config["extenders"][0]["urlPrefix"] == prefix


def test_the_mounted_file_is_the_one_given_to_kube_scheduler(
    config_map: Obj, objects: list[Obj]
) -> None:
    pod = one(objects, "Deployment", "gpuplace")["spec"]["template"]["spec"]
    scheduler = container(pod, "kube-scheduler")
    (flag,) = [a for a in scheduler["command"] if a.startswith("--config=")]
    path = flag.split("=", 1)[1]
    volume = next(v for v in pod["volumes"] if "configMap" in v)
    # kustomize's configMapGenerator appended a content hash; the reference followed it.
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert re.fullmatch(r"gpuplace-scheduler-config-[a-z0-9]{10}", volume["configMap"]["name"])
    mount = next(m for m in scheduler["volumeMounts"] if m["name"] == volume["name"])
    assert path == f"{mount['mountPath']}/config.yaml"
    assert "config.yaml" in config_map["data"]
