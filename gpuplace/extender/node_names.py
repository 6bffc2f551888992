"""Every node's name as one set that a JSON array of names is compared with as bytes
(`EveryNode`), for filter's usual case: kube-scheduler sends every node.

The comparison is C (`gpuplace/extender/_node_names.c`, `c_helpers.NAME_SET`). Without it
(not built, or `GPUPLACE_NO_EXTENSIONS=1`) `EveryNodeSets.of` gives None and filter
parses every name, which costs ~3 ms more at 10,000 nodes and answers the same.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuplace.extender import c_helpers
from gpuplace.placement.choosing import Chooser

if TYPE_CHECKING:
    from gpuplace.extender._node_names import NameSet

KEPT = 2
"""Sets kept: the deciding Chooser's, and a rebuilt one's the warmer fills before it
decides (`gpuplace.extender.workloads.PolicyHolder`)."""


@dataclass(frozen=True, slots=True)
class EveryNode:
    """Every node's name (`names`, a Chooser's own list kept as it is: its identity tells
    the Chooser "these are all the nodes", `Chooser.every_name`) and their set."""

    names: list[str]
    _set: NameSet | None
    """None when a name has no UTF-8 form (a lone surrogate): no array then matches."""

    @classmethod
    def of(cls, names: list[str]) -> EveryNode | None:
        """The set of `names` (unique), or None without the C helper. O(names)."""
        name_set = c_helpers.NAME_SET
        if name_set is None:
            return None
        try:
            matcher: NameSet | None = name_set(names, secrets.randbits(64))
        except UnicodeEncodeError:  # no array without escapes holds that name
            matcher = None
        return cls(names, matcher)

    def listed_by(self, data: bytes, start: int, end: int) -> bool:
        """Whether `data[start:end]` is a JSON array of strings naming each of `names`
        exactly once and nothing else, read without a str per element. False also for
        arrays it does not read (with escapes): parse those. O(end - start)."""
        return self._set is not None and self._set.matches(data, start, end)


class EveryNodeSets:
    """The `EveryNode` of each Chooser's list of every node's name, the last `KEPT` built."""

    def __init__(self) -> None:
        self._kept: list[EveryNode] = []

    def of(self, chooser: Chooser) -> EveryNode | None:
        """`chooser`'s every node as a set, or None without the C helper (then nothing is
        built, not even the Chooser's list). O(1) while no node was added or removed,
        else O(nodes) to build."""
        if c_helpers.NAME_SET is None:
            return None
        names = chooser.every_name()
        for every in self._kept:
            if every.names is names:
                return every
        built = EveryNode.of(names)
        if built is not None:
            self._kept = [built, *self._kept[: KEPT - 1]]
        return built
