"""The xgrammar backend: cached, killable grammar compilation and matcher creation.

One :class:`GrammarBackend` per served model (it holds the tokenizer's vocabulary). The
scheduler calls :meth:`GrammarBackend.submit` when a request arrives (never blocks), polls
:meth:`GrammarFuture.done` / :meth:`GrammarFuture.expired` each loop iteration, then turns the
result into a per-request :class:`~.matcher.Matcher` with :meth:`GrammarBackend.create_matcher`.

A grammar goes through three stages:

1. **Up front** (in :meth:`~GrammarBackend.submit`, microseconds to milliseconds): the
   regex syntax check and the size limits (:mod:`structspec.grammar.limits`); a grammar over
   a limit fails at once with code ``grammar_too_complex``.
2. **Checked compile in a worker process** (:mod:`structspec.grammar.compile_pool`): every
   check and the xgrammar compile, under the request's time budget
   (``GrammarConfig.compile_timeout_s`` from submission, queue wait included). Past it the
   worker is killed, its memory returned, and the request fails with ``grammar_too_complex``.
   Backends of one process with the same tokenizer and compile settings share the worker
   processes (:mod:`structspec.grammar.shared_compile_pool`).
3. **Rebuild in this process** (a daemon thread; shutdown joins it, below): the same compile
   again, to get the ``CompiledGrammar`` the matchers need. It is proven to end (it just
   did, in the worker, in about the same time), so the budget no longer runs; shipping the
   worker's result instead (xgrammar's ``serialize_json``) costs as much as the compile for
   small grammars and up to 6 times more, plus a third for the parse, for big ones. Grammars
   whose worker compile took under :data:`FAST_REBUILD_S` rebuild on their own thread, never
   behind big ones.

Shutdown (:meth:`GrammarBackend.shutdown`, or the backend's finalizer, which also runs at
interpreter exit) drops the queued rebuilds (their requests fail with "shut down") and waits,
bounded, for the one each rebuild thread may be running: a daemon thread still inside
xgrammar's compile (which releases the GIL) when the interpreter finalizes is ended by
``pthread_exit`` as it takes the GIL back, and that forced unwind of its C++ frames ends in
``std::terminate``: the process aborts ("terminate called without an active exception", exit
status 134) after its work is done.

Compiles are cached (LRU, keyed by a hash of the grammar), failures included except a time
limit hit after waiting in a queue; concurrent requests for the same grammar share one
compile. Source of the cache design: sglang's xgrammar backend and grammar manager.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

from structspec.config import GrammarConfig
from structspec.constraints import (
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    StructuralTagConstraint,
)
from structspec.grammar.compile_pool import (
    CompileJob,
    CompilePool,
    shut_down_error,
    too_complex_error,
)
from structspec.grammar.compile_spec import (  # noqa: F401 - re-exported (tests, callers)
    choice_ebnf,
    compile_only,
    metaschema_problem,
    schema_text,
)
from structspec.grammar.errors import GRAMMAR_TOO_COMPLEX, PARAM_BY_KIND, GrammarError
from structspec.grammar.grammar_source import XgrSource, remember_source
from structspec.grammar.limits import is_small, upfront_error
from structspec.grammar.matcher import Matcher
from structspec.grammar.shared_compile_pool import acquire_compile_pool, release_compile_pool

logger = logging.getLogger(__name__)

CacheKey = tuple[str, str]

FAST_REBUILD_S = 1.0
"""Grammars whose worker compile took less than this rebuild on the fast thread."""

REBUILD_EXIT_MIN_S = 5.0
"""Least time shutdown waits for a rebuild in progress (s; see :func:`_stop_compiles`)."""


@dataclass(eq=False)
class _Entry:
    """One cached grammar: its final future, the worker job while one runs, and whether the
    worker accepted it (the rebuild that follows is not under the time limit)."""

    future: Future[xgr.CompiledGrammar] = field(default_factory=Future)
    job: CompileJob | None = None
    accepted: bool = False
    submitted_at: float = 0.0


class GrammarFuture:
    """A pending (or finished) compilation for one request (:meth:`GrammarBackend.submit`).

    Args:
        entry: the shared compile (several requests may wait on the same one).
        timeout_s: the compile time limit (``GrammarConfig.compile_timeout_s``).
        submitted_at: ``time.perf_counter()`` at this request's submission.
        kind: the grammar kind (``regex``, ``json_schema``...), for error params.
        pool: the compile pool; the budget starts at ``max(submitted_at, pool.ready_at)``
            (a request that arrived while the compile processes were still starting is not
            charged for their start) and does not run before the pool is ready.
    """

    def __init__(self, entry: _Entry, *, timeout_s: float, submitted_at: float,
                 kind: str, pool: CompilePool | None = None) -> None:
        self._entry = entry
        self._future = entry.future
        self.timeout_s = timeout_s
        self.submitted_at = submitted_at
        self.kind = kind
        self._pool = pool

    def _budget_start(self) -> float | None:
        """When this request's compile budget started (None: not yet, the compile processes
        are still starting)."""
        if self._pool is None:
            return self.submitted_at
        ready_at = self._pool.ready_at
        return None if ready_at is None else max(self.submitted_at, ready_at)

    def done(self) -> bool:
        """Whether the compilation finished (successfully or not)."""
        return self._future.done()

    def expired(self, now: float) -> bool:
        """Whether this request's budget ran out (``now``: perf_counter) before the worker
        accepted its grammar; the rebuild after acceptance never expires."""
        start = self._budget_start()
        return (not self._future.done() and not self._entry.accepted and start is not None
                and now - start >= self.timeout_s)

    def result(self, timeout: float | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar, waiting at most ``timeout`` seconds (None: until it is
        ready, or until the request's budget runs out before the worker accepts it).

        Raises:
            GrammarError: the compile failed (the compiler's message), the spec is invalid,
                unservable or over a limit, or this request's budget ran out
                (code ``grammar_too_complex``, naming ``timeout_s``); or ``timeout`` passed
                first (a shorter wait than the budget: no code).
        """
        give_up = None if timeout is None else time.perf_counter() + timeout
        while True:
            now = time.perf_counter()
            if self.expired(now):
                raise too_complex_error(self.kind, self.timeout_s)
            start = self._budget_start()
            # before the pool is ready the budget has not started: look again shortly
            waits = ([] if self._entry.accepted else
                     [start + self.timeout_s - now if start is not None else 0.05])
            if give_up is not None:
                waits.append(give_up - now)
            wait = max(0.0, min(waits)) if waits else None
            try:
                return self._future.result(timeout=wait)
            except FutureTimeout:
                if give_up is not None and time.perf_counter() >= give_up \
                        and not self.expired(time.perf_counter()):
                    raise GrammarError(f"grammar compilation still running after the "
                                       f"{timeout:g} s wait", param=PARAM_BY_KIND.get(self.kind)
                                       ) from None


