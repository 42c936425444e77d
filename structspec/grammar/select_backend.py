"""The grammar backend chosen per request: ``GrammarConfig.backend`` ``llguidance`` or
``auto`` (``xgrammar`` uses :class:`~structspec.grammar.backend.GrammarBackend` directly).

``auto``, per grammar: **xgrammar** when its strict check passes and it compiles within the
time limit (it is the tuned path: compile processes, mask workers, C++ tree walk); else
**llguidance** when llguidance compiles it exactly (no ``lenient``, no ``coerce_one_of``:
:mod:`structspec.grammar.llg_compile`); else the request is refused with xgrammar's error,
which names the keyword and its JSON pointer. The llguidance attempt starts when xgrammar
refuses or runs out of time, with a time limit of its own.

Structural tags (:class:`~structspec.constraints.StructuralTagConstraint`) have no exact
llguidance equivalent: ``auto`` serves them on xgrammar alone (:func:`xgrammar_only`), and
``llguidance`` refuses them (:data:`~structspec.grammar.llg_compile.STRUCTURAL_TAG_REFUSAL`).

Which one served a request follows from its compiled grammar
(:meth:`SelectingBackend.create_matcher`; the matcher's ``backend`` attribute).
"""

from __future__ import annotations

import time
from typing import Any

import xgrammar as xgr

from structspec.constraints import GrammarConstraint, StructuralTagConstraint
from structspec.grammar.backend import GrammarBackend, GrammarFuture
from structspec.grammar.compile_spec import with_backend_note
from structspec.grammar.errors import PARAM_BY_KIND, GrammarError
from structspec.grammar.llg_backend import LlgBackend
from structspec.grammar.llg_matcher import LlgCompiled, LlgMatcher
from structspec.grammar.matcher import Matcher

BACKEND_MODES = ("xgrammar", "llguidance", "auto")
"""The values of ``GrammarConfig.backend`` / ``--grammar-backend``."""

_POLL_S = 0.005


def xgrammar_only(spec: GrammarConstraint | None) -> bool:
    """Whether ``auto`` serves ``spec`` on xgrammar without an llguidance fallback: a
    structural tag, which llguidance cannot serve exactly."""
    return isinstance(spec, StructuralTagConstraint)


class AutoFuture:
    """An ``auto`` compile: xgrammar's, then llguidance's when xgrammar fails. The interface
    of :class:`~structspec.grammar.backend.GrammarFuture` (``done``, ``expired``, ``result``).

    Args:
        kind: the grammar kind (error params).
        xgr_future: xgrammar's compile.
        llg_backend: where the fallback compile is submitted.
        spec: the grammar (for the fallback).
    """

    def __init__(self, kind: str, xgr_future: GrammarFuture, llg_backend: LlgBackend,
                 spec: GrammarConstraint) -> None:
        self.kind = kind
        self._xgr = xgr_future
        self._llg_backend = llg_backend
        self._spec = spec
        self._llg: GrammarFuture | None = None
        self._xgr_error: GrammarError | None = None
        self._xgr_timed_out = False

    def _advance(self, now: float) -> None:
        """Start the llguidance compile once xgrammar has failed or run out of time."""
        if self._llg is not None or not (self._xgr.done() or self._xgr.expired(now)):
            return
        # xgrammar still compiling at its time limit: its "error" is only the time-out
        self._xgr_timed_out = not self._xgr.done()
        try:
            self._xgr.result(timeout=0)
        except GrammarError as e:
            self._xgr_error = e
            self._llg = self._llg_backend.submit(self._spec)

    def done(self) -> bool:
        """Whether the final compile (xgrammar's success, or llguidance's verdict) finished."""
        self._advance(time.perf_counter())
        return self._xgr.done() if self._llg is None else self._llg.done()

    def expired(self, now: float) -> bool:
        """Whether the llguidance attempt ran out of time (xgrammar's time-out falls back)."""
        self._advance(now)
        return self._llg is not None and self._llg.expired(now)

    def result(self, timeout: float | None = None) -> xgr.CompiledGrammar | LlgCompiled:
        """The compiled grammar of the chosen backend, waiting at most ``timeout`` seconds.

        Raises:
            GrammarError: both backends refused (xgrammar's error, naming the keyword's JSON
                pointer for a schema its strict check refuses), or ``timeout`` passed.
        """
        give_up = None if timeout is None else time.perf_counter() + timeout
        while True:
            now = time.perf_counter()
            if self.done() or self.expired(now):
                break
            if give_up is not None and now >= give_up:
                raise GrammarError(f"grammar compilation still running after the "
                                   f"{timeout:g} s wait", param=PARAM_BY_KIND.get(self.kind))
            time.sleep(_POLL_S)
        if self._llg is None:
            return self._xgr.result(timeout=0)
        try:
            return self._llg.result(timeout=0)
        except GrammarError as e:
            assert self._xgr_error is not None
            if self._xgr_timed_out:  # llguidance's refusal says why; a time-out says nothing
                raise GrammarError(with_backend_note(str(e), "xgrammar",
                                                     "ran out of its compile time"),
                                   param=e.param, code=e.code) from e
            raise self._xgr_error from e


