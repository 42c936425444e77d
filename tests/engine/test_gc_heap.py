"""The startup heap is frozen out of the cyclic garbage collector while an engine is open, and
unfrozen once the last engine closes (structspec/engine/gc_heap.py)."""

from __future__ import annotations

import gc

from structspec.engine import gc_heap


def test_freeze_and_release_pair_up() -> None:
    before = gc_heap.open_engines()
    frozen = gc_heap.freeze_startup_heap()
    try:
        # (frozen objects freed by reference counting leave the permanent generation)
        assert frozen > 0 and gc.get_freeze_count() > 0
        assert gc_heap.open_engines() == before + 1
        junk = [[i] for i in range(1000)]  # allocated after the freeze: not frozen
        assert gc.get_freeze_count() <= frozen
        del junk
    finally:
        gc_heap.release_startup_heap()
    assert gc_heap.open_engines() == before
    if before == 0:
        assert gc.get_freeze_count() == 0  # the last one out unfreezes


def test_engine_freezes_its_heap_and_close_releases_it(make_llm) -> None:
    llm = make_llm()  # the session's cached engine is open: the heap is frozen
    assert gc_heap.open_engines() >= 1 and gc.get_freeze_count() > 0
    engine = llm.engine
    assert engine._heap_frozen
    held = gc_heap.open_engines()
    engine._heap_frozen = False  # as close() would, without closing the shared engine
    gc_heap.release_startup_heap()
    try:
        assert gc_heap.open_engines() == held - 1
    finally:
        gc_heap.freeze_startup_heap()
        engine._heap_frozen = True
