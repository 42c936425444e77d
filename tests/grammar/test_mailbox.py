"""The shared-memory mailboxes of the mask worker pool (structspec/grammar/mailbox.py): the
box protocol in one process, and a pool's workers sleeping, waking, dying and getting
messages too large for a box."""

from __future__ import annotations

import time
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import pytest

from structspec.constraints import JsonSchemaConstraint
from structspec.grammar import GrammarBackend
from structspec.grammar.mailbox import (
    ASLEEP,
    AWAKE,
    INBOX_BYTES,
    LEN_IN,
    MAILBOX_BYTES,
    ON_SOCKET,
    OUTBOX_BYTES,
    SEQ_IN,
    SEQ_OUT,
    STATE,
    Mailbox,
    supported,
)
from structspec.grammar.pool_types import MaskPoolError
from structspec.grammar.worker_pool import MAILBOX_ENV, MAX_SPIN_MS, MaskWorkerPool, PoolRequest

from .conftest import STOP_ID

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}

needs_x86 = pytest.mark.skipif(not supported(), reason="shared-memory mailboxes need x86-64")


def test_messages_round_trip_and_oversized_ones_are_refused() -> None:
    """Two views of one segment (as parent and worker have): a posted message is read back
    after its sequence moved; one larger than its box is refused with nothing written, and an
    announcement of a socket message says so; replies likewise."""
    shm = SharedMemory(create=True, size=2 * MAILBOX_BYTES)
    try:
        parent, worker = Mailbox(shm.buf, MAILBOX_BYTES), Mailbox(shm.buf, MAILBOX_BYTES)
        job = ([(0, "r1", 3, [10, 20, 30])], [], [], 8, 8, True, 0.05)
        assert worker.seq_in() == 0 and parent.post(job) and worker.seq_in() == 1
        assert worker.read_in() == (True, job)
        assert not parent.post(b"x" * (INBOX_BYTES + 1)) and worker.seq_in() == 1
        parent.post_on_socket()
        assert worker.seq_in() == 2 and worker.read_in() == (False, None)
        reply = ({1: 2}, [0], [0, 1], [], {0: 0}, 1.0, 2.0)
        assert worker.reply(reply) and parent.seq_out() == 1
        assert parent.read_out() == (True, reply)
        assert not worker.reply(b"y" * (OUTBOX_BYTES + 1)) and parent.seq_out() == 1
        worker.reply_on_socket()
        assert parent.read_out() == (False, None) and parent.seq_out() == 2
        # the first mailbox of the segment is untouched
        assert Mailbox(shm.buf, 0).seq_in() == 0
        worker.set_state(ASLEEP)
        assert parent.asleep()
        worker.set_state(AWAKE)
        assert not parent.asleep()
        del parent, worker
    finally:
        shm.close()
        shm.unlink()


@needs_x86
def test_sleeping_workers_wake_for_mailbox_jobs_and_large_ones_go_by_socket(
        backend: GrammarBackend, hf_tokenizer: Any) -> None:
    """Workers past their spin window say they sleep and are woken for the next job; a job
    too large for the inbox (a request's whole history) goes over the socket, announced in
    the mailbox, and its verdicts are right."""
    pool = MaskWorkerPool(backend.tokenizer_info, num_workers=2, vocab_size=backend.vocab_size,
                          max_rows=8, stop_token_ids=[STOP_ID], spin_ms=1.0)
    try:
        assert pool.mailboxes is not None
        compiled = backend.compile(JsonSchemaConstraint(SCHEMA))
        ids = hf_tokenizer.encode('{"name": "Ada"}', add_special_tokens=False)
        assert not pool.advance([PoolRequest("a", compiled, ids[:2])]).rejected
        deadline = time.monotonic() + 10
        while not all(mb.header[STATE] == ASLEEP for mb in pool.mailboxes):
            assert time.monotonic() < deadline, "the workers never went to sleep"
            time.sleep(0.005)
        seq = [int(mb.header[SEQ_IN]) for mb in pool.mailboxes]
        got = pool.advance([PoolRequest("a", compiled, ids)])  # the sleeper is woken
        assert not got.rejected and got.worker_busy_ms
        # 100k ids pickle to ~300 KB, more than the 256 KiB inbox: the socket carries them;
        # the grammar keeps none past the object's end
        history = ids + [ids[1]] * 100_000
        got = pool.advance([PoolRequest("b", compiled, history)])
        assert got.rejected == {0: 100_000}
        w = pool.shipping.place("b", compiled)[0]
        mb = pool.mailboxes[w]
        assert int(mb.header[LEN_IN]) == ON_SOCKET and int(mb.header[SEQ_IN]) > seq[w]
        assert int(mb.header[SEQ_OUT]) == pool._jobs_sent[w]  # every reply read
    finally:
        pool.close()


@needs_x86
def test_a_worker_dying_while_its_reply_is_awaited_fails_the_build(
        backend: GrammarBackend) -> None:
    """A worker killed before it could reply through its mailbox: the build sees it exited
    and raises MaskPoolError at once, it does not wait on the mailbox for ever."""
    pool = MaskWorkerPool(backend.tokenizer_info, num_workers=1, vocab_size=backend.vocab_size,
                          max_rows=8, stop_token_ids=[STOP_ID], spin_ms=MAX_SPIN_MS)
    try:
        assert pool.mailboxes is not None
        compiled = backend.compile(JsonSchemaConstraint(SCHEMA))
        pool.advance([PoolRequest("dies", compiled, [])])  # the grammar is on the worker
        proc = pool._procs[0]  # noqa: SLF001 - the test plays a crashed worker
        send = pool._send_job

        def die_then_send(w: int, msg: tuple) -> None:  # the job lands on a dead worker
            proc.kill()
            proc.wait()
            send(w, msg)

        pool._send_job = die_then_send  # type: ignore[method-assign]
        t0 = time.perf_counter()
        with pytest.raises(MaskPoolError, match="mask worker 0 died"):
            pool.advance([PoolRequest("dies", compiled, [1, 2])])
        assert time.perf_counter() - t0 < 0.5
    finally:
        pool.close()


def test_mailboxes_can_be_turned_off(backend: GrammarBackend,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``STRUCTSPEC_MASK_WORKER_MAILBOXES=0``: spinning workers keep their sockets."""
    monkeypatch.setenv(MAILBOX_ENV, "0")
    pool = MaskWorkerPool(backend.tokenizer_info, num_workers=1, vocab_size=backend.vocab_size,
                          max_rows=8, stop_token_ids=[STOP_ID], spin_ms=1.0)
    try:
        assert pool.mailboxes is None and pool.spin_ms == 1.0
        compiled = backend.compile(JsonSchemaConstraint(SCHEMA))
        assert pool.advance([PoolRequest("s", compiled, [])]).worker_busy_ms
    finally:
        pool.close()
