"""A verify step whose results are still on the device: the D2H copy and its event."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from structspec.draft_tree.verify import VerifyResult


@dataclass
class PendingStep:
    """Results of one verify (or prefill) step on their way to the host.

    ``launch`` queues non_blocking copies of the accepted tokens, their count and the number
    of real drafts into pinned host buffers behind the step's kernels and records an event;
    :meth:`wait` is the step's one planned host synchronisation.
    """

    result: VerifyResult
    accept_tokens_cpu: torch.Tensor  # [B, N] int64, pinned on CUDA
    accept_len_cpu: torch.Tensor  # [B] int64
    num_real_cpu: torch.Tensor  # [B] int64
    event: torch.cuda.Event | None
    on_wait: Callable[[list[list[int]]], None] | None = None
    _runs: list[list[int]] | None = field(default=None, repr=False)

    @classmethod
    def launch(cls, result: VerifyResult, num_real: torch.Tensor,
               pinned_pool: dict[tuple, torch.Tensor] | None = None) -> PendingStep:
        """Queue the D2H copies behind the step's kernels and record the event.

        ``pinned_pool`` reuses pinned host buffers across steps (keyed by shape and dtype):
        pinned allocation is slow, and a buffer is free again once the previous step's
        :meth:`wait` has read it, which always happens before the next launch.
        """
        src = (result.accept_tokens, result.accept_len, num_real)
        if result.accept_tokens.device.type != "cuda":
            return cls(result, *(t.clone() for t in src), event=None)
        pool = pinned_pool if pinned_pool is not None else {}
        dst = []
        for slot, t in enumerate(src):
            key = (slot, tuple(t.shape), t.dtype)
            if key not in pool:
                pool[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            dst.append(pool[key])
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=True)
        event = torch.cuda.Event()
        event.record()  # NOTE: recorded after the copies on the current stream
        return cls(result, *dst, event=event)

    @property
    def num_real_drafts(self) -> list[int]:
        """Real (non-padding) draft nodes per request (valid after :meth:`wait`)."""
        return self.num_real_cpu.tolist()

    def wait(self) -> list[list[int]]:
        """Block until the copies landed; return each request's committed run (host ints)."""
        if self._runs is None:
            if self.event is not None:
                self.event.synchronize()
            lens = self.accept_len_cpu.tolist()
            tokens = self.accept_tokens_cpu
            self._runs = [tokens[i, : lens[i]].tolist() for i in range(len(lens))]
            if self.on_wait is not None:
                self.on_wait(self._runs)
        return self._runs
