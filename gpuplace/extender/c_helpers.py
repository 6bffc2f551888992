"""The extender wire's two optional C helpers, as this process uses them, and the one
switch that turns them off.

- `NAME_SET` (`gpuplace/extender/_node_names.c`): filter's arguments compared as bytes
  with every node's name (`gpuplace.extender.node_names`);
- `RANKED_JSON` (`gpuplace/extender/_priorities.c`): prioritize's answer ranked and
  encoded in one pass (`gpuplace.extender.wire.ranked_priorities_json`).

Each is None where it is not built (the install builds it when a C compiler is there) or
where `GPUPLACE_NO_EXTENSIONS` is set to a non-empty value (`=1`), as aiohttp's
`AIOHTTP_NO_EXTENSIONS` does for its own: the callers then take the pure-Python path,
which gives the same answers, slower. The switch is read here, once, when this module
is first imported, and nowhere else: it decides which code the process runs, not a
setting of the sidecar, so it is not a flag and holds for every entry point (serve,
simulate, the benches, the tests). Callers read `c_helpers.NAME_SET` and
`c_helpers.RANKED_JSON` at call time, never a copy taken at import.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuplace.extender._node_names import NameSet

SWITCH = "GPUPLACE_NO_EXTENSIONS"
OFF = bool(os.environ.get(SWITCH))
"""The C helpers are switched off: the pure-Python paths run even where they are built."""


def _load(module: str, name: str) -> Any:
    """`gpuplace.extender.<module>.<name>`, or None where switched off or not built."""
    if OFF:
        return None
    try:
        return getattr(importlib.import_module(f"gpuplace.extender.{module}"), name)
    except ImportError:  # built without a C compiler
        return None


NAME_SET: type[NameSet] | None = _load("_node_names", "NameSet")
RANKED_JSON: Callable[[list[str], list[Any], int], bytes | None] | None = _load(
    "_priorities", "ranked_json"
)
