"""`gpuplace demo`: the whole of gpuplace on one machine, with no cluster.

The parts: `scenario` (the pods users submit), `admitting` (kube-apiserver's admission
chain and storage, played here), `scheduling` (kube-scheduler's cycle with the gpuplace
profile, played here), `running` (certificates, the local API, the real `gpuplace serve`
composition, the run), `reporting` (text) and `plotting` (the PNG), `progress` (the
stderr line). The webhook, the extender and the gang controller are never imitated:
they are the production code, reached over 127.0.0.1 exactly as in a cluster.
Never talks to a real cluster.
"""
