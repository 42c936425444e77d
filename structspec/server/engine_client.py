"""The front end's handle on the engine process.

:class:`EngineClient` spawns :func:`~structspec.server.engine_process.engine_main`, waits for
it to report ready (or raises :class:`EngineStartupError` with the engine's own reason), and
then moves messages: a sender thread writes add/abort messages to one pipe (so a slow engine
never blocks the event loop), a reader thread reads step outputs from the other and hands
each batch to the event loop, which routes every delta to its request's ``asyncio.Queue``.

The HTTP layer only depends on the :class:`AsyncEngine` protocol (tests substitute a fake).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, Protocol

from structspec.server.ipc import (
    AbortAll,
    AbortRequest,
    AddRequest,
    EngineDelta,
    EngineInfo,
    EngineStats,
    Fatal,
    InitFailed,
    Ready,
    Shutdown,
    StepOutputs,
    ToEngine,
)

if TYPE_CHECKING:
    from structspec.config import EngineConfig
    from structspec.core import SamplingParams

logger = logging.getLogger("structspec.server")

DeltaSink = asyncio.Queue[EngineDelta]
StatsListener = Callable[[EngineStats], None]


class EngineStartupError(RuntimeError):
    """The engine process failed to start; the message is the engine's reason."""


class EngineDeadError(RuntimeError):
    """The engine process is gone (crashed or shut down)."""


class AsyncEngine(Protocol):
    """What the HTTP layer needs from an engine (all methods are called on the event loop)."""

    info: EngineInfo

    @property
    def ready(self) -> bool:
        """True while requests can be served."""
        ...

    @property
    def stats(self) -> EngineStats:
        """Queue state after the latest engine step."""
        ...

    def add_listener(self, listener: StatsListener) -> None:
        """Call ``listener(stats)`` on the event loop after every engine step."""
        ...

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, sink: DeltaSink, *, priority: int = 0) -> None:
        """Queue a request; its deltas arrive in ``sink`` (the last one has ``finished``).
        ``priority``: lower is served first (``LLMEngine.add_request``).

        Raises:
            EngineDeadError: the engine is not serving.
        """
        ...

    def abort_request(self, request_id: str) -> None:
        """Cancel a request if it is still live (its final delta still arrives)."""
        ...

    def abort_all(self) -> None:
        """Cancel every live request."""
        ...

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the server's event loop (called once at startup)."""
        ...