class GrammarBackend:
    """Compiles grammar specs for one tokenizer and creates per-request matchers.

    Args:
        tokenizer_hf: a Hugging Face tokenizer (``PreTrainedTokenizerFast``).
        vocab_size: the model's logits width (may exceed ``len(tokenizer_hf)``; the extra ids
            are never allowed by any grammar). Bitmasks have ``ceil(vocab_size / 32)`` words.
        stop_token_ids: ids that end an output (pass them explicitly: e.g. SmolLM2's GGUF
            conversion reports the wrong EOS).
        config: compile lanes, limits, cache bound, timeout, whitespace and rollback.

    Compile options: JSON Schema with ``strict_mode=True`` and ``any_whitespace`` from the
    config (``False``: xgrammar's default separators ``", "`` and ``": "``). The compile
    worker processes start in the background at construction.
    """

    def __init__(
        self,
        tokenizer_hf: Any,
        *,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        config: GrammarConfig | None = None,
    ) -> None:
        self.config = config or GrammarConfig()
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer_hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        # The rebuild compiler (stage 3); our own LRU cache replaces xgrammar's unbounded one.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max(1, self.config.num_compile_threads),
            cache_enabled=False)
        # One pool per process and settings: engines built for the same tokenizer share its
        # processes (shared_compile_pool.py); this backend holds one reference to it.
        self.pool = acquire_compile_pool(
            self.tokenizer_info.serialize_json(), vocab_size=self.vocab_size,
            stop_token_ids=self.stop_token_ids, any_whitespace=self.config.any_whitespace,
            general_workers=self.config.num_compile_threads,
            small_workers=self.config.num_small_compile_workers,
            small_slice_s=self.config.small_lane_slice_s)
        self._lock = threading.Lock()
        self._cache: OrderedDict[CacheKey, _Entry] = OrderedDict()
        # this backend's jobs on the (shared) pool until their verdict: what shutdown cancels
        self._jobs: set[CompileJob] = set()
        self._compile_s: list[float] = []
        self._timeouts = 0
        self._rebuild_fast: queue.SimpleQueue[_Rebuild | None] = queue.SimpleQueue()
        self._rebuild_slow: queue.SimpleQueue[_Rebuild | None] = queue.SimpleQueue()
        # set by shutdown: the rebuild threads drop what is still queued
        self._stopping = threading.Event()
        # daemon threads (an idle one waits on its queue, which exit must not wait for);
        # shutdown and the finalizer join them, bounded (module docstring, "Shutdown")
        self._threads = [threading.Thread(target=_serve, args=(q, self._stopping), daemon=True,
                                          name=f"grammar-rebuild-{name}")
                         for name, q, n in (("fast", self._rebuild_fast, 1),
                                            ("slow", self._rebuild_slow,
                                             max(1, self.config.num_compile_threads)))
                         for _ in range(n)]
        for t in self._threads:
            t.start()
        self._closed = False
        # A backend dropped without shutdown() (an engine garbage-collected, a test's backend)
        # must not leave its compiles running or its pool reference held: the finalizer holds
        # the pool, the running jobs and the queues, never the backend, so it runs when the
        # last reference goes (or at interpreter exit). Not the cache: a cached failure's
        # exception carries the traceback of every frame it was raised through (the engine's
        # step among them), and the finalizer's arguments live as long as the backend's
        # finalizer is registered, so holding it would keep a dropped engine alive.
        self._finalizer = weakref.finalize(
            self, _stop_compiles, self.pool, self._jobs, self._lock,
            [self._rebuild_fast if t.name.endswith("fast") else self._rebuild_slow
             for t in self._threads], self._stopping, self._threads,
            max(REBUILD_EXIT_MIN_S, self.config.compile_timeout_s))

    # -- compilation ----------------------------------------------------------------------

    def submit(self, spec: GrammarConstraint) -> GrammarFuture:
        """Start compiling ``spec`` (or join a cached / in-flight compile); never blocks on
        the compile (the up-front checks take microseconds to milliseconds).

        Errors (invalid spec, over a limit, compile failure, unservable schema, time limit)
        surface from :meth:`GrammarFuture.result` as :class:`GrammarError`.
        """
        now = time.perf_counter()
        kind = spec.kind
        limit_s = self.config.compile_timeout_s

        def failed(error: GrammarError) -> GrammarFuture:
            entry = _Entry(submitted_at=now)
            entry.future.set_exception(error)
            return GrammarFuture(entry, timeout_s=limit_s, submitted_at=now, kind=kind,
                                 pool=self.pool)

        param = PARAM_BY_KIND.get(kind)
        if self._closed:  # the shared pool may live on for other backends: refuse here
            return failed(shut_down_error(kind))
        try:
            text = spec.canonical_text()
            key = self._key(spec, text)
        except (ValueError, TypeError) as e:
            return failed(GrammarError(str(e), param=param))
        with self._lock:
            entry = self._joinable(key, now + limit_s)
            if entry is not None:
                self._cache.move_to_end(key)
                return GrammarFuture(entry, timeout_s=limit_s, submitted_at=now, kind=kind,
                                     pool=self.pool)
        # up front: not cached (cheap to repeat; a refused 4 MB text would hold cache memory)
        error = upfront_error(spec, text, self.config)
        if error is not None:
            return failed(error)
        with self._lock:
            entry = self._joinable(key, now + limit_s)
            if entry is None:
                entry = _Entry(submitted_at=now)
                entry.job = self.pool.submit(spec, small=is_small(text, self.config),
                                             deadline=now + limit_s, limit_s=limit_s)
                self._jobs.add(entry.job)
                self._cache[key] = entry
                self._evict()
                job: CompileJob | None = entry.job
            else:
                job = None
        if job is not None:  # outside the lock: a finished job runs the callback right here
            job.future.add_done_callback(
                lambda f, e=entry, k=key, s=spec: self._on_worker_done(k, e, s, f))
        return GrammarFuture(entry, timeout_s=limit_s, submitted_at=now, kind=kind,
                             pool=self.pool)

    def compile(self, spec: GrammarConstraint, timeout: float | None = None) -> xgr.CompiledGrammar:
        """Blocking convenience: ``submit(spec).result(timeout)``.

        Raises:
            GrammarError: see :meth:`GrammarFuture.result`.
        """
        return self.submit(spec).result(timeout)

    def create_matcher(self, compiled: xgr.CompiledGrammar) -> Matcher:
        """A fresh per-request matcher over a compiled grammar (cheap)."""
        return Matcher(compiled, stop_token_ids=self.stop_token_ids,
                       max_rollback_tokens=self.config.max_rollback_tokens)

    def cache_size(self) -> int:
        """Number of cache entries (finished and in flight)."""
        with self._lock:
            return len(self._cache)

    def drain_compile_stats(self) -> tuple[list[float], int]:
        """Compile seconds (submission to ready, per compiled grammar) and the number of
        compiles stopped at their time limit, since the last call (``/metrics``)."""
        with self._lock:
            seconds, self._compile_s = self._compile_s, []
            timeouts, self._timeouts = self._timeouts, 0
        return seconds, timeouts

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the compile processes can take work (their first start imports
        xgrammar and torch: seconds); True when they can, False (logged) after
        ``timeout_s`` or when they failed to start."""
        return self.pool.wait_ready(timeout_s)

    def worker_pids(self) -> list[int]:
        """The compile processes' ids (zygote first; tests measure their CPU and memory)."""
        return self.pool.pids()

    def shutdown(self) -> None:
        """Stop this backend's compiles (running ones are killed; their requests fail), give
        back its reference to the shared compile pool (the last one stops the processes) and
        end the rebuild threads; later submissions fail with "shut down". Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    # -- internals ----------------------------------------------------------------------

    def _joinable(self, key: CacheKey, deadline: float) -> _Entry | None:
        """The cached entry of ``key`` a new request may share (with the lock held): a
        finished one, or one whose worker compile now runs until ``deadline`` at least.
        None when there is none, or when its compile is past its deadline and being stopped
        (sharing it would fail the new request on a budget it never had)."""
        entry = self._cache.get(key)
        if entry is None or entry.job is None or entry.accepted:
            return entry
        return entry if self.pool.extend(entry.job, deadline) else None

    @staticmethod
    def _key(spec: GrammarConstraint, text: str) -> CacheKey:
        """``(kind, sha256 of the canonical text)``: a cached 4 MB grammar keeps no 4 MB key."""
        kind = spec.kind
        if isinstance(spec, (JsonSchemaConstraint, StructuralTagConstraint)) and spec.strict:
            # The strict check may fail where the non-strict compile succeeds: separate keys.
            kind += ":strict"
        if isinstance(spec, (JsonSchemaConstraint, JsonObjectConstraint,
                             StructuralTagConstraint)) and not spec.bounded_numbers:
            kind += ":unbounded"  # another grammar (no default number bounds)
        return kind, hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def _evict(self) -> None:
        # Called with the lock held. In-flight entries are kept (they dedupe waiters).
        excess = len(self._cache) - self.config.cache_max_entries
        if excess <= 0:
            return
        for key in [k for k, e in self._cache.items() if e.future.done()][:excess]:
            del self._cache[key]

    def _on_worker_done(self, key: CacheKey, entry: _Entry, spec: GrammarConstraint,
                        job_future: Future[float]) -> None:
        """The worker's verdict (on the pool's thread): fail the entry, or queue its rebuild."""
        job = entry.job
        with self._lock:
            self._jobs.discard(job)  # type: ignore[arg-type]
        error = job_future.exception()
        if error is not None:
            with self._lock:
                if isinstance(error, GrammarError) and error.code == GRAMMAR_TOO_COMPLEX:
                    self._timeouts += 1
                    # cache "too complex" only when it ran its whole budget on a worker; a
                    # budget spent waiting in a queue says nothing about the grammar
                    if (job is None or job.run_s < self.config.compile_timeout_s) \
                            and self._cache.get(key) is entry:
                        del self._cache[key]
                entry.job = None
            if not entry.future.done():
                entry.future.set_exception(error)
            return
        entry.accepted = True
        entry.job = None
        lane = self._rebuild_fast if job_future.result() < FAST_REBUILD_S else self._rebuild_slow
        lane.put(_Rebuild(lambda: self._rebuild(entry, spec), entry, spec.kind))

    def _rebuild(self, entry: _Entry, spec: GrammarConstraint) -> None:
        try:
            compiled = compile_only(self._compiler, spec,
                                    any_whitespace=self.config.any_whitespace)
        except GrammarError as e:
            entry.future.set_exception(e)
            return
        # a mask worker compiles it from this source instead of a serialization
        remember_source(compiled, XgrSource(spec, self.config.any_whitespace))
        with self._lock:
            self._compile_s.append(time.perf_counter() - entry.submitted_at)
        entry.future.set_result(compiled)


@dataclass(frozen=True)
class _Rebuild:
    """A queued rebuild: ``run`` compiles and settles ``entry``; a rebuild dropped at shutdown
    fails ``entry`` with :func:`shut_down_error` of ``kind`` instead."""

    run: Callable[[], None]
    entry: _Entry
    kind: str


def _stop_compiles(pool: CompilePool, jobs: set[CompileJob], lock: threading.Lock,
                   rebuild_queues: list[queue.SimpleQueue[Any]], stopping: threading.Event,
                   threads: list[threading.Thread], join_s: float) -> None:
    """Cancel the backend's unfinished compiles, release its pool reference (the last one
    kills the compile processes) and end the rebuild threads: queued rebuilds are dropped
    (one ``None`` per thread wakes it) and each thread's rebuild in progress is waited for,
    ``join_s`` in all (the request's compile limit, at least :data:`REBUILD_EXIT_MIN_S`: the
    rebuild repeats a compile that finished within it). The backend's shutdown and
    finalizer."""
    with lock:
        running = list(jobs)
    pool.cancel(running)
    release_compile_pool(pool)
    stopping.set()
    for q in rebuild_queues:
        q.put(None)
    deadline = time.monotonic() + join_s
    me = threading.current_thread()
    for t in threads:
        if t is not me:  # a finalizer run by a collection on a rebuild thread
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive() and t is not me]
    if alive:
        logger.warning("grammar rebuild threads %s still compiling %.0f s after shutdown",
                       alive, join_s)


def _serve(work: queue.SimpleQueue[_Rebuild | None], stopping: threading.Event) -> None:
    """A rebuild thread: run queued rebuilds until ``None``; once ``stopping`` is set, fail
    the queued ones instead of compiling them."""
    while True:
        item = work.get()
        if item is None:
            return
        if stopping.is_set():
            if not item.entry.future.done():
                item.entry.future.set_exception(shut_down_error(item.kind))
        else:
            item.run()
        # Drop the done rebuild before waiting again: it references the backend, and a
        # thread blocked in get() with it in a local kept a dropped backend alive for good
        # (its finalizer, which ends this thread, never ran), and with it the compile pool
        # reference and, through a cached failure's traceback, the whole engine.
        del item
