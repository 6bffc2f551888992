"""A gated gang member pinned to its planned node (`gpuplace.controllers.pinning`): the narrowing
obeys the rules kube-apiserver ≥ 1.30 applies to a gated pod's node affinity (KEP-3838,
`validateNodeAffinityMutation`), and `narrows` refuses exactly what the API server
refuses, with its words."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.cluster.node_affinity import NodeAffinity
from gpuplace.controllers.pinning import (
    POD_AFFINITY_CHANGED,
    TERM_CHANGED,
    TERMS_CHANGED,
    TERMS_PATH,
    narrowed,
    narrows,
    pin,
)
from tests.cluster.test_node_affinity import pod_with

WEBHOOK_AFFINITY: dict[str, Any] = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {
                    "matchExpressions": [
                        {
                            "key": "nvidia.com/gpu.product",
                            "operator": "In",
                            "values": ["NVIDIA-A100-SXM4-80GB"],
                        },
                        {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["1"]},
                    ]
                },
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
            ]
        },
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [{"key": "x", "operator": "Exists"}]}}
        ],
    },
    "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
}


def test_a_pod_without_required_affinity_gets_one_term_pinning_it() -> None:
    new = narrowed(None, "gpu-3")
    assert new == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [pin("gpu-3")]}]
            }
        }
    }
    assert narrows(None, new) is None
    assert NodeAffinity.of(pod_with(new)).pinned_to() == "gpu-3"
    preferred_only: dict[str, Any] = {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}
    }
    pinned = narrowed(preferred_only, "gpu-3")
    assert pinned is not None
    assert pinned["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == []


def test_existing_terms_only_gain_a_requirement_at_their_end() -> None:
    before = copy.deepcopy(WEBHOOK_AFFINITY)
    new = narrowed(WEBHOOK_AFFINITY, "gpu-3")
    assert before == WEBHOOK_AFFINITY  # not mutated
    assert new is not None
    assert narrows(WEBHOOK_AFFINITY, new) is None
    terms = new["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    old_terms = before["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert len(terms) == len(old_terms)
    for term, old in zip(terms, old_terms, strict=True):
        assert term["matchExpressions"] == old["matchExpressions"]
        assert term["matchFields"] == [pin("gpu-3")]
    assert (
        new["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        == (before["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"])
    )
    assert new["podAntiAffinity"] == before["podAntiAffinity"]
    assert narrowed(new, "gpu-3") is None  # idempotent


def required(*terms: dict[str, Any], **rest: Any) -> dict[str, Any]:
    """`spec.affinity` with these required node-selector terms (and `rest` beside them)."""
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        },
        **rest,
    }


GPU = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-A100-SXM4-80GB"]}
COUNT = {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["1"]}
ZONE = {"key": "zone", "operator": "In", "values": ["b"]}
HERE = {"key": "metadata.name", "operator": "In", "values": ["n"]}
OLD = required({"matchExpressions": [GPU, COUNT]}, {"matchExpressions": [ZONE]})
"""As the webhook leaves a pod (two terms), before any narrowing."""


@pytest.mark.parametrize(
    ("old", "new", "refusal"),
    [
        # the term list of a pod that has one keeps its length
        (OLD, required({"matchExpressions": [GPU, COUNT]}), f"{TERMS_PATH}: {TERMS_CHANGED}"),
        (
            OLD,
            required(
                {"matchExpressions": [GPU, COUNT]},
                {"matchExpressions": [ZONE]},
                {"matchFields": [HERE]},
            ),
            f"{TERMS_PATH}: {TERMS_CHANGED}",
        ),
        (OLD, {}, f"{TERMS_PATH}: {TERMS_CHANGED}"),  # dropping the required affinity
        # a term's requirements stay, unchanged and in order; only appending is allowed
        (
            OLD,
            required(
                {"matchExpressions": [{**GPU, "values": ["other"]}, COUNT]},
                {"matchExpressions": [ZONE]},
            ),
            f"{TERMS_PATH}[0]: {TERM_CHANGED}",
        ),
        (
            OLD,
            required(
                {"matchExpressions": [GPU, COUNT]},
                {"matchExpressions": [{"key": "k", "operator": "Exists"}, ZONE]},
            ),
            f"{TERMS_PATH}[1]: {TERM_CHANGED}",
        ),
        (
            OLD,
            required({"matchExpressions": [COUNT, GPU]}, {"matchExpressions": []}),
            f"{TERMS_PATH}[0]: {TERM_CHANGED}; {TERMS_PATH}[1]: {TERM_CHANGED}",
        ),
        # an empty term matches no node and may gain nothing
        (
            required({}, {"matchExpressions": [ZONE]}),
            required({"matchFields": [HERE]}, {"matchExpressions": [ZONE], "matchFields": [HERE]}),
            f"{TERMS_PATH}[0]: {TERM_CHANGED}",
        ),
        (required({}), required({"matchFields": [HERE]}), f"{TERMS_PATH}[0]: {TERM_CHANGED}"),
        # a gated pod's node affinity may change; its pod (anti-)affinity may not
        (
            OLD,
            {**OLD, "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}},
            POD_AFFINITY_CHANGED,
        ),
        # allowed: appending to non-empty terms, in expressions or fields
        (
            OLD,
            required(
                {"matchExpressions": [GPU, COUNT, ZONE], "matchFields": [HERE]},
                {"matchExpressions": [ZONE], "matchFields": [HERE]},
            ),
            None,
        ),
        # allowed: anything while there is no required term yet, or none at all
        (None, required({"matchFields": [HERE]}), None),
        (
            {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
            required({"matchExpressions": [ZONE]}, {"matchFields": [HERE]}),
            None,
        ),
        ({"nodeAffinity": {}}, required({"matchFields": [HERE]}), None),
        # allowed: preferred terms change freely
        (
            OLD,
            {
                "nodeAffinity": {
                    **OLD["nodeAffinity"],
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 5, "preference": {"matchExpressions": [ZONE]}}
                    ],
                }
            },
            None,
        ),
        # allowed: requirements compare semantically (an absent list equals an empty one)
        (
            required({"matchExpressions": [{"key": "k", "operator": "Exists"}]}),
            required(
                {"matchExpressions": [{"key": "k", "operator": "Exists", "values": []}, ZONE]}
            ),
            None,
        ),
    ],
)
def test_narrows_refuses_what_the_api_server_refuses(
    old: dict[str, Any] | None, new: dict[str, Any], refusal: str | None
) -> None:
    """Each case is kube-apiserver's answer to a gated pod's update from `old` to `new`
    (`validateNodeAffinityMutation`, `validateNodeSelectorTermHasOnlyAdditions`): the
    field it names and its message, or None where it accepts the update. Played on a
    real kube-apiserver v1.36.2 (../shared/k8s: a gated pod created with `old`, then a
    JSON patch to `new`), all 15 answered so: accepted where None, else refused naming
    that field with that message (the pod-affinity case: its Forbidden "pod updates may
    not change fields other than ...")."""
    assert narrows(old, new) == refusal


def test_empty_terms_match_nothing_and_are_left_alone() -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {},
                    {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
                ]
            }
        }
    }
    new = narrowed(affinity, "n")
    assert new is not None and narrows(affinity, new) is None
    assert (
        new["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][
            0
        ]
        == {}
    )
    assert not NodeAffinity.of(
        pod_with(
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}
                }
            }
        )
    ).matches("n", {})


