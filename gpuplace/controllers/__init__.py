"""The controller kit: what the gang, queue, claim and plan controllers are built from.

A room of its own between `gpuplace.cluster` and the controllers (pyproject.toml's
layers), so that `gpuplace.gangs` and `gpuplace.queues` are peers that never import each
other: `leader` (whether this replica decides: kube-scheduler's Lease), `rounds` (the
leader-gated round loop), `api` (the pod calls a controller makes), `writing` (crash-safe
writes: preconditions, re-read on conflict), `plans` (a plan's write, read-back, narrow,
ungate and roll-back steps), `pinning` (a gated pod's affinity narrowed as kube-apiserver
allows), `evictions` (the PodDisruptionBudget pre-check and the evictions), `victims` (who may
be evicted for a waiting workload, and the plan that passes the budgets), `telling`
(Events, each once). Imports `placement` and `cluster` only.
"""
