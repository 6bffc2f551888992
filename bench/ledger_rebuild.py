"""How long the sidecar takes to rebuild its ledger from the API at start.

A fake kube-apiserver (gpuplace.dev.localapi, in a forked process: it shares neither the GIL nor
the event loop with the sidecar) holds `--nodes` nodes × `--gpus` GPUs and `--pods`
managed pods, bound, with assignment annotations (mixed: two half-GPU shares or one
whole GPU), each a realistic mutated pod (~3.5 KB of JSON: downward-API env vars,
affinity, tolerations, volumes, status). The sidecar's informers list nodes then pods
in pages of `--page-size` over HTTP on 127.0.0.1, read each pod into a record and
rebuild the ledger (`Ledger.restore`); the figure is the time until `ready`.

Also timed apart: reading the pods (`Reader.record`) and rebuilding the ledger from
records, without HTTP or JSON. Checks that the ledger holds exactly the expected grants.
Prints one JSON document. Target: ≤ 10 s for 100,000 pods.

    .venv/bin/python -m bench.ledger_rebuild [--pods 100000 --nodes 12500 --gpus 8]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import resource
import time
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client

from gpuplace.cluster import assignments, connecting, keys, kube, mirroring, pods
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.dev import localapi
from gpuplace.dev.localapi import objects
from gpuplace.placement.ledger import Grant, GrantState

AT = datetime(2026, 11, 21, 5, 44, 24, tzinfo=UTC)


def pod_template() -> dict[str, Any]:
    """A pod as the webhook mutates it and the kubelet reports it running."""
    body = objects.pod("template", percent=50, memory="20Gi", cpu="4", host_memory="16Gi")
    container = body["spec"]["containers"][0]
    container["env"] = [
        {
            "name": "NVIDIA_VISIBLE_DEVICES",
            "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{keys.VISIBLE_DEVICES}']"}
            },
        },
        {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "50"},
        {"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=20480M"},
    ]
    container["volumeMounts"] = [
        {
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "name": "kube-api-access-kpw9n",
            "readOnly": True,
        }
    ]
    container["terminationMessagePath"] = "/dev/termination-log"
    container["imagePullPolicy"] = "IfNotPresent"
    body["spec"].update(
        {
            "dnsPolicy": "ClusterFirst",
            "restartPolicy": "Always",
            "serviceAccountName": "default",
            "terminationGracePeriodSeconds": 30,
            "priority": 0,
            "enableServiceLinks": True,
            "tolerations": [
                {
                    "effect": "NoExecute",
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "tolerationSeconds": 300,
                },
                {
                    "effect": "NoExecute",
                    "key": "node.kubernetes.io/unreachable",
                    "operator": "Exists",
                    "tolerationSeconds": 300,
                },
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": keys.NODE_ENABLED,
                                        "operator": "In",
                                        "values": ["true"],
                                    },
                                    {"key": keys.GFD_COUNT, "operator": "Gt", "values": ["0"]},
                                    {"key": keys.GFD_MEMORY, "operator": "Gt", "values": ["20479"]},
                                ]
                            }
                        ]
                    }
                }
            },
            "volumes": [
                {
                    "name": "kube-api-access-kpw9n",
                    "projected": {
                        "defaultMode": 420,
                        "sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                            {
                                "configMap": {
                                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                                    "name": "kube-root-ca.crt",
                                }
                            },
                            {
                                "downwardAPI": {
                                    "items": [
                                        {
                                            "fieldRef": {
                                                "apiVersion": "v1",
                                                "fieldPath": "metadata.namespace",
                                            },
                                            "path": "namespace",
                                        }
                                    ]
                                }
                            },
                        ],
                    },
                }
            ],
        }
    )
    body["status"] = {
        "phase": "Running",
        "qosClass": "Burstable",
        "hostIP": "10.0.0.1",
        "podIP": "10.1.0.1",
        "startTime": "2026-11-21T05:44:30Z",
        "conditions": [
            {"type": kind, "status": "True", "lastTransitionTime": "2026-11-21T05:44:30Z"}
            for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ],
        "containerStatuses": [
            {
                "name": "main",
                "ready": True,
                "restartCount": 0,
                "image": "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
                "imageID": "docker.io/pytorch/pytorch@sha256:" + "0" * 64,
                "containerID": "containerd://" + "1" * 64,
                "state": {"running": {"startedAt": "2026-11-21T05:44:31Z"}},
            }
        ],
    }
    return body


def build(pod_count: int, node_count: int, gpus: int) -> tuple[localapi.FakeApi, list[Grant]]:
    """The cluster, and the grants its pods' annotations record (bound: CONFIRMED)."""
    api = localapi.FakeApi(record_calls=100)
    api.load(
        "nodes", (objects.node(f"node-{i:05d}", gpus=gpus, uuids=True) for i in range(node_count))
    )
    template = pod_template()
    shared_spec = template["spec"]
    shared_status = template["status"]
    grants: list[Grant] = []
    slots = [(node, gpu) for node in range(node_count) for gpu in range(gpus)]
    bodies = []
    slot = 0
    index = 0
    while index < pod_count and slot < len(slots):
        node, gpu = slots[slot]
        share = index % 5 < 3  # 60% of pods share a GPU with one other pod
        per_slot = 2 if share else 1
        for _ in range(per_slot):
            if index >= pod_count:
                break
            uid = f"uid-{index:07d}"
            milli = 500 if share else 1000
            grant = Grant(
                uid,
                f"node-{node:05d}",
                (gpu,),
                milli,
                20480 if share else 0,
                4000,
                16384,
                GrantState.CONFIRMED,
            )
            notes = {
                keys.GPU_PERCENT: "50" if share else "100",
                **({keys.GPU_MEMORY: "20Gi"} if share else {}),
                **assignments.annotations_for(grant, None, AT),
            }
            metadata = {
                "name": f"pod-{index:07d}",
                "namespace": f"team-{index % 40}",
                "uid": uid,
                "labels": {keys.MANAGED: "true", "app": f"job-{index // 8}"},
                "annotations": notes,
            }
            spec = dict(shared_spec)
            spec["nodeName"] = grant.node
            bodies.append({"metadata": metadata, "spec": spec, "status": shared_status})
            grants.append(grant)
            index += 1
        slot += 1
    api.load("pods", bodies)
    return api, grants


