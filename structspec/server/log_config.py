"""What the server logs: one line per generation request and a periodic engine-stats line.

:class:`ServerLogConfig` holds the switches (``structspec serve`` flags,
:func:`add_log_args`, read back with :func:`log_config_from_args`). The lines themselves are
written by :mod:`structspec.server.request_log` and :mod:`structspec.server.stats_log`, on
the ``structspec.server`` logger at INFO. Nothing here imports fastapi or torch (the CLI
parser loads it).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

DEFAULT_STATS_INTERVAL_S = 10.0  # vLLM's default for its periodic throughput line


@dataclass(frozen=True)
class ServerLogConfig:
    """The server's own log lines (the defaults are the ``structspec serve`` defaults).

    Attributes:
        log_requests: one line per finished ``/v1/chat/completions`` or ``/v1/completions``
            request, refused ones included (``--disable-log-requests`` turns it off).
        log_stats: one engine-stats line every ``stats_interval_s`` seconds while there is
            something to report (``--disable-log-stats`` turns it off).
        stats_interval_s: seconds between stats lines; a finite number > 0.

    Raises:
        ValueError: ``stats_interval_s`` not a finite number > 0 (the message names the field).
    """

    log_requests: bool = True
    log_stats: bool = True
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S

    def __post_init__(self) -> None:
        value = self.stats_interval_s
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                not math.isfinite(value) or value <= 0:
            raise ValueError(f"stats_interval_s={value!r}: expected a finite number of "
                             "seconds > 0")


def add_log_args(p: argparse.ArgumentParser) -> None:
    """Add the "logging" flags of ``structspec serve`` (vLLM's names; read back with
    :func:`log_config_from_args`)."""
    d = ServerLogConfig()
    g = p.add_argument_group("logging")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no per-request log line (id, status, tokens, latency, grammar kind, "
                        "accept length)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic line with throughput, queue depths and KV cache usage")
    g.add_argument("--log-stats-interval", type=float, default=d.stats_interval_s,
                   metavar="SECONDS",
                   help="seconds between two stats lines (idle intervals are not logged)")


def log_config_from_args(args: argparse.Namespace) -> ServerLogConfig:
    """The :class:`ServerLogConfig` of the flags added by :func:`add_log_args`.

    Raises:
        ValueError: ``--log-stats-interval`` not a finite number > 0; the message starts
            with the flag.
    """
    try:
        return ServerLogConfig(log_requests=not args.disable_log_requests,
                               log_stats=not args.disable_log_stats,
                               stats_interval_s=args.log_stats_interval)
    except ValueError as e:
        raise ValueError(f"--log-stats-interval: {e}") from None
