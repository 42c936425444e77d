"""Every host<->device copy of the hot path, and every pinned host buffer behind them
(docs/architecture.md, invariant 6: no blocking copies in the hot path).

Nothing outside this module allocates page-locked memory, queues a ``non_blocking`` copy,
records a copy's event or waits on one. Its pieces, in step order:

* **H2D ring** (:class:`PinnedRing`, :class:`Staging`, :func:`to_device`,
  :func:`stack_to_device`): small host tensors the verify forward reads (committed lengths,
  page tables, a host drafter's tree, the draft graphs' inputs).
* **D2H pending copy** (:class:`DeviceToHost` -> :class:`PendingCopy`): the drafted tree for
  the grammar mask build and the step's accepted tokens for the commit.
* **Pinned uploads** (:func:`pinned_full`, :func:`upload_pinned`, :func:`page_lock`): the tree
  bitmask, built on the host in a pinned buffer (or in the mask workers' page-locked
  shared-memory slab) and uploaded behind the verify forward; from the slab, optionally behind
  device-side waits on the workers' flags (:func:`upload_pinned_gated`).

Stream/event ordering, H2D ring:

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

Stream/event ordering, D2H pending copy:

* :meth:`DeviceToHost.launch` queues one ``non_blocking`` copy per source into a pinned host
  buffer on the *current* stream, right behind the kernels that produced the sources, and
  records **one** event after the last of them. Nothing waits there.
* The host waits in :meth:`PendingCopy.wait` (``cudaEventSynchronize`` on that event: it blocks
  until those copies are done, never for work queued after the event, and it is neither a
  stream nor a device sync), at the one planned point of its step: the drafted tree's copies
  are launched *before* the verify forward and waited for *after* its launch (so the wait
  covers the small copies only, not the forward); the step's results are waited for once, when
  the scheduler commits them.
* ``record_stream`` (the grammar tree's copies): the copy reads its source later on the
  current stream; recording that stream keeps the caching allocator from handing the source's
  memory to another stream's kernels before the copy has read it, if the source was allocated
  on another stream (a no-op when it was allocated on the current one).
* Buffer reuse: a :class:`DeviceToHost` keeps one pinned buffer per ``(slot, shape, dtype)``
  and reuses it on every launch, so its caller must have waited for and read the previous
  launch's buffers before launching again (the scheduler's results: a step is always waited
  for before the next one is launched). A :class:`DeviceToHost` made per launch allocates
  fresh buffers each time, which the grammar tree's copies have always done (what a fresh
  pinned allocation costs: :func:`pinned_full`).

Stream ordering, pinned uploads:

* :func:`upload_pinned` queues one ``non_blocking`` H2D copy on the current stream; stream
  order puts it before the kernels queued after it that read the destination (the mask
  application), so no event is needed on the device side.
* :func:`upload_pinned_side` queues it on a copy stream instead, for a destination that is a
  CUDA graph's static bitmask: the copy runs beside the verify forward rather than after it
  (3.5 MB at batch 64 x 9 rows), and the post graph's stream waits on its event
  (:func:`wait_upload`) right before the replay. The destination is made by
  :func:`side_upload_target` (filled on the copy stream, the current stream waiting for it),
  and its earlier reader, the previous step's post graph, finished before that step's results
  were waited for.
* The source must not change until the copy ran. An in-process bitmask is a fresh
  :func:`pinned_full` buffer per step (torch's caching host allocator records the copy's event
  on the block and does not hand it out again before that event completed). The mask
  workers' slab is page-locked once (:func:`page_lock`) and rewritten only by the next step's
  build, which starts after the scheduler waited for this step's results, queued behind the
  upload on the same stream.

CPU fallbacks: on a machine without CUDA nothing is staged. :func:`to_device` /
:func:`stack_to_device` without a :class:`Staging` and :class:`HostRing` make plain copies,
:meth:`DeviceToHost.launch` of CPU tensors returns host clones with no event,
:func:`pinned_full` returns pageable memory, :func:`page_lock` is a no-op and
:func:`upload_pinned` to the CPU is a plain copy into ``out`` (or returns the host tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

#: Key of a :class:`DeviceToHost` buffer: ``(slot, shape, dtype)``.
BufferKey = tuple[int, tuple[int, ...], torch.dtype]


# ------------------------------------------------------------------------ pinned host memory


def pinned_full(shape: Sequence[int], fill: int | float, dtype: torch.dtype, *,
                pin: bool = True) -> torch.Tensor:
    """A host tensor filled with ``fill``, page-locked when ``pin`` and CUDA is available, so
    that :func:`upload_pinned` is truly asynchronous (a pageable source makes CUDA stage the
    copy and block the host).

    A fresh page-locked allocation per call: it goes through torch's caching host allocator,
    which reuses a freed block once the copies recorded on it completed, so a steady per-step
    allocation of one size costs a free-list lookup and the fill, not a ``cudaHostAlloc``
    (only a new size, or more buffers in flight than ever before, allocates).

    Args:
        shape: the tensor's shape.
        fill: the value of every element.
        dtype: its dtype.
        pin: False for a pageable buffer (one that is never uploaded asynchronously).

    Returns:
        A CPU tensor of ``shape`` and ``dtype``.
    """
    pin = pin and torch.cuda.is_available()
    return torch.full(tuple(shape), fill, dtype=dtype, pin_memory=pin)


def upload_pinned(host: torch.Tensor, device: torch.device | str, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Queue an H2D copy of a page-locked host tensor on the current stream; no host wait.

    The caller keeps ``host`` unchanged until the copy ran (module doc, "pinned uploads").

    Args:
        host: a CPU tensor (page-locked for an asynchronous copy: :func:`pinned_full` or
            :func:`page_lock`).
        device: the destination device; ``"cpu"`` returns ``host`` itself when ``out`` is None.
        out: a device tensor of ``host``'s shape and dtype to copy into (e.g. a view of a CUDA
            graph's static input), or None for a fresh tensor from the caching allocator.

    Returns:
        ``out``, or the fresh device tensor.
    """
    if out is None:
        return host.to(device, non_blocking=True)
    out.copy_(host, non_blocking=True)
    return out


