"""Engine supervision: restart the engine process when it dies, within bounds.

:class:`EngineSupervisor` is the :class:`~structspec.server.engine_client.AsyncEngine` the
HTTP layer talks to; it forwards to the current
:class:`~structspec.server.engine_client.EngineClient`. When that engine process dies (killed,
or its loop crashed), the client fails every in-flight request (HTTP 503 / an SSE error
event) and the supervisor:

1. marks itself not ready: ``/health`` answers 503 and new requests get a 503 with
   ``Retry-After``;
2. waits ``backoff_s * 2**(k-1)`` seconds before the k-th restart in a row (capped at
   :attr:`RestartPolicy.max_backoff_s`), then spawns a new engine process and waits for it to
   load (a start that fails or times out counts as one more restart in a row);
3. serves again once it is ready (``/health`` 200).

An engine that served for :attr:`RestartPolicy.reset_after_s` seconds resets the count, so
a crash every few hours is always restarted, while a crash loop stops. When the count reaches
``max_restarts`` (0: no restarts), the supervisor calls ``on_exhausted`` and the server exits
with status 1, for an outer supervisor (systemd, Kubernetes) to act.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from structspec.server.engine_client import (
    DeltaSink,
    EngineClient,
    EngineDeadError,
    EngineStartupError,
    StatsListener,
)
from structspec.server.ipc import EngineInfo, EngineStats

if TYPE_CHECKING:
    from structspec.core import SamplingParams

logger = logging.getLogger("structspec.server")


@dataclass(frozen=True)
class RestartPolicy:
    """How the engine process is restarted (see the module docstring).

    Attributes:
        max_restarts: restarts in a row before the server gives up (0: exit on the first
            engine death).
        backoff_s: wait before the first restart in a row; doubled for each next one.
        max_backoff_s: cap on that wait.
        reset_after_s: an engine that served this long resets the count of restarts in a row.
        start_timeout_s: how long one restart may take to load before it counts as failed.
    """

    max_restarts: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    reset_after_s: float = 60.0
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or \
                self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts!r}: expected an integer >= 0")
        for name in ("backoff_s", "max_backoff_s", "reset_after_s", "start_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not 0 <= value < float("inf"):
                raise ValueError(f"{name}={value!r}: expected a finite number of seconds >= 0")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before restart number ``attempt`` (1-based) in a row."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))


def add_supervision_args(p: argparse.ArgumentParser) -> None:
    """Add the "engine supervision" flags of ``structspec serve`` (read back with
    :func:`policy_from_args`)."""
    d = RestartPolicy()
    g = p.add_argument_group("engine supervision")
    g.add_argument("--engine-restarts", type=int, default=d.max_restarts,
                   help="restarts of a dead engine process in a row before the server exits "
                        f"with status 1 (0: exit on the first death; an engine that served "
                        f"{d.reset_after_s:.0f} s resets the count)")
    g.add_argument("--engine-restart-backoff", type=float, default=d.backoff_s,
                   help="seconds before the first restart in a row, doubled for each next "
                        f"one (at most {d.max_backoff_s:.0f} s)")


def policy_from_args(args: argparse.Namespace) -> RestartPolicy:
    """The :class:`RestartPolicy` of the flags added by :func:`add_supervision_args`.

    Raises:
        ValueError: a negative count or wait, naming the flag.
    """
    if args.engine_restarts < 0:
        raise ValueError(f"--engine-restarts: expected an integer >= 0, got "
                         f"{args.engine_restarts}")
    try:
        return RestartPolicy(max_restarts=args.engine_restarts,
                             backoff_s=args.engine_restart_backoff)
    except ValueError as e:
        raise ValueError(f"--engine-restart-backoff: {e}") from None


class EngineSupervisor:
    """An :class:`~structspec.server.engine_client.AsyncEngine` that restarts its engine
    process (see the module docstring).

    Args:
        client: the running, ready engine client.
        make_client: builds a new (not yet spawned) client for a restart.
        policy: restart bounds.
        on_exhausted: called on the event loop with the last reason when no restart is left
            (the server then exits with status 1).
    """

    def __init__(self, client: EngineClient, make_client: Callable[[], EngineClient],
                 policy: RestartPolicy,
                 on_exhausted: Callable[[str], None] | None = None) -> None:
        if client.info is None:
            raise ValueError("client: the engine client must be ready (wait_ready() first)")
        self._client = client
        self._make_client = make_client
        self.policy = policy
        self.on_exhausted = on_exhausted
        self.info: EngineInfo = client.info
        self.restarts = 0  # successful restarts since the server started
        self._in_a_row = 0  # restarts since the last engine that served reset_after_s
        self._up_since = time.monotonic()
        self._restarting = False
        self._closing = False
        self._listeners: list[StatsListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ AsyncEngine

    @property
    def client(self) -> EngineClient:
        """The engine client now in use."""
        return self._client

    @property
    def ready(self) -> bool:
        return self._client.ready and not self._restarting and not self._closing

    @property
    def restarting(self) -> bool:
        """True from an engine death until its replacement is ready (or restarts run out)."""
        return self._restarting

    @property
    def stats(self) -> EngineStats:
        return self._client.stats

    @property
    def num_inflight(self) -> int:
        """Engine requests whose final delta has not arrived yet."""
        return self._client.num_inflight

    def add_listener(self, listener: StatsListener) -> None:
        self._listeners.append(listener)
        self._client.add_listener(listener)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, sink: DeltaSink, *, priority: int = 0) -> None:
        if not self.ready:
            raise EngineDeadError("the engine process is restarting" if self._restarting
                                  else "the engine is not serving")
        self._client.add_request(request_id, prompt_token_ids, params, sink, priority=priority)

    def abort_request(self, request_id: str) -> None:
        self._client.abort_request(request_id)

    def abort_all(self) -> None:
        self._client.abort_all()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._watch(self._client)
        self._client.attach(loop)

    # ------------------------------------------------------------------ shutdown

    def begin_shutdown(self) -> None:
        """Stop accepting requests, abort the live ones and stop restarting (thread- and
        signal-safe: it only sets flags and queues messages)."""
        self._closing = True
        self._client.begin_shutdown()

    async def aclose(self, timeout: float = 10.0) -> None:
        """Cancel a restart in progress, then stop and join the engine process (on the
        event loop, at server shutdown)."""
        self._closing = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await asyncio.to_thread(self._client.shutdown, timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop and join the current engine process (blocking; outside the event loop)."""
        self._closing = True
        self._client.shutdown(timeout)

    # ------------------------------------------------------------------ restarts

    def _watch(self, client: EngineClient) -> None:
        client.on_dead = lambda reason: self._on_dead(client, reason)

    def _on_dead(self, client: EngineClient, reason: str) -> None:
        """``client``'s engine died (on the event loop, after its requests were failed).
        A late report from a replaced client (a crash message, then the pipe's EOF) is
        ignored."""
        if client is not self._client or self._closing or self._restarting:
            return
        if time.monotonic() - self._up_since >= self.policy.reset_after_s:
            self._in_a_row = 0
        self._restarting = True
        assert self._loop is not None
        self._task = self._loop.create_task(self._restart(reason))

    async def _restart(self, reason: str) -> None:
        dead = self._client
        await asyncio.to_thread(dead.shutdown, 5.0)  # reap the process, stop its I/O threads
        while not self._closing:
            if self._in_a_row >= self.policy.max_restarts:
                self._give_up(reason)
                return
            self._in_a_row += 1
            delay = self.policy.backoff(self._in_a_row)
            logger.warning("engine process gone (%s); restart %d of %d in %.1f s", reason,
                           self._in_a_row, self.policy.max_restarts, delay)
            await asyncio.sleep(delay)
            if self._closing:
                return
            client = self._make_client()
            try:
                info = await asyncio.to_thread(client.start, self.policy.start_timeout_s,
                                               lambda: self._closing)
            except EngineStartupError as e:
                reason = f"restart failed: {e}"
                logger.error("engine %s", reason)
                continue
            if self._closing:
                await asyncio.to_thread(client.shutdown, 5.0)
                return
            self._install(client, info)
            return

    def _install(self, client: EngineClient, info: EngineInfo) -> None:
        assert self._loop is not None
        self._watch(client)
        for listener in self._listeners:
            client.add_listener(listener)
        client.attach(self._loop)
        self._client = client
        self.info = info
        self.restarts += 1
        self._up_since = time.monotonic()
        self._restarting = False
        logger.info("engine process restarted (pid %d); serving again", info.pid)

    def _give_up(self, reason: str) -> None:
        logger.error("engine process gone (%s) and no restart left (--engine-restarts %d); "
                     "exiting", reason, self.policy.max_restarts)
        self._restarting = False
        self._closing = True
        if self.on_exhausted is not None:
            self.on_exhausted(reason)
