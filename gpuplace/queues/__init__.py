"""The queue controller: GPU pods wait in their GpuQueue until it admits them.

Its own room (docs/queues.md, "How it runs"), a peer of the gang room on the controller
kit (`gpuplace.controllers`: the leader gate and round loop, the crash-safe writes and
plan steps, the affinity narrowing, the PodDisruptionBudget pre-check and evictions). It
hands a queued gang's plan over to the gang controller through the API alone (the plan
marks, the gates), which settles it as its own; neither room imports the other
(pyproject.toml's contracts).

`gpuplace.wiring.queues.build` composes it (the directory of queues, the index of queued
pods, the controller) for the sidecar and the tests alike; `controller` runs the rounds
on the pure engine (`gpuplace.placement.queueing.admitting`); `workloads` turns pods into
the engine's workloads; `committing` admits (reserve, write, narrow, ungate) crash-safe;
`reclaiming` evicts what a queue takes back; `statuses`, `events` and `metrics` tell;
`explaining` answers `gpuplace explain` about a waiting pod. The GpuQueues and namespaces
themselves come from `gpuplace.cluster.queue_directory`, which the webhook reads too.
"""
