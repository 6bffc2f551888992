"""The DRA claim controller (`--dra-claims`): the ResourceClaim of every pod the webhook sent
to DRA nodes, created by the sidecar (owned by its pod, from its annotations) before the
pod's gate `gpuplace.io/dra-claim` goes, and what kube-scheduler's DRA allocator then made
of it told on the pod (docs/dra.md, "The annotations on DRA nodes"). A peer of the gang and
queue controllers on the controller kit (`gpuplace.controllers`): `controller` (plan,
then pin: each claim names the GPUs the engine planned), `preempting` (a lone DRA pod's
preemption, which kube-scheduler does not do for claims).
"""
