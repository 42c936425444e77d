"""Per-step timing of verify steps: CPU phases (host clock) and GPU busy / idle (CUDA events).

One :class:`StepTimer` lives in the scheduler. Each verify step records host timestamps at its
phase boundaries and, on CUDA, four events on the compute stream:

``start``      before the drafter (a device drafter's kernels are GPU work of the step);
``fwd_start``  after drafting, before the tree upload and the verify forward;
``fwd_end``    after the verify forward was enqueued (the GPU reaches it when the forward ends);
``post``       after the grammar bitmask upload was enqueued (mask application, sampling and
               the tree check follow): ``elapsed(fwd_end, post)`` is how long the GPU sat
               finished with the forward waiting for the host's mask -- zero when the grammar
               work is hidden;
``end``        after the result D2H copies.

Event times are read one step late (when step k+1 has waited for its own results, every event
of step k has completed), so timing adds no host synchronisation. ``idle_before_ms`` is the
GPU gap between step k-1's ``end`` and step k's ``start``: the host time between steps that
the GPU did not overlap.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import fields

import torch

from structspec.scheduler.step_record import CPU_PHASES, StepRecord


class _Events:
    """The five CUDA events of one step (reused from a free list)."""

    __slots__ = ("start", "fwd_start", "fwd_end", "post", "end")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, torch.cuda.Event(enable_timing=True))


class StepTimer:
    """Collects a :class:`StepRecord` per verify step; keeps the last ``keep`` records.

    Args:
        device: the model device; CUDA events are used only when it is a CUDA device.
        keep: how many finished records to keep (a ring; older ones are dropped).
    """

    def __init__(self, device: torch.device, keep: int = 4096) -> None:
        self.cuda = device.type == "cuda"
        self.keep = keep
        self.records: list[StepRecord] = []
        self._undrained: list[StepRecord] = []  # finished records not yet taken by drain()
        self._current: StepRecord | None = None
        self._events: _Events | None = None
        self._t_mark = 0.0
        self._t_start = 0.0
        self._t_fwd_start = 0.0  # host clock when ``fwd_start`` was recorded
        self._unread: tuple[StepRecord, _Events] | None = None
        self._prev: _Events | None = None  # events of the last step read (its ``end``)
        self._free: list[_Events] = []
        self._stream: torch.cuda.Stream | None = None

    # ---------------------------------------------------------------- recording

    def begin(self, batch_size: int, num_nodes: int, constrained: int) -> None:
        """Start a step: records the ``start`` event on the current stream."""
        self._current = StepRecord(batch_size, num_nodes, constrained)
        self._t_start = self._t_mark = time.perf_counter()
        if self.cuda:
            self._events = self._free.pop() if self._free else _Events()
            # One current_stream() lookup per step (~15 us each): every event of the step is
            # recorded on the stream current at its start (the scheduler never switches).
            self._stream = torch.cuda.current_stream()
            self._events.start.record(self._stream)

    def note_nodes(self, num_nodes: int, num_drafting: int, num_plain: int) -> None:
        """Set the step's tree size ``N`` once the drafter's trees are sized (adaptive trees
        may be smaller than the drafter's ``num_draft_tokens``) and how many requests were
        drafted vs verified as plain decode rows."""
        rec = self._current
        if rec is not None:
            rec.num_nodes = num_nodes
            rec.num_drafting = num_drafting
            rec.num_plain = num_plain

    def phase(self, name: str) -> None:
        """Close the host phase ``name`` (time since the previous mark is added to it)."""
        rec = self._current
        if rec is None:
            return
        t = time.perf_counter()
        rec.cpu_ms[name] = rec.cpu_ms.get(name, 0.0) + (t - self._t_mark) * 1e3
        self._t_mark = t

    def pool(self, send_ms: float, worker_busy_ms: Sequence[float], *,
             first_start_ms: float | None = None, last_reply_ms: float | None = None,
             read_ms: float | None = None) -> None:
        """Note the step's mask worker pool build: host time sending the messages (ms),
        each messaged worker's busy time (ms) and, when known, the round trip's marks from
        the first message (ms; :class:`~structspec.grammar.pool_types.PoolBuildResult`)."""
        rec = self._current
        if rec is None:
            return
        rec.pool_workers = len(worker_busy_ms)
        rec.pool_send_ms = send_ms
        rec.pool_worker_max_ms = max(worker_busy_ms, default=0.0)
        rec.pool_first_start_ms = first_start_ms
        rec.pool_last_reply_ms = last_reply_ms
        rec.pool_read_ms = read_ms

    def pool_order(self, sent_first: bool) -> None:
        """Note whether the step's pool build went out before the verify launch (kept only
        for a step whose bitmask the pool built: :meth:`pool` was called)."""
        rec = self._current
        if rec is not None and rec.pool_workers is not None:
            rec.pool_sent_first = sent_first

    def event(self, name: str) -> None:
        """Record the CUDA event ``name`` (``fwd_start``, ``fwd_end``, ``post``, ``end``); the
        host time from ``fwd_start`` to ``fwd_end`` goes to ``host_fwd_launch_ms``."""
        if self._events is not None and self._current is not None:
            if name == "fwd_end":  # before its record: the forward's launches are all queued
                self._current.host_fwd_launch_ms = (time.perf_counter()
                                                    - self._t_fwd_start) * 1e3
            getattr(self._events, name).record(self._stream)
            if name == "fwd_start":
                self._t_fwd_start = time.perf_counter()

    def end(self) -> None:
        """Finish the step's host timing; GPU times are read after the next step's wait."""
        rec, ev = self._current, self._events
        if rec is None:
            return
        rec.wall_ms = (time.perf_counter() - self._t_start) * 1e3
        self._current, self._events = None, None
        if ev is None:
            self._push(rec)
            return
        # The previous step's events completed before this step's wait returned.
        self._read_unread()
        self._unread = (rec, ev)

    def flush(self) -> None:
        """Read the last step's GPU events (synchronises on its ``end`` event)."""
        if self._unread is not None:
            self._unread[1].end.synchronize()
            self._read_unread()

    def _read_unread(self) -> None:
        if self._unread is None:
            return
        rec, ev = self._unread
        self._unread = None
        rec.gpu_draft_ms = ev.start.elapsed_time(ev.fwd_start)
        rec.gpu_forward_ms = ev.fwd_start.elapsed_time(ev.fwd_end)
        rec.gpu_grammar_stall_ms = ev.fwd_end.elapsed_time(ev.post)
        rec.gpu_post_ms = ev.fwd_end.elapsed_time(ev.end)
        if self._prev is not None:
            rec.gpu_idle_before_ms = self._prev.end.elapsed_time(ev.start)
            self._free.append(self._prev)  # all its times have been read: reuse
        self._prev = ev
        self._push(rec)

    def break_chain(self) -> None:
        """A non-verify step (prefill) ran: the next step's idle gap is not measured."""
        self.flush()
        if self._prev is not None:
            self._free.append(self._prev)
            self._prev = None

    def _push(self, rec: StepRecord) -> None:
        for buf in (self.records, self._undrained):
            buf.append(rec)
            if len(buf) > self.keep:
                del buf[: len(buf) - self.keep]

    def latest(self) -> StepRecord | None:
        """The newest record whose times are all read, or None (none yet, or a reset since).
        Right after :meth:`end` that is the ended step's record on the CPU and the previous
        verify step's on CUDA (events are read one step late, or at a :meth:`flush` in
        between); the same record can be returned by several calls."""
        return self.records[-1] if self.records else None

    def drain(self) -> list[StepRecord]:
        """Records finished since the last call (for metrics exporters); no host sync, so
        the latest step's record arrives with the next call."""
        out, self._undrained = self._undrained, []
        return out

    # ---------------------------------------------------------------- summaries

    def reset(self) -> None:
        """Drop the finished records (e.g. after a warm-up)."""
        self.flush()
        self.records = []

    def summary(self) -> dict[str, float]:
        """Mean of every timing over the kept records (ms), plus ``steps``.

        Keys: ``wall_ms``, ``cpu_<phase>_ms`` for :data:`CPU_PHASES`, on CUDA ``gpu_busy_ms``
        and ``<interval>_ms`` for :data:`GPU_INTERVALS` and ``host_fwd_launch_ms``, and for the
        steps that used the mask worker pool ``pool_workers``, ``pool_send_ms``,
        ``pool_worker_max_ms``, ``pool_first_start_ms``, ``pool_last_reply_ms``,
        ``pool_read_ms`` and ``pool_sent_first`` (the share of them whose build went out
        before the launch).
        """
        self.flush()
        recs = self.records
        out: dict[str, float] = {"steps": float(len(recs))}
        if not recs:
            return out
        out["wall_ms"] = sum(r.wall_ms for r in recs) / len(recs)
        for p in CPU_PHASES:
            out[f"cpu_{p}_ms"] = sum(r.cpu_ms.get(p, 0.0) for r in recs) / len(recs)
        names = [f.name for f in fields(StepRecord)
                 if f.name.startswith(("gpu_", "pool_", "host_"))]
        for name in names:
            vals = [getattr(r, name) for r in recs if getattr(r, name) is not None]
            if vals:
                out[name] = sum(vals) / len(vals)
        busy = [r.gpu_busy_ms for r in recs if r.gpu_busy_ms is not None]
        if busy:
            out["gpu_busy_ms"] = sum(busy) / len(busy)
        return out
