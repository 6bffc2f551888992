"""gpuplace.extender.reasons: what kube-scheduler gets per node, in both modes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuplace.extender import reasons
from gpuplace.placement import fit

misfits = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.builds(fit.Misfit, st.sampled_from(list(fit.MisfitKind)), st.text(max_size=20)),
    max_size=30,
)


@given(misfits, st.sampled_from(["kind", "detail"]))
def test_for_nodes_is_for_node_split_by_resolvability(
    found: dict[str, fit.Misfit], mode: reasons.Mode
) -> None:
    resolvable, unresolvable = reasons.for_nodes(found, mode)
    assert resolvable == {n: reasons.for_node(m, mode) for n, m in found.items() if m.resolvable}
    assert unresolvable == {
        n: reasons.for_node(m, mode) for n, m in found.items() if not m.resolvable
    }
    assert resolvable.keys() | unresolvable.keys() == found.keys()


def test_the_two_modes_read_as_documented() -> None:
    busy = fit.Misfit(fit.MisfitKind.GPU_SHARE, "gpu 3: 40% free, needs 50%")
    wrong = fit.Misfit(fit.MisfitKind.WRONG_MODEL, "GPU model T4, needs one of A100")
    assert reasons.for_nodes({"a": busy, "b": wrong}) == (
        {"a": "gpuplace: no GPU with enough share free"},
        {"b": "gpuplace: wrong GPU model"},
    )
    resolvable, _ = reasons.for_nodes({"a": busy}, "detail")
    assert resolvable == {
        "a": "gpuplace: no GPU with enough share free (gpu 3: 40% free, needs 50%)"
    }