LABEL_KEYS = st.sampled_from(["a", "b", "zone", "count"])
VALUES = st.sampled_from(["1", "2", "8", "z1"])
EXPRESSIONS = st.one_of(
    st.builds(
        lambda k, op, vs: {"key": k, "operator": op, "values": vs},
        LABEL_KEYS,
        st.sampled_from(["In", "NotIn"]),
        st.lists(VALUES, min_size=1, max_size=2),
    ),
    st.builds(
        lambda k, op: {"key": k, "operator": op},
        LABEL_KEYS,
        st.sampled_from(["Exists", "DoesNotExist"]),
    ),
    st.builds(
        lambda k, op, v: {"key": k, "operator": op, "values": [v]},
        LABEL_KEYS,
        st.sampled_from(["Gt", "Lt"]),
        st.sampled_from(["0", "4", "16"]),
    ),
)
TERMS = st.lists(
    st.fixed_dictionaries({}, optional={"matchExpressions": st.lists(EXPRESSIONS, max_size=3)}),
    max_size=3,
)
AFFINITIES = st.one_of(
    st.none(),
    st.just({}),
    st.builds(
        lambda terms: {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
            }
        },
        TERMS,
    ),
)
NODES = st.sampled_from(["n0", "n1", "n2"])
LABELS = st.dictionaries(LABEL_KEYS, VALUES, max_size=4)


@settings(max_examples=300, deadline=None)
@given(affinity=AFFINITIES, node=NODES, name=NODES, labels=LABELS)
def test_narrowing_is_allowed_only_tightens_and_pins(
    affinity: Any, node: str, name: str, labels: dict[str, str]
) -> None:
    new = narrowed(affinity, node)
    if new is None:
        new = affinity
    assert narrows(affinity, new) is None
    before = NodeAffinity.of(pod_with(affinity))
    after = NodeAffinity.of(pod_with(new))
    if after.matches(name, labels):
        assert name == node
        assert before.matches(name, labels)
    if before.matches(node, labels):
        assert after.matches(node, labels)
