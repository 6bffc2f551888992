"""Plan, then pin: every gpuplace pod that is neither a gang member nor queued is placed by
the engine before kube-scheduler sees it, and handed that node.

A peer of `gpuplace.gangs` and `gpuplace.queues` on the controller kit
(`gpuplace.controllers`): `controller` (the leader-gated rounds that plan the pods behind
the gate `gpuplace.io/place` and release them), `choice` (its choice for one pod, which
`gpuplace simulate --via-planner` replays), `pins` (how a release hands the node
over: kube-scheduler's nominated node, or the pod's affinity narrowed; a DRA pod's claim
plugs in there), `metrics`, `events`. Imports `placement`, `cluster` and the kit only.
"""