class EngineClient:
    """Runs the engine in a spawned process and talks to it (see module docstring).

    Args:
        config: the engine configuration, sent to the child as is.
        log_level: logging level of the engine process.
        engine_factory: builds the engine from ``config`` in the child (None: ``LLMEngine``);
            a picklable module-level callable (tests run a scripted engine behind the real
            loop and pipes).
    """

    def __init__(self, config: EngineConfig, *, log_level: int = logging.INFO,
                 engine_factory: Callable[[Any], Any] | None = None) -> None:
        self.config = config
        self.log_level = log_level
        self.info: EngineInfo | None = None  # type: ignore[assignment]
        self._stats = EngineStats()
        self._sinks: dict[str, DeltaSink] = {}
        self._listeners: list[StatsListener] = []
        # control messages, and requests pickled by add_request (bytes)
        self._outbox: queue.SimpleQueue[ToEngine | bytes | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self._closing = False
        self._draining = False
        self._threads: list[threading.Thread] = []
        self.on_dead: Callable[[str], None] | None = None  # called on the loop if it dies
        ctx = mp.get_context("spawn")
        self._to_engine_r, self._to_engine_w = ctx.Pipe(duplex=False)
        self._from_engine_r, self._from_engine_w = ctx.Pipe(duplex=False)
        from structspec.server.engine_process import engine_main

        self.process = ctx.Process(
            target=engine_main, name="structspec-engine",
            args=(config, self._to_engine_r, self._from_engine_w, log_level, engine_factory))

    # ------------------------------------------------------------------ lifecycle

    def spawn(self) -> None:
        """Start the engine process (returns at once; :meth:`wait_ready` waits for it)."""
        self.process.start()
        self._to_engine_r.close()  # the child's ends: closing ours makes EOF detectable
        self._from_engine_w.close()

    def start(self, timeout: float | None = None,
              should_stop: Callable[[], bool] | None = None) -> EngineInfo:
        """:meth:`spawn` then :meth:`wait_ready`."""
        self.spawn()
        return self.wait_ready(timeout, should_stop)

    def wait_ready(self, timeout: float | None = None,
                   should_stop: Callable[[], bool] | None = None) -> EngineInfo:
        """Block until the spawned engine is ready.

        Args:
            timeout: seconds to wait (None: as long as loading takes).
            should_stop: polled while waiting; True aborts the start (e.g. on Ctrl-C).

        Raises:
            EngineStartupError: the engine reported an init error, died, or timed out.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._from_engine_r.poll(0.2):
                try:
                    msg = self._from_engine_r.recv()
                except (EOFError, OSError):
                    self._reap()
                    raise EngineStartupError(
                        f"engine process exited (code {self.process.exitcode}) before it was "
                        "ready") from None
                if isinstance(msg, Ready):
                    self.info = msg.info
                    return msg.info
                if isinstance(msg, InitFailed):
                    logger.debug("engine init traceback:\n%s", msg.traceback)
                    self._reap()
                    raise EngineStartupError(msg.message)
                logger.warning("unexpected message before ready: %r", type(msg).__name__)
            elif not self.process.is_alive():
                self._reap()
                raise EngineStartupError(
                    f"engine process exited (code {self.process.exitcode}) before it was ready")
            if deadline is not None and time.monotonic() > deadline:
                self._reap(kill=True)
                raise EngineStartupError(f"engine was not ready after {timeout:.0f} s")
            if should_stop is not None and should_stop():
                self._reap(kill=True)
                raise EngineStartupError("start interrupted")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the I/O threads; deltas are delivered on ``loop``."""
        self._loop = loop
        for name, target in (("structspec-engine-tx", self._send_forever),
                             ("structspec-engine-rx", self._recv_forever)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what runs, stop the engine process and join it (terminate if it hangs)."""
        if self._closing:
            return
        self._closing = True
        if self.process.is_alive():
            self._outbox.put(AbortAll())
            self._outbox.put(Shutdown())
        self._outbox.put(None)
        if not self._threads:  # never attached: send directly
            self._flush_outbox()
        self.process.join(timeout)
        self._reap(kill=True)
        for t in self._threads:
            t.join(timeout=2.0)

    def _reap(self, kill: bool = False) -> None:
        if kill and self.process.is_alive():
            logger.warning("engine process did not exit; terminating it")
            self.process.terminate()
            self.process.join(5.0)
            if self.process.is_alive():
                self.process.kill()
        self.process.join(1.0)

    # ------------------------------------------------------------------ AsyncEngine

    @property
    def ready(self) -> bool:
        return (self.info is not None and self._dead is None and not self._closing
                and not self._draining)

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def num_inflight(self) -> int:
        """Engine requests whose final delta has not arrived yet."""
        return len(self._sinks)

    def add_listener(self, listener: StatsListener) -> None:
        self._listeners.append(listener)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, sink: DeltaSink, *, priority: int = 0) -> None:
        if not self.ready:
            raise EngineDeadError(self._dead or "the engine is not serving")
        # Pickled here, on the caller's side: a request that cannot be pickled (e.g. nested
        # past the recursion limit) then fails alone instead of killing the sender thread,
        # which would leave every later request waiting forever.
        data = bytes(ForkingPickler.dumps(AddRequest(request_id, prompt_token_ids, params,
                                                        priority)))
        self._sinks[request_id] = sink
        self._outbox.put(data)

    def abort_request(self, request_id: str) -> None:
        if request_id in self._sinks and self._dead is None:
            self._outbox.put(AbortRequest(request_id))

    def abort_all(self) -> None:
        if self._dead is None:
            self._outbox.put(AbortAll())

    def begin_shutdown(self) -> None:
        """Stop accepting requests and abort the live ones (thread- and signal-safe)."""
        self._draining = True
        self.abort_all()

    # ------------------------------------------------------------------ I/O threads

    def _send_forever(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._send(msg)
            except (OSError, ValueError):
                return  # the engine is gone; the reader reports it

    def _send(self, msg: object) -> None:
        """One outbox item to the engine: pre-pickled bytes (requests) or a control message."""
        if isinstance(msg, bytes):
            self._to_engine_w.send_bytes(msg)
        else:
            self._to_engine_w.send(msg)

    def _flush_outbox(self) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            if msg is None:
                continue
            try:
                self._send(msg)
            except (OSError, ValueError):
                return

    def _recv_forever(self) -> None:
        assert self._loop is not None
        while True:
            try:
                msg = self._from_engine_r.recv()
            except (EOFError, OSError):
                if not self._closing:  # reap it so the reason has its exit code (-9: killed)
                    self.process.join(1.0)
                reason = ("server is shutting down" if self._closing
                          else f"engine process exited (code {self.process.exitcode})")
                if not self._closing:
                    logger.error("%s", reason)
                self._call_soon(self._mark_dead, reason)
                return
            if isinstance(msg, StepOutputs):
                self._call_soon(self._on_outputs, msg)
            elif isinstance(msg, Fatal):
                logger.error("engine crashed: %s\n%s", msg.message, msg.traceback)
                self._call_soon(self._mark_dead, f"engine crashed: {msg.message}")

    def _call_soon(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    # ------------------------------------------------------------------ on the event loop

    def _on_outputs(self, msg: StepOutputs) -> None:
        self._stats = msg.stats
        for listener in self._listeners:
            listener(msg.stats)
        for delta in msg.deltas:
            sink = self._sinks.get(delta.request_id)
            if sink is None:
                continue
            if delta.finished:
                del self._sinks[delta.request_id]
            sink.put_nowait(delta)

    def _mark_dead(self, reason: str) -> None:
        self._dead = reason
        self._fail_all(reason)
        if not self._closing and self.on_dead is not None:
            self.on_dead(reason)

    def _fail_all(self, reason: str) -> None:
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            sink.put_nowait(EngineDelta(request_id=rid, finished=True, finish_reason="abort",
                                        error=reason))
