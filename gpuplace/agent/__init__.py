"""The node agent (`gpuplace node-agent`, a DaemonSet on opted-in GPU nodes).

It owns what only the node can do: discovering the GPUs and their health through NVML
and publishing them on the Node; answering the kubelet's device-plugin API so that each
container gets exactly the GPUs its pod was granted (and, for a share, the MPS pipe
directory and limits); running and supervising the MPS control daemon where shares
live; and reporting what pods really use. It reads grants from the pods' assignment
annotations (written at bind by the sidecar) and never decides a placement.

May import `placement` and `cluster`; never `webhook`, `extender`, `certs` or `gpuplace`
(the composition root imports it). Every API call goes through `gpuplace.cluster.kube`.
"""
