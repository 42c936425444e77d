"""The mask worker process (see :mod:`structspec.grammar.worker_pool`, which starts it as
``python -m structspec.grammar.mask_worker FD SHIP_FD``): it keeps mirror matchers, walks the
trees of its requests into the shared slab and replies on the socket ``FD``.

Compiled grammars arrive on the second socket, ``SHIP_FD``, and are loaded by a thread of their
own (:func:`_load_grammars`): deserializing one takes ~3-30 ms (MaskBench schemas), which in the
main loop would hold up a build reply, and so the whole verify step. xgrammar grammars arrive
serialized; llguidance grammars as their grammar text, compiled here (milliseconds) for the
llguidance tokenizer the loader builds from the pool's
:class:`~structspec.grammar.llg_tokenizer.LlgTokenizerSource` (llguidance's objects cannot be
pickled). A mirror of either backend walks its tree with the same ``walk_tree``. The loader acknowledges
each grammar once it is usable; the parent sends jobs for a grammar only after that.

Between messages a worker polls for its next one without sleeping for the pool's spin window
(``MaskWorkerPool``'s ``spin_ms``), then blocks. A worker asleep in ``recv`` is woken by the
kernel when its message lands; on a slow virtualised host the last of 8 workers started its
walk ~0.7 ms after the message was sent (2026-12-04, H200 host, ``grammar_overlap.py
--algorithms eagle`` at batch 8: its walks took 0.23 ms), and the verify step waited for it. A
spinning worker reads its message at once. Where the pool gave it a shared-memory mailbox
(:mod:`~structspec.grammar.mailbox`: spinning workers on x86-64), jobs and replies go through
it, without a system call; the socket then carries only the stop message, wake-ups and
payloads too large for a box (:class:`_JobChannel`).

The process ends with ``os._exit`` (:func:`main`), never through the interpreter's shutdown:
grammars may still be arriving when the parent says stop, and a daemon thread still inside
xgrammar's C++ (``deserialize_json`` releases the GIL) when the interpreter finalizes is ended
by ``pthread_exit`` as it takes the GIL back, and that forced unwind of its C++ frames ends in
``std::terminate`` ("terminate called without an active exception", SIGABRT). The
interpreter's shutdown (module teardown with torch imported) also took a loaded host seconds,
which the parent spent waiting.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import llguidance
import torch
import xgrammar as xgr

from structspec.grammar.compile_spec import compile_only
from structspec.grammar.grammar_shipping import WireForm
from structspec.grammar.grammar_source import XgrSource
from structspec.grammar.llg_matcher import LlgCompiled, LlgMatcher
from structspec.grammar.llg_tokenizer import LlgTokenizerSource
from structspec.grammar.mailbox import (
    ASLEEP,
    AWAKE,
    SLEEP_RECHECK_S,
    SOCKET_CHECK_S,
    WAKE,
    Mailbox,
    fence,
)
from structspec.grammar.matcher import Matcher
from structspec.grammar.pool_types import LINK_PLANES, links_offset
from structspec.grammar.tree_mask import settle_request_rows, walk_tree


def _load_grammars(ship: Connection, tokenizer_info: xgr.TokenizerInfo | None,
                   llg_source: LlgTokenizerSource | None,
                   grammars: dict[int, xgr.CompiledGrammar | LlgCompiled]) -> None:
    """Loader thread: load each shipped grammar ``(wire id, payload)`` into ``grammars``
    (shared with the main loop; a dict store is atomic under the GIL), then acknowledge it as
    ``(wire id, None)``, or ``(wire id, error text)`` when it cannot be loaded. The payload
    (:func:`~structspec.grammar.grammar_shipping.wire_form`) is ``("xgrammar", source)``
    (compiled here, on this thread's own one-thread compiler), ``("llguidance", kind,
    grammar text)`` (compiled here for llguidance's tokenizer, which this thread builds
    first: ~1 s) or xgrammar's JSON serialization (deserialized).
    Ends when the parent closes the socket or sends None."""
    llg_tokenizer = None if llg_source is None else llg_source.build()
    compiler = (None if tokenizer_info is None
                else xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False))
    while True:
        try:
            msg = ship.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        wire_id, payload = msg
        try:
            grammars[wire_id] = _load(payload, compiler, tokenizer_info, llg_source,
                                      llg_tokenizer)
            error = None
        except Exception as e:  # noqa: BLE001 - the parent keeps that grammar's masks local
            error = repr(e)
        del payload, msg  # a large string: free it before the next one arrives
        try:
            ship.send((wire_id, error))
        except OSError:
            return


def _load(payload: WireForm, compiler: xgr.GrammarCompiler | None,
          tokenizer_info: xgr.TokenizerInfo | None, llg_source: LlgTokenizerSource | None,
          llg_tokenizer: llguidance.LLTokenizer | None) -> xgr.CompiledGrammar | LlgCompiled:
    """One shipped grammar, usable by this process's mirrors.

    Raises:
        ValueError: a payload for a backend this worker was not started with, or an
            llguidance grammar that does not compile here.
        GrammarError: an xgrammar source that does not compile here (it did in the engine).
    """
    if isinstance(payload, str) or payload[0] == "xgrammar":
        if tokenizer_info is None or compiler is None:
            raise ValueError("an xgrammar grammar, but this worker has no xgrammar tokenizer")
        if isinstance(payload, str):
            return xgr.CompiledGrammar.deserialize_json(payload, tokenizer_info)
        source = payload[1]
        assert isinstance(source, XgrSource)
        return compile_only(compiler, source.spec, any_whitespace=source.any_whitespace)
    _, kind, grammar = payload
    if llg_tokenizer is None or llg_source is None:
        raise ValueError("an llguidance grammar, but this worker has no llguidance tokenizer")
    template = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
    if template.is_error():
        raise ValueError(f"llguidance grammar does not compile: {template.get_error()}")
    return LlgCompiled(template=template, vocab_size=llg_source.vocab_size, kind=kind,
                       grammar=grammar)


def _spin_for_message(conn: Connection, spin_s: float) -> None:
    """Poll ``conn`` without sleeping until a message (or EOF) is there or ``spin_s`` seconds
    have passed (then the caller's ``recv`` blocks as usual). Each turn calls ``sched_yield``:
    another runnable thread of this core's queue (the grammar loader thread among them: the
    call drops the GIL) runs first; with none the spin keeps the core busy."""
    deadline = time.perf_counter() + spin_s
    while not conn.poll():
        if time.perf_counter() > deadline:
            return
        os.sched_yield()


class _JobChannel:
    """The worker's end of its job channel: the socket alone, or the shared-memory mailbox
    with the socket beside it (:mod:`~structspec.grammar.mailbox`, whose module doc gives the
    protocol).

    Args:
        conn: the job socket.
        mailbox: this worker's mailbox, or None (socket only).
        spin_s: how long :meth:`next_message` polls before it blocks (s).
    """

    def __init__(self, conn: Connection, mailbox: Mailbox | None, spin_s: float) -> None:
        self.conn = conn
        self.mailbox = mailbox
        self.spin_s = spin_s
        self._seen = 0 if mailbox is None else mailbox.seq_in()  # inbox messages taken

    def next_message(self) -> Any:
        """The parent's next message (a job, or None to stop). Raises EOFError when the
        socket closed."""
        mb = self.mailbox
        if mb is None:
            if self.spin_s > 0:
                _spin_for_message(self.conn, self.spin_s)
            return self.conn.recv()
        now = time.perf_counter()
        deadline, next_check = now + self.spin_s, now + SOCKET_CHECK_S
        while True:
            if mb.seq_in() != self._seen:
                return self._take()
            now = time.perf_counter()
            if now >= next_check:  # the stop message (or a stale wake-up) comes this way
                if self.conn.poll():
                    # a job too large for the inbox comes this way too, announced in the
                    # inbox first: take it through the inbox (counted), as the sleep loop does
                    if mb.seq_in() != self._seen:
                        return self._take()
                    msg = self.conn.recv()
                    if msg != WAKE:
                        return msg
                next_check = now + SOCKET_CHECK_S
            if now > deadline:
                break
            os.sched_yield()
        # Asleep: say so, then look once more (the parent posts, then reads the state; the
        # fences make at least one of us see the other's store), then block on the socket.
        mb.set_state(ASLEEP)
        fence()
        try:
            while True:
                if mb.seq_in() != self._seen:
                    return self._take()  # a wake-up sent meanwhile stays queued: skipped later
                if self.conn.poll(SLEEP_RECHECK_S):
                    if mb.seq_in() != self._seen:
                        return self._take()
                    msg = self.conn.recv()
                    if msg != WAKE:
                        return msg
        finally:
            mb.set_state(AWAKE)

    def _take(self) -> Any:
        """The inbox's next message (or, announced there, the socket's)."""
        assert self.mailbox is not None
        self._seen += 1
        in_box, msg = self.mailbox.read_in()
        if in_box:
            return msg
        while (msg := self.conn.recv()) == WAKE:  # wake-ups queued before it
            pass
        return msg

    def reply(self, obj: Any) -> None:
        """Send the parent a reply (the outbox, else the socket, announced first)."""
        mb = self.mailbox
        if mb is None:
            self.conn.send(obj)
        elif not mb.reply(obj):
            mb.reply_on_socket()
            self.conn.send(obj)


def _worker_main(conn: Connection, ship: Connection) -> None:
    """Worker loop: keep mirror matchers, walk trees into the shared slab, reply."""
    torch.set_num_threads(1)
    try:
        init = conn.recv()
    except (EOFError, OSError):
        return  # the parent closed the pool while this worker was starting: nothing to do
    try:
        (tok_json, llg_source, shm_name, max_rows, width, stop_token_ids, max_rollback,
         spin_s, mailbox_at, (caps_at, flag_at)) = init
        tokenizer_info = (None if tok_json is None
                          else xgr.TokenizerInfo.deserialize_json(tok_json))
        shm = SharedMemory(name=shm_name)
        # The parent owns the segment: keep this process's resource tracker from unlinking
        # it at exit (Python < 3.13 registers every attach).
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        slab = torch.frombuffer(shm.buf, dtype=torch.int32,
                                count=max_rows * width).view(max_rows, width)
        slab_np = slab.numpy()
        links_all = torch.frombuffer(shm.buf, dtype=torch.int64,
                                     count=LINK_PLANES * max_rows,
                                     offset=links_offset(max_rows, width))
        links_np = links_all.numpy()
        # a deferred build's caps (int64 per batch row) and this worker's flag
        # (:mod:`~structspec.grammar.deferred_build`)
        caps_np = torch.frombuffer(shm.buf, dtype=torch.int64, count=max_rows,
                                   offset=caps_at).numpy()
        flag_np = torch.frombuffer(shm.buf, dtype=torch.int32, count=1,
                                   offset=flag_at).numpy()
        stops = frozenset(int(t) for t in stop_token_ids)
        channel = _JobChannel(conn, None if mailbox_at is None else Mailbox(shm.buf, mailbox_at),
                              spin_s)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        with contextlib.suppress(OSError):  # unless the parent is gone already
            conn.send(repr(e))
        return
    grammars: dict[int, xgr.CompiledGrammar | LlgCompiled] = {}
    threading.Thread(target=_load_grammars, args=(ship, tokenizer_info, llg_source, grammars),
                     name="grammar-loader", daemon=True).start()
    try:
        conn.send("ready")
    except OSError:
        return  # the parent closed the pool during this worker's start
    mirrors: dict[str, Matcher | LlgMatcher] = {}
    # (bs, N) -> per batch row: its next_token / next_sibling / draft_tokens views of the
    # shared links and its [N, W] slab rows. Built once per shape: torch slicing costs a few
    # us per view, paid per request and step otherwise.
    row_views: dict[tuple[int, int], list[tuple[torch.Tensor, ...]]] = {}
    while True:
        try:
            msg = channel.next_message()
        except EOFError:
            break
        if msg is None:
            break
        t0 = time.perf_counter()
        jobs, released, dropped, bs, n, has_tree, time_limit_s, gate_seq = msg
        try:
            for key in released:
                mirrors.pop(key, None)
            for gid in dropped:
                grammars.pop(gid, None)
            # Pass 1: advance every mirror (the host has already applied the verdicts it
            # predicted; these check them).
            terminated: list[int] = []
            rejected: dict[int, int] = {}
            live: list[tuple[int, Matcher | LlgMatcher]] = []
            for b, key, gid, new_ids in jobs:
                m = mirrors.get(key)
                if m is None:  # the host's matcher classes: the same accept and stop rules
                    compiled = grammars[gid]
                    m = mirrors[key] = (
                        LlgMatcher(compiled, stop_token_ids=stop_token_ids,
                                   max_rollback_tokens=max_rollback)
                        if isinstance(compiled, LlgCompiled)
                        else Matcher(compiled, stop_token_ids=stop_token_ids))
                kept = m.accept_run(new_ids)
                if kept < len(new_ids):
                    rejected[b] = len(new_ids) - kept
                if m.is_terminated():
                    terminated.append(b)
                if has_tree and b < bs:  # rows >= bs (or no tree): advance only
                    live.append((b, m))
            # Pass 2: walk the trees into the slab, and settle each walked request's rows
            # (the parent would otherwise settle the whole batch's after the replies: 0.1-0.14
            # ms of its time at batch 32-64 on a 2-core VM, 4-9 us a request here;
            # benchmarks/settle_cost.py)
            walked, timed_out = [], []
            settled: dict[int, int] = {}
            views = row_views.get((bs, n)) if live else None
            if live and views is None:
                nt_all, ns_all, dt_all, _ = links_all[: LINK_PLANES * bs * n].view(
                    LINK_PLANES, bs, n).unbind(0)
                views = row_views[(bs, n)] = [
                    (nt_all[b], ns_all[b], dt_all[b], slab[b * n : (b + 1) * n])
                    for b in range(bs)]
            planes = links_np[: LINK_PLANES * bs * n].reshape(LINK_PLANES, bs, n) if live \
                else None
            for b, m in live:
                rows_np = slab_np[b * n : (b + 1) * n]
                rows_np[:] = -1  # numpy: half a torch fill_'s overhead
                if m.is_terminated():
                    continue
                walked.append(b)
                nt, ns, dt, rows = views[b]  # type: ignore[index]
                if not walk_tree(m, nt, ns, dt, rows, time_limit_s):
                    timed_out.append(b)  # rows reset, row 0 exact: nothing to settle
                    continue
                settled[b] = settle_request_rows(rows_np, planes[2, b].tolist(),  # type: ignore[index]
                                                 planes[3, b].tolist(), stops)  # type: ignore[index]
            if gate_seq:
                # A deferred build: the device waits on this flag before it uploads the slab,
                # so the rows and the caps go first (the parent wrote N - 1 for every row);
                # the fence also orders string and streaming stores before the flag's.
                for b in timed_out:
                    caps_np[b] = 0
                fence()
                flag_np[0] = gate_seq
            # absolute times (CLOCK_MONOTONIC, one clock for every process of the host): the
            # parent splits its round trip into wake-up, work and reading from them
            reply: Any = (rejected, terminated, walked, timed_out, settled, t0,
                          time.perf_counter())
        except Exception as e:  # noqa: BLE001 - the parent raises it
            reply = e
        try:
            channel.reply(reply)
        except OSError:
            # the parent closed the pool mid-build (it dropped the pool after another worker
            # died, or is shutting down): no one to reply to, so end quietly, not with a
            # BrokenPipeError traceback in the server's log
            break
    del slab, slab_np, links_all, links_np, row_views, channel, caps_np, flag_np
    shm.close()


def main(argv: list[str]) -> None:
    """Entry point: ``argv`` holds the job socket's and the grammar socket's file descriptors.
    Never returns: the process ends with ``os._exit`` (module docstring), status 0 after the
    loop ended normally (the parent's None, or its socket closed) and 1 after an error, whose
    traceback is printed first."""
    code = 1
    try:
        _worker_main(Connection(int(argv[0])), Connection(int(argv[1])))
        code = 0
    except BaseException:  # noqa: BLE001 - printed, then the process ends all the same
        traceback.print_exc()
    finally:
        # os._exit skips the buffered streams' flush: flush them here. The grammar loader
        # thread may be inside xgrammar: it ends with the process, no interpreter shutdown.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
