"""Asked vs used: what pods really use of the GPUs they were granted, read from
Prometheus (the node agent's metrics or NVIDIA dcgm-exporter's), summed up per pod, GPU
and node, with the pods that over-ask named and a request suggested for each."""
