"""A mask worker build whose replies are read after the post graph is queued.

Why: in a verify step with the grammar on the mask workers, the host used to wait for every
worker's reply, then upload the slab and queue the post graph. The busiest worker's walks
(~0.5 ms at batch 32, ~0.9-1.0 ms at batch 64 on the H200 host, EAGLE + JSON) and that
host's reply handling sat on the step's critical path whenever they outlasted the verify
forward (benchmarks/README.md, "Sixteenth H200 run"). Here the host queues the upload and
the post graph at once, behind a device-side wait on each busy worker's flag, and reads the
replies afterwards.

Protocol (:meth:`MaskWorkerPool.build_deferred <structspec.grammar.worker_pool.MaskWorkerPool.build_deferred>`):

1. Before the send the host writes every row's cap (``N - 1``) into the segment's caps, all
   ones into the rows no worker walks, and takes the build's sequence number ``seq``
   (1 to 2**31 - 1, never 0, so a flag left from an earlier build never matches).
2. Each busy worker walks and settles its rows, writes 0 as the cap of each walk that timed
   out (its rows reset, row 0 exact, as in the in-process build), issues a full barrier and
   stores ``seq`` in its flag word. A worker that fails stores nothing.
3. The host queues, on the copy stream, one ``cuStreamWaitValue32(flag_w == seq)`` per busy
   worker, then the slab's upload and an event; the post graph's stream waits on that event
   and copies the caps from the segment after it
   (:func:`structspec.staging.upload_pinned_gated`). The device reads the rows only once
   every flag holds ``seq``: x86-64 keeps the workers' stores in order (the barrier orders
   string and streaming stores too), so the rows are complete when the flag is seen.
4. The host reads the replies (:meth:`DeferredPoolBuild.finish`) before the step's commit.

Failure: a worker that died or failed never stores its flag, and the device would wait
forever. The scheduler then stops the pool's workers, writes the whole batch's rows and caps
from its own matchers into the segment, stores every flag itself (:meth:`release`) and
synchronizes the device before the segment is freed
(:meth:`GrammarService <structspec.scheduler.grammar_service.GrammarService>`'s fail-over).
Closing a pool with a deferred build unread releases the flags the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from structspec.grammar.mailbox import fence
from structspec.grammar.pool_types import PoolBuildResult


@dataclass
class InflightBuild:
    """A build sent to the workers, its replies unread (the pool's bookkeeping).

    Attributes:
        busy: the workers sent a job (each owes one reply).
        predicted: row -> the verdict predicted for its new ids (ids not kept, grammar ended).
        sent_total: row -> output ids its mirror has been sent in all.
        checked: verdicts were predicted for the caller (mismatches are reported).
        t_send: ``time.perf_counter()`` as the first job went out.
        out: the result, filled as the replies are read.
    """

    busy: list[int]
    predicted: dict[int, tuple[int, bool]]
    sent_total: dict[int, int]
    checked: bool
    t_send: float
    out: PoolBuildResult


class GatedPool(Protocol):
    """What a deferred build needs of its pool
    (:class:`~structspec.grammar.worker_pool.MaskWorkerPool`)."""

    slab: torch.Tensor
    caps: torch.Tensor
    flags: np.ndarray
    deferred: DeferredPoolBuild | None
    #: run once the workers have exited and before the segment is freed (``_shutdown``)
    _before_free: list[Callable[[], None]]

    def flag_device_pointers(self) -> list[int]: ...

    def _collect(self, inflight: InflightBuild) -> PoolBuildResult: ...


class DeferredPoolBuild:
    """A sent mask build (module doc). :meth:`finish` reads its replies, once.

    Args:
        pool: the pool that sent it.
        inflight: its bookkeeping.
        bs, n: the batch size and nodes per tree.
        seq: its sequence number (0: not gated: the workers store no flag).
    """

    def __init__(self, pool: GatedPool, inflight: InflightBuild, bs: int, n: int,
                 seq: int) -> None:
        self.pool = pool
        self.inflight = inflight
        self.bs, self.n, self.seq = bs, n, seq
        #: device waits were queued on the flags (the segment must outlive the copies)
        self.waits_queued = False
        self.device: torch.device | None = None  # where they were queued
        self._result: PoolBuildResult | None = None
        self._released = False

    @property
    def rows(self) -> torch.Tensor:
        """``int32 [bs * N, W]``: the build's rows in the pool's slab (page-locked)."""
        return self.pool.slab[: self.bs * self.n]

    @property
    def caps(self) -> torch.Tensor:
        """``int64 [bs]``: the build's caps in the pool's segment (page-locked)."""
        return self.pool.caps[: self.bs]

    def device_waits(self, device: torch.device) -> list[tuple[int, int]]:
        """``(device address of a busy worker's flag, seq)`` for each busy worker, for
        :func:`~structspec.staging.upload_pinned_gated` on ``device``; marks the waits as
        queued.

        Raises:
            RuntimeError: the build is not gated, or the flags have no device address.
        """
        if not self.seq:
            raise RuntimeError("this build is not gated (no flags are written)")
        ptrs = self.pool.flag_device_pointers()
        self.waits_queued, self.device = True, device
        return [(ptrs[w], self.seq) for w in self.inflight.busy]

    def flags_set(self) -> bool:
        """Whether every busy worker's flag holds ``seq`` (its rows and caps are written)."""
        flags = self.pool.flags
        return all(int(flags[w]) == self.seq for w in self.inflight.busy)

    @property
    def done(self) -> bool:
        """Whether :meth:`finish` returned."""
        return self._result is not None

    def finish(self) -> PoolBuildResult:
        """Read the replies (once; later calls return the same result).

        Raises:
            MaskPoolError: a worker died or failed: its flag may never be stored. When device
                waits were queued, the build stays the pool's ``deferred`` one and its
                :meth:`release` stays among the pool's close hooks: the pool's
                :meth:`~structspec.grammar.worker_pool.MaskWorkerPool.close` then releases the
                flags before the segment is freed, unless the caller hands it a hook that
                writes the rows first (module doc).
        """
        if self._result is None:
            try:
                self._result = self.pool._collect(self.inflight)
            except BaseException:
                if not self.waits_queued:  # nothing waits on the flags
                    self._forget()
                raise
            self._forget()
        return self._result

    def _forget(self) -> None:
        """No longer the pool's build in flight, nor among its close hooks."""
        pool = self.pool
        if pool.deferred is self:
            pool.deferred = None
        if self.release in pool._before_free:
            pool._before_free.remove(self.release)

    def release(self) -> None:
        """Store ``seq`` in every busy worker's flag from this process (after writing the rows
        and caps it wants the device to read), then, when device waits were queued,
        synchronize the device: the copies out of the segment have run when this returns.
        Idempotent. Call it only once no worker writes the segment any more (the pool's
        workers stopped, or every reply read)."""
        if self._released:
            return
        self._released = True
        if self.seq:
            fence()  # the rows and caps written here before the flags
            flags = self.pool.flags
            for w in self.inflight.busy:
                flags[w] = self.seq
        if self.waits_queued:
            torch.cuda.synchronize(self.device)