#: one copy stream per CUDA device index for :func:`upload_pinned_side`
_COPY_STREAMS: dict[int, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The copy stream of a CUDA device (created at first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _COPY_STREAMS.get(index)
    if stream is None:
        stream = _COPY_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def side_upload_target(shape: Sequence[int], fill: int | float, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    """A persistent device tensor filled with ``fill`` that :func:`upload_pinned_side` may
    write (a CUDA graph's static bitmask and cap).

    On CUDA it is allocated and filled on the copy stream, and the current stream then waits
    for that stream: every later copy-stream upload is ordered after the fill by stream order,
    and every reader on the current stream too. (Filled on the current stream, the fill would
    sit behind a forward already queued there while an upload on the copy stream ran first
    and was then overwritten; and a block the caching allocator just freed on the current
    stream may still be read by kernels queued there.) Never freed while uploads may target
    it. Elsewhere, or during a CUDA graph capture, a plain ``torch.full``.

    Returns:
        A ``shape`` tensor of ``dtype`` on ``device``.
    """
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.full(tuple(shape), fill, dtype=dtype, device=device)
    stream = _copy_stream(device)
    with torch.cuda.stream(stream):
        out = torch.full(tuple(shape), fill, dtype=dtype, device=device)
    torch.cuda.current_stream(device).wait_stream(stream)
    return out


def upload_pinned_side(host: torch.Tensor, out: torch.Tensor) -> torch.cuda.Event | None:
    """Queue the H2D copy of a page-locked ``host`` into ``out`` on a copy stream of ``out``'s
    device, so the copy engine runs it while the current stream is still busy (the verify
    forward) instead of behind it; the consumer's stream waits on the returned event
    (:func:`wait_upload`) just before the kernels that read ``out``.

    Ordering (module doc, "Pinned uploads"): the copy stream waits for nothing on the current
    stream, so ``out`` must come from :func:`side_upload_target` (its fill is ordered before
    the copy on the copy stream; never memory the caching allocator hands around), and its
    earlier readers must have finished before the host got here: the post graph of the
    previous step reads the graph's bitmask, and the scheduler waited for that step's
    results, queued behind it, before this step's build started (invariant 6). The host
    source is guarded as before: the copy's event is recorded on the block by the caching
    host allocator (a :func:`pinned_full` buffer), and the workers' slab is rewritten only
    after the step's results, queued behind the consumer's wait, were waited for.

    Args:
        host: the CPU source (page-locked for an asynchronous copy), ``out``'s shape and dtype.
        out: the device destination.

    Returns:
        The event recorded on the copy stream after the copy; None when the copy was queued
        on the current stream instead (a CPU ``out``, or a CUDA graph capture in progress),
        which then needs no wait.
    """
    if out.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        upload_pinned(host, out.device, out=out)
        return None
    stream = _copy_stream(out.device)
    with torch.cuda.stream(stream):
        out.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done


class StreamWaitError(RuntimeError):
    """A device-side wait on a flag could not be queued (:func:`upload_pinned_gated`): the
    copy and anything after it were not queued."""


#: what must run before this process blocks on the device while a gated upload waits for
#: flags that only it may release (:func:`register_before_host_sync`)
_BEFORE_HOST_SYNC: list[Callable[[], None]] = []


def register_before_host_sync(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn`` to run (once) before the next code path that may block the host on the
    device (:func:`before_host_sync`: a CUDA graph capture synchronizes the device). A gated
    upload registers the reading of its build's replies: a worker that failed never stores
    its flag, the device waits for it, and only that reading releases it, so a host sync
    before it would wait forever. Returns a function that unregisters ``fn`` (idempotent)."""
    _BEFORE_HOST_SYNC.append(fn)

    def unregister() -> None:
        if fn in _BEFORE_HOST_SYNC:
            _BEFORE_HOST_SYNC.remove(fn)

    return unregister


def before_host_sync() -> None:
    """Run (and unregister) every :func:`register_before_host_sync` callback: call it before
    anything on a step's path that may block the host on the device."""
    while _BEFORE_HOST_SYNC:
        _BEFORE_HOST_SYNC.pop()()


def upload_pinned_gated(host: torch.Tensor, device: torch.device, waits: Sequence[tuple[int, int]],
                        *, out: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """:func:`upload_pinned_side` (``out`` given) or :func:`upload_pinned` (``out`` None),
    with the copy queued behind device-side waits on flag words in page-locked host memory
    (:func:`structspec.stream_wait.stream_wait_equal`): the copy reads ``host`` only once
    every flag holds its value, so the host may queue it (and its consumers) before the
    writers of ``host`` are done, as long as each writer stores its flag after its part.

    Ordering: the waits go on the stream that runs the copy (the copy stream, or the current
    one when ``out`` is None), before the copy, so stream order puts the copy's read of
    ``host`` after them; the consumer orders itself after the copy as for the ungated uploads
    (:func:`wait_upload` on the returned event; stream order when ``out`` is None). A
    consumer's own later pinned copies out of the same memory (the caps) on the current
    stream come after that event, so after the flags too.

    Args:
        host: the page-locked source (its writers store their flags after their rows).
        device: a CUDA device (the destination's).
        waits: ``(device address of a 32-bit flag, value)`` pairs, each 4-byte aligned.
        out: the destination, from :func:`side_upload_target`; None: a fresh tensor on the
            current stream.

    Returns:
        ``(destination, event)``: the event recorded on the copy stream after the copy
        (None when the copy went on the current stream).

    Raises:
        StreamWaitError: a wait could not be queued (nothing was queued after it; the waits
            queued before it end once their flags are stored).
    """
    from structspec.stream_wait import stream_wait_equal

    def queue_waits(stream: torch.cuda.Stream) -> None:
        for ptr, value in waits:
            try:
                stream_wait_equal(stream, ptr, value)
            except RuntimeError as e:
                raise StreamWaitError(str(e)) from e

    if out is None:
        queue_waits(torch.cuda.current_stream(device))
        return host.to(device, non_blocking=True), None
    stream = _copy_stream(out.device)
    queue_waits(stream)
    with torch.cuda.stream(stream):
        out.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return out, done


def wait_upload(done: torch.cuda.Event | None) -> None:
    """Make the current stream wait (on the device; the host never blocks) for an upload of
    :func:`upload_pinned_side`; None: nothing to wait for."""
    if done is not None:
        done.wait()  # the current stream of the current device, as the consumer's kernels


def page_lock(host: torch.Tensor) -> int | None:
    """Page-lock the memory of an existing host tensor in place (``cudaHostRegister``), e.g. a
    shared-memory segment another process writes, so uploads out of it are asynchronous.

    Args:
        host: a contiguous CPU tensor; its whole storage range ``[data_ptr, + nbytes)`` is
            registered. Release it with :func:`page_unlock` before its memory is freed.

    Returns:
        None without CUDA (nothing to lock; the memory stays pageable), 0 when locked, or the
        CUDA error code of a failed registration (the memory stays pageable and uploads out of
        it block the host).
    """
    if not torch.cuda.is_available():
        return None
    nbytes = host.numel() * host.element_size()
    return int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0))


def page_unlock(data_ptr: int) -> None:
    """Undo :func:`page_lock` (``cudaHostUnregister``) for the tensor whose ``data_ptr()`` was
    ``data_ptr``; call it only after a :func:`page_lock` that returned 0."""
    torch.cuda.cudart().cudaHostUnregister(data_ptr)


# ------------------------------------------------------------------------------- H2D ring


MAX_RETAINED_BYTES = 8 << 20
"""Largest buffer a :class:`PinnedRing` slot keeps between copies (larger copies get a one-off
pinned buffer)."""


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
        self._current = i
        if numel * self._bufs[i].element_size() > MAX_RETAINED_BYTES:
            # A rare large copy (a long prompt's catch-up mask can be ~100 MB) gets a one-off
            # buffer from torch's pinned caching allocator instead of growing a slot for good:
            # every slot of every ring would otherwise end up holding the largest copy ever
            # seen. The allocator keeps the block until the copy queued from it has finished
            # (it records an event on non_blocking copies out of pinned memory).
            return torch.empty(numel, dtype=self.dtype, pin_memory=True)
        if self._bufs[i].numel() < numel:
            grown = min(max(numel, 2 * self._bufs[i].numel()),
                        MAX_RETAINED_BYTES // self._bufs[i].element_size())
            self._bufs[i] = torch.empty(grown, dtype=self.dtype, pin_memory=True)
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


# ----------------------------------------------------------------------- D2H pending copy


@dataclass
class PendingCopy:
    """Host copies of device tensors, possibly still in flight (see :class:`DeviceToHost`).

    Attributes:
        hosts: one CPU tensor per source, in source order (page-locked on CUDA). Read them
            only after :meth:`wait`.
        event: CUDA event recorded after the copies, or None when the sources were on the CPU
            (then ``hosts`` are already final).
    """

    hosts: tuple[torch.Tensor, ...]
    event: torch.cuda.Event | None = None
    _waited: bool = field(default=False, repr=False)

    @property
    def from_device(self) -> bool:
        """Whether the copies came from a CUDA device (an event guards them)."""
        return self.event is not None

    def done(self) -> bool:
        """Whether the copies have landed, without blocking (``cudaEventQuery``)."""
        return self._waited or self.event is None or self.event.query()

    def wait(self) -> tuple[torch.Tensor, ...]:
        """Block until the copies landed (once; later calls return at once) and return
        :attr:`hosts`. The only host wait of a D2H copy (module doc, "D2H pending copy")."""
        if not self._waited:
            if self.event is not None:
                self.event.synchronize()
            self._waited = True
        return self.hosts


class DeviceToHost:
    """Asynchronous D2H copies of a fixed list of sources ("slots") into pinned host buffers,
    one event after them.

    Args:
        buffers: where the reusable pinned buffers live, keyed by ``(slot, shape, dtype)``;
            pass a dict that outlives this object to reuse buffers across objects. None = a
            dict of this object's own (reused by its later launches).
        record_stream: protect each source with ``record_stream`` on the current stream (for
            sources that may have been allocated on another stream; module doc).

    A buffer is reused by the next launch with the same key: wait for and read a launch's
    :class:`PendingCopy` before launching again with the same ``buffers``.
    """

    def __init__(self, buffers: dict[BufferKey, torch.Tensor] | None = None, *,
                 record_stream: bool = False) -> None:
        self.buffers: dict[BufferKey, torch.Tensor] = {} if buffers is None else buffers
        self.record_stream = record_stream

    def launch(self, srcs: Sequence[torch.Tensor], *,
               dtype: torch.dtype | None = None) -> PendingCopy:
        """Queue the copies of ``srcs`` behind the kernels that made them; no host wait.

        Args:
            srcs: tensors of any shapes on one device. On CUDA each is copied ``non_blocking``
                into a pinned buffer on the current stream, then one event is recorded; on the
                CPU each is cloned (no event).
            dtype: the host dtype (e.g. ``torch.int64`` for int32 sources); None = each
                source's own.

        Returns:
            A :class:`PendingCopy` whose ``hosts`` follow ``srcs``' order.
        """
        if srcs[0].device.type != "cuda":
            return PendingCopy(tuple(t.clone() if dtype in (None, t.dtype) else t.to(dtype)
                                     for t in srcs))
        stream = torch.cuda.current_stream(srcs[0].device)
        hosts = []
        for slot, t in enumerate(srcs):
            key = (slot, tuple(t.shape), t.dtype if dtype is None else dtype)
            host = self.buffers.get(key)
            if host is None:
                host = self.buffers[key] = torch.empty(key[1], dtype=key[2], pin_memory=True)
            host.copy_(t, non_blocking=True)
            if self.record_stream:
                t.record_stream(stream)
            hosts.append(host)
        event = torch.cuda.Event()
        event.record(stream)  # after the copies: waiting on it waits for them and no more
        return PendingCopy(tuple(hosts), event)

    def launch_packed(self, srcs: Sequence[torch.Tensor], *,
                      dtype: torch.dtype) -> PendingCopy:
        """:meth:`launch` of same-shape sources as ONE copy: on CUDA they are stacked into a
        ``[len(srcs), *shape]`` device tensor (one kernel, stream ordered after the kernels
        that made them) and that is copied into one pinned buffer, so the host pays one pinned
        buffer, one ``copy_`` and one event instead of one of each per source (a device
        tree's four fields each step). With ``record_stream`` the sources are protected on
        the current stream as in :meth:`launch` (the stack reads them there).

        Args:
            srcs: tensors of one shape on one device.
            dtype: the host dtype (the stack is converted on the device).

        Returns:
            A :class:`PendingCopy` whose ``hosts`` follow ``srcs``' order (views of the one
            pinned buffer on CUDA).

        Raises:
            ValueError: the sources' shapes differ.
        """
        if any(t.shape != srcs[0].shape for t in srcs):
            raise ValueError(f"launch_packed needs sources of one shape, got "
                             f"{[tuple(t.shape) for t in srcs]}")
        if srcs[0].device.type != "cuda":
            return self.launch(srcs, dtype=dtype)
        if self.record_stream:
            stream = torch.cuda.current_stream(srcs[0].device)
            for t in srcs:
                t.record_stream(stream)
        packed = torch.stack([t if t.dtype == dtype else t.to(dtype) for t in srcs])
        copy = DeviceToHost(self.buffers).launch([packed])  # allocated here: no record needed
        return PendingCopy(tuple(copy.hosts[0].unbind(0)), copy.event)
