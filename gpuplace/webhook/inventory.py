"""Where the webhook learns what the cluster's GPUs could ever hold.

The webhook depends only on `CapabilitySource`; the process wires in a concrete source
(a `--inventory FILE` loader today, an informer-backed one for a live cluster). A source
answers None until it knows the inventory: the webhook is then not ready and refuses to
validate GPU pods rather than let them through unchecked.
"""

from __future__ import annotations

from typing import Protocol

from gpuplace.placement.inventory import Capabilities


class CapabilitySource(Protocol):
    def capabilities(self) -> Capabilities | None:
        """The largest GPU requests any node could ever hold, or None when not known yet.

        Called on every GPU pod review: must be O(1) (precompute on change)."""
        ...


class FixedCapabilities:
    """A source holding whatever it was last given (offline use, tests)."""

    __slots__ = ("_capabilities",)

    def __init__(self, capabilities: Capabilities | None = None) -> None:
        self._capabilities = capabilities

    def set(self, capabilities: Capabilities | None) -> None:
        self._capabilities = capabilities

    def capabilities(self) -> Capabilities | None:
        return self._capabilities
