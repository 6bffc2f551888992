"""What `gpuplace explain` says of a gang member beyond its node table: whether its gang
restarts and what it waits for, and for a gang that keeps to one topology domain
(`gpuplace.io/gang-domain`) which domains the planner tried and why none holds it.

Works on a `LedgerSync` built from the API, as the controller decides (minus its
in-memory holds, fences and tombstones): the gang's waiting members as the controller
would form them (`gpuplace.gangs.waiting`), planned once with the policy in force
(`gpuplace.placement.gangs.plan`). Pure: no I/O, no clock of its own (`now` is given).
"""

from __future__ import annotations

from gpuplace.cluster.pods import PodRecord
from gpuplace.cluster.syncing import LedgerSync
from gpuplace.controllers import restarts, telling
from gpuplace.controllers.store import gang_members
from gpuplace.gangs.waiting import planned, waits
from gpuplace.placement import gangs
from gpuplace.placement.choosing import Policy


def lines(sync: LedgerSync, record: PodRecord, policy: Policy, *, now: float) -> list[str]:
    """The lines for `record` ([] for a pod in no gang, or one that started). O(gang
    pods) plus one gang plan (its docstring)."""
    if not record.controlled.gang_name or not record.live:
        return []
    store = gang_members(sync)
    key = record.gang_key
    members = store.members(key)
    found: list[str] = []
    broken = restarts.broken(key, members)
    holding = restarts.barrier(broken)
    if broken and holding:
        names = ", ".join(sorted(str(pod) for pod in holding)[:6])
        found.append(
            f"Gang {key[1]} restarts ({broken[0].cause}): its new members start as one gang "
            f"once the {len(holding)} member{'s' if len(holding) != 1 else ''} of its last "
            f"run still holding GPUs ({names}) have stopped."
        )
        return found
    if not record.controlled.gang_gated or not record.controlled.domain:
        return found
    wait = next(
        (item for item in waits(store, sync.ledger, now, told=telling.Told()) if item.key == key),
        None,
    )
    if wait is None or record.uid not in {pod.uid for pod in wait.members}:
        return found
    asked = planned(wait, store, sync.ledger.inventory)
    domain = gangs.domain_of(asked)
    if domain is None:
        return found
    policy_word = "required" if domain.required else "preferred"
    where = f"one {domain.key}" + (f" ({domain.key}={domain.value})" if domain.value else "")
    result = gangs.plan(sync.ledger, policy, asked)
    if isinstance(result, gangs.Plan):
        values = sorted(
            {
                sync.ledger.inventory[node].labels.get(domain.key, "(no label)")
                for node in result.nodes
            }
        )
        spread = ", ".join(f"{node} ×{count}" for node, count in result.per_node().items())
        found.append(
            f"Gang {key[1]} keeps to {where} ({policy_word}): its {len(wait.members)} "
            f"waiting members fit now in {domain.key}={', '.join(values)} ({spread})."
        )
        return found
    head = (
        f"Gang {key[1]} keeps to {where} ({policy_word}): {len(result.domains)} "
        f"domain{'s' if len(result.domains) != 1 else ''} tried, none holds all "
        f"{result.needed} members now"
    )
    if not result.domains:
        found.append(f"{head}: {result.reason}.")
        return found
    found.append(head + ":")
    found.extend(
        f"  {domain.key}={item.value} ({item.nodes} node{'s' if item.nodes != 1 else ''}): "
        f"{item.reason}"
        for item in result.domains
    )
    return found
