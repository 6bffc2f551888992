"""The cluster's node names as one set that a JSON array of names is compared with as
bytes (`EveryNode`), for filter's usual case: kube-scheduler sends every node.

The comparison is C (`gpuplace/placement/_names.c`, built with the package when a C compiler
is there). Without it `EveryNode.of` gives None and filter parses every name, which
costs ~3 ms more at 10,000 nodes and answers the same.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

try:
    from gpuplace.placement._names import NameSet
except ImportError:  # built without a C compiler
    NATIVE = False
else:
    NATIVE = True


@dataclass(frozen=True, slots=True)
class EveryNode:
    """Every node's name (`names`, a list kept as it is: its identity says "these are
    all the nodes"), as of the inventory's `membership` count."""

    membership: int
    names: list[str]
    _set: NameSet | None
    """None when a name has no UTF-8 form (a lone surrogate): no array then matches."""

    @classmethod
    def of(cls, membership: int, names: list[str]) -> EveryNode | None:
        """The set of `names` (unique), or None without the C helper. O(names)."""
        if not NATIVE:
            return None
        try:
            matcher: NameSet | None = NameSet(names, secrets.randbits(64))
        except UnicodeEncodeError:  # no array without escapes holds that name
            matcher = None
        return cls(membership, names, matcher)

    def listed_by(self, data: bytes, start: int, end: int) -> bool:
        """Whether `data[start:end]` is a JSON array of strings naming each of `names`
        exactly once and nothing else, read without a str per element. False also for
        arrays it does not read (with escapes): parse those. O(end - start)."""
        return self._set is not None and self._set.matches(data, start, end)