class SelectingBackend:
    """``GrammarConfig.backend`` ``llguidance`` (every grammar on llguidance) or ``auto``
    (module docstring); the interface of :class:`~structspec.grammar.backend.GrammarBackend`
    that the scheduler and the server use.

    Args:
        mode: ``"llguidance"`` or ``"auto"``.
        xgrammar: the xgrammar backend (required for ``auto``, unused for ``llguidance``).
        llguidance: the llguidance backend.

    Raises:
        ValueError: an unknown mode, or ``auto`` without an xgrammar backend.
    """

    def __init__(self, mode: str, *, xgrammar: GrammarBackend | None,
                 llguidance: LlgBackend) -> None:
        if mode not in ("llguidance", "auto"):
            raise ValueError(f"grammar_backend={mode!r}: SelectingBackend serves 'llguidance' "
                             "or 'auto'")
        if mode == "auto" and xgrammar is None:
            raise ValueError("grammar_backend='auto' needs the xgrammar backend")
        self.mode = mode
        self.xgrammar = xgrammar
        self.llguidance = llguidance
        self.config = llguidance.config
        self.vocab_size = llguidance.vocab_size
        self.stop_token_ids = llguidance.stop_token_ids

    @property
    def tokenizer_info(self) -> xgr.TokenizerInfo | None:
        """xgrammar's tokenizer info (the mask worker pool's), or None in ``llguidance``."""
        return None if self.xgrammar is None else self.xgrammar.tokenizer_info

    def submit(self, spec: GrammarConstraint) -> GrammarFuture | AutoFuture:
        """Start compiling ``spec`` on the mode's backend(s); never blocks."""
        if self.mode == "llguidance" or self.xgrammar is None:
            return self.llguidance.submit(spec)
        if xgrammar_only(spec):
            return self.xgrammar.submit(spec)
        return AutoFuture(spec.kind, self.xgrammar.submit(spec), self.llguidance, spec)

    def compile(self, spec: GrammarConstraint,
                timeout: float | None = None) -> xgr.CompiledGrammar | LlgCompiled:
        """Blocking convenience: ``submit(spec).result(timeout)``."""
        return self.submit(spec).result(timeout)

    def create_matcher(self, compiled: Any) -> Matcher | LlgMatcher:
        """A fresh matcher on the backend that compiled ``compiled``."""
        if isinstance(compiled, LlgCompiled):
            return self.llguidance.create_matcher(compiled)
        assert self.xgrammar is not None
        return self.xgrammar.create_matcher(compiled)

    def cache_size(self) -> int:
        """Cache entries of both backends."""
        return self.llguidance.cache_size() + (
            0 if self.xgrammar is None else self.xgrammar.cache_size())

    def drain_compile_stats(self) -> tuple[list[float], int]:
        """Both backends' compile seconds and time-limit hits since the last call."""
        seconds, timeouts = self.llguidance.drain_compile_stats()
        if self.xgrammar is not None:
            more, hits = self.xgrammar.drain_compile_stats()
            seconds, timeouts = seconds + more, timeouts + hits
        return seconds, timeouts

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the xgrammar compile processes (if any) can take work."""
        return True if self.xgrammar is None else self.xgrammar.wait_ready(timeout_s)

    def worker_pids(self) -> list[int]:
        """xgrammar's compile processes (none for ``llguidance``)."""
        return [] if self.xgrammar is None else self.xgrammar.worker_pids()

    def shutdown(self) -> None:
        """Stop both backends. Idempotent."""
        self.llguidance.shutdown()
        if self.xgrammar is not None:
            self.xgrammar.shutdown()
