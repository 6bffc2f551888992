"""Fixtures for every test folder: the session's real Kubernetes (`tests.realcluster.
sessions`: control plane, kubelet node, gpuplace installed), one per session whichever
folder asks first."""

pytest_plugins = ("tests.realcluster.sessions",)
