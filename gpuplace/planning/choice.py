"""The planner's choice for one pod, apart from its rounds and writes so that a replay makes
exactly it (`gpuplace simulate --via-planner`).

`choose(chooser, request, rng, names)` is the chooser's (`gpuplace.placement.choosing.
Chooser.choose`: the policy in force, exact ties to the policy's line of nodes, else drawn
by `rng`) among `names`, the nodes kube-scheduler would offer the pod (None: every node
of the inventory, the chooser then works on its groups of equal nodes). It is the choice
the extender's filter makes for the same pod on the same ledger: filter passes the
policy's best nodes, which the default policy's line narrows to one. Pure;
O(changed nodes + distinct node states) with `names` None, O(names) else.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from gpuplace.placement.choosing import Choice, Chooser
from gpuplace.placement.requests import GpuRequest


def choose(
    chooser: Chooser, request: GpuRequest, rng: random.Random, names: Sequence[str] | None
) -> Choice | None:
    """See the module docstring; None when no node of `names` has room now."""
    if names is not None and not names:
        return None
    return chooser.choose(request, rng, names)
