"""Keep Python's cyclic garbage collector off the engine's startup heap.

An engine holds ~370k Python objects once started (torch, transformers, xgrammar, Triton,
the tokenizer). A full (generation 2) collection walks all of them: 180-194 ms on the 2-core
CPU host (measured with ``gc.collect(2)`` after one ``generate``), a pause that lands on
whichever engine step happens to allocate the object that triggers it, i.e. on a stream's
inter-token latency. None of those objects becomes garbage while the engine serves, so after
startup they move to the permanent generation (``gc.freeze()``): later collections walk only
what was allocated since (0.0007 ms on the same heap right after the freeze). vLLM freezes its
heap after warm-up the same way (``freeze_gc_heap``); sglang offers a ``freeze_gc`` call.

Frozen objects are never collected, so the last engine of the process to close unfreezes the
heap (a closed engine's cycles become collectable again). An engine dropped without ``close()``
releases its hold when reference counting frees it (:func:`hold_startup_heap`); otherwise the
heap would stay frozen for the rest of the process, whatever engines closed later.

``STRUCTSPEC_GC_FREEZE=0`` turns it off (an engine start then skips the full collection,
~0.2-0.3 s on the 2-core CPU host: the test suite, which builds and closes engines by the
hundred, sets it; a process that keeps several engines open and closes some of them keeps
their cyclic garbage frozen until the last one closes).
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

from structspec.env_flags import env_flag

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_open_engines = 0


def freeze_startup_heap() -> int:
    """Collect the garbage startup left, then freeze every live object (one call per engine
    start; pair it with :func:`release_startup_heap` at close).

    Returns:
        Objects in the permanent generation afterwards.
    """
    global _open_engines
    with _lock:
        _open_engines += 1
        gc.collect()
        gc.freeze()
        frozen = gc.get_freeze_count()
    logger.debug("froze %d objects of the startup heap", frozen)
    return frozen


def release_startup_heap() -> None:
    """One engine closed; when it was the last open one, unfreeze the heap."""
    global _open_engines
    with _lock:
        _open_engines = max(0, _open_engines - 1)
        if _open_engines == 0:
            gc.unfreeze()


def open_engines() -> int:
    """Engines that froze the heap and have not closed yet (tests, diagnostics)."""
    with _lock:
        return _open_engines


def freeze_enabled() -> bool:
    """``STRUCTSPEC_GC_FREEZE`` unset or anything but ``0`` / ``false`` / ``off`` / ``no``."""
    return env_flag("STRUCTSPEC_GC_FREEZE")


def _nothing() -> None:
    return None


def hold_startup_heap(owner: object) -> weakref.finalize:
    """Freeze the startup heap on behalf of ``owner`` (an engine, at the end of its start),
    unless ``STRUCTSPEC_GC_FREEZE=0``.

    Returns:
        A finalizer that releases the hold (:func:`release_startup_heap`) exactly once: when
        called (the engine's ``close()``; later calls do nothing) or when ``owner`` is freed
        unclosed, whichever comes first (with the freeze off, a finalizer that does nothing).
    """
    if not freeze_enabled():
        return weakref.finalize(owner, _nothing)
    freeze_startup_heap()
    return weakref.finalize(owner, release_startup_heap)
