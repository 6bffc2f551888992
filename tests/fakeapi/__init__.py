"""The fake kube-apiserver of the tests: a re-export of `gpuplace.localapi`, where the code
lives now (it also backs `gpuplace demo`). Tests keep importing `tests.fakeapi` and its
modules (`from tests.fakeapi import objects`); see `gpuplace.localapi` for the usage."""

from gpuplace import localapi
from gpuplace.localapi import *  # noqa: F403  (the same names, under the tests' old path)

__all__ = localapi.__all__
