"""Shared-memory mailboxes between the mask worker pool (:mod:`~.worker_pool`) and its spinning
workers (:mod:`~.mask_worker`): a build's messages and replies without a system call.

Why: each build sends every busy worker one small message and reads one reply. Over a socket
that is a ``send`` and a ``recv`` system call each, 15-20 us apiece on the H200's virtualised
host (2026-12-04: 0.13-0.15 ms to send 8 messages at batch 8-64, on the step's critical path
before the workers can start). A worker that spins between steps
(``MaskWorkerPool(spin_ms > 0)``) can as well watch a sequence number in shared memory, and the
parent can watch the worker's: a message is then a memory copy and a store.

Layout: one :class:`Mailbox` per worker, :data:`MAILBOX_BYTES` each, in the pool's shared
segment: a header of int64 slots (:data:`SEQ_IN`, :data:`LEN_IN`, :data:`SEQ_OUT`,
:data:`LEN_OUT`, :data:`STATE`), the inbox (:data:`INBOX_BYTES`, parent to worker) and the
outbox (:data:`OUTBOX_BYTES`). A message is pickled into its box, its length stored, then its
sequence number incremented; the reader waits for the number to move, then reads the length
and the bytes. One message is in flight per direction at a time (the parent reads each
build's replies before it sends again), so a box is never overwritten while it is read. A
payload larger than its box goes over the socket instead, its length slot set to
:data:`ON_SOCKET`.

Ordering: the writer's payload stores precede its sequence store, and the reader loads the
sequence before the payload. x86-64 keeps stores in order and loads in order (TSO), and each
store here is a separate C call, so the compiler cannot reorder them either; other
architectures need barriers that Python cannot issue, so there the pool keeps the sockets
(:func:`supported`).

Sleeping: a worker past its spin window sets :data:`STATE` to :data:`ASLEEP`, then checks its
inbox once more, then blocks on its socket; the parent, after posting, reads :data:`STATE` and
sends a wake-up byte string (:data:`WAKE`) when the worker sleeps. Store-then-load on both
sides is the one order x86 may reorder, so each side issues a full barrier (:func:`fence`)
between its store and its load: then at least one of them sees the other's store, and a
message is never left unseen by a sleeping worker. The worker's blocking wait also rechecks
its inbox every :data:`SLEEP_RECHECK_S`, so that even a missed wake-up costs that long, not a
hang. A wake-up that arrives after the worker already read the message is ignored.
"""

from __future__ import annotations

import pickle
import platform
import threading
from typing import Any

import numpy as np
import torch

#: int64 header slots of a mailbox
SEQ_IN, LEN_IN, SEQ_OUT, LEN_OUT, STATE = range(5)
#: header size (bytes; a cache line, so that the boxes start aligned)
HEADER_BYTES = 64
#: the inbox's size (bytes): a job of 64 requests with their new ids pickles to ~2-5 KiB; a
#: request that moves to its worker after a long in-process run carries every id since
INBOX_BYTES = 256 * 1024
#: the outbox's size (bytes): a reply is a few dicts and lists over the batch rows
OUTBOX_BYTES = 64 * 1024
#: one worker's mailbox (bytes)
MAILBOX_BYTES = HEADER_BYTES + INBOX_BYTES + OUTBOX_BYTES
#: :data:`STATE` values
AWAKE, ASLEEP = 0, 1
#: a length slot's value when the payload went over the socket
ON_SOCKET = -1
#: what the parent sends a sleeping worker over the socket after posting to its inbox
WAKE = "wake"
#: how often a sleeping worker rechecks its inbox (s): a safety net, not the wake-up path
SLEEP_RECHECK_S = 0.1
#: how often a spinning worker checks its socket (s) for what comes only that way: the pool's
#: stop message, a stale :data:`WAKE`
SOCKET_CHECK_S = 1e-3

_FENCE = threading.Lock()


def supported() -> bool:
    """Whether this machine orders the mailboxes' plain stores and loads as they need
    (x86-64: module doc); elsewhere the pool uses its sockets."""
    return platform.machine().lower() in ("x86_64", "amd64")


