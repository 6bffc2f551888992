"""A share takes its ask plus its MPS client's CUDA context (issue 43, point 1): the
ledger, fit, gang counting and victim search all count what the limit handed to MPS
really takes, and a whole GPU or a share without memory takes its ask alone."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplace.placement import fit, gangs, victim_choice
from gpuplace.placement.inventory import ClientContext, Gpu, Inventory, Node
from gpuplace.placement.ledger import Grant, Ledger, Oversubscribed
from gpuplace.placement.requests import WHOLE, GpuRequest, thread_percent

H100 = ClientContext(base_mib=144, per_percent_mib=5)
PACKABLE = 80960


def node(name: str = "h100-0", gpus: int = 1, memory: int = PACKABLE) -> Node:
    return Node(
        name,
        cpu_milli=64000,
        memory_mib=512 * 1024,
        gpus=tuple(Gpu(i, "NVIDIA-H100-80GB-HBM3", memory, context=H100) for i in range(gpus)),
    )


def share(milli: int, memory_mib: int) -> GpuRequest:
    return GpuRequest(milli=milli, memory_mib=memory_mib, count=1)


def test_the_context_grows_with_the_thread_percentage() -> None:
    assert thread_percent(250) == 25 and thread_percent(251) == 26
    assert thread_percent(0) == 100  # a memory-only share runs at MPS's 100 %
    assert H100.mib(250) == 144 + 5 * 25 == 269
    assert H100.mib(0) == 644
    assert H100.takes(250, 2048) == 2317
    assert H100.takes(250, 0) == 0  # no memory asked: no limit, nothing reserved
    assert H100.takes(WHOLE, 81920) == 81920  # a whole GPU never goes through MPS


def test_the_ledger_takes_the_ask_and_the_context_and_gives_both_back() -> None:
    ledger = Ledger(Inventory([node()]))
    ledger.reserve(Grant("a", "h100-0", (0,), 250, 2048))
    state = ledger.state("h100-0")
    assert state is not None
    assert state.free_memory == [PACKABLE - 2317]
    ledger.release("a")
    assert state.free_memory == [PACKABLE]


def test_a_share_whose_ask_fits_but_not_with_its_context_is_refused_with_the_reason() -> None:
    ledger = Ledger(Inventory([node()]))
    ledger.reserve(Grant("a", "h100-0", (0,), 500, 60000))
    state = ledger.state("h100-0")
    assert state is not None
    left = state.free_memory[0]
    request = share(250, left - 100)  # the ask fits, ask + 269 does not
    assert fit.gpu_sets(state, request) == []
    misfit = fit.misfit(state, request)
    assert misfit is not None and misfit.kind is fit.MisfitKind.GPU_MEMORY
    assert f"needs {left - 100 + 269} MiB ({left - 100} asked + 269 for its CUDA" in (
        misfit.message
    )
    try:
        ledger.reserve(Grant("b", "h100-0", (0,), 250, left - 100))
    except Oversubscribed as refused:
        assert f"needs {left - 100 + 269} MiB" in str(refused)
    else:
        raise AssertionError("the ledger took a share its GPU cannot hold with its context")
    assert fit.gpu_sets(state, share(250, left - 269)) == [(0,)]


def test_a_gpu_too_small_for_the_ask_and_its_context_is_unresolvable() -> None:
    state = Ledger(Inventory([node()])).state("h100-0")
    assert state is not None
    misfit = fit.static_misfit(state, share(250, PACKABLE))
    assert misfit is not None and misfit.kind is fit.MisfitKind.GPU_TOO_SMALL
    assert not misfit.resolvable and "269 for its CUDA context" in misfit.message
    # a whole GPU with that memory still fits: no MPS, no context
    assert fit.static_misfit(state, GpuRequest(milli=WHOLE, memory_mib=PACKABLE, count=1)) is None


def test_gang_counting_and_victim_search_count_the_context() -> None:
    state = Ledger(Inventory([node(gpus=2)])).state("h100-0")
    assert state is not None
    each = 20000 + H100.mib(100)
    copies, _ = gangs.capacity(state, share(100, 20000))
    assert copies == 2 * min(PACKABLE // each, 10)
    assert victim_choice.takes(state, share(100, PACKABLE - H100.mib(100) + 1), (0,)) is False
    assert victim_choice.takes(state, share(100, PACKABLE - H100.mib(100)), (0,)) is True


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([0, 100, 250, 333, 500, 999]), st.integers(1, 30000)),
        max_size=40,
    ),
    st.data(),
)
def test_granted_asks_with_their_contexts_never_exceed_the_gpu(
    asks: list[tuple[int, int]], data: st.DataObject
) -> None:
    """The invariant 'granted memory <= the GPU's', with contexts: whatever is reserved
    and released, the free memory is the GPU's less each grant's ask plus context."""
    ledger = Ledger(Inventory([node()]))
    held: dict[str, tuple[int, int]] = {}
    for number, (milli, memory) in enumerate(asks):
        uid = f"p{number}"
        try:
            ledger.reserve(Grant(uid, "h100-0", (0,), milli, memory))
        except Oversubscribed:
            continue
        held[uid] = (milli, memory)
        release = data.draw(st.booleans(), label="release one")
        if held and release:
            gone: str = data.draw(st.sampled_from(sorted(held)), label="which")
            ledger.release(gone)
            del held[gone]
        state = ledger.state("h100-0")
        assert state is not None
        taken = sum(H100.takes(m, mem) for m, mem in held.values())
        assert taken <= PACKABLE
        assert state.free_memory[0] == PACKABLE - taken