async def rebuild(url: str, page_size: int) -> tuple[float, float, LedgerSync]:
    configuration = client.Configuration(host=url)
    api = kube.Kube(connecting.client_for(configuration), timeout=120)
    sync = LedgerSync()
    mirror = mirroring.Mirror(api, sync, page_size=page_size)
    started = time.perf_counter()
    task = asyncio.create_task(mirror.run())
    await mirror.nodes.synced.wait()
    nodes_seconds = time.perf_counter() - started
    await sync.ready.wait()
    elapsed = time.perf_counter() - started
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await api.close()
    return elapsed, nodes_seconds, sync


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=100_000)
    parser.add_argument("--nodes", type=int, default=12_500)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=500)
    args = parser.parse_args()

    set_up = time.perf_counter()
    api, grants = build(args.pods, args.nodes, args.gpus)
    api.warm()  # serve lists from serialized objects, as kube-apiserver's cache does
    set_up = time.perf_counter() - set_up
    expected = tuple(sorted(grants, key=lambda grant: grant.pod_uid))
    page = api.store.list(localapi.PODS, limit=1)[0][0]
    pod_bytes = len(json.dumps(page))

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with localapi.serve_in_subprocess(api) as server:
        elapsed, nodes_seconds, sync = asyncio.run(rebuild(server.url, args.page_size))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    identical = sync.ledger.snapshot() == expected

    raw = [copy.deepcopy(body) for body in api.store.items(localapi.PODS)[:20_000]]
    reader = pods.Reader()
    started = time.perf_counter()
    records = [reader.record(body) for body in raw]
    read_seconds = (time.perf_counter() - started) * len(grants) / max(len(raw), 1)
    started = time.perf_counter()
    sync.replace_pods(list(sync.pods.values()))
    restore_seconds = time.perf_counter() - started

    print(
        json.dumps(
            {
                "benchmark": "ledger rebuild at sidecar start",
                "api": "fake kube-apiserver (gpuplace.dev.localapi) in a forked process, "
                "HTTP on 127.0.0.1",
                "nodes": args.nodes,
                "gpus": args.nodes * args.gpus,
                "pods": len(grants),
                "pod_json_bytes": pod_bytes,
                "page_size": args.page_size,
                "rebuild_seconds": round(elapsed, 3),
                "of_which_nodes_seconds": round(nodes_seconds, 3),
                "target_seconds": 10,
                "identical_to_expected": identical,
                "grants": len(sync.ledger),
                "of_which_reading_pods_seconds_est": round(read_seconds, 3),
                "of_which_ledger_restore_seconds": round(restore_seconds, 3),
                "records_checked": len(records),
                "sidecar_peak_rss_mib_growth": round((after - before) / 1024, 1),
                "set_up_seconds": round(set_up, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
