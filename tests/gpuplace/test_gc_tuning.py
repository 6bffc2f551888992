"""The cyclic collector's tuning (`gpuplace.runtime.gc_tuning`): young generations collected while
small, or frozen when large; automatic passes paused and restored; the survivors of the
first sync frozen with automatic full passes off; the sidecar's loop doing its passes."""

from __future__ import annotations

import ast
import asyncio
import gc
from pathlib import Path

from gpuplace.runtime import gc_tuning
from gpuplace.runtime.gc_tuning import collect_young


def test_collect_young_collects_the_middle_generation_when_due() -> None:
    middle = gc.get_threshold()[1]
    gc.collect()
    for _ in range(middle):
        collect_young()
    assert gc.get_count()[1] == middle  # youngest collected, each counted towards the middle
    collect_young()
    assert gc.get_count()[1] == 0  # the middle one was due and collected


def test_collect_young_freezes_a_large_young_generation() -> None:
    gc.collect()
    frozen = gc.get_freeze_count()
    kept = [[index] for index in range(50)]  # young, alive
    collect_young(freeze_above=1_000)
    assert gc.get_freeze_count() == frozen  # small: collected, not frozen
    gc.disable()  # as churn does: no automatic pass while the young generation grows
    kept += [[index] for index in range(5_000)]
    gc.enable()
    try:
        collect_young(freeze_above=1_000)
        assert gc.get_freeze_count() >= frozen + 5_000
        assert len(gc.get_objects(0)) < 1_000
    finally:
        gc.unfreeze()
    assert len(kept) == 5_050


def test_a_pause_disables_automatic_passes_and_restores_what_was() -> None:
    assert gc.isenabled()
    with gc_tuning.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_tuning.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off: it stays off
    finally:
        gc.enable()


def test_the_survivors_are_frozen_and_full_passes_turned_off() -> None:
    threshold = gc.get_threshold()
    try:
        kept = [[index] for index in range(1_000)]
        frozen = gc_tuning.freeze_survivors()
        assert frozen == gc.get_freeze_count() >= len(kept)
        assert gc.get_threshold()[2] == gc_tuning.FULL_PASS_NEVER
        assert gc.get_threshold()[:2] == threshold[:2]
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_large_young_generations_are_frozen_only_when_full_passes_come() -> None:
    assert gc_tuning.young_freeze_limit(10.0, 3600.0) == gc_tuning.YOUNG_FREEZE
    assert gc_tuning.young_freeze_limit(0.0, 3600.0) is None
    assert gc_tuning.young_freeze_limit(10.0, 0.0) is None


async def test_the_loop_freezes_after_the_first_sync_then_runs_full_passes() -> None:
    threshold = gc.get_threshold()
    passes: list[int] = []

    def collected(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            passes.append(info["generation"])

    ready = asyncio.Event()
    before = gc.get_freeze_count()
    loop = asyncio.create_task(
        gc_tuning.keep_passes_short(
            ready, young_seconds=0.0, freeze_seconds=0.01, full_seconds=0.05
        )
    )
    try:
        await asyncio.sleep(0.03)
        assert gc.get_freeze_count() == before  # nothing before the first sync
        ready.set()
        await asyncio.sleep(0.01)
        assert gc.get_freeze_count() > before
        assert gc.get_threshold()[2] == gc_tuning.FULL_PASS_NEVER
        gc.callbacks.append(collected)
        await asyncio.sleep(0.2)
        assert 2 in passes  # its own full pass, every full_seconds
    finally:
        if collected in gc.callbacks:
            gc.callbacks.remove(collected)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_only_gc_tuning_touches_the_collector() -> None:
    """Every call to `gc` is in `gpuplace.runtime.gc_tuning` (issue 26: the tuning lives in one
    place); any other module of the package that imports `gc` fails here."""
    package = Path(gc_tuning.__file__).parent
    importers = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if "gc" in names:
                importers.append(str(path.relative_to(package)))
    assert importers == ["gc_tuning.py"]
