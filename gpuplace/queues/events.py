"""The Events the queue controller writes on queued pods (`kubectl describe pod`).

Each is said once per episode (`gpuplace.controllers.telling.Told`): a pod hears why it waits
once per reason kind (quota, cohort, place, ...), not once per round; its position moves
too often to be an Event (`gpuplace explain` says it). The victims of a reclaim get the
`GpuPreempted` Event every preemption writes (`gpuplace.cluster.recording.PREEMPTED`).
"""

from __future__ import annotations

ADMITTED = "QueueAdmitted"
"""Normal: its queue admitted it, and where its GPUs are reserved."""
WAITING = "QueueWaiting"
"""Normal: why it waits (quota, cohort, place, behind, reclaiming, members)."""
UNPLACEABLE = "QueueUnplaceable"
"""Warning: no GPU of the cluster could ever hold it."""
MISSING = "QueueMissing"
"""Warning: its queue does not exist (any more) or cannot be used."""
RECLAIMING = "QueueReclaiming"
"""Normal: borrowed workloads are preempted so that it can be admitted."""
HELD = "QueueCapacityHeld"
"""Normal: nodes are kept for it (no new pod there) while they drain: it starves, of
the queue furthest below its fair share (`gpuplace.placement.queueing.holds`)."""
RECLAIM_BLOCKED = "QueueReclaimBlocked"
"""Warning: a PodDisruptionBudget (or the API) refused the reclaim's evictions."""
BLOCKED = "QueueControllerBlocked"
"""Warning: this replica cannot tell whether it leads (the Lease read is refused)."""
