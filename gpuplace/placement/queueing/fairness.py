"""What each team is entitled to at one moment, and how fair a split is (Jain's index).

`entitlements(capacity, demand, nominal, weight)`: every team first gets its nominal
quota or its demand, whichever is less (scaled down together if the nominals exceed the
capacity); what is left is shared by weight among the teams that want more, none getting
more than it demands (water-filling). With nominals in proportion to the weights, this is
the weighted max-min fair split of the capacity.

`jain(values)`: (sum x)^2 / (n x sum x^2), 1 when all are equal, 1/n when one holds all.

Pure arithmetic: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def entitlements(
    capacity: float,
    demand: Mapping[str, float],
    nominal: Mapping[str, float],
    weight: Mapping[str, float],
) -> dict[str, float]:
    """Each team's share of `capacity` (see the module docstring). O(teams^2) at worst
    (one pass per team that is satisfied)."""
    given = {
        team: min(max(want, 0.0), max(nominal.get(team, 0.0), 0.0)) for team, want in demand.items()
    }
    guaranteed = sum(given.values())
    if guaranteed > capacity > 0:
        scale = capacity / guaranteed
        given = {team: amount * scale for team, amount in given.items()}
    elif capacity <= 0:
        return dict.fromkeys(demand, 0.0)
    left = capacity - sum(given.values())
    wanting = {team for team, want in demand.items() if want > given[team]}
    while left > 1e-9 and wanting:
        weights = sum(weight.get(team, 1.0) for team in wanting)
        satisfied = set()
        handed = 0.0
        for team in sorted(wanting):
            offer = left * weight.get(team, 1.0) / weights
            take = min(offer, demand[team] - given[team])
            given[team] += take
            handed += take
            if given[team] >= demand[team] - 1e-9:
                satisfied.add(team)
        left -= handed
        if not satisfied:
            break
        wanting -= satisfied
    return given


def jain(values: Iterable[float]) -> float:
    """Jain's fairness index of `values` (1.0 for none). O(n)."""
    found = list(values)
    if not found:
        return 1.0
    squares = sum(value * value for value in found)
    if squares == 0:
        return 1.0
    return sum(found) ** 2 / (len(found) * squares)
