"""The planner's tests run against the extender tests' fake API server fixture (`server`)."""

from tests.extender.conftest import server

__all__ = ["server"]
