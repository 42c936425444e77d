"""Killable grammar compiles: worker processes in two lanes, each job under a deadline.

xgrammar's compile cannot be interrupted, and a thread running it keeps its CPU and memory
to the end: one 10,000-property schema kept compiling for minutes after its request had
failed, and four of them held every compile thread, so that a trivial ``choice`` request
timed out behind them. Here every compile runs in a worker process
(:mod:`structspec.grammar.compile_worker`); a job still running at its deadline is stopped
by killing its worker (its memory goes back to the system) and the worker is replaced by a
fork of the warm zygote (milliseconds).

Lanes: the **small** lane (``GrammarConfig.num_small_compile_workers``) takes grammars that
:func:`~structspec.grammar.limits.is_small` estimates cheap, the **general** lane
(``GrammarConfig.num_compile_threads``) the rest; each lane is first come, first served. A
small-lane job still running after ``small_lane_slice_s`` (a cheap-looking grammar that is
not) is stopped and queued at the front of the general lane with its deadline unchanged, so
the small lane is never held longer than that.

One dispatcher thread does all the process I/O; :meth:`CompilePool.submit` only queues and
wakes it. A process shares one pool among its backends of the same settings
(:mod:`structspec.grammar.shared_compile_pool`); :meth:`CompilePool.cancel` stops the jobs of
a backend that shuts down while others still use the pool.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle

from structspec.constraints import GrammarConstraint
from structspec.grammar.errors import GRAMMAR_TOO_COMPLEX, PARAM_BY_KIND, GrammarError

logger = logging.getLogger(__name__)

_WORKER_MODULE = "structspec.grammar.compile_worker"
SMALL, GENERAL = "small", "general"
_MAX_WAIT_S = 1.0  # the dispatcher re-checks deadlines at least this often


def shut_down_error(kind: str) -> GrammarError:
    """The error of a compile whose backend (or pool) shut down before it finished."""
    return GrammarError("the grammar compiler is shut down", param=PARAM_BY_KIND.get(kind))


def too_complex_error(kind: str, limit_s: float) -> GrammarError:
    """The error of a compile stopped at its time limit: a 400 with code
    ``grammar_too_complex`` naming the grammar's field and the limit in seconds."""
    return GrammarError(
        f"the {kind} grammar did not finish compiling within the {limit_s:g} s limit "
        "(grammar_compile_timeout_s) and was stopped; simplify it (fewer properties, enum "
        "values, alternatives or nesting)", param=PARAM_BY_KIND.get(kind),
        code=GRAMMAR_TOO_COMPLEX)


@dataclass(eq=False)
class CompileJob:
    """One compile in the pool.

    Attributes:
        spec: the grammar constraint.
        lane: ``"small"`` or ``"general"`` (a small job past its slice moves to general).
        deadline: ``time.perf_counter()`` at which the job is stopped (queue wait included);
            :meth:`CompilePool.extend` moves it later when another request joins.
        limit_s: the configured limit, for the error message.
        future: the worker's verdict: its compile seconds, or the :class:`GrammarError`.
        run_s: seconds the job has run on a worker (the last attempt), once finished.
        cancelled: set by :meth:`CompilePool.cancel`: the dispatcher stops the job (its
            worker is killed if one runs it) and fails it with :func:`shut_down_error`.
    """

    spec: GrammarConstraint
    lane: str
    deadline: float
    limit_s: float
    job_id: int = 0
    future: Future[float] = field(default_factory=Future)
    started_at: float | None = None
    run_s: float = 0.0
    cancelled: bool = False


@dataclass(frozen=True)
class LaneStatus:
    """One lane of the pool at one moment (:meth:`CompilePool.status`).

    Attributes:
        size: the workers the lane keeps (a killed one is replaced by a fork).
        workers: live workers now (fewer than ``size`` while a replacement is forked).
        busy: workers running a job.
        queued: jobs waiting for a worker of the lane.
    """

    size: int
    workers: int
    busy: int
    queued: int

    @property
    def settled(self) -> bool:
        """Every worker the lane keeps is there and idle, and nothing waits."""
        return self.workers == self.size and self.busy == 0 and self.queued == 0


@dataclass(eq=False)
class _Worker:
    pid: int
    conn: Connection
    lane: str
    job: CompileJob | None = None


