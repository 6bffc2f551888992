"""The fake kube-apiserver of the tests: a re-export of `gpuplace.localapi`, where the code
lives now (it also backs `gpuplace demo`). Tests keep importing `tests.fakeapi` and its
modules (`from tests.fakeapi import objects`); see `gpuplace.localapi` for the usage."""

from gpuplace.localapi import (
    DEFAULT_RESOURCES,
    EVENTS,
    NODES,
    PODS,
    ApiStatusError,
    Call,
    FakeApi,
    Resource,
    Server,
    ThreadedServer,
    serve,
    serve_in_subprocess,
    serve_in_thread,
)

__all__ = [
    "DEFAULT_RESOURCES",
    "EVENTS",
    "NODES",
    "PODS",
    "ApiStatusError",
    "Call",
    "FakeApi",
    "Resource",
    "Server",
    "ThreadedServer",
    "serve",
    "serve_in_subprocess",
    "serve_in_thread",
]
