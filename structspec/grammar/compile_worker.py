"""Grammar compile processes: one zygote and the compile workers it forks.

``python -m structspec.grammar.compile_worker <fd>`` starts the **zygote** on the socket
``fd`` (see :mod:`structspec.grammar.compile_pool`, which starts it). It reads its init
message, imports xgrammar (which imports torch: seconds of CPU) and loads the tokenizer
once, reports ``"ready"``, and then only forks: each ``("fork", lane)`` message forks a
**worker** that shares those pages copy-on-write and starts in milliseconds, and the zygote
answers ``("forked", pid, lane)`` followed by the worker's end of a new socket pair (passed
as a file descriptor). A worker killed at its time limit is replaced this way without paying
the import again.

A worker serves ``(job_id, constraint)`` messages one at a time: it runs
:func:`~structspec.grammar.compile_spec.compile_checked` on a one-thread xgrammar compiler,
drops the compiled grammar and answers ``(job_id, GrammarError | None, compile_seconds)``.
The engine process rebuilds accepted grammars itself: shipping one (xgrammar's
``serialize_json``) costs as much as the compile for small grammars and up to 6 times more
for large ones (an 894 MB JSON for one MaskBench schema).

Both kinds of process die with their parent (Linux ``PR_SET_PDEATHSIG``) and exit when their
socket closes, so an engine that stops, even by a kill, leaves no compile running.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that started it exits (no-op
    elsewhere)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _serve_worker(conn: Connection, tokenizer_info: Any, init: dict[str, Any]) -> None:
    """One compile worker's loop (in a forked child); returns when its socket closes."""
    import xgrammar as xgr

    from structspec.grammar.compile_spec import compile_checked
    from structspec.grammar.errors import PARAM_BY_KIND, GrammarError

    compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
    while True:
        try:
            job_id, spec = conn.recv()
        except (EOFError, OSError):
            return
        start = time.perf_counter()
        error: GrammarError | None = None
        try:
            compile_checked(compiler, spec, any_whitespace=init["any_whitespace"],
                            vocab_size=init["vocab_size"],
                            stop_token_ids=init["stop_token_ids"])
        except GrammarError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - an unexpected compiler fault: that request's
            error = GrammarError(f"Failed to compile {spec.kind} grammar: "
                                 f"{type(e).__name__}: {e}", param=PARAM_BY_KIND.get(spec.kind))
        try:
            conn.send((job_id, error, time.perf_counter() - start))
        except OSError:
            return


def _zygote(conn: Connection) -> None:
    init: dict[str, Any] = conn.recv()  # first: the sender blocks until it is read
    import xgrammar as xgr

    import structspec.grammar.compile_spec  # noqa: F401 - imported once, shared by forks

    tokenizer_info = xgr.TokenizerInfo.deserialize_json(init.pop("tokenizer_info_json"))
    # forked workers are reaped by the kernel; the pool kills them by pid
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if not (isinstance(msg, tuple) and msg and msg[0] == "fork"):
            continue
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the worker
            try:
                conn.close()
                ours.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _die_with_parent()
                _serve_worker(Connection(theirs.detach()), tokenizer_info, init)
            finally:
                os._exit(0)
        theirs.close()
        conn.send(("forked", pid, msg[1]))
        send_handle(conn, ours.fileno(), pid)
        ours.close()


def main(argv: list[str]) -> None:
    """Entry point: ``argv[0]`` is the inherited socket's file descriptor."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine drives shutdown
    conn = Connection(int(argv[0]))
    try:
        _zygote(conn)
    finally:
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
