"""The engine process: owns the :class:`~structspec.engine.llm_engine.LLMEngine` and runs
its step loop, apart from the HTTP front end (its own interpreter, its own GIL).

:func:`engine_main` is the ``multiprocessing`` spawn target. It builds the engine, reports
:class:`~structspec.server.ipc.Ready` (or :class:`~structspec.server.ipc.InitFailed` with the
reason) and then runs :class:`EngineLoop`: between two steps it drains every queued
add/abort message; when nothing is left to run it blocks on the pipe instead of spinning.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from structspec.core import RequestError
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
)

if TYPE_CHECKING:
    from structspec.config import EngineConfig
    from structspec.core import RequestOutput

logger = logging.getLogger("structspec.server.engine")

IDLE_WAIT_S = 0.002
"""How long to wait for messages after a step that made no progress (e.g. every request is
still waiting for its grammar to compile), so that the loop does not spin."""


def delta_from_output(out: RequestOutput) -> EngineDelta:
    """The compact per-step record of ``out`` sent to the front end."""
    new_ids = list(out.new_token_ids)
    logprobs = None
    if out.logprobs is not None and new_ids:
        end = len(out.token_ids)
        logprobs = [
            (lp.token_id, float(lp.logprob), [(int(t), float(v)) for t, v in lp.top_logprobs])
            for lp in out.logprobs[end - len(new_ids):end]
        ]
    delta = EngineDelta(request_id=out.request_id, new_token_ids=new_ids,
                        new_logprobs=logprobs, finished=out.finished)
    if out.prompt_logprobs is not None and len(out.token_ids) == len(new_ids):
        # the request's first output (every id so far is new): its prompt logprobs, once
        delta.prompt_logprobs = [
            None if lp is None else (lp.token_id, float(lp.logprob), int(lp.rank or 0),
                                     [(int(t), float(v)) for t, v in lp.top_logprobs])
            for lp in out.prompt_logprobs]
    if out.finished:
        delta.finish_reason = out.finish_reason.value if out.finish_reason else "abort"
        delta.stop_reason = out.stop_reason
        delta.error = out.error
        delta.error_param = out.error_param
        delta.error_code = out.error_code
        delta.text = out.text
        delta.num_prompt_tokens = out.num_prompt_tokens
        delta.num_cached_tokens = out.cached_tokens
        delta.num_completion_tokens = out.num_completion_tokens
        delta.schema_valid = out.schema_valid
        delta.grammar_backend = out.grammar_backend
        delta.spec = out.spec
        delta.engine_ttft_s = out.ttft_s
        delta.engine_latency_s = out.latency_s
    return delta


def engine_info(engine: Any) -> EngineInfo:
    """Describe a loaded :class:`~structspec.engine.llm_engine.LLMEngine`."""
    cfg = engine.config
    return EngineInfo(
        model_path=str(engine.model_path),
        max_model_len=int(engine.max_model_len),
        vocab_size=int(engine.model_config.vocab_size),
        device=str(cfg.device),
        dtype=str(cfg.dtype),
        speculative_algorithm=str(cfg.spec.algorithm),
        num_draft_tokens=int(cfg.spec.tree_size),
        kv_capacity_tokens=int(cfg.cache.kv_capacity_tokens),
        max_batch_size=int(cfg.scheduler.max_batch_size),
        pid=os.getpid(),
    )


class EngineLoop:
    """Steps the engine and shuttles messages; see the module docstring.

    Args:
        engine: a loaded ``LLMEngine`` (anything with its ``add_request``/``abort_request``/
            ``step``/``has_unfinished_requests``/``stats`` methods).
        inbox: receives :data:`~structspec.server.ipc.ToEngine` messages.
        outbox: sends :data:`~structspec.server.ipc.FromEngine` messages.
    """

    def __init__(self, engine: Any, inbox: Connection, outbox: Connection) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.live: set[str] = set()
        self._pending: list[EngineDelta] = []
        self._last_stats: EngineStats | None = None
        self._stop = False
        # the grammar backend's compile seconds and time-limit stops (None: an engine
        # without one, e.g. a test fake)
        self._drain_compile_stats = getattr(getattr(engine, "grammar", None),
                                            "drain_compile_stats", None)

    def run(self) -> None:
        """Serve until :class:`~structspec.server.ipc.Shutdown` or the front end goes away."""
        self._last_stats = self._stats()
        self.outbox.send(StepOutputs([], self._last_stats))  # /health has numbers at once
        while not self._stop:
            busy = self.engine.has_unfinished_requests()
            if not busy and not self._pending:
                self._wait(None)  # idle: block until the front end says something
            self._drain()
            if self._stop:
                break
            outputs: list[RequestOutput] = []
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
            deltas = self._pending + [delta_from_output(o) for o in outputs]
            self._pending = []
            for d in deltas:
                if d.finished:
                    self.live.discard(d.request_id)
            stats = self._stats()
            if deltas or stats != self._last_stats:
                self.outbox.send(StepOutputs(deltas, stats))
                self._last_stats = stats
            if not outputs and self.engine.has_unfinished_requests():
                self._wait(IDLE_WAIT_S)
        self._abort_all("server is shutting down")
        self._flush_after_shutdown()

    # ------------------------------------------------------------------ messages

    def _wait(self, timeout: float | None) -> None:
        try:
            self.inbox.poll(timeout)
        except (EOFError, OSError):
            self._stop = True

    def _drain(self) -> None:
        try:
            while not self._stop and self.inbox.poll(0):
                self._handle(self.inbox.recv())
        except (EOFError, OSError):
            logger.warning("front end went away; engine process exiting")
            self._stop = True

    def _handle(self, msg: object) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            if msg.request_id in self.live:
                self.engine.abort_request(msg.request_id, msg.reason)
        elif isinstance(msg, AbortAll):
            self._abort_all(msg.reason)
        elif isinstance(msg, Shutdown):
            self._stop = True
        else:
            logger.error("engine process got an unknown message %r", type(msg).__name__)

    def _add(self, msg: AddRequest) -> None:
        try:
            self.engine.add_request(msg.prompt_token_ids, msg.params, request_id=msg.request_id,
                                    priority=msg.priority)
        except RequestError as e:
            self._pending.append(EngineDelta(
                request_id=msg.request_id, finished=True, finish_reason="abort", error=str(e),
                error_param=e.param, error_code=e.code, rejected=True,
                num_prompt_tokens=len(msg.prompt_token_ids)))
            return
        except Exception as e:  # an engine bug must not take the loop down
            logger.exception("add_request(%s) failed", msg.request_id)
            self._pending.append(EngineDelta(
                request_id=msg.request_id, finished=True, finish_reason="abort",
                error=f"internal error: {type(e).__name__}: {e}",
                num_prompt_tokens=len(msg.prompt_token_ids)))
            return
        self.live.add(msg.request_id)

    def _abort_all(self, reason: str) -> None:
        for rid in list(self.live):
            self.engine.abort_request(rid, reason)

    def _flush_after_shutdown(self) -> None:
        """Report the final (aborted) outputs so waiting handlers can finish."""
        try:
            outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            deltas = self._pending + [delta_from_output(o) for o in outputs]
            if deltas:
                self.outbox.send(StepOutputs(deltas, self._stats()))
        except Exception:  # best effort on the way out
            logger.debug("final flush failed", exc_info=True)

    def _stats(self) -> EngineStats:
        s = self.engine.stats()
        compile_s, timeouts = ([], 0) if self._drain_compile_stats is None \
            else self._drain_compile_stats()
        return EngineStats(
            num_running=int(s.get("num_running", 0)),
            num_waiting=int(s.get("num_waiting", 0)),
            num_waiting_grammar=int(s.get("num_waiting_grammar", 0)),
            num_prefilling=int(s.get("num_prefilling", 0)),
            kv_free_pages=int(s.get("kv_free_pages", 0)),
            kv_total_pages=int(s.get("kv_total_pages", 0)),
            prefix_cache_queried_tokens=int(s.get("prefix_cache_queried_tokens", 0)),
            prefix_cache_hit_tokens=int(s.get("prefix_cache_hit_tokens", 0)),
            num_preemptions=int(s.get("num_preemptions", 0)),
            grammar_compile_s=tuple(compile_s),
            grammar_compile_timeouts=int(timeouts),
            steps=tuple(self.engine.scheduler.timer.drain()),
        )


def engine_main(config: EngineConfig, inbox: Connection, outbox: Connection,
                log_level: int = logging.INFO,
                engine_factory: Callable[[Any], Any] | None = None) -> None:
    """Entry point of the engine process (a ``multiprocessing`` spawn target).

    ``engine_factory(config)`` builds the engine (None: :class:`LLMEngine`); anything with
    the methods :class:`EngineLoop` calls will do.

    Ctrl-C reaches the whole process group; the engine ignores SIGINT and lets the front end
    drive shutdown (it sends :class:`~structspec.server.ipc.Shutdown` or closes the pipe).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s [engine] %(levelname)s %(message)s")
    try:
        if engine_factory is None:
            from structspec.engine.llm_engine import LLMEngine

            engine_factory = LLMEngine
        engine = engine_factory(config)
        info = engine_info(engine)
    except BaseException as e:  # report every failure, then exit non-zero
        outbox.send(InitFailed(f"{type(e).__name__}: {e}", traceback.format_exc()))
        outbox.close()
        raise SystemExit(1) from None
    outbox.send(Ready(info))
    logger.info("engine ready: %s (max_model_len=%d, spec=%s) pid=%d", info.model_path,
                info.max_model_len, info.speculative_algorithm, info.pid)
    loop = EngineLoop(engine, inbox, outbox)
    try:
        loop.run()
    except BaseException as e:
        logger.exception("engine loop crashed")
        try:
            outbox.send(Fatal(f"{type(e).__name__}: {e}", traceback.format_exc()))
        except (OSError, ValueError):
            pass
        raise SystemExit(1) from None
    finally:  # grammar mask workers and their shared memory go with the engine
        engine.close()
