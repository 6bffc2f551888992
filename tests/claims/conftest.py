"""The claim tests run against the local API with the RBAC deploy/overlays/self-managed-dra
ships, a DRA node and a device-plugin node in it (`server`, tests/claims/test_controller.py)."""

from tests.claims.test_controller import server

__all__ = ["server"]
