"""The queues scene's cast and script: two teams' GpuQueues in one cohort on one 8-GPU
node, and what each team submits or finishes, step by step (docs/queues.md's worked
example, with an elastic gang). Pure data: no I/O. Nothing here says what the queue
controller will decide: the steps say what people do, the run shows what came of it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from gpuplace.cluster import keys
from gpuplace.dev.demo import scenario
from gpuplace.dev.demo.scenario import Submission, User

NODE = "dgx-a100-01"
"""The one node of the scene (8 A100-SXM4-80GB, NVLink), from the bundled cluster."""
COHORT = "research"
NOMINAL = 4
"""Each team's nominal quota, in whole GPUs: together the node's 8."""
TEAMS = ("a", "b")

ALICE = User("alice@example.com", ("team-a", "system:authenticated"))
BOB = User("bob@example.com", ("team-b", "system:authenticated"))
JOB_UID = "5d1e6c8a-0a3b-4c52-9d1e-7c1f2b3a4d50"
"""The uid of team A's Job (the played Job controller's; its pods name it as owner)."""
JOB = "sweep"


def queue_name(team: str) -> str:
    return f"team-{team}"


def namespace(team: str) -> dict[str, Any]:
    """A team's namespace: `team=<team>` (what its queue's selector matches) and the
    namespace default queue (`gpuplace.io/queue`, an admin's label)."""
    name = queue_name(team)
    labels = {"team": team, keys.QUEUE_LABEL: name}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def gpuqueue(team: str) -> dict[str, Any]:
    """docs/queues.md's example queue: NOMINAL whole GPUs in cohort COHORT."""
    return {
        "apiVersion": "gpuplace.io/v1alpha1",
        "kind": "GpuQueue",
        "metadata": {"name": queue_name(team)},
        "spec": {
            "namespaceSelector": {"matchLabels": {"team": team}},
            "cohort": COHORT,
            "resources": [{"name": "gpus", "nominal": str(NOMINAL)}],
        },
    }


def job_pod(name: str) -> dict[str, Any]:
    """One pod of team A's Job `sweep`: one whole GPU, restartPolicy Never, the Job as
    owner (its replacement after an eviction comes from the Job controller)."""
    body = scenario.pod(
        "team-a",
        name,
        {keys.GPU_COUNT: "1"},
        cpu="8",
        memory="32Gi",
        labels={"batch.kubernetes.io/job-name": JOB},
    )
    body["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": JOB,
            "uid": JOB_UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return body


def replacement(pod: dict[str, Any]) -> dict[str, Any]:
    """What the Job controller creates for a pod of its Job that went: the same template
    under a new name (`<name>-retry`)."""
    name = str(pod["metadata"]["name"])
    return job_pod(name.removesuffix("-retry") + "-retry")


def training(name: str, gpus: int) -> dict[str, Any]:
    """Team B's training pod: `gpus` whole GPUs."""
    return scenario.pod("team-b", name, {keys.GPU_COUNT: str(gpus)}, cpu="16", memory="64Gi")


def elastic_member(index: int) -> dict[str, Any]:
    """A member of team A's elastic gang `ddp`: 4 members of one GPU, runs with 2."""
    return scenario.pod(
        "team-a",
        f"ddp-{index}",
        {
            keys.GPU_COUNT: "1",
            keys.GANG_NAME: "ddp",
            keys.GANG_SIZE: "4",
            keys.GANG_MIN: "2",
            keys.GANG_TIMEOUT: "10m",
        },
        cpu="8",
        memory="32Gi",
    )


@dataclass(frozen=True, slots=True)
class Step:
    """What people do in one step: submit pods (through admission), or their pods finish
    (the played kubelet marks them Succeeded)."""

    title: str
    submit: tuple[Submission, ...] = ()
    finish: tuple[str, ...] = ()
    """Pods (`namespace/name`) that complete."""


def steps() -> list[Step]:
    """The script. A fresh copy on each call."""

    def submit(user: User, *bodies: dict[str, Any]) -> tuple[Submission, ...]:
        return tuple(Submission(copy.deepcopy(body), user) for body in bodies)

    return [
        Step(
            "team A submits Job sweep: four 1-GPU pods, its nominal quota",
            submit(ALICE, *(job_pod(f"sweep-{i}") for i in range(4))),
        ),
        Step(
            "team A adds two more pods to the sweep; team B is idle",
            submit(ALICE, *(job_pod(f"sweep-{i}") for i in range(4, 6))),
        ),
        Step(
            "team B submits train-0 (2 GPUs)",
            submit(BOB, training("train-0", 2)),
        ),
        Step(
            "team B submits train-1 (2 GPUs): within its nominal, but no GPU is free",
            submit(BOB, training("train-1", 2)),
        ),
        Step(
            "team A's first four sweep pods finish",
            finish=tuple(f"team-a/sweep-{i}" for i in range(4)),
        ),
        Step(
            "team A submits the elastic gang ddp: 4 members of 1 GPU, gang-min 2",
            submit(ALICE, *(elastic_member(i) for i in range(4))),
        ),
        Step(
            "team B's train-0 finishes",
            finish=("team-b/train-0",),
        ),
    ]
