"""The gang controller: gated gang members start together, or none holds GPUs.

Its own room (docs/gangs.md): a controller beside the extender's verbs, not one of them.
`gpuplace.wiring.gangs.build` composes it (the index of gang members, the leader gate
on kube-scheduler's Lease, the controller and its preemptions) for the sidecar and the
tests alike; `controller` runs the rounds; `waiting` says who waits; `committing`
writes, narrows and ungates a plan, or rolls it back, crash-safe; `evicting` preempts
for a waiting gang through the Eviction API; `conditions` and `events` tell. What it
shares with the queue controller (the leader gate, the round loop, the crash-safe writes
and plan steps, the PodDisruptionBudget pre-check) is the controller kit,
`gpuplace.controllers`. The pure core is `gpuplace.placement.gangs` (planning) and
`gpuplace.placement.fences` (capacity holds, which the extender's filter reads). Imports
`placement`, `cluster` and `controllers` only; only the composition root imports it
(pyproject.toml's contracts).
"""
