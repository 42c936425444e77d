"""The llguidance backend: cached, time-limited compiles in threads and
:class:`~structspec.grammar.llg_matcher.LlgMatcher` creation.

Same interface as the xgrammar :class:`~structspec.grammar.backend.GrammarBackend`
(``submit`` never blocks and returns a :class:`~structspec.grammar.backend.GrammarFuture`;
``create_matcher``, ``drain_compile_stats``, ``shutdown``). Compiles run on a thread pool:
llguidance releases the GIL while it builds a grammar, and its own parser and lexer limits
(``LLParserLimits``: fuel, lexer states, grammar size) bound a compile's work, so no process
has to be killed. The request's time limit (``GrammarConfig.compile_timeout_s``) still holds:
past it the request fails with ``grammar_too_complex`` whether or not the thread finished.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance

from structspec.config import GrammarConfig
from structspec.constraints import GrammarConstraint
from structspec.grammar.backend import CacheKey, GrammarBackend, GrammarFuture, _Entry
from structspec.grammar.errors import PARAM_BY_KIND, GrammarError
from structspec.grammar.limits import upfront_error
from structspec.grammar.llg_compile import compile_llguidance
from structspec.grammar.llg_matcher import LlgCompiled, LlgMatcher
from structspec.grammar.llg_tokenizer import LlgTokenizerSource, check_token_bytes


def llguidance_tokenizer(tokenizer_hf: Any, *, vocab_size: int,
                         stop_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of a Hugging Face fast tokenizer (~1 s; build once).

    Args:
        tokenizer_hf: a ``PreTrainedTokenizerFast``.
        vocab_size: the model's logits width (>= the tokenizer's size); ids past the
            tokenizer's are never allowed.
        stop_token_ids: the ids that end an output: llguidance's EOS tokens, the only special
            tokens a grammar allows (at its end).

    Raises:
        ValueError: a slow (non-Rust) tokenizer.
    """
    return LlgTokenizerSource.from_hf(tokenizer_hf, vocab_size=vocab_size,
                                      stop_token_ids=stop_token_ids).build()


class LlgBackend:
    """Compiles grammar specs with llguidance for one tokenizer and creates matchers.

    Args:
        tokenizer_hf: a Hugging Face fast tokenizer.
        vocab_size: the model's logits width (bitmask rows of ``ceil(vocab_size / 32)`` words).
        stop_token_ids: ids that end an output.
        config: compile threads, limits, cache bound, timeout, whitespace and rollback.
    """

    name = "llguidance"

    def __init__(self, tokenizer_hf: Any, *, vocab_size: int, stop_token_ids: Sequence[int],
                 config: GrammarConfig | None = None) -> None:
        self.config = config or GrammarConfig()
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        #: what the mask worker processes build the same tokenizer from
        self.tokenizer_source = LlgTokenizerSource.from_hf(
            tokenizer_hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        self.tokenizer = self.tokenizer_source.build()
        check_token_bytes(self.tokenizer, self.tokenizer_source.tokenizer_json)
        self._executor = ThreadPoolExecutor(max(1, self.config.num_compile_threads),
                                            thread_name_prefix="llg-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._compile_s: list[float] = []
        self._timeouts = 0
        self._closed = False

    def submit(self, spec: GrammarConstraint) -> GrammarFuture:
        """Start compiling ``spec`` (or join a cached / in-flight compile); never blocks.
        Errors surface from :meth:`GrammarFuture.result` as :class:`GrammarError`."""
        now = time.perf_counter()
        kind = spec.kind
        limit_s = self.config.compile_timeout_s
        param = PARAM_BY_KIND.get(kind)

        def future_of(entry: _Entry) -> GrammarFuture:
            return GrammarFuture(entry, timeout_s=limit_s, submitted_at=now, kind=kind)

        def failed(error: GrammarError) -> GrammarFuture:
            entry = _Entry(submitted_at=now)
            entry.future.set_exception(error)
            return future_of(entry)

        try:
            text = spec.canonical_text()
            key = GrammarBackend._key(spec, text)
        except (ValueError, TypeError) as e:
            return failed(GrammarError(str(e), param=param))
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return future_of(entry)
        error = upfront_error(spec, text, self.config)
        if error is not None:
            return failed(error)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                return future_of(entry)
            entry = _Entry(submitted_at=now)
            self._cache[key] = entry
            self._evict()
        self._executor.submit(self._compile, key, entry, spec)
        return future_of(entry)

    def compile(self, spec: GrammarConstraint, timeout: float | None = None) -> LlgCompiled:
        """Blocking convenience: ``submit(spec).result(timeout)``.

        Raises:
            GrammarError: see :meth:`GrammarFuture.result`.
        """
        return self.submit(spec).result(timeout)  # type: ignore[return-value]

    def create_matcher(self, compiled: LlgCompiled) -> LlgMatcher:
        """A fresh per-request matcher (a copy of the compiled grammar's start state)."""
        return LlgMatcher(compiled, stop_token_ids=self.stop_token_ids,
                          max_rollback_tokens=self.config.max_rollback_tokens)

    def cache_size(self) -> int:
        """Number of cache entries (finished and in flight)."""
        with self._lock:
            return len(self._cache)

    def drain_compile_stats(self) -> tuple[list[float], int]:
        """Compile seconds and compiles past their time limit since the last call."""
        with self._lock:
            seconds, self._compile_s = self._compile_s, []
            timeouts, self._timeouts = self._timeouts, 0
        return seconds, timeouts

    def wait_ready(self, timeout_s: float) -> bool:
        """Always ready (compiles run on threads of this process)."""
        return True

    def shutdown(self) -> None:
        """Stop taking compiles; running ones finish in the background. Idempotent."""
        if not self._closed:
            self._closed = True
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _evict(self) -> None:
        # Called with the lock held; in-flight entries are kept (they dedupe waiters).
        excess = len(self._cache) - self.config.cache_max_entries
        if excess > 0:
            for key in [k for k, e in self._cache.items() if e.future.done()][:excess]:
                del self._cache[key]

    def _compile(self, key: CacheKey, entry: _Entry, spec: GrammarConstraint) -> None:
        """One compile on a pool thread: the result or the error goes to the entry; a compile
        that ends past the time limit is counted and not cached (its waiters already failed)."""
        try:
            compiled = compile_llguidance(
                self.tokenizer, spec, vocab_size=self.vocab_size,
                any_whitespace=self.config.any_whitespace, stop_token_ids=self.stop_token_ids)
        except GrammarError as e:
            entry.future.set_exception(e)
            return
        except Exception as e:  # noqa: BLE001 - an llguidance fault stays this request's
            entry.future.set_exception(GrammarError(
                f"Failed to compile {spec.kind} grammar (llguidance): {e}",
                param=PARAM_BY_KIND.get(spec.kind)))
            return
        elapsed = time.perf_counter() - entry.submitted_at
        with self._lock:
            if elapsed >= self.config.compile_timeout_s:
                self._timeouts += 1
            else:
                self._compile_s.append(elapsed)
        entry.future.set_result(compiled)  # type: ignore[arg-type]