def fence() -> None:
    """A full memory barrier: acquiring a lock is an atomic read-modify-write (a ``lock``-
    prefixed instruction on x86-64), which no load can pass. Used between a store and a load
    of the sleep handshake (module doc)."""
    with _FENCE:
        pass


class Mailbox:
    """One worker's mailbox in a shared segment (module doc). Both processes build one over
    the same bytes; each side uses its own half of the methods.

    Args:
        buf: the shared segment's buffer.
        offset: where this mailbox starts (bytes; a multiple of 8).

    The views go through torch (``torch.frombuffer(...).numpy()``): a numpy view made with
    ``np.frombuffer`` would export the segment's buffer, and the segment cannot be closed
    while an export lives.
    """

    def __init__(self, buf: memoryview, offset: int) -> None:
        self.header = torch.frombuffer(buf, dtype=torch.int64, count=HEADER_BYTES // 8,
                                       offset=offset).numpy()
        self.inbox = torch.frombuffer(buf, dtype=torch.uint8, count=INBOX_BYTES,
                                      offset=offset + HEADER_BYTES).numpy()
        self.outbox = torch.frombuffer(buf, dtype=torch.uint8, count=OUTBOX_BYTES,
                                       offset=offset + HEADER_BYTES + INBOX_BYTES).numpy()

    # ------------------------------------------------------------------ writers

    @staticmethod
    def _write(header: np.ndarray, box: np.ndarray, seq_slot: int, len_slot: int,
               obj: Any) -> bool:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(payload)
        if n > len(box):
            return False
        box[:n] = np.frombuffer(payload, dtype=np.uint8)
        header[len_slot] = n
        header[seq_slot] += 1  # last: the reader sees the sequence move after the bytes
        return True

    def post(self, obj: Any) -> bool:
        """Parent: put ``obj`` in the inbox. False when it does not fit (nothing written:
        send it over the socket, then :meth:`post_on_socket`)."""
        return self._write(self.header, self.inbox, SEQ_IN, LEN_IN, obj)

    def post_on_socket(self) -> None:
        """Parent: announce a message sent over the socket instead of the inbox."""
        self.header[LEN_IN] = ON_SOCKET
        self.header[SEQ_IN] += 1

    def reply(self, obj: Any) -> bool:
        """Worker: put ``obj`` in the outbox; False when it does not fit (send it over the
        socket, then :meth:`reply_on_socket`)."""
        return self._write(self.header, self.outbox, SEQ_OUT, LEN_OUT, obj)

    def reply_on_socket(self) -> None:
        """Worker: announce a reply sent over the socket instead of the outbox."""
        self.header[LEN_OUT] = ON_SOCKET
        self.header[SEQ_OUT] += 1

    # ------------------------------------------------------------------ readers

    def seq_in(self) -> int:
        """The inbox's sequence number (messages posted so far)."""
        return int(self.header[SEQ_IN])

    def seq_out(self) -> int:
        """The outbox's sequence number (replies posted so far)."""
        return int(self.header[SEQ_OUT])

    def read_in(self) -> tuple[bool, Any]:
        """Worker, after :meth:`seq_in` moved: ``(True, message)``, or ``(False, None)`` when
        the message is on the socket."""
        return self._read(self.header[LEN_IN], self.inbox)

    def read_out(self) -> tuple[bool, Any]:
        """Parent, after :meth:`seq_out` moved: ``(True, reply)``, or ``(False, None)`` when
        the reply is on the socket."""
        return self._read(self.header[LEN_OUT], self.outbox)

    @staticmethod
    def _read(n: np.int64, box: np.ndarray) -> tuple[bool, Any]:
        if int(n) == ON_SOCKET:
            return False, None
        return True, pickle.loads(box[: int(n)].tobytes())

    # ------------------------------------------------------------------ sleep handshake

    def asleep(self) -> bool:
        """Parent, after posting: whether the worker may be blocked on its socket (call
        :func:`fence` between the post and this)."""
        return int(self.header[STATE]) == ASLEEP

    def set_state(self, state: int) -> None:
        """Worker: :data:`AWAKE` or :data:`ASLEEP` (before sleeping: then :func:`fence`, then
        check the inbox once more)."""
        self.header[STATE] = state
