"""The startup heap is frozen out of the cyclic garbage collector while an engine is open, and
unfrozen once the last engine closes (structspec/engine/gc_heap.py)."""

from __future__ import annotations

import gc

import pytest

from structspec.engine import gc_heap


@pytest.fixture(autouse=True)
def freeze_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite turns the freeze off (tests/conftest.py); these tests turn it on."""
    monkeypatch.setenv("STRUCTSPEC_GC_FREEZE", "1")


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


def test_a_hold_releases_once_when_called_or_when_its_owner_is_freed() -> None:
    class Owner:
        pass

    before = gc_heap.open_engines()
    closed, dropped = Owner(), Owner()
    hold_closed = gc_heap.hold_startup_heap(closed)
    gc_heap.hold_startup_heap(dropped)
    assert gc_heap.open_engines() == before + 2
    hold_closed()  # close()
    hold_closed()  # a second close() releases nothing more
    assert gc_heap.open_engines() == before + 1
    del dropped  # an engine dropped unclosed: reference counting frees it
    assert gc_heap.open_engines() == before
    if before == 0:
        assert gc.get_freeze_count() == 0


def test_freeze_off_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRUCTSPEC_GC_FREEZE", "0")

    class Owner:
        pass

    before, frozen = gc_heap.open_engines(), gc.get_freeze_count()
    hold = gc_heap.hold_startup_heap(Owner())
    assert gc_heap.open_engines() == before and gc.get_freeze_count() == frozen
    hold()


def test_engine_holds_the_heap_while_open(make_llm) -> None:
    """An engine takes a hold at the end of its start and close() releases it (the release is
    tested on its own above; the suite's engines are built with the freeze off, so the cached
    engine's hold is the no-op one: only the wiring is checked here)."""
    engine = make_llm().engine
    assert engine._heap_hold.alive
