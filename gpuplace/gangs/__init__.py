"""The gang controller: gated gang members start together, or none holds GPUs.

Its own room (docs/gangs.md): a controller beside the extender's verbs, not one of them.
`wiring.build` composes it (the gang-pod informer and store, the leader gate on
kube-scheduler's Lease, the controller and its preemptions) for `gpuplace.wiring.sidecar` and
the tests alike; `controller` runs the rounds; `waiting` says who waits; `committing`
writes, narrows (`pinning`) and ungates a plan, or rolls it back, crash-safe; `evicting`
preempts for a waiting gang through the Eviction API; `conditions` and `events` tell.
The pure core is `gpuplace.placement.gangs` (planning) and `gpuplace.placement.fences`
(capacity holds, which the extender's filter reads). Imports `placement` and `cluster`
only; only the composition root imports it (pyproject.toml's contracts).
"""
