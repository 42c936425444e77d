"""The periodic engine-stats log line, vLLM's "Avg prompt throughput ..." line.

Every ``stats_interval_s`` seconds :class:`StatsLogger` writes one line on the
``structspec.server`` logger (INFO)::

    stats interval_s=10.00 prompt_tokens_per_s=152.3 generation_tokens_per_s=48.1
        finished=3 running=2 waiting=0 waiting_grammar=1 kv_cache_usage=12.5%
        prefix_cache_hit_rate=87.5% preemptions=0

(one line): prompt and generated tokens per second over the interval, engine requests
finished in it and running requests preempted in it, read as differences of the Prometheus
counters (``structspec_prompt_tokens_total``, ``structspec_generation_tokens_total``,
``structspec_requests_total``, ``structspec_preemptions_total``: no second count is kept),
and the queue state of the engine's
last stats (what ``/health`` and the gauges show): requests running, waiting for a batch
slot / KV pages, waiting for their grammar to compile, the KV pages in use (``-``
before the engine reported its pool) and the prefix cache's hit rate in prompt tokens since
the engine started (``-`` before its first request). An idle interval (no token, no finished request,
nothing queued) is not logged, as vLLM skips idle repeats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import Counter

from structspec.server.ipc import EngineStats
from structspec.server.metrics import ServerMetrics

logger = logging.getLogger("structspec.server")


def _total(counter: Counter) -> float:
    """A Prometheus counter's total over all its label values (its public ``collect()``)."""
    return sum(s.value for metric in counter.collect() for s in metric.samples
               if s.name.endswith("_total"))


class StatsLogger:
    """Writes the stats line (module docstring) from ``metrics`` and the engine's stats.

    Args:
        metrics: the server's metrics (their token and request counters are read).
        engine_stats: returns the engine's latest :class:`EngineStats`.
        interval_s: seconds between lines (:meth:`run`).
    """

    def __init__(self, metrics: ServerMetrics, engine_stats: Callable[[], EngineStats],
                 interval_s: float) -> None:
        self.metrics = metrics
        self.engine_stats = engine_stats
        self.interval_s = interval_s
        self._last_s = time.monotonic()
        self._last = self._totals()

    def _totals(self) -> tuple[float, float, float, float]:
        """The counters' totals: prompt tokens, generated tokens, finished requests,
        preemptions."""
        m = self.metrics
        return (_total(m.prompt_tokens), _total(m.generation_tokens), _total(m.requests),
                _total(m.preemptions))

    def tick(self, now_s: float | None = None) -> str | None:
        """Close the interval that ends now: the line to log, or None when it was idle.

        Args:
            now_s: ``time.monotonic()`` (default: now).
        """
        now_s = time.monotonic() if now_s is None else now_s
        totals = self._totals()
        elapsed_s = max(now_s - self._last_s, 1e-9)
        prompt, generated, finished, preempted = (a - b for a, b in zip(totals, self._last, strict=True))
        self._last_s, self._last = now_s, totals
        stats = self.engine_stats()
        queued = stats.num_running + stats.num_waiting + stats.num_waiting_grammar
        if not (prompt or generated or finished or queued):
            return None
        usage = stats.kv_usage
        queried = stats.prefix_cache_queried_tokens
        return (f"stats interval_s={elapsed_s:.2f} "
                f"prompt_tokens_per_s={prompt / elapsed_s:.1f} "
                f"generation_tokens_per_s={generated / elapsed_s:.1f} "
                f"finished={finished:.0f} running={stats.num_running} "
                f"waiting={stats.num_waiting} waiting_grammar={stats.num_waiting_grammar} "
                f"kv_cache_usage={'-' if usage is None else f'{usage * 100:.1f}%'} "
                f"prefix_cache_hit_rate={_percent(stats.prefix_cache_hit_tokens, queried)} "
                f"preemptions={preempted:.0f}")

    async def run(self) -> None:
        """Log a line every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                line = self.tick()
            except Exception:  # the stats line must never take the server down
                logger.exception("could not write the stats line")
                continue
            if line is not None:
                logger.info("%s", line)


def _percent(part: int, whole: int) -> str:
    """``part / whole`` as ``"12.5%"``; ``"-"`` when ``whole`` is 0."""
    return f"{100 * part / whole:.1f}%" if whole else "-"
