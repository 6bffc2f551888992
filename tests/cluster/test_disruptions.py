"""The PodDisruptionBudget pre-check of a gang's preemption (gpuplace.cluster.disruptions) applies
the Eviction API's rules to all victims together."""

from __future__ import annotations

from typing import Any

from gpuplace.cluster import disruptions
from gpuplace.cluster.disruptions import Victim


def pdb(name: str, allowed: int, selector: Any, *, generation: int = 1, seen: int = 1) -> Any:
    return disruptions.budget(
        {
            "metadata": {"name": name, "namespace": "ml", "generation": generation},
            "spec": {"selector": selector},
            "status": {"disruptionsAllowed": allowed, "observedGeneration": seen},
        }
    )


def victim(uid: str, app: str, *, phase: str = "Running", deleting: bool = False) -> Victim:
    return Victim(uid, "ml", uid, {"app": app, "tier": "batch"}, phase, deleting)


def test_victims_of_one_budget_count_together() -> None:
    budgets = [pdb("web", 1, {"matchLabels": {"app": "web"}})]
    victims = [victim("w1", "web"), victim("w2", "web"), victim("j1", "job")]
    assert disruptions.refused(budgets, victims) == {
        "w2": "PodDisruptionBudget web allows 1 disruption(s) now"
    }
    assert disruptions.refused(budgets, victims[:1]) == {}


def test_expressions_stale_budgets_and_two_budgets() -> None:
    expression = {"matchExpressions": [{"key": "app", "operator": "In", "values": ["job"]}]}
    stale = pdb("jobs", 5, expression, generation=2, seen=1)
    assert "still being processed" in disruptions.refused([stale], [victim("j1", "job")])["j1"]
    tier = pdb("batch", 5, {"matchExpressions": [{"key": "tier", "operator": "Exists"}]})
    both = disruptions.refused([pdb("jobs", 5, expression), tier], [victim("j1", "job")])
    assert "more than one PodDisruptionBudget (batch, jobs)" in both["j1"]


def test_absent_or_malformed_selectors_match_nothing_and_other_namespaces_do_not_count() -> None:
    absent = pdb("none", 0, None)
    broken = pdb("odd", 0, {"matchExpressions": [{"key": "app", "operator": "Near"}]})
    elsewhere = disruptions.Budget("other", "web", lambda labels: True, 0, True)
    assert disruptions.refused([absent, broken, elsewhere], [victim("w1", "web")]) == {}


def test_an_empty_selector_covers_every_pod_of_its_namespace() -> None:
    # policy/v1: a non-nil empty selector selects everything (eviction.go uses
    # LabelSelectorAsSelector, which gives Everything for {})
    empties: list[dict[str, Any]] = [{}, {"matchLabels": {}}, {"matchExpressions": []}]
    for empty in empties:
        refused = disruptions.refused(
            [pdb("all", 1, empty)], [victim("w1", "web"), victim("j1", "job")]
        )
        assert refused == {"j1": "PodDisruptionBudget all allows 1 disruption(s) now"}


def test_too_many_unconfirmed_disruptions_refuse() -> None:
    crowded = disruptions.budget(
        {
            "metadata": {"name": "web", "namespace": "ml", "generation": 1},
            "spec": {"selector": {"matchLabels": {"app": "web"}}},
            "status": {
                "disruptionsAllowed": 5,
                "observedGeneration": 1,
                "disruptedPods": {f"p{i}": "t" for i in range(disruptions.MAX_DISRUPTED_PODS)},
            },
        }
    )
    # at the limit the first eviction still passes (the map is not yet too big); it
    # adds one entry, so the next is refused as the API server refuses it (403)
    refused = disruptions.refused([crowded], [victim("w1", "web"), victim("w2", "web")])
    assert list(refused) == ["w2"]
    assert "too many evictions not confirmed" in refused["w2"]


def test_pods_the_eviction_api_deletes_without_budget_are_never_refused() -> None:
    budgets = [pdb("web", 0, {"matchLabels": {"app": "web"}})]
    victims = [
        victim("p", "web", phase="Pending"),
        victim("s", "web", phase="Succeeded"),
        victim("d", "web", deleting=True),
        victim("r", "web"),
    ]
    assert set(disruptions.refused(budgets, victims)) == {"r"}
