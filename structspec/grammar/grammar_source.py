"""The source of each xgrammar grammar this process compiled, so a mask worker can compile it
itself instead of receiving xgrammar's serialization.

Why: shipping a compiled grammar meant ``serialize_json`` on the engine's one shipping thread
(as long as the compile for small grammars, up to 6x for large ones) and a parse in the
worker. With a distinct schema per request (benchmarks/distinct_schemas.py, H200, 8 workers)
the thread was busy 15.7 s of a 17.3 s run: requests waited in its queue with their grammar
work in process, and 8 workers ran slower than none. The source (the constraint and the
compile option) pickles in microseconds, and each worker compiles it on its loader thread
(xgrammar's compile releases the GIL), the workers in parallel. xgrammar's compile is
deterministic for one tokenizer, so the worker's grammar equals the engine's.

Keyed by ``id`` of the compiled grammar (xgrammar's objects are not hashable), with a
``weakref.finalize`` that drops the entry when the grammar is collected, before its ``id``
can be reused.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import xgrammar as xgr

from structspec.constraints import GrammarConstraint


@dataclass(frozen=True)
class XgrSource:
    """What compiles to a grammar: :func:`~structspec.grammar.compile_spec.compile_only` of
    ``spec`` with ``any_whitespace``."""

    spec: GrammarConstraint
    any_whitespace: bool


_SOURCES: dict[int, XgrSource] = {}
_LOCK = threading.Lock()


def remember_source(compiled: xgr.CompiledGrammar, source: XgrSource) -> None:
    """Record that ``source`` compiles to ``compiled`` (until ``compiled`` is collected)."""
    key = id(compiled)
    with _LOCK:
        _SOURCES[key] = source
    weakref.finalize(compiled, _forget, key)


def source_of(compiled: xgr.CompiledGrammar) -> XgrSource | None:
    """The recorded source of ``compiled``, or None (a grammar compiled elsewhere)."""
    with _LOCK:
        return _SOURCES.get(id(compiled))


def _forget(key: int) -> None:
    with _LOCK:
        _SOURCES.pop(key, None)
