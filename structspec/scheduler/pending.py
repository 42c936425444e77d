"""A verify step whose results are still on the device: its D2H copy (staged by
:mod:`structspec.staging`) and the one planned host wait of the step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from structspec.draft_tree.verify import VerifyResult
from structspec.staging import BufferKey, DeviceToHost, PendingCopy


@dataclass
class PendingStep:
    """Results of one verify (or prefill) step on their way to the host.

    ``launch`` queues the D2H copies of the accepted tokens, their count and the number of real
    drafts behind the step's kernels (:class:`~structspec.staging.DeviceToHost`: pinned host
    buffers, one event after the copies); :meth:`wait` is the step's one planned host
    synchronisation.
    """

    result: VerifyResult
    accept_tokens_cpu: torch.Tensor  # [B, N] int64, pinned on CUDA
    accept_len_cpu: torch.Tensor  # [B] int64
    num_real_cpu: torch.Tensor  # [B] int64
    copy: PendingCopy
    on_wait: Callable[[list[list[int]]], None] | None = None
    _runs: list[list[int]] | None = field(default=None, repr=False)

    @classmethod
    def launch(cls, result: VerifyResult, num_real: torch.Tensor,
               pinned_pool: dict[BufferKey, torch.Tensor] | None = None) -> PendingStep:
        """Queue the D2H copies behind the step's kernels and record the event.

        ``pinned_pool`` reuses pinned host buffers across steps (keyed by slot, shape and
        dtype; see :class:`~structspec.staging.DeviceToHost`): pinned allocation is slow, and a
        buffer is free again once the previous step's :meth:`wait` has read it, which always
        happens before the next launch. None = fresh buffers. On the CPU the results are
        cloned (no event).
        """
        copy = DeviceToHost(pinned_pool).launch(
            (result.accept_tokens, result.accept_len, num_real))
        accept_tokens, accept_len, num_real_host = copy.hosts
        return cls(result, accept_tokens, accept_len, num_real_host, copy)

    @property
    def event(self) -> torch.cuda.Event | None:
        """The CUDA event recorded after the copies (None on the CPU)."""
        return self.copy.event

    @property
    def num_real_drafts(self) -> list[int]:
        """Real (non-padding) draft nodes per request (valid after :meth:`wait`)."""
        return self.num_real_cpu.tolist()

    def wait(self) -> list[list[int]]:
        """Block until the copies landed; return each request's committed run (host ints)."""
        if self._runs is None:
            self.copy.wait()
            lens = self.accept_len_cpu.tolist()
            # One host conversion for the batch, then list slices: a tensor slice and a
            # tolist per request cost ~4 us each (~1 ms per step at batch 256).
            rows = self.accept_tokens_cpu.tolist()
            self._runs = [row[:n] for row, n in zip(rows, lens, strict=True)]
            if self.on_wait is not None:
                self.on_wait(self._runs)
        return self._runs
