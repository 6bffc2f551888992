"""The DRA claim controller (`--dra-claims`): the ResourceClaim of every pod the webhook sent
to DRA nodes, created by the sidecar (owned by its pod, from its annotations) before the
pod's gate `gpuplace.io/dra-claim` goes, and what kube-scheduler's DRA allocator then made
of it told on the pod (docs/dra.md, "The annotations on DRA nodes"). A peer of the gang and
queue controllers on the controller kit (`gpuplace.controllers`); the next step, "plan,
then pin", makes its claims name the GPU the engine plans.
"""
