"""What the mask worker pool's parent side (:mod:`structspec.grammar.worker_pool`), the
worker processes (:mod:`structspec.grammar.mask_worker`) and the in-process mask build
(:mod:`structspec.grammar.tree_mask`) share: the request and result types, the pool's error,
and the layout of the shared-memory segment."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import xgrammar as xgr

from structspec.grammar.llg_matcher import LlgCompiled


class MaskPoolError(RuntimeError):
    """The worker pool cannot serve a build: a worker died, failed, or the pool is closed.
    The scheduler then drops the pool and builds in its own process."""


@dataclass
class PoolRequest:
    """What the pool needs of one constrained request of a batch.

    Attributes:
        key: the request's id (stable while it runs).
        compiled: its compiled grammar (shipped to a worker on first use).
        output_ids: every output id committed so far (the pool sends the new tail).
    """

    key: str
    compiled: xgr.CompiledGrammar | LlgCompiled
    output_ids: Sequence[int]


@dataclass
class PoolBuildResult:
    """Outcome of :meth:`MaskWorkerPool.build` / :meth:`MaskWorkerPool.advance` (batch indices).

    Attributes:
        walked: rows whose tree was walked (mirror not terminated; empty for ``advance``).
        timed_out: rows whose walk hit the time limit.
        rejected: row -> how many of the ids sent this time the mirror did not keep (past the
            grammar's end, or from the first rejected id on); rows that kept all are absent.
        terminated: rows whose mirror has reached the grammar's end.
        worker_busy_ms: per worker that had work, its time from receiving the request to
            sending the reply (the rest of a build's wall time is messaging and wake-ups).
        send_ms: host time spent pickling and writing the messages (ms).
        first_start_ms, last_reply_ms: from the first message sent to the first worker
            starting on its message, and to the last worker sending its reply (ms, the
            workers' clocks: ``time.perf_counter`` is ``CLOCK_MONOTONIC`` on Linux, one clock
            for every process). A ``first_start_ms`` well above ``send_ms`` is the workers'
            wake-up; a ``last_reply_ms`` well below ``read_ms`` means the replies waited for
            this process.
        read_ms: from the first message sent to the last reply read by this process (ms).
        settled: walked rows the workers settled after the walk (rejected and terminating
            nodes' rows all ones, as ``settle_tree_rows_batch`` does) -> the reached drafts
            whose token the parent's row forbids; every walked row not timed out is in it.
        mismatched: rows whose mirror's verdict differs from the one predicted for
            ``on_verdicts`` (see :meth:`MaskWorkerPool.build`): row -> (output ids the mirror
            has been sent in all, ids of them it did not keep, grammar ended). Empty unless
            committed ids broke the grammar (a grammar engine fault).
    """

    walked: list[int]
    timed_out: list[int]
    rejected: dict[int, int] = field(default_factory=dict)
    terminated: list[int] = field(default_factory=list)
    worker_busy_ms: list[float] = field(default_factory=list)
    send_ms: float = 0.0
    first_start_ms: float = 0.0
    last_reply_ms: float = 0.0
    read_ms: float = 0.0
    settled: dict[int, int] = field(default_factory=dict)
    mismatched: dict[int, tuple[int, int, bool]] = field(default_factory=dict)


#: planes of the shared tree links: next_token, next_sibling, draft_tokens, parents
LINK_PLANES = 4


def links_offset(max_rows: int, width: int) -> int:
    """Byte offset of the tree links (:data:`LINK_PLANES` int64 planes of ``max_rows``) in the
    shared segment: after the ``[max_rows, width]`` int32 slab, 8-byte aligned (parent and
    workers compute it alike)."""
    return (max_rows * width * 4 + 7) // 8 * 8


#: bytes between two workers' build flags (each a 32-bit word on a cache line of its own, so
#: that one worker's store never shares a line another worker or the host writes)
GATE_FLAG_STRIDE = 64


@dataclass(frozen=True)
class GateLayout:
    """Where a deferred build's caps and flags lie in the pool's shared segment (bytes from
    its start; :mod:`~structspec.grammar.deferred_build`).

    Attributes:
        caps_at: ``int64 [max_rows]``: per batch row, the most draft tokens the verifier may
            accept (``N - 1``; 0 after a timed-out walk), 64-byte aligned.
        flags_at: per worker ``w``, a 32-bit flag at ``flags_at + w * GATE_FLAG_STRIDE``: the
            sequence number of the last deferred build whose rows (and caps) the worker has
            written.
        end: the first byte after the flags.
    """

    caps_at: int
    flags_at: int
    end: int

    @staticmethod
    def after(offset: int, max_rows: int, num_workers: int) -> GateLayout:
        """The layout that starts at the first 64-byte boundary at or after ``offset``."""
        caps_at = (offset + 63) // 64 * 64
        flags_at = (caps_at + 8 * max_rows + 63) // 64 * 64
        return GateLayout(caps_at, flags_at, flags_at + GATE_FLAG_STRIDE * num_workers)
