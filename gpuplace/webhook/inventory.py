"""Where the webhook learns what the cluster's GPUs could ever hold.

The webhook depends only on `CapabilitySource`; the process wires in a concrete source
(a `--inventory FILE` loader today, an informer-backed one for a live cluster). A source
answers None until it knows the inventory: the webhook is then not ready and refuses to
validate GPU pods rather than let them through unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gpuplace.cluster.nodes import is_dra
from gpuplace.placement.inventory import Capabilities, Inventory

NO_CAPABILITIES = Capabilities({})


@dataclass(frozen=True, slots=True)
class Paths:
    """What each path's nodes could ever hold: the device-plugin (extender) nodes and the
    DRA nodes (label `gpuplace.io/dra=true`), for the webhook's choice of a pod's path."""

    device_plugin: Capabilities
    dra: Capabilities


def paths_of(inventory: Inventory) -> Paths:
    """Each path's capabilities. O(GPUs)."""
    dra = [node for node in inventory if is_dra(node)]
    if not dra:
        return Paths(inventory.capabilities(), NO_CAPABILITIES)
    plugin = Inventory(node for node in inventory if not is_dra(node))
    return Paths(plugin.capabilities(), Inventory(dra).capabilities())


class CapabilitySource(Protocol):
    def capabilities(self) -> Capabilities | None:
        """The largest GPU requests any node could ever hold, or None when not known yet.

        Called on every GPU pod review: must be O(1) (precompute on change)."""
        ...

    def paths(self) -> Paths | None:
        """The same, per path (`Paths`); None when not known yet. O(1)."""
        ...


class FixedCapabilities:
    """A source holding whatever it was last given (offline use, tests)."""

    __slots__ = ("_capabilities", "_paths")

    def __init__(
        self, capabilities: Capabilities | None = None, paths: Paths | None = None
    ) -> None:
        self._capabilities = capabilities
        self._paths = paths

    def set(self, capabilities: Capabilities | None, paths: Paths | None = None) -> None:
        self._capabilities = capabilities
        self._paths = paths

    def capabilities(self) -> Capabilities | None:
        return self._capabilities

    def paths(self) -> Paths | None:
        """As given; else every node on the device-plugin path."""
        if self._paths is not None or self._capabilities is None:
            return self._paths
        return Paths(self._capabilities, NO_CAPABILITIES)