class CompilePool:
    """The compile worker processes (module docstring).

    Args:
        tokenizer_info_json: ``xgr.TokenizerInfo.serialize_json()`` of the served tokenizer.
        vocab_size: the logits width. stop_token_ids: the stop ids.
        any_whitespace: JSON Schema whitespace option (see ``GrammarConfig``).
        general_workers: workers of the general lane (>= 1).
        small_workers: workers of the small lane (0: small jobs use the general lane).
        small_slice_s: seconds a small-lane job may run before it moves to the general lane.

    The zygote starts at once (in the background); jobs queue until it is ready.
    """

    def __init__(self, tokenizer_info_json: str, *, vocab_size: int,
                 stop_token_ids: Sequence[int], any_whitespace: bool, general_workers: int,
                 small_workers: int, small_slice_s: float) -> None:
        self._init = {"tokenizer_info_json": tokenizer_info_json, "vocab_size": int(vocab_size),
                      "stop_token_ids": [int(t) for t in stop_token_ids],
                      "any_whitespace": bool(any_whitespace)}
        self._size = {GENERAL: max(1, int(general_workers)), SMALL: max(0, int(small_workers))}
        self._slice_s = float(small_slice_s)
        # Reentrant: the pool's owner may be collected (its finalizer calls close()) on any
        # thread, the dispatcher included, possibly while that thread holds the lock.
        self._lock = threading.RLock()
        self._queues: dict[str, deque[CompileJob]] = {SMALL: deque(), GENERAL: deque()}
        self._workers: list[_Worker] = []
        self._forks_pending: dict[str, int] = {SMALL: 0, GENERAL: 0}
        self._ids = itertools.count(1)
        self._closed = False
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zygote_conn: Connection | None = None
        self._zygote_ready = False
        #: ``time.perf_counter()`` when the zygote was ready (None before): compile budgets
        #: of requests that arrived earlier start here
        self.ready_at: float | None = None
        self._failed: str | None = None  # why the zygote could not start
        self._ready = threading.Event()  # every lane has a worker, or the start failed
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="grammar-compile-pool",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API

    def submit(self, spec: GrammarConstraint, *, small: bool, deadline: float,
               limit_s: float) -> CompileJob:
        """Queue a compile of ``spec``; never blocks. Its :attr:`CompileJob.future` ends
        with the worker's compile seconds or a :class:`GrammarError` (the spec's own error,
        or :func:`too_complex_error` at ``deadline``)."""
        lane = SMALL if small and self._size[SMALL] > 0 else GENERAL
        job = CompileJob(spec, lane, deadline, limit_s, job_id=next(self._ids))
        with self._lock:
            if self._closed:
                job.future.set_exception(shut_down_error(spec.kind))
                return job
            self._queues[lane].append(job)
        self._wake()
        return job

    def extend(self, job: CompileJob, deadline: float) -> bool:
        """Let ``job`` run until ``deadline`` if that is later (another request joined it).

        Returns False, moving nothing, when the job is done, cancelled or already past its
        deadline: the dispatcher fails it (it may have taken it off its queue already), so
        the joining request must start a compile of its own instead of sharing that
        failure."""
        with self._lock:
            if job.cancelled or job.future.done():
                return False
            if time.perf_counter() >= job.deadline and (job.started_at is not None
                                                        or self._may_expire_queued(job)):
                return False
            job.deadline = max(job.deadline, deadline)
            return True

    def cancel(self, jobs: Sequence[CompileJob]) -> None:
        """Stop ``jobs`` without closing the pool (their backend shut down while other
        backends share the pool): queued ones leave their queue, a running one has its
        worker killed (a fork replaces it); each fails with :func:`shut_down_error`. Jobs
        already finished are left as they are. Never blocks on the processes."""
        with self._lock:
            for job in jobs:
                if not job.future.done():
                    job.cancelled = True
                    job.deadline = float("-inf")  # the dispatcher's next pass stops it
        self._wake()

    def usable(self) -> bool:
        """Whether the pool can still compile: not closed, its compile processes did not
        fail to start or exit, and its dispatcher thread runs."""
        return not self._closed and self._failed is None and self._thread.is_alive()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until every lane has a worker; True then, False (logged) after
        ``timeout_s`` or when the compile processes failed to start."""
        if self._ready.wait(timeout_s) and self._failed is None:
            return True
        logger.warning("grammar compile processes not ready after %.0f s: %s", timeout_s,
                       self._failed or "still starting")
        return False

    def pids(self) -> list[int]:
        """The zygote's and every live worker's process id (tests, monitoring)."""
        with self._lock:
            zygote = [self._zygote.pid] if self._zygote is not None else []
            return zygote + [w.pid for w in self._workers]

    def status(self) -> dict[str, LaneStatus]:
        """A snapshot of each lane (``"small"``, ``"general"``): tests and monitoring wait on
        it for a state (every killed worker replaced, a job moved to the general lane)
        instead of sleeping."""
        with self._lock:
            workers = [(w.lane, w.job is not None) for w in list(self._workers)]
            queued = {lane: len(q) for lane, q in self._queues.items()}
        return {lane: LaneStatus(size=size,
                                 workers=sum(1 for w_lane, _ in workers if w_lane == lane),
                                 busy=sum(1 for w_lane, busy in workers
                                          if w_lane == lane and busy),
                                 queued=queued[lane])
                for lane, size in self._size.items()}

    def close(self) -> None:
        """Fail queued and running jobs, kill every worker and the zygote. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        if threading.current_thread() is not self._thread:  # close() from the dispatcher
            self._thread.join(timeout=5)  # itself: it sees _closed and ends its loop

    # ------------------------------------------------------------------ dispatcher

    def _wake(self) -> None:
        with self._lock:
            fd = self._wake_w
            if fd < 0:
                return
            try:
                os.write(fd, b"x")
            except OSError:  # the pipe is full: the dispatcher is awake anyway
                pass

    def _run(self) -> None:
        try:
            self._start_zygote()
            while not self._closed:
                self._step()
        except Exception:  # a bug here must not leave requests waiting forever
            logger.exception("grammar compile pool failed")
            self._failed = self._failed or "the grammar compile pool failed (see the log)"
        finally:
            self._ready.set()  # nobody waits for a pool that is gone
            self._shutdown()

    def _start_zygote(self) -> None:
        import socket

        ours, theirs = socket.socketpair()
        self._zygote = subprocess.Popen(
            self._zygote_command(theirs.fileno()), pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL)
        theirs.close()
        self._zygote_conn = Connection(ours.detach())
        self._zygote_conn.send(self._init)

    def _zygote_command(self, fd: int) -> list[str]:
        """The zygote's command line, given the file descriptor of its socket end (a
        method so that tests can start a slower zygote)."""
        return [sys.executable, "-m", _WORKER_MODULE, str(fd)]

    def _step(self) -> None:
        now = time.perf_counter()
        self._enforce_deadlines(now)
        self._dispatch()
        self._request_forks()
        conns: list[Connection | int] = [self._wake_r]
        if self._zygote_conn is not None:
            conns.append(self._zygote_conn)
        conns.extend(w.conn for w in self._workers)
        for ready in wait(conns, timeout=self._next_event(now)):
            if ready == self._wake_r:
                os.read(self._wake_r, 4096)
            elif ready is self._zygote_conn:
                self._on_zygote()
            else:
                worker = next((w for w in self._workers if w.conn is ready), None)
                if worker is not None:
                    self._on_worker(worker)

    def _next_event(self, now: float) -> float:
        with self._lock:
            times = [j.deadline for q in self._queues.values() for j in q
                     if self._may_expire_queued(j)]
            for w in self._workers:
                if w.job is not None:
                    times.append(w.job.deadline)
                    if w.lane == SMALL and w.job.started_at is not None:
                        times.append(w.job.started_at + self._slice_s)
        return min([_MAX_WAIT_S] + [max(0.0, t - now) + 0.001 for t in times])

    def _may_expire_queued(self, job: CompileJob) -> bool:
        """Whether a queued job's deadline runs: a cancelled job always, others only once
        the zygote is ready. Budgets count from ``ready_at`` (:meth:`_on_zygote` moves them
        then), so a job queued during a start slower than its limit must not be failed by
        its first deadline before that move: it was, and valid grammars got
        ``grammar_too_complex`` on a loaded 2-core machine whose zygote took 3.3 s."""
        return job.cancelled or self.ready_at is not None

    def _enforce_deadlines(self, now: float) -> None:
        with self._lock:
            expired = []
            for q in self._queues.values():
                for job in [j for j in q if now >= j.deadline and self._may_expire_queued(j)]:
                    q.remove(job)
                    expired.append(job)
        for job in expired:
            _fail(job, _deadline_error(job))
        for w in list(self._workers):
            job = w.job
            if job is None or job.started_at is None:
                continue
            if now >= job.deadline:
                job.run_s = now - job.started_at
                self._kill(w)
                _fail(job, _deadline_error(job))
            elif w.lane == SMALL and now - job.started_at >= self._slice_s:
                self._kill(w)  # a cheap-looking grammar that is not: free the small lane
                job.lane, job.started_at = GENERAL, None
                with self._lock:
                    self._queues[GENERAL].appendleft(job)

    def _dispatch(self) -> None:
        for w in self._workers:
            if w.job is not None:
                continue
            with self._lock:
                queue = self._queues[w.lane]
                job = queue.popleft() if queue else None
            if job is None:
                continue
            if job.future.done():  # failed while queued
                continue
            if job.cancelled:  # cancelled after this step's deadline pass
                _fail(job, shut_down_error(job.spec.kind))
                continue
            job.started_at = time.perf_counter()
            w.job = job
            try:
                w.conn.send((job.job_id, job.spec))
            except OSError:
                self._on_worker_died(w)

    def _request_forks(self) -> None:
        if not self._zygote_ready or self._zygote_conn is None:
            if self._failed is not None:
                self._fail_queued(self._failed)
            return
        for lane, size in self._size.items():
            have = sum(1 for w in self._workers if w.lane == lane) + self._forks_pending[lane]
            for _ in range(size - have):
                self._zygote_conn.send(("fork", lane))
                self._forks_pending[lane] += 1

    def _on_zygote(self) -> None:
        assert self._zygote_conn is not None
        try:
            msg = self._zygote_conn.recv()
            if msg == "ready":
                self._zygote_ready = True
                # Compile budgets count from here for requests that arrived earlier: the
                # processes' first start (xgrammar and torch imports, seconds) is the engine's
                # own latency, not the grammar's cost. Forks from now on take milliseconds.
                now = time.perf_counter()
                with self._lock:
                    for q in self._queues.values():
                        for job in q:
                            if not job.cancelled:
                                job.deadline = max(job.deadline, now + job.limit_s)
                    self.ready_at = now
                return
            _, pid, lane = msg
            fd = recv_handle(self._zygote_conn)
        except (EOFError, OSError) as e:
            code = self._zygote.poll() if self._zygote is not None else None
            self._failed = f"the grammar compile process exited ({code}: {e!r})"
            logger.error("%s", self._failed)
            self._ready.set()
            self._zygote_conn.close()
            self._zygote_conn = None
            self._zygote_ready = False
            return
        self._forks_pending[lane] -= 1
        self._workers.append(_Worker(pid, Connection(fd), lane))
        if all(size == 0 or any(w.lane == name for w in self._workers)
               for name, size in self._size.items()):
            self._ready.set()

    def _on_worker(self, w: _Worker) -> None:
        try:
            job_id, error, compile_s = w.conn.recv()
        except (EOFError, OSError):
            self._on_worker_died(w)
            return
        job, w.job = w.job, None
        if job is None or job.job_id != job_id:
            return
        job.run_s = time.perf_counter() - (job.started_at or time.perf_counter())
        if error is not None:
            _fail(job, error)
        elif not job.future.done():
            job.future.set_result(float(compile_s))

    def _on_worker_died(self, w: _Worker) -> None:
        job = w.job
        self._kill(w)
        if job is not None:  # a crash in the compiler on this grammar: its request fails
            _fail(job, GrammarError(f"the grammar compiler crashed on this {job.spec.kind} "
                                    "grammar", param=PARAM_BY_KIND.get(job.spec.kind)))

    def _kill(self, w: _Worker) -> None:
        """Kill ``w`` (the zygote reaps it) and forget it; a fork replaces it next step."""
        try:
            os.kill(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        w.conn.close()
        w.job = None
        self._workers.remove(w)

    def _fail_queued(self, reason: str) -> None:
        with self._lock:
            jobs = [j for q in self._queues.values() for j in q]
            for q in self._queues.values():
                q.clear()
        for job in jobs:
            _fail(job, GrammarError(reason, param=PARAM_BY_KIND.get(job.spec.kind)))

    def _shutdown(self) -> None:
        for w in list(self._workers):
            job = w.job
            self._kill(w)
            if job is not None:
                _fail(job, shut_down_error(job.spec.kind))
        self._fail_queued("the grammar compiler is shut down")
        if self._zygote_conn is not None:
            self._zygote_conn.close()
        if self._zygote is not None:
            self._zygote.kill()
            self._zygote.wait()
        with self._lock:
            fds, self._wake_w = (self._wake_r, self._wake_w), -1
        for fd in fds:
            os.close(fd)


def _deadline_error(job: CompileJob) -> GrammarError:
    """Why a job past its deadline is stopped: cancelled (:meth:`CompilePool.cancel`) or
    over its time limit."""
    if job.cancelled:
        return shut_down_error(job.spec.kind)
    return too_complex_error(job.spec.kind, job.limit_s)


def _fail(job: CompileJob, error: GrammarError) -> None:
    if not job.future.done():
        job.future.set_exception(error)
