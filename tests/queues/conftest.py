"""The queue tests run against the extender tests' local API fixture (`server`: the shipped
RBAC enforced)."""

from tests.extender.conftest import server

__all__ = ["server"]
