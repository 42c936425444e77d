"""Pinned host staging for host->device copies in the decode/verify hot path (invariant 6).

Every small host tensor the verify forward needs (committed lengths, page tables, a host
drafter's tree) goes to the device through a :class:`PinnedRing`: the host fills a pinned
buffer, one ``copy_(..., non_blocking=True)`` per destination is queued on the *current*
stream, and a CUDA event is recorded right after it.

Stream/event ordering:

* The H2D copy is queued on the same stream as the forward (eager kernels or a CUDA graph
  replay) that reads its destination, so stream order alone guarantees the forward sees the
  copied values; no event is needed on the device side.
* What needs guarding is the *host* side: a pinned buffer must not be refilled while an earlier
  copy out of it may still be in flight (the host runs ahead of the GPU). Each ring slot keeps
  the event recorded after its last copy; :meth:`PinnedRing.acquire` waits on that event before
  handing the slot out again (``cudaEventSynchronize``, which blocks only until that one copy is
  done and is not a stream/device sync). With ``depth`` slots, the wait only blocks when the host
  is ``depth`` steps ahead of the GPU, i.e. it is back-pressure, normally a no-op since the
  scheduler already waits once per step for the verify result.
* Device destinations are owned by the caller (static CUDA graph inputs or fresh tensors from
  the caching allocator, which is stream ordered).

On CPU there is nothing to stage: :meth:`PinnedRing.to_device` falls back to plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PinnedRing:
    """A ring of pinned host buffers of one dtype, each guarded by the event of its last copy.

    Args:
        device: the CUDA device copies go to.
        dtype: element dtype of every buffer (e.g. ``torch.int64``, ``torch.bool``).
        capacity: initial elements per buffer; a buffer grows (after its event) when asked for
            more.
        depth: number of buffers (steps the host may run ahead of the GPU before it waits).
    """

    def __init__(
        self, device: torch.device, dtype: torch.dtype, *, capacity: int = 4096, depth: int = 8
    ) -> None:
        self.device = device
        self.dtype = dtype
        self._bufs = [torch.empty(capacity, dtype=dtype, pin_memory=True) for _ in range(depth)]
        self._events: list[torch.cuda.Event | None] = [None] * depth
        self._next = 0
        self._current = -1

    def acquire(self, numel: int) -> torch.Tensor:
        """Next free pinned buffer: a ``[numel]`` host view of ``dtype`` to fill on the host.

        Blocks only until the previous copy out of this slot has finished (see module doc).
        Call :meth:`copy_to` (once or several times) after filling it.
        """
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        ev = self._events[i]
        if ev is not None and not ev.query():
            ev.synchronize()
        self._events[i] = None
        if self._bufs[i].numel() < numel:
            self._bufs[i] = torch.empty(max(numel, 2 * self._bufs[i].numel()), dtype=self.dtype,
                                        pin_memory=True)
        self._current = i
        return self._bufs[i][:numel]

    def copy_to(self, host: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue ``dst.copy_(host)`` (``non_blocking``) on the current stream and record the
        slot's event after it.

        Args:
            host: a view of the buffer last returned by :meth:`acquire` (same numel as ``dst``).
            dst: device tensor of ``dtype`` (any shape/strides), written asynchronously.
        """
        dst.copy_(host.view(dst.shape), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._events[self._current] = ev

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of the host tensor ``host`` (any shape, ``dtype``), staged through the
        ring; the result is a fresh device tensor from the caching allocator."""
        buf = self.acquire(host.numel())
        buf.copy_(host.reshape(-1))
        dst = torch.empty(host.shape, dtype=self.dtype, device=self.device)
        self.copy_to(buf, dst)
        return dst


class HostRing:
    """CPU stand-in for :class:`PinnedRing` with the same two calls (plain buffers and plain
    copies), so code that stages inputs reads the same on both devices."""

    def acquire(self, numel: int) -> torch.Tensor:
        """A fresh ``[numel]`` int64 host buffer."""
        return torch.empty(numel, dtype=torch.int64)

    def copy_to(self, host: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst.copy_(host)`` (synchronous: both on the CPU)."""
        dst.copy_(host.view(dst.shape))


class Staging:
    """The runner's pinned staging: one :class:`PinnedRing` per dtype it ever copies.

    Args:
        device: the CUDA device.
        depth: ring depth for every dtype.
    """

    def __init__(self, device: torch.device, *, depth: int = 32) -> None:
        self.device = device
        self.depth = depth
        self._rings: dict[torch.dtype, PinnedRing] = {}

    def ring(self, dtype: torch.dtype) -> PinnedRing:
        """The ring for ``dtype`` (created on first use)."""
        if dtype not in self._rings:
            self._rings[dtype] = PinnedRing(self.device, dtype, depth=self.depth)
        return self._rings[dtype]

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Non-blocking device copy of a host tensor through the ring of its dtype; a tensor
        already on the device is returned as is."""
        if host.device.type != "cpu":
            return host
        return self.ring(host.dtype).to_device(host)


def to_device(host: torch.Tensor, device: torch.device, staging: Staging | None) -> torch.Tensor:
    """``host`` on ``device``: on CUDA through ``staging``'s pinned ring (one ``non_blocking``
    H2D copy, no host sync); without staging (CPU runs) a plain ``.to(device)``.

    Args:
        host: a tensor of any shape and dtype (a tensor already off the CPU is returned as is).
        device: the model device.
        staging: the runner's :class:`Staging`, or None on CPU.

    Returns:
        A tensor of ``host``'s shape and dtype on ``device``.
    """
    if staging is not None:
        return staging.to_device(host)
    return host.to(device)


def stack_to_device(hosts: Sequence[torch.Tensor], device: torch.device,
                    staging: Staging | None) -> list[torch.Tensor]:
    """Several host tensors of one shape and dtype on ``device`` with one copy: stacked into
    one pinned buffer and sent by one ``non_blocking`` H2D copy (each staged copy costs ~50 us
    of host time, which matters at batch 1).

    Args:
        hosts: ``k`` CPU tensors of the same shape ``S`` and dtype.
        device: the model device.
        staging: the runner's :class:`Staging`, or None on CPU (plain copies).

    Returns:
        ``k`` device tensors of shape ``S`` (views of one ``[k, *S]`` tensor when staged).
    """
    if staging is None:
        return [h.to(device) for h in hosts]
    return list(staging.to_device(torch.stack(list(hosts))).unbind(0))
