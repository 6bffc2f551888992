"""The kubelet's device-plugin API v1beta1: `api.proto` and the modules protoc generates
from it (`api_pb2`: messages, `api_pb2_grpc`: the Registration and DevicePlugin services).

Generated files are never edited by hand; `api.proto` says how to regenerate them and a
test fails when the committed ones differ from what the pinned grpcio-tools and
mypy-protobuf produce.
"""
