"""The queue controller: GPU pods wait in their GpuQueue until it admits them.

Its own room (docs/queues.md, "How it runs"), above the gang room: it reuses the gang
controller's machinery (the crash-safe writes of `gpuplace.gangs.writing`, the affinity
narrowing of `gpuplace.gangs.pinning`, the PodDisruptionBudget pre-check of
`gpuplace.gangs.evicting`, the leader gate of `gpuplace.gangs.leader`) and hands a queued
gang's plan over to the gang controller, which settles it as its own. The gang room never
imports this one (pyproject.toml's layers).

`wiring.build` composes it (the queued-pod informer and store, the controller) for
`gpuplace.wiring.sidecar` and the tests alike; `controller` runs the rounds on the pure engine
(`gpuplace.placement.queueing.admitting`); `workloads` turns pods into the engine's workloads;
`committing` admits (reserve, write, narrow, ungate) crash-safe; `reclaiming` evicts what
a queue takes back; `statuses`, `events` and `metrics` tell; `explaining` answers
`gpuplace explain` about a waiting pod. The GpuQueues and namespaces themselves come from
`gpuplace.cluster.queue_directory`, which the webhook reads too.
"""
