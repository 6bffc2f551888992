"""Where the webhook learns which GpuQueue a GPU pod uses, and whether it may.

The webhook depends only on `QueueSource`; `gpuplace serve` wires in the sidecar's
`gpuplace.cluster.queue_directory.QueueDirectory` (its GpuQueue and namespace informers,
in the same process), so the webhook never calls the API itself. A source that has not
listed both yet is not `synced`: GPU pods are then refused with 503 (the pod's namespace
may name a default queue the webhook cannot see yet), and the process is not ready.
Without a source (`--queues false`, or the offline `--inventory` webhook) namespace
labels are not read and a pod that names a queue is refused: nothing would admit it.
"""

from __future__ import annotations

from typing import Protocol

from gpuplace.cluster.queue_directory import Resolution


class QueueSource(Protocol):
    def synced(self) -> bool:
        """Whether the queues and the namespaces' labels are known."""
        ...

    def resolve(self, namespace: str, asked: str | None) -> Resolution:
        """The queue a GPU pod of `namespace` uses given its `gpuplace.io/queue`
        annotation (`asked`), or why it may not. Called on every GPU pod review: O(1)
        but for the queue's selector."""
        ...
