"""The staging module (:mod:`structspec.staging`): CPU fallbacks, the D2H pending copy, the
pinned helpers, and (on CUDA) round trips that make no host sync; plus the check that no
other source file stages copies by hand."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from structspec.draft_tree.verify import VerifyResult
from structspec.scheduler.pending import PendingStep
from structspec.staging import (
    MAX_RETAINED_BYTES,
    DeviceToHost,
    HostRing,
    PendingCopy,
    Staging,
    page_lock,
    page_unlock,
    pinned_full,
    side_upload_target,
    stack_to_device,
    to_device,
    upload_pinned,
    upload_pinned_side,
    wait_upload,
)

CPU = torch.device("cpu")
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
T = TypeVar("T")


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the CPU fallbacks run even on a machine with a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _result(tokens: list[list[int]], lens: list[int], device: torch.device) -> VerifyResult:
    t = torch.tensor(tokens, dtype=torch.int64, device=device)
    return VerifyResult(accept_tokens=t, accept_len=torch.tensor(lens, device=device),
                        accept_nodes=torch.zeros_like(t))


# ----------------------------------------------------------------------------- CPU fallbacks


def test_to_device_without_staging_is_a_plain_copy() -> None:
    host = torch.arange(6, dtype=torch.int64).view(2, 3)
    out = to_device(host, CPU, None)
    assert out.shape == (2, 3) and out.dtype == torch.int64 and torch.equal(out, host)
    outs = stack_to_device([host, host + 10, host + 20], CPU, None)
    assert len(outs) == 3
    for k, o in enumerate(outs):
        assert o.device == CPU and torch.equal(o, host + 10 * k)


def test_host_ring_fills_and_copies() -> None:
    ring = HostRing()
    buf = ring.acquire(6)
    assert buf.shape == (6,) and buf.dtype == torch.int64
    buf.copy_(torch.arange(6))
    dst = torch.zeros(2, 3, dtype=torch.int64)
    ring.copy_to(buf, dst)
    assert dst.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_device_to_host_on_cpu_returns_values_without_event() -> None:
    a = torch.tensor([[1, 2], [3, 4]], dtype=torch.int64)
    b = torch.tensor([5, 6], dtype=torch.int32)
    d2h = DeviceToHost()
    copy = d2h.launch([a, b])
    assert isinstance(copy, PendingCopy) and copy.event is None and not copy.from_device
    a.fill_(0)  # the host copies are snapshots, not views of the sources
    hosts = copy.wait()
    assert hosts is copy.hosts and copy.wait() is hosts  # idempotent
    assert hosts[0].tolist() == [[1, 2], [3, 4]] and hosts[1].dtype == torch.int32
    assert d2h.buffers == {}  # nothing pinned on the CPU
    (as_int64,) = DeviceToHost().launch([b], dtype=torch.int64).wait()
    assert as_int64.dtype == torch.int64 and as_int64.tolist() == [5, 6]


def test_packed_device_to_host_on_cpu_converts_and_keeps_the_order() -> None:
    a = torch.tensor([[1, 2], [3, 4]], dtype=torch.int64)
    b = torch.tensor([[5, 6], [7, 8]], dtype=torch.int32)
    copy = DeviceToHost().launch_packed([a, b], dtype=torch.int64)
    assert copy.event is None
    a.fill_(0)  # snapshots, as launch's
    got = copy.wait()
    assert [h.dtype for h in got] == [torch.int64, torch.int64]
    assert got[0].tolist() == [[1, 2], [3, 4]] and got[1].tolist() == [[5, 6], [7, 8]]
    with pytest.raises(ValueError, match="one shape"):  # torch.stack would refuse on CUDA
        DeviceToHost().launch_packed([a, b[0]], dtype=torch.int64)


def test_pending_step_on_cpu() -> None:
    result = _result([[7, 8, -1], [9, -1, -1]], [2, 1], CPU)
    pool: dict = {}
    step = PendingStep.launch(result, torch.tensor([2, 0]), pool)
    assert step.event is None and pool == {}
    seen: list[list[list[int]]] = []
    step.on_wait = seen.append
    assert step.wait() == [[7, 8], [9]] and seen == [[[7, 8], [9]]]
    assert step.wait() == [[7, 8], [9]] and len(seen) == 1  # runs once
    assert step.num_real_drafts == [2, 0]


@pytest.mark.usefixtures("no_cuda")
def test_pinned_helpers_fall_back_to_pageable_memory() -> None:
    t = pinned_full((2, 3), -1, torch.int32)
    assert t.dtype == torch.int32 and t.shape == (2, 3) and not t.is_pinned()
    assert bool((t == -1).all())
    assert not pinned_full((4,), 0, torch.int64, pin=False).is_pinned()
    assert page_lock(t) is None  # nothing to lock without CUDA


def test_upload_pinned_on_cpu() -> None:
    host = torch.arange(4, dtype=torch.int32)
    assert upload_pinned(host, "cpu") is host  # ``.to`` of the same device: no copy
    out = torch.zeros(2, 4, dtype=torch.int32)
    got = upload_pinned(host, "cpu", out=out[1])
    assert got.data_ptr() == out[1].data_ptr() and out.tolist() == [[0] * 4, [0, 1, 2, 3]]


def test_side_upload_target_on_cpu_is_a_plain_full() -> None:
    t = side_upload_target((2, 3), -1, torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [[-1] * 3] * 2


def test_side_upload_on_cpu_is_a_plain_copy_without_event() -> None:
    host = torch.arange(4, dtype=torch.int32)
    out = torch.zeros(2, 4, dtype=torch.int32)
    assert upload_pinned_side(host, out[1]) is None
    wait_upload(None)  # nothing to wait for
    assert out.tolist() == [[0] * 4, [0, 1, 2, 3]]


# --------------------------------------------------------------------- no hand-written staging

#: What only structspec/staging.py may write: page-locked allocations (``pin_memory``),
#: asynchronous copies (``non_blocking=True`` or a variable), page-locking foreign memory
#: (``cudaHostRegister`` / ``cudaHostUnregister``) and cross-stream source protection.
HAND_STAGED = re.compile(
    r"pin_memory|non_blocking\s*=\s*(?!False\b)\w+|cudaHost(?:Un)?[Rr]egister|record_stream\(")


def test_no_staging_outside_the_staging_module() -> None:
    root = Path(__file__).resolve().parents[1] / "structspec"
    staging = root / "staging.py"
    assert staging.is_file()
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path == staging:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            match = HAND_STAGED.search(line)
            if match:
                rel = path.relative_to(root.parent)
                offenders.append(f"{rel}:{lineno}: {match.group(0)!r}: {line.strip()}")
    assert not offenders, ("host/device staging outside structspec/staging.py (use its "
                           "helpers):\n" + "\n".join(offenders))


def test_the_staging_pattern_catches_what_it_should() -> None:
    for bad in ("x = torch.empty(3, pin_memory=True)", "t.pin_memory().to(d)",
                "dst.copy_(src, non_blocking=True)", "t.to(dev, non_blocking = nb)",
                "cudart().cudaHostRegister(p, n, 0)", "cudart().cudaHostUnregister(p)",
                "t.record_stream(s)"):
        assert HAND_STAGED.search(bad), bad
    for fine in ("t.to(dev, non_blocking=False)", "t.to(dev)", "queued asynchronously"):
        assert not HAND_STAGED.search(fine), fine


# ------------------------------------------------------------------------------------ CUDA


def _no_sync(fn: Callable[[], T]) -> T:
    """Run ``fn()`` under ``set_sync_debug_mode("error")``: any blocking host sync raises.
    (Waiting on an event, ``cudaEventSynchronize``, is not one of them: it is the planned
    wait of a staged copy.)"""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("depth", [1, 4])
def test_h2d_ring_and_d2h_round_trip_do_not_sync(depth: int) -> None:
    dev = torch.device("cuda")
    staging = Staging(dev, depth=depth)
    d2h = DeviceToHost()
    hosts = [torch.arange(12, dtype=torch.int64).view(3, 4) + 100 * k for k in range(3)]
    ks = [torch.tensor(k, device=dev) for k in range(3)]  # a blocking H2D copy each: made here

    def rounds() -> list[tuple[torch.Tensor, ...]]:
        out = []
        for k in range(3):  # more rounds than slots when depth == 1: the ring waits
            dev_t = to_device(hosts[k], dev, staging)
            stacked = stack_to_device([hosts[k], hosts[k] + 1], dev, staging)
            copy = d2h.launch([dev_t, stacked[1], ks[k]])
            out.append(tuple(h.clone() for h in copy.wait()))
        return out

    got = _no_sync(rounds)
    for k, (a, b, c) in enumerate(got):
        assert torch.equal(a, hosts[k]) and torch.equal(b, hosts[k] + 1) and int(c) == k
    assert len(d2h.buffers) == 3 and all(b.is_pinned() for b in d2h.buffers.values())


@pytest.mark.gpu
@NEEDS_CUDA
def test_ring_keeps_no_slot_above_the_retained_size() -> None:
    """A copy larger than MAX_RETAINED_BYTES travels correctly and leaves no slot that big."""
    dev = torch.device("cuda")
    staging = Staging(dev, depth=2)
    big = torch.arange(MAX_RETAINED_BYTES // 8 + 1000, dtype=torch.int64)
    small = torch.arange(10, dtype=torch.int64)
    got = [to_device(t, dev, staging) for t in (big, small, big)]
    assert torch.equal(got[0].cpu(), big) and torch.equal(got[1].cpu(), small)
    assert torch.equal(got[2].cpu(), big)
    ring = staging.ring(torch.int64)
    assert all(b.numel() * 8 <= MAX_RETAINED_BYTES for b in ring._bufs)


@pytest.mark.gpu
@NEEDS_CUDA
def test_d2h_reuses_its_buffers_and_converts_dtype() -> None:
    dev = torch.device("cuda")
    src = torch.arange(8, dtype=torch.int32, device=dev)
    d2h = DeviceToHost(record_stream=True)
    first = _no_sync(lambda: d2h.launch([src], dtype=torch.int64).wait())
    assert first[0].dtype == torch.int64 and first[0].tolist() == list(range(8))
    ptr = first[0].data_ptr()
    second = _no_sync(lambda: d2h.launch([src * 2], dtype=torch.int64).wait())
    assert second[0].data_ptr() == ptr and second[0].tolist() == [2 * i for i in range(8)]
    fresh = DeviceToHost().launch([src]).wait()[0]
    assert fresh.data_ptr() != ptr


@pytest.mark.gpu
@NEEDS_CUDA
def test_packed_d2h_is_one_copy_without_sync() -> None:
    """A device tree's fields travel as one stacked copy: values and order kept, int32
    converted on the device, no host sync before the wait, the one pinned buffer reused."""
    dev = torch.device("cuda")
    d2h = DeviceToHost(record_stream=True)
    fields = [torch.arange(12, device=dev).view(3, 4) + 100 * k for k in range(3)]
    fields.append(torch.arange(12, dtype=torch.int32, device=dev).view(3, 4) - 1)
    got = _no_sync(lambda: d2h.launch_packed(fields, dtype=torch.int64).wait())
    for k in range(3):
        assert torch.equal(got[k], fields[k].cpu())
    assert got[3].dtype == torch.int64 and torch.equal(got[3], fields[3].cpu().long())
    assert len(d2h.buffers) == 1 and next(iter(d2h.buffers.values())).is_pinned()


@pytest.mark.gpu
@NEEDS_CUDA
def test_pinned_uploads_do_not_sync() -> None:
    dev = torch.device("cuda")
    bitmask = pinned_full((4, 3), -1, torch.int32)
    assert bitmask.is_pinned()
    bitmask[1] = 5
    static = torch.zeros(8, 3, dtype=torch.int32, device=dev)
    slab = torch.arange(1 << 16, dtype=torch.int32)  # pageable memory, locked in place
    assert page_lock(slab) == 0
    try:
        def upload() -> tuple[torch.Tensor, ...]:
            fresh = upload_pinned(bitmask, dev)
            into = upload_pinned(bitmask, dev, out=static[:4])
            from_slab = upload_pinned(slab, dev)
            return DeviceToHost().launch([fresh, into, from_slab]).wait()

        fresh, into, from_slab = _no_sync(upload)
    finally:
        torch.cuda.synchronize()
        page_unlock(slab.data_ptr())
    assert torch.equal(fresh, bitmask) and torch.equal(into, bitmask)
    assert torch.equal(from_slab, slab)
    assert bool((static[4:] == 0).all())


@pytest.mark.gpu
@NEEDS_CUDA
def test_side_upload_runs_beside_a_busy_stream_and_its_reader_waits() -> None:
    """The bitmask's copy-stream upload lands while the current stream is still busy (a
    ~0.1 s spin standing in for the verify forward), and a kernel queued after
    :func:`wait_upload` reads the uploaded rows; no host sync on the way."""
    dev = torch.device("cuda")
    host = pinned_full((64, 1536), -1, torch.int32)
    host[::3] = 7
    static = torch.zeros(72, 1536, dtype=torch.int32, device=dev)

    # load the kernels and make the copy stream first: a lazily loaded module can wait for
    # the running kernels, which would read here as a copy that waited
    static[:64].sum(dim=1)
    wait_upload(upload_pinned_side(host[:8], static[64:]))
    torch.cuda.synchronize()
    static.zero_()

    def upload() -> tuple[torch.cuda.Event | None, torch.Tensor]:
        torch.cuda._sleep(200_000_000)  # the "forward": keeps the current stream busy
        done = upload_pinned_side(host, static[:64])
        wait_upload(done)
        return done, static[:64].sum(dim=1)  # the "mask kernel", after the wait

    done, sums = _no_sync(upload)
    assert done is not None
    done.synchronize()  # the copy alone (an event wait, not a stream sync)
    assert not torch.cuda.current_stream().query(), "the copy waited for the busy stream"
    torch.cuda.synchronize()
    assert torch.equal(static[:64].cpu(), host) and bool((static[64:] == 0).all())
    assert torch.equal(sums.cpu(), host.sum(dim=1, dtype=torch.int64).to(sums.dtype))


@pytest.mark.gpu
@NEEDS_CUDA
def test_side_upload_into_a_target_made_behind_a_busy_stream_keeps_the_rows() -> None:
    """The post graph's bitmask is made lazily, after the forward was queued: its fill must
    not land after a copy-stream upload that ran beside the forward (found in review: a
    ``torch.full`` on the current stream overwrote the uploaded rows with -1)."""
    dev = torch.device("cuda")
    host = pinned_full((64, 1536), 7, torch.int32)
    warm = side_upload_target((8, 1536), -1, torch.int32, dev)  # the copy stream exists
    wait_upload(upload_pinned_side(host[:8], warm))
    torch.cuda.synchronize()

    def make_then_upload() -> torch.Tensor:
        torch.cuda._sleep(200_000_000)  # the forward, queued first
        static = side_upload_target((64, 1536), -1, torch.int32, dev)
        wait_upload(upload_pinned_side(host, static))
        return static

    static = _no_sync(make_then_upload)
    torch.cuda.synchronize()
    assert bool((static == 7).all())


@pytest.mark.gpu
@NEEDS_CUDA
def test_pending_step_does_not_sync_and_reuses_the_pool() -> None:
    dev = torch.device("cuda")
    pool: dict = {}
    runs = []
    for k in range(3):
        result = _result([[k, 8, -1], [9, -1, -1]], [2, 1], dev)
        num_real = torch.tensor([2, 0], device=dev)
        runs.append(_no_sync(lambda r=result, n=num_real: PendingStep.launch(r, n, pool).wait()))
    assert runs == [[[k, 8], [9]] for k in range(3)]
    assert len(pool) == 3 and all(b.is_pinned() for b in pool.values())


def test_before_host_sync_runs_each_registered_callback_once() -> None:
    """What a gated upload registers runs before the next host sync, once; an unregistered
    one never runs."""
    from structspec.staging import before_host_sync, register_before_host_sync

    calls: list[str] = []
    register_before_host_sync(lambda: calls.append("a"))
    drop_b = register_before_host_sync(lambda: calls.append("b"))
    register_before_host_sync(lambda: calls.append("c"))
    drop_b()
    drop_b()  # idempotent
    before_host_sync()
    before_host_sync()
    assert sorted(calls) == ["a", "c"]
