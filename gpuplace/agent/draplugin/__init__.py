"""The kubelet's plugin APIs a DRA kubelet plugin speaks, as in Kubernetes v1.36.2
(`staging/src/k8s.io/kubelet/pkg/apis/...`), copied unchanged (Apache License 2.0, their
headers kept), and the modules protoc generates from them:

- `dra.proto` (`dra/v1/api.proto`): service `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`,
  NodePrepareResources and NodeUnprepareResources (`dra_pb2`, `dra_pb2_grpc`);
- `registration.proto` (`pluginregistration/v1/api.proto`): service
  `pluginregistration.Registration`, GetInfo and NotifyRegistrationStatus, which the
  kubelet's plugin watcher calls on the socket in its plugins_registry directory;
- `health.proto` (`dra-health/v1alpha1/api.proto`): the optional
  `v1alpha1.DRAResourceHealth/NodeWatchResources` stream.

Generated files are never edited by hand. From the repository root, with the test extra
installed and .venv/bin on PATH:

    python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. \\
      --mypy_out=. --mypy_grpc_out=. gpuplace/agent/draplugin/dra.proto \\
      gpuplace/agent/draplugin/registration.proto gpuplace/agent/draplugin/health.proto

tests/agent/test_draplugin_generated.py fails when the committed modules differ from what
the pinned grpcio-tools and mypy-protobuf produce, or (where ../shared is beside the
checkout) when a .proto differs from the kit's copy of v1.36.2's.
"""
